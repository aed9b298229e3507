"""Damaged slot streams on a real file system (docs/design/small-streams.md §5, §9): the rules of
tests/storage/test_corruption.py for streams in slots of pack files. Start-up never raises and
never serves garbage; a damaged slot makes only its stream unreadable (listed in
`engine.unreadable`, its slot kept for the operator and never reused, across restarts), its
neighbours served; a pack cut short, missing or copied sparse, a journal record naming another
stream's slot and a damaged place column cost only the streams they reach."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from storage import AppendBatch, Engine, EngineConfig, StreamNotFoundError
from storage.catalog import CATALOG_FILE
from storage.format import SEGMENT_HEADER_SIZE, SLOT_BYTES, SLOT_HEADER_BYTES
from storage.layout import PACKS_DIR, pack_name
from storage.packinspect import inspect_packs
from storage.packs import split_place
from tests.storage.conftest import SMALL

NAMES = [f"s{i}" for i in range(8)]
ENTRIES = {name: [f"{name}-{j}".encode() * 8 for j in range(i + 1)] for i, name in enumerate(NAMES)}
PACK = Path(PACKS_DIR) / pack_name(0)


def config() -> EngineConfig:
    return EngineConfig(**SMALL, max_open_streams=2, small_streams="slots")


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    """A data directory of NAMES in slots 1 to 8 of one pack, closed cleanly; and their places."""
    data = tmp_path_factory.mktemp("slots") / "data"
    engine = Engine(data, config())
    for name in NAMES:
        engine.append(name, AppendBatch(ENTRIES[name]))
    places = {name: engine._catalog.place(name) for name in NAMES}
    engine.close()
    return data, places


@pytest.fixture
def data(source: tuple[Path, dict[str, int]], tmp_path: Path) -> Path:
    copy = tmp_path / "data"
    shutil.copytree(source[0], copy)
    return copy


def slot_start(places: dict[str, int], name: str) -> int:
    return split_place(places[name])[1] * SLOT_BYTES


def flip(path: Path, pos: int, mask: int = 0x01) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ mask]))


def served(engine: Engine, name: str) -> bool:
    """Whether the stream reads back whole; False if it is gone or refused as damaged."""
    try:
        entries = [e.payload for e in engine.read(name, 0, 1000).entries()]
    except StreamNotFoundError:
        return False
    assert entries == ENTRIES[name], f"{name} served something else: {entries}"
    return True


# The slot header's fields (storage/format.py SlotHeader): byte positions to flip in each.
SLOT_FIELDS = {"magic": 0, "generation": 8, "created": 12, "name length": 20, "name": 22, "crc": 508}


@pytest.mark.parametrize("field", list(SLOT_FIELDS))
def test_a_bit_flip_in_a_slot_header_makes_only_that_stream_unreadable(source, data, field):
    places = source[1]
    flip(data / PACK, slot_start(places, "s3") + SLOT_FIELDS[field])
    engine = Engine(data, config())
    assert not served(engine, "s3")
    assert "s3" in engine.unreadable
    assert all(served(engine, name) for name in NAMES if name != "s3")
    engine.close()


def test_an_unreadable_slot_stream_keeps_its_slot_across_restarts(source, data):
    """Listed in `unreadable` by every start-up, its name refused, its slot's bytes left as they
    were and never given to a new stream."""
    places = source[1]
    at = slot_start(places, "s3")
    flip(data / PACK, at + SLOT_FIELDS["crc"])
    damaged = (data / PACK).read_bytes()[at : at + SLOT_BYTES]
    engine = Engine(data, config())
    assert not served(engine, "s3")
    engine.close()
    for _ in range(2):
        engine = Engine(data, config())
        assert "s3" in engine.unreadable and not engine.exists("s3")
        for i in range(20):
            engine.append(f"new{i}", AppendBatch([b"x"]))
        taken = {engine._catalog.place(f"new{i}") >> 24 for i in range(20)}  # (pack, slot) of each
        assert places["s3"] >> 24 not in taken
        with pytest.raises(Exception, match="damaged"):
            engine.append("s3", AppendBatch([b"y"]))
        engine.close()
    assert (data / PACK).read_bytes()[at : at + SLOT_BYTES] == damaged


@pytest.mark.parametrize("where", ["segment header", "node header", "blob"])
def test_damage_inside_a_slot_segment_costs_that_stream_only(source, data, where):
    """The segment in a slot is checked as a file's: a damaged header makes the stream unreadable
    (its slot kept), a damaged node is cut from the tail (a slot stream's one node is its tail).
    Never garbage, never a neighbour."""
    places = source[1]
    segment = slot_start(places, "s5") + SLOT_HEADER_BYTES
    blob = (data / PACK).read_bytes().index(ENTRIES["s5"][2], segment)  # a payload in its node
    flip(
        data / PACK,
        {"segment header": segment + 8, "node header": segment + SEGMENT_HEADER_SIZE + 16}.get(where, blob),
    )
    engine = Engine(data, config())
    try:
        entries = [e.payload for e in engine.read("s5", 0, 1000).entries()]
        assert entries == ENTRIES["s5"][: len(entries)]  # a prefix of what it held
    except StreamNotFoundError:
        assert "s5" in engine.unreadable
    assert all(served(engine, name) for name in NAMES if name != "s5")
    engine.close()


@pytest.mark.parametrize("cut", [k * SLOT_BYTES + d for k in range(1, 11) for d in (0, SLOT_BYTES // 2)])
def test_a_pack_cut_short_costs_only_the_streams_past_the_cut(source, data, cut):
    places = source[1]
    os.truncate(data / PACK, cut)
    engine = Engine(data, config())
    for name in NAMES:
        whole = slot_start(places, name) + SLOT_BYTES <= cut
        assert served(engine, name) == whole, name
        if not whole:
            assert name in engine.unreadable or not engine.exists(name)
    engine.append("after", AppendBatch([b"new"]))
    assert [e.payload for e in engine.read("after", 0, 10).entries()] == [b"new"]
    engine.close()


def test_a_missing_pack_makes_its_streams_unreadable_and_start_up_goes_on(data):
    (data / PACK).unlink()
    engine = Engine(data, config())
    assert not any(served(engine, name) for name in NAMES)
    engine.append("after", AppendBatch([b"new"]))
    assert [e.payload for e in engine.read("after", 0, 10).entries()] == [b"new"]
    engine.close()


def test_a_pack_copied_sparse_is_served_and_grows_again(data):
    raw = (data / PACK).read_bytes()
    (data / PACK).unlink()
    with open(data / PACK, "wb") as f:  # what `cp --sparse=always` makes: holes for the zeros
        for pos in range(0, len(raw), SLOT_BYTES):
            block = raw[pos : pos + SLOT_BYTES]
            if any(block):
                f.seek(pos)
                f.write(block)
        f.truncate(len(raw))
    engine = Engine(data, config())
    assert all(served(engine, name) for name in NAMES)
    for i in range(30):
        engine.append(f"new{i}", AppendBatch([b"x"]))
    engine.close()
    engine = Engine(data, config())
    assert all(served(engine, name) for name in NAMES)
    assert all([e.payload for e in engine.read(f"new{i}", 0, 1).entries()] == [b"x"] for i in range(30))
    engine.close()


def test_a_damaged_place_column_rebuilds_the_catalog_by_a_scan(data):
    raw = bytearray((data / CATALOG_FILE).read_bytes())
    raw[-3] ^= 0x40  # the last row's place (the file ends with the place column)
    (data / CATALOG_FILE).write_bytes(bytes(raw))
    engine = Engine(data, config())
    assert all(served(engine, name) for name in NAMES) and not engine.unreadable
    engine.close()


def test_a_place_that_names_another_streams_slot_serves_neither_wrongly(source, data):
    """A catalog row whose place holds another stream (a journal record or the file damaged in a
    way its CRC missed): the open finds another name in the slot header and refuses it."""
    places = source[1]
    engine = Engine(data, config())
    engine._catalog.set_place("s2", places["s6"])  # as a `p` record naming s6's slot would
    assert not served(engine, "s2") and "s2" in engine.unreadable
    assert all(served(engine, name) for name in NAMES if name != "s2")
    engine.close()
    engine = Engine(data, config())
    assert all(served(engine, name) for name in NAMES if name != "s2")
    engine.close()


def scan_next(data: Path, keep_file: bool) -> None:
    """Make the next start-up find the slot streams by a scan of the packs: no journal to trust
    (none, as after a crash that lost them), and the catalog file too unless `keep_file`."""
    for path in data.iterdir():
        if path.name.endswith(".log") or path.name == "catalog.clean":
            path.unlink()
    if not keep_file:
        (data / CATALOG_FILE).unlink()


@pytest.mark.parametrize("keep_file", [False, True], ids=["no catalog file", "catalog file"])
def test_a_damaged_slot_found_by_a_scan_is_kept_until_the_operator_zeroes_it(source, data, keep_file):
    """A slot whose header fails its checks, found by a full scan (no trusted journal), keeps its
    place as an unreadable slot stream's does (under the name the catalog file gives its row, else
    a key of its own), reported by every start-up and never handed out, across restarts and
    scans, its bytes unchanged; once an operator zeroes its header it is free again."""
    places = source[1]
    at = slot_start(places, "s3")
    flip(data / PACK, at + SLOT_FIELDS["crc"])
    damaged = (data / PACK).read_bytes()[at : at + SLOT_BYTES]
    reported = "s3" if keep_file else f"packs/{pack_name(0)} slot {split_place(places['s3'])[1]}"
    for round in range(3):
        if round != 1:  # (round 1 takes the catalog file the last close wrote)
            scan_next(data, keep_file)
        engine = Engine(data, config())
        assert reported in engine.unreadable and not served(engine, "s3")
        assert all(served(engine, name) for name in NAMES if name != "s3")
        for i in range(20):
            engine.append(f"new{round}-{i}", AppendBatch([b"x"]))
        taken = {engine._catalog.place(f"new{round}-{i}") >> 24 for i in range(20)}
        assert places["s3"] >> 24 not in taken
        engine.close()
        assert (data / PACK).read_bytes()[at : at + SLOT_BYTES] == damaged
    slot = split_place(places["s3"])[1]
    problems = inspect_packs(data)[1]
    assert any(p.startswith(f"slot {slot} of pack 0: ") and "kept for the operator" in p for p in problems)
    with open(data / PACK, "r+b") as f:  # what docs/OPERATIONS.md has the operator do
        f.seek(at)
        f.write(bytes(SLOT_HEADER_BYTES))
    engine = Engine(data, config())
    assert reported not in engine.unreadable
    engine.append("after", AppendBatch([b"x"]))
    assert engine._catalog.place("after") >> 24 == places["s3"] >> 24  # the one free slot
    engine.close()


def test_a_damaged_slot_found_by_a_scan_leaves_a_stream_promoted_since_the_file_in_its_directory(
    source, data
):
    """The catalog file places s3 in its slot, but s3 was promoted to a directory since (its slot
    freed), and that slot's header is damaged now: a scan keeps the slot under a key of its own and
    s3 is served from its directory."""
    places = source[1]
    stale = (data / CATALOG_FILE).read_bytes()
    more = [b"m" * 1000] * 4  # past the slot's 3.5 KiB: a promotion
    with Engine(data, config()) as engine:
        engine.append("s3", AppendBatch(more))
        assert engine._catalog.place("s3") == -1
    scan_next(data, keep_file=True)
    (data / CATALOG_FILE).write_bytes(stale)
    flip(data / PACK, slot_start(places, "s3") + 100)  # a freed header, all zeros, no more
    engine = Engine(data, config())
    assert [e.payload for e in engine.read("s3", 0, 1000).entries()] == ENTRIES["s3"] + more
    assert f"packs/{pack_name(0)} slot {split_place(places['s3'])[1]}" in engine.unreadable
    engine.close()
