"""Cheap creation (issue 17, storage/creation.py): creating a stream syncs nothing; its first
sync (the everysec round's, an "always" append's, a close's) makes it durable, sharing the
streams directory's sync with every stream created meanwhile. A power loss before that leaves
the new stream whole or absent, never torn or reported damaged. A new stream is its directory
and one page of segment: no meta file (format 4), and a format-3 directory opens as it is."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from storage import AppendBatch, Engine, EngineConfig, StreamConfig
from storage.catalog import CATALOG_FILE
from storage.format import SEGMENT_HEADER_SIZE, SLOTTED_HEADER_SIZE, SYNCED_SLOT_SIZE
from storage.layout import META_FILE, META_NEW, encode_meta, segment_name, stream_directory
from tests.storage import conftest
from tests.storage.conftest import erase_slot, synced_marker
from tests.storage.faultfs import Crash, FaultFS
from tests.storage.test_handoff import counting_syncfs

# Streams created in directories of their own (small_streams off): a new small stream takes a slot
# by default, whose creation tests/storage/test_slot_streams.py covers.
SMALL = {**conftest.SMALL, "small_streams": "off"}

ROOT = Path("/faultfs/data")


def new_engine(fsync: str) -> tuple[FaultFS, Engine]:
    fs = FaultFS()
    fs.prepare_dir(ROOT)
    return fs, Engine(ROOT, EngineConfig(**SMALL, fsync=fsync), fs=fs)


def test_a_new_stream_under_everysec_costs_no_sync_until_the_round_which_shares_one_for_all():
    fs, engine = new_engine("everysec")
    before = fs.syncs
    for i in range(10):
        engine.append(f"s{i}", AppendBatch([b"x"]))
    assert fs.syncs == before  # not one sync on the append path
    engine.maintain()  # the everysec round
    # Each stream: its segment, its directory (no meta file); the streams directory once for all.
    assert fs.syncs - before == 10 * 2 + 1
    lost = Engine(ROOT, EngineConfig(**SMALL), fs=fs.crashed_copy(mode="lost"))
    assert sorted(lost.list_streams()) == sorted(f"s{i}" for i in range(10))
    assert all(lost.read(f"s{i}", 0, 1).entries()[0].payload == b"x" for i in range(10))


def test_under_always_a_new_stream_is_durable_when_its_append_or_creation_returns():
    fs, engine = new_engine("always")
    engine.append("new", AppendBatch([b"kept"]))
    engine.create_stream("empty")
    lost = Engine(ROOT, EngineConfig(**SMALL), fs=fs.crashed_copy(mode="lost"))
    assert [e.payload for e in lost.read("new", 0, 10).entries()] == [b"kept"]
    assert lost.list_streams() == ["empty", "new"]


@pytest.mark.parametrize("seed", range(40))
def test_a_power_loss_before_the_sync_leaves_each_new_stream_whole_or_absent(seed):
    rng = random.Random(seed)
    fs, engine = new_engine("everysec")
    engine.append("old", AppendBatch([b"old"]))
    engine.sync()
    written = {}
    for i in range(rng.randint(1, 6)):
        written[f"n{i}"] = [rng.randbytes(rng.randint(1, 200)) for _ in range(rng.randint(1, 5))]
        engine.append(f"n{i}", AppendBatch(written[f"n{i}"]))
    synced = rng.random() < 0.5
    if synced:
        engine.maintain()  # the everysec round: every new stream is durable now
    must = set(written) if synced else set()
    state = fs.crashed_copy(random.Random(seed), "power")
    after = Engine(ROOT, EngineConfig(**SMALL), fs=state)
    assert after.unreadable == [] and "old" in after.list_streams()
    assert not [d for d in state.listdir(ROOT / "streams") if d not in {"old", *after.list_streams()}]
    assert must <= set(after.list_streams())
    for name in after.list_streams():
        got = [e.payload for e in after.read(name, 0, 100).entries()]
        assert after.info(name).damaged == ()
        if name in written:
            assert got == written[name][: len(got)] and (name not in must or got == written[name])
    after.close()


def test_a_kill9_before_the_first_sync_keeps_every_new_stream_and_its_entries():
    fs, engine = new_engine("everysec")
    before = fs.syncs
    for i in range(5):
        engine.append(f"n{i}", AppendBatch([b"a%d" % i, b"b%d" % i]))
    assert fs.syncs == before  # nothing synced yet
    state = fs.crashed_copy(mode="process")  # kill -9: the page cache keeps every write
    after = Engine(ROOT, EngineConfig(**SMALL), fs=state)
    # Start-up adopted them durably: a power loss right now changes nothing.
    lost = Engine(ROOT, EngineConfig(**SMALL), fs=state.crashed_copy(mode="lost"))
    for engine_ in (after, lost):
        assert engine_.list_streams() == [f"n{i}" for i in range(5)]
        for i in range(5):
            assert [e.payload for e in engine_.read(f"n{i}", 0, 10).entries()] == [b"a%d" % i, b"b%d" % i]


def test_a_new_stream_is_its_directory_and_one_page_of_segment(tmp_path):
    engine = Engine(tmp_path, EngineConfig(**SMALL))
    engine.append("room-1", AppendBatch([b"%03d" % i * 33 for i in range(10)]))  # 10 x 99 bytes
    engine.maintain()
    engine.close()
    directory = stream_directory(tmp_path, "room-1")
    # The clean close's SYNCED marker is in the segment's slot: no third block for it.
    assert sorted(p.name for p in directory.iterdir()) == [segment_name(0)]
    assert (directory / segment_name(0)).stat().st_blocks * 512 == 4096
    assert synced_marker(directory) is not None
    after = Engine(tmp_path, EngineConfig(**SMALL))
    assert after.stream_config("room-1") == StreamConfig()
    assert [e.payload for e in after.read("room-1", 0, 20).entries()] == [b"%03d" % i * 33 for i in range(10)]
    after.close()


def test_a_name_its_directory_cannot_give_back_is_kept_in_a_meta_file(tmp_path):
    long_name = "n" * 250  # its directory is the hash of the name
    engine = Engine(tmp_path, EngineConfig(**SMALL))
    engine.append(long_name, AppendBatch([b"x"]))
    assert (stream_directory(tmp_path, long_name) / META_NEW).exists()
    engine.close()
    assert (stream_directory(tmp_path, long_name) / META_FILE).exists()
    (tmp_path / CATALOG_FILE).unlink()  # start-up finds the name in the directory
    after = Engine(tmp_path, EngineConfig(**SMALL))
    assert after.list_streams() == [long_name]
    assert after.read(long_name, 0, 1).entries()[0].payload == b"x"
    after.close()


def test_a_format_3_data_directory_opens_and_keeps_working(tmp_path):
    """Formats 2 and 3 gave every stream a meta file, `stream.meta.new` until its creation was
    committed: a directory with one, and one with a creation a kill -9 came before."""
    engine = Engine(tmp_path, EngineConfig(**SMALL))
    for name in ("old", "pending"):
        engine.append(name, AppendBatch([name.encode()]))
    engine.close()
    (tmp_path / CATALOG_FILE).unlink()
    old, pending = stream_directory(tmp_path, "old"), stream_directory(tmp_path, "pending")
    (old / META_FILE).write_bytes(encode_meta("old", 0, StreamConfig(max_entries=5)))
    (pending / META_NEW).write_bytes(encode_meta("pending", 0, StreamConfig()))
    erase_slot(pending / segment_name(0))
    after = Engine(tmp_path, EngineConfig(**SMALL))
    assert after.list_streams() == ["old", "pending"] and after.unreadable == []
    assert (pending / META_FILE).exists() and not (pending / META_NEW).exists()  # committed
    assert after.stream_config("old") == StreamConfig(max_entries=5)
    for name in ("old", "pending"):
        after.append(name, AppendBatch([b"more"]))
        assert [e.payload for e in after.read(name, 0, 5).entries()] == [name.encode(), b"more"]
    after.close()


def test_start_up_syncs_nothing_for_streams_a_clean_close_marked():
    """A directory without stream.meta and with SYNCED was committed before the close wrote the
    marker: start-up takes it without a sync, even when it reads every directory."""
    fs, engine = new_engine("everysec")
    for i in range(20):
        engine.append(f"s{i}", AppendBatch([b"x"]))
    engine.close()
    fs.remove(ROOT / CATALOG_FILE)
    before = fs.syncs
    after = Engine(ROOT, EngineConfig(**SMALL), fs=fs)
    assert len(after.list_streams()) == 20
    assert fs.syncs - before < 20  # a few for the engine's own files, none per stream


def test_a_new_streams_torn_first_segment_header_is_salvaged_or_the_directory_removed(tmp_path):
    engine = Engine(tmp_path, EngineConfig(**SMALL))
    for name in ("kept", "gone", "other"):
        engine.append(name, AppendBatch([b"a", b"b"]))
    engine.close()
    (tmp_path / CATALOG_FILE).unlink()
    for name in ("kept", "gone"):  # as if a kill -9 and a power loss came before the first sync
        directory = stream_directory(tmp_path, name)
        segment = directory / segment_name(0)
        raw = bytearray(segment.read_bytes())
        raw[SEGMENT_HEADER_SIZE:SLOTTED_HEADER_SIZE] = bytes(SYNCED_SLOT_SIZE)  # no clean close yet
        end = SEGMENT_HEADER_SIZE if name == "kept" else len(raw)  # "gone": its node torn too
        raw[:end] = random.Random(name).randbytes(end)
        segment.write_bytes(bytes(raw))
    after = Engine(tmp_path, EngineConfig(**SMALL))
    assert after.list_streams() == ["kept", "other"] and after.unreadable == []
    assert not stream_directory(tmp_path, "gone").exists()
    assert [e.payload for e in after.read("kept", 0, 5).entries()] == [b"a", b"b"]
    assert after.info("kept").damaged == ()
    after.close()


def test_a_stream_created_empty_gets_a_meta_file_at_its_first_sync_the_cache_closing_it_or_not():
    """Without a segment, its directory alone would look like a creation a crash cut short."""
    fs = FaultFS()
    fs.prepare_dir(ROOT)
    engine = Engine(ROOT, EngineConfig(**{**SMALL, "max_open_streams": 1}), fs=fs)
    engine.create_stream("closed-empty")
    engine.create_stream("open-empty")  # closes the first one, its creation handed to the round
    engine.maintain()
    for name in ("closed-empty", "open-empty"):
        assert fs.exists(stream_directory(ROOT, name) / META_FILE)
    lost = Engine(ROOT, EngineConfig(**SMALL), fs=fs.crashed_copy(mode="lost"))
    assert lost.list_streams() == ["closed-empty", "open-empty"]
    assert lost.info("open-empty").end_offset == 0


def made_parts(stream) -> list[str]:
    """The parts a stream makes on first use (storage/streamparts.py) that it has made so far."""
    parts = ("producers", "epochs", "cleaner", "retention", "truncation")
    return [part for part in parts if stream.made(part)]


def test_a_new_stream_makes_no_part_it_does_not_use_and_each_works_once_made_after_a_reopen():
    """A new stream's producer table, epochs, cleaner, retention and truncation are made on first
    use: its creation, append and eviction pay for none (issue 17). Made later, after a reopen
    (a close by the cache, then an engine's restart after a crash), each does its work."""
    fs = FaultFS()
    fs.prepare_dir(ROOT)
    config = EngineConfig(**SMALL, max_open_streams=1)
    engine = Engine(ROOT, config, fs=fs)
    engine.append("room", AppendBatch([b"a", b"b"]))
    room = engine._open.glance("room")
    assert made_parts(room) == []
    engine.append("other", AppendBatch([b"x"]))  # closes "room" (the cache holds one)
    assert room.closed and made_parts(room) == []

    first = engine.append("room", AppendBatch([b"c"]), producer=("p", 1))  # reopened
    assert made_parts(engine._open.glance("room")) == ["producers"]
    engine.append("other", AppendBatch([b"y"]))  # closed again: its table is saved
    assert engine.append("room", AppendBatch([b"c"]), producer=("p", 1)).duplicate
    engine.sync()

    engine = Engine(ROOT, config, fs=fs.crashed_copy(mode="lost"))  # no clean close
    retry = engine.append("room", AppendBatch([b"c"]), producer=("p", 1))
    assert retry.duplicate and retry.first_offset == first.first_offset
    assert engine.trim("room", 1) == 1  # retention
    assert engine.compact("room") == 0  # the cleaner: one growing segment, nothing sealed to compact
    assert engine.read("room", 0, 10).entries()[0].payload == b"b"
    assert engine.info("room").entries == 2
    engine.close()


def crashed_creations(hashed: bool, count: int = 6) -> tuple[FaultFS, dict[str, list[bytes]]]:
    """A kill -9 before the first round, and a restart before the kernel wrote the page cache
    back: `count` new streams (one a hashed name's, kept in stream.meta.new, if `hashed`) whose
    creations nothing synced, their writes still pending."""
    fs, engine = new_engine("everysec")
    engine.append("old", AppendBatch([b"old"]))
    engine.sync()
    names = [f"n{i}" for i in range(count - hashed)] + ["h" * 250] * hashed
    written = {name: [b"%s-%d" % (name[:4].encode(), i) for i in range(3)] for name in names}
    for name, items in written.items():
        engine.append(name, AppendBatch(items))
    return fs.crashed_copy(mode="process", written_back=False), written


def contents(engine: Engine, name: str) -> list[bytes]:
    return [e.payload for e in engine.read(name, 0, 100).entries()]


@pytest.mark.parametrize("hashed", [False, True])
def test_start_up_after_a_kill9_makes_the_adopted_creations_durable_with_one_or_two_filesystem_syncs(hashed):
    state, written = crashed_creations(hashed, count=40)
    calls = counting_syncfs(state)
    before = state.syncs
    after = Engine(ROOT, EngineConfig(**SMALL), fs=state)
    assert calls == [ROOT] * (2 if hashed else 1)  # a second one for the renames, only if any
    assert state.syncs - before == len(calls)  # nothing stream by stream
    assert len(after.list_streams()) == 41
    lost = Engine(ROOT, EngineConfig(**SMALL), fs=state.crashed_copy(mode="lost"))
    assert {name: contents(lost, name) for name in written} == written
    assert lost.unreadable == [] and all(lost.info(name).damaged == () for name in written)


@pytest.mark.parametrize("hashed", [False, True])
def test_a_power_loss_at_every_sync_point_of_start_up_keeps_each_adopted_stream_whole_or_removes_it(hashed):
    state, _ = crashed_creations(hashed)
    before = state.syncs
    syncfs_points: list[int] = []  # the sync point of each syncfs
    real = state.sync_filesystem

    def sync_filesystem(path: Path) -> None:
        syncfs_points.append(state.syncs + 1)
        real(path)

    state.sync_filesystem = sync_filesystem  # type: ignore[method-assign]
    Engine(ROOT, EngineConfig(**SMALL), fs=state)
    points = state.syncs - before
    synced_at = syncfs_points[0] - before if syncfs_points else points
    for k in range(1, points + 2):  # points + 1: the start-up ended, then the power went
        state, written = crashed_creations(hashed)
        state.crash_at_sync = state.syncs + k
        try:
            Engine(ROOT, EngineConfig(**SMALL), fs=state)
            assert k == points + 1, "the start-up ended before its last sync point"
        except Crash:
            pass
        for seed, mode in [(0, "lost"), (1, "power"), (2, "power"), (3, "power")]:
            crashed = state.crashed_copy(random.Random(seed * 1000 + k), mode)
            after = Engine(ROOT, EngineConfig(**SMALL), fs=crashed)
            assert after.unreadable == [] and contents(after, "old") == [b"old"], (k, mode)
            for name, items in written.items():
                got = contents(after, name) if after.exists(name) else None
                if k > synced_at:
                    assert got == items, (k, mode, name)  # adopted: durable from the first syncfs on
                else:  # the power took back what the crash left unsynced: some of it, never torn
                    assert got in (None, [], items), (k, mode, name)
                if got is not None:
                    assert after.info(name).damaged == (), (k, mode, name)
            after.close()


def test_a_crashed_creation_start_up_reads_twice_is_adopted_once():
    """A replicated stream deleted and created again (not replicated, a hashed name): after a
    kill -9 the journal's creation and the catalog's replicated list both read its directory."""
    fs, engine = new_engine("everysec")
    name = "h" * 250
    engine.create_stream(name, incarnation=1)
    engine.close()
    engine = Engine(ROOT, EngineConfig(**SMALL, fsync="everysec"), fs=fs)
    engine.delete_stream(name)
    engine.append(name, AppendBatch([b"again"]))
    after = Engine(ROOT, EngineConfig(**SMALL), fs=fs.crashed_copy(mode="process"))
    assert after.list_streams() == [name] and after.unreadable == []
    assert contents(after, name) == [b"again"]
