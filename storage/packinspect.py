"""What the offline inspector reports of pack files (storage/packs.py): per pack, its slots used,
free and damaged (those the catalog keeps for the operator said so); each slot the catalog places
a stream in checked against it (the slot's header names that stream at that generation, the pack
is there and long enough) and its segment checked as a segment file's would be
(docs/design/small-streams.md §5). Without a catalog a start-up could trust (none, or a journal
from before the last boot), each used slot is checked by its header alone.

    python -m storage.inspect packs DATA     (storage/inspect.py; `verify` runs `inspect_packs` too)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from storage.catalog import CATALOG_CLEAN, read_catalog
from storage.catalogfiles import read_journaled, replay_places
from storage.catalogjournal import journal_generations
from storage.errors import CorruptionError, DurabilityError
from storage.format import SLOT_BYTES
from storage.fs import FileSystem
from storage.layout import PACKS_DIR, pack_id_of
from storage.packs import NO_PLACE, Packs, split_place
from storage.segment import Segment


@dataclass
class PackReport:
    pack_id: int
    file_bytes: int
    slots: int  # the slots its allocated length holds, slot 0 (the pack's header) aside
    used: int
    damaged: int  # slot headers that fail their checks
    unnamed: int = 0  # used slots no catalog row places a stream in (a start-up frees them)

    @property
    def free(self) -> int:
        return self.slots - self.used - self.damaged


def catalog_places(fs: FileSystem, data_dir: Path) -> dict[str, int] | None:
    """The streams in slots and their places as a start-up would take them without a scan: the
    catalog file after a clean shutdown, else the file (or the one a deletion set aside) and its
    journals, replayed (storage/catalogfiles.py: read by `read_journaled`, as `_load` reads them,
    and the places moved by `replay_places`, as its `_place_vouched` moves them); None when those
    cannot be trusted."""
    clean = fs.exists(data_dir / CATALOG_CLEAN)
    generations = journal_generations(fs.listdir(data_dir))
    journaled = read_journaled(fs, data_dir, read_catalog(fs, data_dir), clean, generations)
    if journaled is None:
        return None
    listed, changes = journaled
    places = {
        name: place for name, place in zip(listed.names, listed.places, strict=True) if place != NO_PLACE
    }
    if changes is not None:
        replay_places(places, changes)
    return places


def inspect_packs(data_dir: Path) -> tuple[list[PackReport], list[str]]:
    """A report per pack file, and every problem found: a stream the catalog places in a slot
    that does not hold it (free, another stream or generation, a damaged header, a pack missing
    or shorter than the slot), damaged slot headers, pack files that do not open, segments in
    slots that fail their checks."""
    fs = FileSystem()
    directory = data_dir / PACKS_DIR
    reports = {}
    for name in sorted(fs.listdir(directory)):
        pack = pack_id_of(name)
        if pack is not None:
            size = (directory / name).stat().st_size
            reports[pack] = PackReport(pack, size, max(size // SLOT_BYTES - 1, 0), 0, 0)
    places = catalog_places(fs, data_dir)
    problems: list[str] = []
    if not reports and not places:
        return [], problems
    packs = Packs(fs, data_dir)
    damaged: list[tuple[int, str]] = []
    named = {split_place(place)[:2]: name for name, place in (places or {}).items()}
    try:
        for place, header, _ in packs.scan(damaged):
            pack, slot, _ = split_place(place)
            reports[pack].used += 1
            if places is None:
                problems.extend(_check(packs, place, header.name))
            elif (pack, slot) not in named:
                reports[pack].unnamed += 1
        for name, place in sorted((places or {}).items()):
            problems.extend(_check(packs, place, name))
    except (CorruptionError, DurabilityError) as exc:
        problems.append(f"pack files unreadable: {exc}")
    finally:
        packs.close()
    listed = read_catalog(fs, data_dir)
    kept = {split_place(place)[:2] for place in (listed.unreadable.values() if listed else ())}
    for place, why in damaged:
        pack, slot, _ = split_place(place)
        reports[pack].damaged += 1
        if (pack, slot) in kept:  # (storage/catalogfiles.py's _keep_damaged)
            problems.append(
                f"slot {slot} of pack {pack}: {why} (kept for the operator: never reused until its "
                "header is zeroed, docs/OPERATIONS.md)"
            )
        elif (pack, slot) not in named:  # (else reported as its stream's)
            problems.append(f"slot {slot} of pack {pack}: {why} (the stream in it is unreadable)")
    return list(reports.values()), problems


def _check(packs: Packs, place: int, name: str) -> list[str]:
    """What is wrong with stream `name` in the slot at `place` (empty: nothing)."""
    pack, slot, _ = split_place(place)
    try:
        file = packs.open_slot(place, name, writable=False)
    except CorruptionError as exc:
        return [f"stream {name!r}: {exc} (the catalog places it there: it is unreadable)"]
    try:
        segment, cut = Segment.over(file, verify=True)
    except CorruptionError as exc:
        return [f"stream {name!r} in slot {slot} of pack {pack}: segment unreadable: {exc}"]
    segment.close()
    return [] if cut is None else [f"stream {name!r} in slot {slot} of pack {pack}: {cut}"]
