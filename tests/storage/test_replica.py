"""The engine's replication primitives: replica chunks out and in, truncation, epochs, the commit cap."""

from __future__ import annotations

import dataclasses
import random
import tempfile
from array import array
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage import (
    AppendBatch,
    Engine,
    EngineConfig,
    InvalidArgumentError,
    OffsetMismatchError,
    PreconditionError,
    StreamConfig,
)
from storage.layout import EPOCHS_FILE, segment_name, stream_directory
from storage.packs import NO_PLACE
from tests.storage.conftest import SMALL, FakeClock
from tests.storage.faultfs import FaultFS


def replicate(leader: Engine, follower: Engine, name: str, sizes) -> None:
    """Copy the leader's records the follower lacks, in chunks of the given byte budgets."""
    if not follower.exists(name):
        follower.create_stream(name)
    sizes = iter(sizes)
    while follower.log_end(name) < leader.log_end(name):
        chunk = leader.read_replica(name, follower.log_end(name), next(sizes, 1 << 20))
        assert chunk.end_offset > chunk.first_offset  # records, or a hole the leader's compaction left
        assert follower.append_replica(name, chunk) == chunk.end_offset


def everything(engine: Engine, name: str) -> tuple:
    info = engine.info(name)
    result = engine.read(name, info.first_offset, 1_000_000)
    content = (info.first_offset, info.end_offset, info.entries, info.last_timestamp_ms)
    return content, b"".join(result.records), result.entries()


entry = st.tuples(
    st.binary(min_size=0, max_size=300),  # payload
    st.sampled_from(["", "", "k1", "k2"]),  # tag
    st.sampled_from([0, 0, 0, 1_800_000_000_000]),  # deliver_at_ms
    st.booleans(),  # headers
)
step = st.one_of(
    st.tuples(
        st.just("append"),
        st.lists(entry, min_size=1, max_size=20),
        st.one_of(st.none(), st.tuples(st.sampled_from(["p1", "p2"]), st.integers(0, 6))),
    ),
    st.tuples(st.just("replicate"), st.lists(st.integers(1, 3000), min_size=1, max_size=5), st.none()),
    st.tuples(st.just("tick"), st.integers(0, 5000), st.none()),
    st.tuples(st.just("compact"), st.none(), st.none()),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(step, min_size=1, max_size=30), final=st.lists(st.integers(1, 5000), max_size=5))
def test_a_follower_reads_back_byte_identical_to_its_leader(steps, final):
    with tempfile.TemporaryDirectory() as tmp:
        # The follower's clock is ahead (within the dedup window): nothing gets re-stamped by it.
        leader_clock, follower_clock = FakeClock(), FakeClock(1_700_000_100_000)
        leader = Engine(Path(tmp) / "a", EngineConfig(**SMALL), clock=leader_clock)
        follower = Engine(Path(tmp) / "b", EngineConfig(**SMALL), clock=follower_clock)
        leader.create_stream("s")
        batches = {}
        for kind, arg, producer in steps:
            if kind == "append":
                batch = AppendBatch(
                    [e[0] for e in arg],
                    tags=[e[1] for e in arg],
                    headers=[{"h": b"v"} if e[3] else None for e in arg],
                    deliver_at_ms=[e[2] for e in arg],
                )
                result = leader.append("s", batch, producer=producer)
                if producer and not result.duplicate:
                    batches[producer] = (batch, result.first_offset, result.last_offset)
            elif kind == "replicate":
                replicate(leader, follower, "s", arg)
            elif kind == "compact":  # holes: the follower's copy gets them too
                leader.compact("s")
            else:
                leader_clock.advance(arg)
            if kind != "append" or not arg:
                leader.maintain()  # packs full segments: chunks then come from packed nodes too
        replicate(leader, follower, "s", final)
        assert everything(follower, "s") == everything(leader, "s")
        for (producer, sequence), (batch, first, last) in batches.items():
            again = follower.append("s", batch, producer=(producer, sequence))
            assert (again.duplicate, again.first_offset, again.last_offset) == (True, first, last)
        follower.close()
        follower = Engine(Path(tmp) / "b", EngineConfig(**SMALL), clock=follower_clock)
        assert everything(follower, "s") == everything(leader, "s")
        for (producer, sequence), (batch, first, _) in batches.items():
            again = follower.append("s", batch, producer=(producer, sequence))
            assert (again.duplicate, again.first_offset) == (True, first)
        leader.close()
        follower.close()


def compacted_leader(open_engine) -> Engine:
    """A leader whose sealed segments compaction left with holes: whole nodes gone and, inside
    nodes, every third entry kept (three tags, only the latest of each survives a segment)."""
    leader = open_engine()
    for i in range(150):
        leader.append("s", AppendBatch([b"v%d-" % i * 40] * 3, tags=[f"k{j}" for j in range(3)]))
        leader.append("s", AppendBatch([b"plain-%d" % i * 20, b""], tags=["", f"k{i % 5}"]))
    leader.maintain()
    assert leader.compact("s") > 0 and leader.read("s", 0, 10).next_offset > 10
    return leader


@pytest.mark.parametrize("budget", [1, 300, 5000, 1 << 20])
def test_a_follower_copies_a_compacted_leaders_holes(open_engine, tmp_path, budget):
    leader = compacted_leader(open_engine)
    follower = Engine(tmp_path / "f", EngineConfig(**SMALL))
    replicate(leader, follower, "s", [budget] * 10_000)
    assert everything(follower, "s") == everything(leader, "s")
    assert follower.read("s", 0, 5).gap == leader.read("s", 0, 5).gap is not None  # same gaps, same reasons
    follower.close()
    follower = Engine(tmp_path / "f", EngineConfig(**SMALL))
    assert everything(follower, "s") == everything(leader, "s")
    leader.append("s", AppendBatch([b"after"] * 3))  # copied after the holes, into a new segment
    replicate(leader, follower, "s", [budget] * 10_000)
    assert everything(follower, "s") == everything(leader, "s")
    follower.close()


def test_a_chunk_up_to_a_stop_inside_a_hole_covers_the_hole_and_survives_a_restart(open_engine, tmp_path):
    leader = compacted_leader(open_engine)
    first_kept = leader.read("s", 0, 1).entries()[0].offset
    assert first_kept > 2
    chunk = leader.read_replica("s", 0, 1 << 20, stop=first_kept - 1)  # an epoch starting in the hole
    assert (chunk.count, chunk.end_offset) == (0, first_kept - 1)
    follower = Engine(tmp_path / "f", EngineConfig(**SMALL))
    follower.create_stream("s")
    assert follower.append_replica("s", chunk) == first_kept - 1
    follower.begin_epoch("s", 3)
    follower.close()
    follower = Engine(tmp_path / "f", EngineConfig(**SMALL))
    assert follower.log_end("s") == first_kept - 1 and follower.epochs("s") == [(3, first_kept - 1)]
    replicate(leader, follower, "s", [700] * 10_000)
    assert everything(follower, "s") == everything(leader, "s")
    follower.close()


def test_a_chunk_whose_end_is_before_its_last_record_is_refused(open_engine, tmp_path):
    leader = compacted_leader(open_engine)
    chunk = leader.read_replica("s", 0, 1 << 20)
    follower = Engine(tmp_path / "f", EngineConfig(**SMALL))
    follower.create_stream("s")
    with pytest.raises(InvalidArgumentError):
        follower.append_replica("s", dataclasses.replace(chunk, end_offset=chunk.runs[-1].first_offset))
    assert follower.info("s").end_offset == 0
    follower.close()


def test_a_record_larger_than_the_byte_budget_still_moves(open_engine):
    engine = open_engine()
    engine.append("s", AppendBatch([b"x" * 2000, b"y" * 10]))
    chunk = engine.read_replica("s", 0, 1)
    assert (chunk.first_offset, chunk.count, chunk.log_end) == (0, 1, 2)
    assert engine.read_replica("s", 2, 100).count == 0


def test_a_replica_read_sees_past_the_commit_cap(open_engine):
    engine = open_engine()
    engine.append("s", AppendBatch([b"a", b"b", b"c"]))
    engine.set_commit("s", 1)
    assert engine.read("s", 0, 10).count == 1
    assert engine.read_replica("s", 0, 1000).count == 3


def test_a_chunk_that_does_not_start_at_the_end_changes_nothing(open_engine, tmp_path):
    leader = open_engine()
    leader.append("s", AppendBatch([b"a", b"b", b"c"]))
    follower = Engine(tmp_path / "f", EngineConfig(**SMALL))
    follower.create_stream("s")
    with pytest.raises(OffsetMismatchError) as err:
        follower.append_replica("s", leader.read_replica("s", 1, 1000))
    assert err.value.end_offset == 0
    assert follower.info("s").end_offset == 0
    follower.close()


@pytest.mark.parametrize(
    "damage",
    [
        lambda c: dataclasses.replace(c, positions=array("I", [0, 5, 3, len(c.records)])),
        lambda c: dataclasses.replace(c, positions=array("I", [0, len(c.records)])),
        lambda c: dataclasses.replace(
            c, runs=(dataclasses.replace(c.runs[0], first_ts=c.runs[0].first_ts + 1),)
        ),
        lambda c: dataclasses.replace(
            c, first_offset=0, runs=(dataclasses.replace(c.runs[0], first_offset=1),)
        ),
        lambda c: dataclasses.replace(c, records=c.records[:-1] + b"\x00"),
    ],
    ids=["positions out of order", "runs miss records", "timestamp", "offsets", "last byte"],
)
def test_a_malformed_chunk_is_refused_and_writes_nothing(open_engine, tmp_path, damage):
    leader = open_engine()
    leader.append("s", AppendBatch([b"aaaa", b"bbbb", b"cccc"]))
    chunk = leader.read_replica("s", 0, 1000)
    follower = Engine(tmp_path / "f", EngineConfig(**SMALL))
    follower.create_stream("s")
    bad = damage(chunk)
    if bad.records != chunk.records:  # the records' own bytes are trusted: a payload byte goes through
        follower.append_replica("s", bad)
        assert follower.read("s", 0, 10).entries()[-1].payload == b"ccc\x00"
    else:
        with pytest.raises(InvalidArgumentError):
            follower.append_replica("s", bad)
        assert follower.info("s").end_offset == 0
    follower.close()


# ---------------------------------------------------------------------- truncation


def filled(open_engine, n: int, **config) -> tuple[Engine, list[bytes]]:
    engine = open_engine(**config)
    payloads = [b"entry-%04d" % i * 100 for i in range(n)]
    for i in range(0, n, 5):
        engine.append("s", AppendBatch(payloads[i : i + 5]))
    return engine, payloads


@pytest.mark.parametrize("packed", [False, True], ids=["growing", "packed"])
@pytest.mark.parametrize("cut", [0, 3, 8, 37, 80, 199])
def test_truncate_drops_the_suffix_and_appends_go_on_from_the_cut(open_engine, packed, cut):
    engine, payloads = filled(open_engine, 200)
    if packed:
        engine.maintain()
    assert engine.info("s").segments > 2
    engine.truncate("s", cut)
    assert [e.payload for e in engine.read("s", 0, 1000).entries()] == payloads[:cut]
    assert engine.info("s").end_offset == cut
    assert engine.append("s", AppendBatch([b"new"] * 7)).first_offset == cut
    engine.close()
    engine = open_engine()
    got = engine.read("s", 0, 1000).entries()
    assert [e.payload for e in got] == payloads[:cut] + [b"new"] * 7
    assert [e.offset for e in got] == list(range(cut + 7))


def test_truncate_refuses_a_cut_outside_the_stream(open_engine):
    engine, _ = filled(open_engine, 20)
    engine.trim("s", 5)
    for cut in (4, 21, -1):
        with pytest.raises(InvalidArgumentError):
            engine.truncate("s", cut)
    engine.truncate("s", 20)  # at the end: nothing to drop
    engine.truncate("s", 5)
    assert engine.info("s").end_offset == 5


def test_truncate_forgets_epochs_and_producers_past_the_cut(open_engine):
    engine = open_engine()
    engine.create_stream("s", incarnation=7)
    engine.begin_epoch("s", 1)
    engine.append("s", AppendBatch([b"a"] * 4))
    engine.begin_epoch("s", 2)
    engine.append("s", AppendBatch([b"b"] * 4), producer=("p", 1))
    engine.truncate("s", 4)
    assert engine.epochs("s") == [(1, 0)]
    again = engine.append("s", AppendBatch([b"c"] * 4), producer=("p", 1))
    assert (again.duplicate, again.first_offset) == (False, 4)
    engine.close()
    engine = open_engine()
    assert engine.epochs("s") == [(1, 0)] and engine.incarnation("s") == 7
    assert engine.append("s", AppendBatch([b"c"] * 4), producer=("p", 1)).duplicate


# ---------------------------------------------------------------------- epochs


def test_the_epoch_history_answers_kip279_lookups(open_engine):
    engine = open_engine()
    engine.create_stream("s")
    assert engine.epochs("s") == [] and engine.epoch_end("s", 3) == (-1, 0)
    engine.begin_epoch("s", 2)
    engine.append("s", AppendBatch([b"a"] * 5))
    engine.begin_epoch("s", 2)  # the latest again: no change
    engine.begin_epoch("s", 4)
    engine.append("s", AppendBatch([b"b"] * 3))
    engine.begin_epoch("s", 5)
    engine.begin_epoch("s", 6)  # epoch 5 wrote nothing: it gives way
    assert engine.epochs("s") == [(2, 0), (4, 5), (6, 8)]
    assert engine.epoch_end("s", 1) == (-1, 0)
    assert engine.epoch_end("s", 2) == (2, 5)
    assert engine.epoch_end("s", 3) == (2, 5)
    assert engine.epoch_end("s", 4) == (4, 8)
    engine.append("s", AppendBatch([b"c"]))
    assert engine.epoch_end("s", 9) == (6, 9)
    with pytest.raises(PreconditionError):
        engine.begin_epoch("s", 3)
    engine.close()
    assert open_engine().epochs("s") == [(2, 0), (4, 5), (6, 8)]


def test_a_damaged_epoch_file_makes_the_stream_unreadable(open_engine, tmp_path):
    engine = open_engine()
    engine.create_stream("s", incarnation=3)
    engine.begin_epoch("s", 1)
    engine.close()
    path = stream_directory(tmp_path / "data", "s") / EPOCHS_FILE
    raw = bytearray(path.read_bytes())
    raw[-2] ^= 0xFF
    path.write_bytes(bytes(raw))
    engine = open_engine()
    assert not engine.exists("s") and engine.unreadable


def test_a_stream_keeps_its_incarnation(open_engine):
    engine = open_engine()
    engine.create_stream("s", incarnation=42)
    engine.create_stream("s", StreamConfig(), incarnation=42)
    with pytest.raises(PreconditionError):
        engine.create_stream("s", incarnation=43)
    engine.create_stream("plain")
    assert (engine.incarnation("s"), engine.incarnation("plain")) == (42, 0)


# ---------------------------------------------------------------------- the commit cap


def test_the_commit_cap_bounds_every_reader_and_wakes_them_when_it_moves(open_engine, clock):
    engine = open_engine()
    woken: list[tuple[str, int]] = []
    engine.add_append_listener(lambda name, end: woken.append((name, end)))
    engine.create_stream("s")
    engine.create_group("s", "g")
    engine.set_commit("s", 0)
    engine.append("s", AppendBatch([b"a"] * 5))
    clock.advance(1000)
    engine.append("s", AppendBatch([b"b"] * 5))
    assert woken == []  # an append alone wakes nobody while a cap is set
    assert engine.read("s", 0, 100).count == 0
    engine.set_commit("s", 7)
    assert woken == [("s", 7)]
    assert engine.read("s", 0, 100).count == 7
    assert engine.read("s", 100, 100, reverse=True).count == 7
    assert engine.bounds("s").end_offset == engine.info("s").end_offset == 7
    assert engine.count("s", 0, 100) == 7
    assert (engine.seek_time("s", clock.now_ms), engine.seek_time("s", clock.now_ms + 1)) == (5, 7)
    from storage import GroupReadOptions

    assert engine.read_group("s", "g", GroupReadOptions("c", 100)).offsets == list(range(7))
    engine.set_commit("s", 3)  # down: nobody to wake
    engine.set_commit("s", None)
    assert woken == [("s", 7), ("s", 10)]
    assert engine.read("s", 0, 100).count == 10
    assert engine.log_end("s") == 10


# ---------------------------------------------------------------------- rebuilding, epochs' bounds


def test_an_empty_copy_reset_to_the_leaders_first_offset_takes_its_records(open_engine, tmp_path):
    leader, _ = filled(open_engine, 40)
    leader.trim("s", 17)
    follower = Engine(tmp_path / "f", EngineConfig(**SMALL))
    follower.create_stream("s", incarnation=5)
    with pytest.raises(PreconditionError):
        leader.read_replica("s", follower.log_end("s"), 1000)  # the follower's end is evicted there
    follower.reset("s", leader.info("s").first_offset)
    assert (follower.info("s").first_offset, follower.log_end("s")) == (17, 17)
    replicate(leader, follower, "s", [300, 5000])
    assert everything(follower, "s") == everything(leader, "s")
    follower.close()
    follower = Engine(tmp_path / "f", EngineConfig(**SMALL))
    assert everything(follower, "s") == everything(leader, "s")
    assert follower.incarnation("s") == 5
    with pytest.raises(PreconditionError):
        follower.reset("s", 50)  # it holds records now
    follower.close()


def test_a_reset_never_moves_a_copy_back(open_engine):
    # A directory stream's copy, as a follower's is (a replicated stream never takes a slot).
    engine = open_engine(small_streams="off")
    engine.create_stream("s")
    engine.reset("s", 9)
    for bad in (8, -1, "10"):
        with pytest.raises(InvalidArgumentError):
            engine.reset("s", bad)
    engine.reset("s", 12)
    engine.append("s", AppendBatch([b"a"]))
    assert engine.read("s", 0, 10).entries()[0].offset == 12


def test_an_empty_slot_stream_is_reset_as_a_directory_streams_copy_is(open_engine, tmp_path):
    engine = open_engine()  # small_streams "slots", the default: a stream made without an incarnation
    engine.create_stream("s")
    assert engine._catalog.place("s") != NO_PLACE
    for bad in (-1, "10"):
        with pytest.raises(InvalidArgumentError):
            engine.reset("s", bad)
    assert engine._catalog.place("s") != NO_PLACE  # refused: still in its slot
    engine.reset("s", 9)  # a slot keeps no first offset: the stream moves to a directory first
    assert engine._catalog.place("s") == NO_PLACE
    assert (engine.info("s").first_offset, engine.log_end("s")) == (9, 9)
    engine.append("s", AppendBatch([b"a", b"b"]))
    engine.close()
    again = open_engine()
    assert [e.offset for e in again.read("s", 0, 10).entries()] == [9, 10]
    # Its first segment is named after its first offset, as a directory stream's reset copy's is.
    assert sorted(p.name for p in stream_directory(tmp_path / "data", "s").glob("*.seg")) == [segment_name(9)]
    again.append("full", AppendBatch([b"x"]))
    with pytest.raises(PreconditionError, match="holds records"):
        again.reset("full", 5)
    assert again._catalog.place("full") != NO_PLACE  # refused: left in its slot


@pytest.mark.parametrize("mode", ["process", "power"])
def test_a_crash_at_every_step_of_a_slot_streams_reset_leaves_an_empty_copy_a_reset_again_finishes(mode):
    root = Path("/faultfs/data")
    fs = FaultFS()
    fs.prepare_dir(root)
    engine = Engine(root, EngineConfig(**SMALL, fsync="always"), fs=fs)
    engine.create_stream("s")
    states: list[FaultFS] = []
    rng = random.Random(3)
    fs.on_sync = fs.on_write = lambda state: states.append(state.crashed_copy(rng, mode))
    engine.reset("s", 9)
    fs.on_sync = fs.on_write = None
    assert len(states) >= 5  # the promotion's steps, the segment's removal, the meta file
    for k, state in enumerate(states):
        crashed = Engine(root, EngineConfig(**SMALL, fsync="always"), fs=state)
        assert (crashed.info("s").first_offset, crashed.log_end("s")) in ((0, 0), (9, 9)), k
        crashed.reset("s", 9)
        crashed.append("s", AppendBatch([b"a"]))
        assert [e.offset for e in crashed.read("s", 0, 10).entries()] == [9], k
        crashed.close()


def test_a_replica_read_stops_short_of_the_bound_asked(open_engine):
    engine, _ = filled(open_engine, 30)
    chunk = engine.read_replica("s", 4, 1 << 20, stop=11)
    assert (chunk.first_offset, chunk.end_offset, chunk.log_end) == (4, 11, 30)
    assert engine.read_replica("s", 11, 1 << 20, stop=11).count == 0


def test_appends_under_a_commit_cap_tell_the_log_listeners_not_the_readers(open_engine):
    engine = open_engine()
    readers: list[tuple[str, int]] = []
    logs: list[tuple[str, int]] = []
    engine.add_append_listener(lambda name, end: readers.append((name, end)))
    engine.add_log_listener(lambda name, end: logs.append((name, end)))
    engine.append("s", AppendBatch([b"a"] * 2))
    assert (readers, logs) == ([("s", 2)], [])
    engine.set_commit("s", 2)
    engine.append("s", AppendBatch([b"b"] * 3))
    assert (readers, logs) == ([("s", 2)], [("s", 5)])
    # Several batches in one write (Publish's) tell them once, of the end of all of them.
    engine.append_many("s", [(AppendBatch([b"c"]), None), (AppendBatch([b"d"] * 2), None)])
    assert (readers, logs) == ([("s", 2)], [("s", 5), ("s", 8)])


def test_a_damaged_copy_is_wiped_for_a_rebuild(open_engine, tmp_path):
    engine = open_engine()
    engine.create_stream("s", incarnation=3)
    engine.append("s", AppendBatch([b"a"] * 3))
    engine.close()
    path = stream_directory(tmp_path / "data", "s") / EPOCHS_FILE
    path.write_bytes(b"garbage")
    engine = open_engine()
    assert not engine.wipe_damaged("other")
    with pytest.raises(PreconditionError):
        engine.create_stream("s", incarnation=3)  # never written over while damaged
    assert engine.wipe_damaged("s") and not engine.unreadable
    engine.create_stream("s", incarnation=3)
    assert engine.log_end("s") == 0
    engine.close()
    assert open_engine().log_end("s") == 0


def test_a_sync_under_way_when_a_truncation_cuts_does_not_vouch_for_the_cut_entries(open_engine, monkeypatch):
    import threading

    from storage.fs import SegmentFile

    engine = open_engine(fsync="everysec", small_streams="off")  # its segment file's sync is held
    engine.append("s", AppendBatch([b"a"] * 15))
    syncing, release = threading.Event(), threading.Event()
    plain_sync = SegmentFile.sync

    def slow_sync(self):
        syncing.set()
        assert release.wait(10)
        plain_sync(self)

    monkeypatch.setattr(SegmentFile, "sync", slow_sync)
    syncer = threading.Thread(target=engine.sync)
    syncer.start()
    assert syncing.wait(10)  # it counted the 15 entries and syncs their file now
    monkeypatch.setattr(SegmentFile, "sync", plain_sync)
    engine.truncate("s", 10)
    release.set()
    syncer.join(10)
    assert engine.log_end("s") == 10  # not the 15 the sync had counted
    assert engine.append("s", AppendBatch([b"b"])).first_offset == 10


def test_a_truncation_at_the_end_forgets_an_epoch_begun_there(open_engine):
    engine = open_engine()
    engine.create_stream("s", incarnation=1)
    engine.begin_epoch("s", 1)
    engine.append("s", AppendBatch([b"a"] * 4))
    engine.begin_epoch("s", 3)  # led at epoch 3, deposed before it wrote anything
    engine.truncate("s", 4)
    assert engine.epochs("s") == [(1, 0)] and engine.log_end("s") == 4
