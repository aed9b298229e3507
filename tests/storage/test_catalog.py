"""The catalog (storage/catalog.py): start-up reads one file instead of every stream's meta file,
rebuilds it from the stream directories when it is missing, damaged or stale, and the engine's
totals cover closed streams; maintenance visits closed streams whose upkeep is due."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from crc32c import crc32c

from storage import AppendBatch, CorruptionError, Engine, EngineConfig, StreamBounds, StreamConfig
from storage.catalog import CATALOG_CLEAN, CATALOG_FILE, NO_PLACE, Catalog, StreamSummary, decode_catalog
from storage.fs import FileSystem
from storage.layout import META_FILE, stream_directory
from tests.storage.conftest import SMALL
from tests.storage.faultfs import FaultFS

ROOT = Path("/faultfs/data")
# Streams in directories of their own (small_streams off, not the default slots): for the tests
# about what start-up finds in stream directories (meta files, names, deletions' leftovers).
DIRECTORIES = {**SMALL, "small_streams": "off"}


class CountingFS(FileSystem):
    """The real file system, counting the meta files read and the listings of the streams."""

    def __init__(self) -> None:
        super().__init__()
        self.meta_reads = 0
        self.stream_listings = 0

    def read_file(self, path: Path) -> bytes:
        if path.name == META_FILE:
            self.meta_reads += 1
        return super().read_file(path)

    def entries(self, path: Path) -> set[str]:
        self.stream_listings += path.name == "streams"
        return super().entries(path)

    def listdir(self, path: Path) -> list[str]:
        self.stream_listings += path.name == "streams"
        return super().listdir(path)


def fill(engine: Engine, streams: int, entries: int = 3) -> dict[str, list[bytes]]:
    written = {f"room-{i:03d}": [f"{i}/{j}".encode() for j in range(entries)] for i in range(streams)}
    for name, items in written.items():
        engine.append(name, AppendBatch(items))
    return written


def contents(engine: Engine, name: str) -> list[bytes]:
    return [e.payload for e in engine.read(name, 0, 1000).entries()]


def test_start_up_reads_the_catalog_and_no_meta_file(tmp_path, clock):
    config = EngineConfig(**SMALL, max_open_streams=4)
    engine = Engine(tmp_path / "data", config, clock=clock)
    written = fill(engine, 40)
    engine.close()
    fs = CountingFS()
    engine = Engine(tmp_path / "data", config, clock=clock, fs=fs)
    assert fs.meta_reads == 0 and fs.stream_listings == 0  # a clean shutdown left a complete catalog
    assert engine.list_streams() == sorted(written) and engine.stats()["entries"] == 120
    assert contents(engine, "room-007") == written["room-007"]
    assert fs.meta_reads == 0  # the stream opened on its first use has none, as its listing says
    engine.close()


@pytest.mark.parametrize("damage", ["missing", "bit flip", "truncated", "garbage", "other version"])
def test_a_missing_or_damaged_catalog_is_rebuilt_from_the_directories(tmp_path, clock, damage):
    config = EngineConfig(**SMALL, max_open_streams=4)
    engine = Engine(tmp_path / "data", config, clock=clock)
    written = fill(engine, 12)
    engine.close()
    path = tmp_path / "data" / CATALOG_FILE
    raw = path.read_bytes()
    if damage == "missing":
        path.unlink()
    elif damage == "bit flip":
        pos = random.Random(7).randrange(len(raw))
        path.write_bytes(raw[:pos] + bytes([raw[pos] ^ 0x10]) + raw[pos + 1 :])
    elif damage == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    elif damage == "garbage":
        path.write_bytes(b"SLCT" + b"\0" * 40)
    else:  # a valid file of a version this code does not know
        other = bytearray(raw)
        other[8] = 9  # the version field (outside the CRC, which covers the body)
        path.write_bytes(bytes(other))
    engine = Engine(tmp_path / "data", config, clock=clock)
    assert engine.list_streams() == sorted(written) and engine.unreadable == []
    assert decode_catalog(path.read_bytes()).names == sorted(written)
    for name, items in written.items():
        assert contents(engine, name) == items
    engine.close()


def test_a_data_directory_without_a_catalog_opens_and_gets_one(tmp_path, clock):
    """The upgrade path: a directory written before the catalog existed."""
    config = EngineConfig(**SMALL, max_open_streams=4)
    engine = Engine(tmp_path / "data", config, clock=clock)
    written = fill(engine, 6)
    engine.close()
    (tmp_path / "data" / CATALOG_FILE).unlink()
    engine = Engine(tmp_path / "data", config, clock=clock)
    assert (tmp_path / "data" / CATALOG_FILE).exists()
    # Figures unknown until each stream is visited: maintenance visits them in batches.
    engine.maintain()
    assert engine.stats()["entries"] == 18 and engine.open_streams() == 0
    assert all(contents(engine, n) == items for n, items in written.items())
    engine.close()


@pytest.mark.parametrize("mode", ["process", "power"])
def test_streams_created_or_deleted_after_the_catalog_was_written_survive_a_crash(mode):
    rng = random.Random(mode)
    fs = FaultFS()
    fs.prepare_dir(ROOT)
    config = EngineConfig(**SMALL, fsync="always", max_open_streams=3)
    engine = Engine(ROOT, config, fs=fs)
    written = fill(engine, 8)
    engine.close()  # writes the catalog
    engine = Engine(ROOT, config, fs=fs)
    for name in ["room-001", "room-005"]:
        engine.delete_stream(name)
        del written[name]
    engine.append("room-005", AppendBatch([b"again"]))  # recreated
    written["room-005"] = [b"again"]
    for i in range(8, 14):  # created after the catalog file: acknowledged durable ("always")
        written[f"room-{i:03d}"] = [f"new {i}".encode()]
        engine.append(f"room-{i:03d}", AppendBatch(written[f"room-{i:03d}"]))
    crashed = fs.crashed_copy(rng, mode)
    after = Engine(ROOT, config, fs=crashed)
    assert after.list_streams() == sorted(written) and after.unreadable == []
    for name, items in written.items():
        assert contents(after, name) == items, name
    after.close()
    assert decode_catalog(crashed.read_file(ROOT / CATALOG_FILE)).names == sorted(written)


def test_names_that_are_not_their_directory_names_and_replicated_streams(tmp_path, clock):
    config = EngineConfig(**DIRECTORIES, max_open_streams=2)
    engine = Engine(tmp_path / "data", config, clock=clock)
    odd = ["a/b", "été", "x" * 240, "../up"]
    for name in odd:
        engine.append(name, AppendBatch([name.encode()]))
    engine.create_stream("rep", incarnation=5)
    engine.close()
    listed = decode_catalog((tmp_path / "data" / CATALOG_FILE).read_bytes())
    assert listed.dirs == {n: stream_directory(tmp_path, n).name for n in odd}
    assert listed.replicated == ["rep"]
    fs = CountingFS()
    engine = Engine(tmp_path / "data", config, clock=clock, fs=fs)
    assert fs.meta_reads == 1  # the replicated stream's, checked at start-up with its epochs
    assert engine.list_streams() == sorted([*odd, "rep"])
    assert all(contents(engine, n) == [n.encode()] for n in odd)
    engine.close()


def test_reopening_a_stream_without_a_meta_file_tries_to_read_none(tmp_path, clock):
    """Its directory's listing says there is none: no failed open per reopen (issue 17)."""
    config = EngineConfig(**SMALL, max_open_streams=2)
    fs = CountingFS()
    engine = Engine(tmp_path / "data", config, clock=clock, fs=fs)
    written = fill(engine, 6)  # names their directories give back: no meta file
    engine.maintain()
    assert fs.meta_reads == 0
    for name, items in written.items():  # each reopened, closing another
        assert contents(engine, name) == items
    engine.set_stream_config("room-000", StreamConfig(max_entries=100))  # now it has one
    for other in ("room-001", "room-002"):  # close it
        engine.append(other, AppendBatch([b"x"]))
    assert contents(engine, "room-000") == written["room-000"]  # read back from its meta file
    assert engine.stream_config("room-000").max_entries == 100
    assert fs.meta_reads == 1
    engine.close()


def test_totals_cover_closed_streams_with_no_stream_opened(tmp_path, clock):
    config = EngineConfig(**SMALL, max_open_streams=2)
    engine = Engine(tmp_path / "data", config, clock=clock)
    fill(engine, 10, entries=4)
    stats = engine.stats()
    assert (stats["streams"], stats["entries"], stats["segments"], stats["open_streams"]) == (10, 40, 10, 2)
    engine.append("room-000", AppendBatch([b"more"]))  # reopened: its figures come from it now
    assert engine.stats()["entries"] == 41
    engine.delete_stream("room-003")
    assert engine.stats()["entries"] == 37
    engine.close()
    engine = Engine(tmp_path / "data", config, clock=clock)
    stats = engine.stats()
    assert (stats["entries"], stats["segments"], stats["open_streams"]) == (37, 9, 0)
    assert stats["bytes_on_disk"] > 0
    engine.close()


def test_maintenance_applies_max_age_to_closed_streams_in_batches(tmp_path, clock):
    config = EngineConfig(**SMALL, max_open_streams=2, compaction_interval_ms=1000)
    engine = Engine(tmp_path / "data", config, clock=clock)
    names = [f"aged-{i:02d}" for i in range(20)]
    for name in names:
        engine.create_stream(name, StreamConfig(max_age_ms=60_000))
        for _ in range(3):  # three nodes (node_entries=8)
            engine.append(name, AppendBatch([b"x" * 100] * 8))
    engine.append("keep", AppendBatch([b"k"]))
    engine.append("keep2", AppendBatch([b"k"]))  # the aged streams are all closed now
    assert engine.stats()["entries"] == 20 * 24 + 2
    clock.advance(120_000)
    engine.maintain()
    # One batch at most per round, each stream opened for it and closed again.
    assert engine.open_streams() == 2 and engine.stats()["entries"] == 4 * 24 + 2
    engine.maintain()
    assert engine.stats()["entries"] == 2
    assert engine._catalog.due(clock() + 10**9, 100) == []
    assert all(engine.bounds(n) == StreamBounds(24, 24) for n in names)
    engine.close()


def test_a_closed_stream_with_nothing_due_is_not_visited(tmp_path, clock):
    config = EngineConfig(**SMALL, max_open_streams=1)
    engine = Engine(tmp_path / "data", config, clock=clock)
    fill(engine, 5)
    assert engine._catalog.due(clock() + 10**9, 100) == []
    engine.close()
    listed = decode_catalog((tmp_path / "data" / CATALOG_FILE).read_bytes())
    assert (listed.due, listed.replicated, listed.dirs) == ([], [], {})
    assert [list(column[:2]) for column in listed.columns[::2]] == [[3, 3], [1, 1]]  # entries, segments


def test_list_streams_pages_from_the_sorted_names_in_place(tmp_path, clock):
    engine = Engine(tmp_path / "data", EngineConfig(**SMALL), clock=clock)
    fill(engine, 30, entries=1)
    names = engine.stream_names()
    assert len(names) == 30 and names[0] == "room-000" and names[5:8] == ["room-005", "room-006", "room-007"]
    engine.delete_stream("room-006")
    assert names[5:8] == ["room-005", "room-007", "room-008"] and list(names) == engine.list_streams()
    engine.close()


def test_a_one_off_listing_leaves_no_sorted_list_for_creations_to_keep(tmp_path, clock):
    """A new data directory's start-up lists the streams once (the consumer groups' probe,
    storage/groupstore.py): the sorted list each creation then inserted into (issue 17) is built
    by the first paged listing only, and kept up to date from then on."""
    engine = Engine(tmp_path / "data", EngineConfig(**SMALL), clock=clock)
    fill(engine, 3, entries=1)
    assert engine.list_streams() == ["room-000", "room-001", "room-002"]
    assert engine._catalog._sorted is None
    assert engine.stream_names()[1] == "room-001" and engine._catalog._sorted is not None
    engine.append("a", AppendBatch([b"x"]))
    assert engine.stream_names()[0] == "a" and engine.list_streams()[:2] == ["a", "room-000"]
    engine.close()


def test_start_up_lists_no_stream_after_a_clean_shutdown_nor_after_a_kill_9(tmp_path, clock):
    data = tmp_path / "data"
    config = EngineConfig(**SMALL, max_open_streams=4)
    engine = Engine(data, config, clock=clock)
    written = fill(engine, 10)
    engine.close()
    assert (data / CATALOG_CLEAN).exists()
    fs = CountingFS()
    engine = Engine(data, config, clock=clock, fs=fs)
    assert fs.stream_listings == 0 and not (data / CATALOG_CLEAN).exists()  # gone before any creation
    for name in ["new-1", "new-2"]:  # streams the file does not name
        written[name] = [name.encode()]
        engine.append(name, AppendBatch(written[name]))
    engine.delete_stream("room-000")
    del written["room-000"]
    # kill -9: the engine is dropped unclosed (with its own fs it holds no lock), no CATALOG_CLEAN.
    fs = CountingFS()
    engine = Engine(data, config, clock=clock, fs=fs)
    assert fs.stream_listings == 0  # the journal names what changed (tests/storage/test_catalog_journal.py)
    assert engine.list_streams() == sorted(written)
    assert all(contents(engine, name) == items for name, items in written.items())
    engine.close()


def test_an_unreadable_stream_is_reported_by_every_start_up(tmp_path, clock):
    data = tmp_path / "data"
    config = EngineConfig(**DIRECTORIES)
    engine = Engine(data, config, clock=clock)
    fill(engine, 3)
    engine.close()
    (stream_directory(data, "room-001") / META_FILE).write_bytes(b"damaged")
    (data / CATALOG_FILE).unlink()  # rebuilt from the directories: the damage is found now
    for _ in range(2):  # a clean shutdown after it does not hide it from the next start-up
        engine = Engine(data, config, clock=clock)
        assert engine.list_streams() == ["room-000", "room-002"] and engine.unreadable == ["room-001"]
        engine.close()


def test_a_deletion_that_left_its_directory_makes_the_next_start_up_list(tmp_path, clock):
    data = tmp_path / "data"
    config = EngineConfig(**DIRECTORIES)

    class FailingRemoval(CountingFS):
        def remove_tree(self, path: Path) -> None:
            if path.name.endswith(".deleted"):
                raise OSError("injected: the directory stays")
            super().remove_tree(path)

    engine = Engine(data, config, clock=clock, fs=FailingRemoval())
    fill(engine, 2)
    with pytest.raises(OSError):
        engine.delete_stream("room-000")
    engine.close()
    assert not (data / CATALOG_CLEAN).exists()  # the leftover must be found by a listing
    fs = CountingFS()
    engine = Engine(data, config, clock=clock, fs=fs)
    assert fs.stream_listings == 1 and engine.list_streams() == ["room-001"]
    assert not any(p.name.endswith(".deleted") for p in (data / "streams").iterdir())
    engine.close()


def test_the_files_names_are_found_by_bisection_with_deletions_and_creations_since():
    first = Catalog()
    for name in ["a", "c", "e"]:
        first.add_closed(name, StreamSummary(1, 10, 1, 1))
    catalog = Catalog()
    catalog.load(decode_catalog(first.encode(set(), {})), gone={"e"})
    assert [n in catalog for n in ["a", "b", "c", "e", 7]] == [True, False, True, False, False]
    catalog.remove("a")
    catalog.add("b")  # created: a row of its own
    catalog.add("a")  # recreated: back under its old row, open (no figures)
    catalog.closed("a", StreamSummary(5, 50, 1, 1))
    assert len(catalog) == 3 and catalog.names() == ["a", "b", "c"]
    assert catalog.totals() == {"entries": 6, "bytes_on_disk": 60, "segments": 2, "nodes": 2}
    again = decode_catalog(catalog.encode({"b"}, {}))
    assert again.names == ["a", "c"] and list(again.columns[0]) == [5, 1]


def test_a_change_finds_its_row_once_and_the_totals_follow(monkeypatch):
    """A close (once per eviction, issue 17) and a creation look the stream's row up once each:
    a close found it three times (`closed`, then `_forget` and `_keep`), and a name not in the
    catalog was probed in its dict twice. Its figures replace the row's, the totals following."""
    first = Catalog()
    first.add_closed("a", StreamSummary(1, 10, 1, 1))
    catalog = Catalog()
    catalog.load(decode_catalog(first.encode(set(), {})), gone=set())
    lookups: list[str] = []
    real = Catalog._row
    monkeypatch.setattr(Catalog, "_row", lambda c, name: (lookups.append(name), real(c, name))[1])
    catalog.add("b")
    catalog.closed("b", StreamSummary(3, 30, 1, 1))
    catalog.opened("a")
    catalog.closed("a", StreamSummary(2, 20, 1, 1))
    catalog.closed("b", StreamSummary(4, 40, 1, 2))  # (a closed stream's figures replaced whole)
    assert lookups == ["b", "b", "a", "a", "b"]
    assert catalog.totals() == {"entries": 6, "bytes_on_disk": 60, "segments": 2, "nodes": 3}
    assert "a" in catalog and "c" not in catalog and len(lookups) == 5  # (membership: no `_row`)


def test_a_catalog_whose_names_are_out_of_order_counts_as_damaged():
    catalog = Catalog()
    for name in ["a", "b"]:
        catalog.add_closed(name, StreamSummary())
    raw = bytearray(catalog.encode(set(), {}))
    at = raw.index(b"a\0b")
    raw[at : at + 3] = b"b\0a"
    raw[4:8] = crc32c(bytes(raw[20:])).to_bytes(4, "little")
    with pytest.raises(CorruptionError, match="not in order"):
        decode_catalog(bytes(raw))


PLACE = 1 << 48 | 5 << 24 | 1  # pack 1, slot 5, its first generation


def as_version_1(raw: bytes) -> bytes:
    """A catalog file as the version before places wrote it: no place column."""
    n = int.from_bytes(raw[12:16], "little")
    body = raw[20 : len(raw) - 8 * n]
    return raw[:4] + crc32c(body).to_bytes(4, "little") + (1).to_bytes(2, "little") + raw[10:20] + body


def test_places_round_trip_through_the_file():
    catalog = Catalog()
    catalog.add_closed("dir", StreamSummary(1, 10, 1, 1))
    catalog.add_closed("slot", StreamSummary(2, 4096, 1, 1), PLACE)
    catalog.add("new-slot", PLACE + 1)  # created now, open
    catalog.add("new-dir")
    catalog.add_closed("promoted", StreamSummary(3, 30, 1, 1), PLACE + 2)
    catalog.set_place("promoted", NO_PLACE)
    raw = catalog.encode(set(), {})
    assert raw[8:10] == (2).to_bytes(2, "little")
    places = [
        int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(len(raw) - 40, len(raw), 8)
    ]
    assert places == [NO_PLACE, NO_PLACE, PLACE + 1, NO_PLACE, PLACE]  # the last column, after the figures
    listed = decode_catalog(raw)
    assert listed.names == ["dir", "new-dir", "new-slot", "promoted", "slot"]
    assert list(listed.places) == [NO_PLACE, NO_PLACE, PLACE + 1, NO_PLACE, PLACE]
    assert list(listed.columns[0]) == [1, 0, 0, 3, 2]  # the figures are where they were
    assert listed.dirnames() == {"dir", "new-dir", "promoted"}  # a slot stream has no directory
    again = Catalog()
    again.load(listed, set())
    assert [again.place(n) for n in ["slot", "new-slot", "dir", "promoted", "absent"]] == [
        PLACE,
        PLACE + 1,
        NO_PLACE,
        NO_PLACE,
        NO_PLACE,
    ]
    again.remove("slot")
    again.add("slot")  # recreated in a directory, under its old row
    again.add("another", PLACE + 3)
    listed = decode_catalog(again.encode(set(), {}))
    assert dict(zip(listed.names, listed.places, strict=True)) == {
        "another": PLACE + 3,
        "dir": NO_PLACE,
        "new-dir": NO_PLACE,
        "new-slot": PLACE + 1,
        "promoted": NO_PLACE,
        "slot": NO_PLACE,
    }


def test_a_version_1_file_is_read_with_no_place_and_written_as_version_2(tmp_path, clock):
    config = EngineConfig(**DIRECTORIES, max_open_streams=4)  # before places: no slot
    data = tmp_path / "data"
    with Engine(data, config, clock=clock) as engine:
        written = fill(engine, 6)
    path = data / CATALOG_FILE
    path.write_bytes(as_version_1(path.read_bytes()))
    old = decode_catalog(path.read_bytes())
    assert old.names == sorted(written) and list(old.places) == [NO_PLACE] * 6
    fs = CountingFS()
    engine = Engine(data, config, clock=clock, fs=fs)
    assert fs.stream_listings == 0 and fs.meta_reads == 0  # a clean start-up: the file was trusted
    assert engine.list_streams() == sorted(written) and engine.stats()["entries"] == 18
    assert all(contents(engine, name) == items for name, items in written.items())
    engine.close()
    raw = path.read_bytes()
    assert int.from_bytes(raw[8:10], "little") == 2
    assert list(decode_catalog(raw).places) == [NO_PLACE] * 6


@pytest.mark.parametrize("start_up", ["clean", "kill -9", "listing"])
def test_a_stream_in_a_slot_survives_start_up_without_a_directory(tmp_path, clock, start_up):
    """A slot stream has no directory in streams/: start-up must not forget it, whether it reads
    the file alone, the file and its journal, or the file and the listing of streams/."""
    config = EngineConfig(**DIRECTORIES, max_open_streams=4)
    data = tmp_path / "data"
    with Engine(data, config, clock=clock) as engine:
        written = fill(engine, 3)
    slots = EngineConfig(**SMALL, max_open_streams=4, small_streams="slots")
    engine = Engine(data, slots, clock=clock, fs=CountingFS())  # its own fs: no lock, a kill -9 frees it
    engine.append("slotted", AppendBatch([b"in a slot"]))  # its slot written, then its row added
    place = engine._catalog.place("slotted")
    engine.maintain()  # its slot synced
    engine._open.discard("slotted")  # left closed, its figures the catalog's (journaled)
    engine._catalog.closed("slotted", StreamSummary(1, 4096, 1, 1))
    if start_up != "kill -9":
        engine.close()
    if start_up == "listing":  # neither a clean shutdown's mark nor a journal to trust
        (data / CATALOG_CLEAN).unlink()
        for log in data.glob("catalog.*.log"):
            log.unlink()
    fs = CountingFS()
    engine = Engine(data, config, clock=clock, fs=fs)
    assert fs.stream_listings == (start_up == "listing")
    assert engine.list_streams() == sorted([*written, "slotted"])
    assert place != NO_PLACE and engine._catalog.place("slotted") == place
    assert engine._catalog.place("room-001") == NO_PLACE
    assert contents(engine, "slotted") == [b"in a slot"]
    assert engine.stats()["entries"] == 9 + 1
    assert all(contents(engine, name) == items for name, items in written.items())
    engine.close()


@pytest.mark.parametrize(
    "rule",
    ["none", "packing", "max_entries", "max_bytes", "max_age_ms", "compaction"],
)
def test_a_closed_stream_is_due_for_a_visit_only_under_a_rule_or_with_segments_to_pack(tmp_path, clock, rule):
    """A close works out when maintenance is to visit the stream only if something may be due
    (most streams: the default config, nothing to pack, never visited while closed)."""
    config = {
        "max_entries": StreamConfig(max_entries=1000),
        "max_bytes": StreamConfig(max_bytes=1 << 30),
        "max_age_ms": StreamConfig(max_age_ms=60_000),
        "compaction": StreamConfig(compaction=True),
    }.get(rule)
    engine = Engine(tmp_path / "data", EngineConfig(**DIRECTORIES, max_open_streams=1), clock=clock)
    if config is not None:
        engine.create_stream("s", config)
    payload = b"x" * (3 * 1024 if rule in ("packing", "compaction") else 10)  # past one segment
    for _ in range(30 if rule in ("packing", "compaction") else 1):
        engine.append("s", AppendBatch([payload] * 2, tags=["t", "t"] if rule == "compaction" else None))
    engine.append("other", AppendBatch([b"x"]))  # closes "s"
    due = engine._catalog.due(clock() + 10**9, 10)
    assert due == ([] if rule == "none" else ["s"])
    engine.close()
