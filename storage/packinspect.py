"""What the offline inspector reports of pack files (storage/packs.py): per pack, its slots used,
free and damaged; and each used slot's segment checked as a segment file's would be.

    python -m storage.inspect packs DATA     (storage/inspect.py; `verify` runs `verify_packs` too)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from storage.errors import CorruptionError, DurabilityError
from storage.format import SLOT_BYTES
from storage.fs import FileSystem
from storage.layout import PACKS_DIR, pack_id_of
from storage.packs import Packs, split_place
from storage.segment import Segment


@dataclass
class PackReport:
    pack_id: int
    file_bytes: int
    slots: int  # the slots its allocated length holds, slot 0 (the pack's header) aside
    used: int
    damaged: int  # slot headers that fail their checks

    @property
    def free(self) -> int:
        return self.slots - self.used - self.damaged


def inspect_packs(data_dir: Path) -> tuple[list[PackReport], list[str]]:
    """A report per pack file, and every problem found: damaged slot headers, pack files that do
    not open, slots whose segment fails its checks."""
    directory = data_dir / PACKS_DIR
    reports = {}
    for name in sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []:
        pack = pack_id_of(name)
        if pack is not None:
            size = (directory / name).stat().st_size
            reports[pack] = PackReport(pack, size, max(size // SLOT_BYTES - 1, 0), 0, 0)
    problems: list[str] = []
    if not reports:
        return [], problems
    packs = Packs(FileSystem(), data_dir)
    damaged: list[tuple[int, str]] = []
    try:
        for place, header, _ in packs.scan(damaged):
            pack, slot, _ = split_place(place)
            reports[pack].used += 1
            problems.extend(
                f"stream {header.name!r} in slot {slot} of pack {pack}: {p}"
                for p in _check(packs, place, header.name)
            )
    except (CorruptionError, DurabilityError) as exc:
        problems.append(f"pack files unreadable: {exc}")
    finally:
        packs.close()
    for place, why in damaged:
        pack, slot, _ = split_place(place)
        reports[pack].damaged += 1
        problems.append(f"slot {slot} of pack {pack}: {why} (the stream in it is unreadable)")
    return list(reports.values()), problems


def _check(packs: Packs, place: int, name: str) -> list[str]:
    """What is wrong with the segment in the slot at `place` (empty: nothing)."""
    try:
        segment, cut = Segment.over(packs.open_slot(place, name, writable=False), verify=True)
    except CorruptionError as exc:
        return [f"segment unreadable: {exc}"]
    segment.close()
    return [] if cut is None else [cut]
