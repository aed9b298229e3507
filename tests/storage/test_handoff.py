"""A stream the cache closes under everysec hands its syncs to the next round (storage/handoff.py):
the call that needed the room syncs nothing; the round syncs it and writes its SYNCED marker; a
reopening before the round takes the close back; a stream opened after a clean close keeps its
marker through its writes (storage/cleanmark.py). The crash guarantees stay those of a synced close."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from storage import AppendBatch, DurabilityError, Engine, EngineConfig
from storage.handoff import BACKLOG_BOUND, SYNCFS_BATCH
from storage.layout import stream_directory
from tests.storage import conftest
from tests.storage.conftest import synced_marker
from tests.storage.faultfs import Crash, FaultFS

# Streams in directories of their own (small_streams off, not the default slots): a close handed to
# the round and its SYNCED marker are a directory stream's (a slot stream's close hands it nothing).
SMALL = {**conftest.SMALL, "small_streams": "off"}

ROOT = Path("/faultfs/data")


def new_engine(fsync: str = "everysec", max_open_streams: int = 1) -> tuple[FaultFS, Engine]:
    fs = FaultFS()
    fs.prepare_dir(ROOT)
    return fs, Engine(ROOT, EngineConfig(**SMALL, fsync=fsync, max_open_streams=max_open_streams), fs=fs)


def contents(engine: Engine, name: str) -> list[bytes]:
    return [e.payload for e in engine.read(name, 0, 10_000).entries()]


def marked_clean(fs: FaultFS, name: str) -> bool:
    return synced_marker(stream_directory(ROOT, name), fs) is not None


def test_an_eviction_under_everysec_makes_no_sync_call_on_the_callers_thread():
    fs, engine = new_engine()
    engine.append("old", AppendBatch([b"synced"]))
    engine.maintain()
    engine.append("old", AppendBatch([b"unsynced"] * 5))
    syncing_threads: list[int] = []
    fs.on_sync = lambda _: syncing_threads.append(threading.get_ident())
    for i in range(5):  # each closes the stream before it, written and unsynced
        engine.append(f"new-{i}", AppendBatch([b"x" * 100] * 3))
    assert engine.open_streams() == 1
    assert syncing_threads == []  # not one sync: the closes, the creations, the appends
    assert not marked_clean(fs, "old")  # a marker vouches for synced bytes: it waits for the round
    round_ = threading.Thread(target=engine.maintain)
    round_.start()
    round_.join()
    assert syncing_threads and set(syncing_threads) == {round_.ident}
    assert marked_clean(fs, "old") and all(marked_clean(fs, f"new-{i}") for i in range(4))
    lost = Engine(ROOT, EngineConfig(**SMALL), fs=fs.crashed_copy(mode="lost"))
    assert contents(lost, "old") == [b"synced"] + [b"unsynced"] * 5
    assert all(contents(lost, f"new-{i}") == [b"x" * 100] * 3 for i in range(5))
    assert all(lost.info(n).damaged == () for n in lost.list_streams())


def test_under_always_an_eviction_has_nothing_left_to_sync():
    fs, engine = new_engine("always")
    engine.append("a", AppendBatch([b"1"]))
    before = fs.syncs
    engine.append("b", AppendBatch([b"2"]))  # closes "a": already synced, so only b's own syncs
    after_b = fs.syncs
    engine.append("c", AppendBatch([b"3"]))
    assert fs.syncs - after_b == after_b - before  # closing a stream adds none
    assert marked_clean(fs, "a") and marked_clean(fs, "b")


def test_a_stream_reopened_before_the_round_takes_its_close_back_and_the_round_syncs_it():
    fs, engine = new_engine()
    engine.append("a", AppendBatch([b"first"]))
    engine.append("b", AppendBatch([b"b"]))  # closes "a", unsynced, not yet durable even as a stream
    before = fs.syncs
    assert contents(engine, "a") == [b"first"]  # reopened from its close: no sync, no marker
    engine.append("a", AppendBatch([b"second"]))
    assert fs.syncs == before and not marked_clean(fs, "a")
    engine.maintain()  # syncs "b" (handed off when "a" came back) and "a" (open: its own files)
    state = fs.crashed_copy(random.Random(1), "power")
    after = Engine(ROOT, EngineConfig(**SMALL), fs=state)
    assert contents(after, "a") == [b"first", b"second"] and contents(after, "b") == [b"b"]
    assert after.info("a").damaged == () and after.unreadable == []


def test_a_read_of_a_cleanly_closed_stream_costs_no_sync_and_neither_does_its_first_write():
    fs, engine = new_engine()
    engine.append("a", AppendBatch([b"1"]))
    engine.append("b", AppendBatch([b"2"]))
    engine.maintain()  # "a" is closed, synced, marked clean
    engine.append("c", AppendBatch([b"3"]))  # closes "b"
    engine.maintain()
    before = fs.syncs
    assert contents(engine, "a") == [b"1"]  # reopens "a", closes "c" (synced): nothing to sync
    assert fs.syncs == before and marked_clean(fs, "a")
    engine.append("a", AppendBatch([b"4"]))
    assert fs.syncs == before and marked_clean(fs, "a")  # the marker names the synced prefix: it stays
    state = fs.crashed_copy(random.Random(2), "power")
    after = Engine(ROOT, EngineConfig(**SMALL), fs=state)
    assert contents(after, "a") in ([b"1"], [b"1", b"4"]) and after.info("a").damaged == ()


@pytest.mark.parametrize("seed", range(30))
def test_a_power_loss_with_closes_waiting_for_the_round_keeps_each_stream_a_synced_prefix(seed):
    """Streams written, closed by the cache, reopened by reads, and rounds, at random; then a
    power loss. Each stream is written at most once between rounds: two unsynced appends into
    one growing node can tear both of its header slots, which no close changes (see the report)."""
    rng = random.Random(seed)
    fs, engine = new_engine(max_open_streams=rng.randint(1, 3))
    names = [f"s{i}" for i in range(6)]
    synced: dict[str, list[bytes]] = {n: [] for n in names}
    written: dict[str, list[bytes]] = {n: [] for n in names}
    for _ in range(rng.randint(10, 60)):
        name = rng.choice(names)
        if len(written[name]) > len(synced[name]):
            assert contents(engine, name) == written[name]  # reopens it, maybe from its handed close
        else:
            items = [rng.randbytes(rng.randint(1, 300)) for _ in range(rng.randint(1, 6))]
            engine.append(name, AppendBatch(items))
            written[name] += items
        if rng.random() < 0.15:
            engine.maintain()
            synced = {n: list(items) for n, items in written.items()}
    state = fs.crashed_copy(random.Random(seed), "power")
    after = Engine(ROOT, EngineConfig(**SMALL), fs=state)
    assert after.unreadable == []
    for name in names:
        got = contents(after, name) if after.exists(name) else []
        assert got == written[name][: len(got)] and len(got) >= len(synced[name]), name
        if after.exists(name):
            assert after.info(name).damaged == ()
    after.close()


def test_a_round_whose_sync_fails_leaves_the_stream_refusing_appends_when_reopened():
    fs, engine = new_engine()
    engine.append("a", AppendBatch([b"1"]))
    engine.maintain()
    engine.append("a", AppendBatch([b"2"]))
    engine.append("b", AppendBatch([b"x"]))  # closes "a" with its second entry unsynced
    fs.fail_at_sync = fs.syncs + 1  # the round's first sync: a's segment
    engine.maintain()
    assert not marked_clean(fs, "a")
    with pytest.raises(DurabilityError):
        engine.append("a", AppendBatch([b"3"]))
    engine.append("c", AppendBatch([b"y"]))
    assert engine.open_streams() == 2  # a stream whose sync failed stays open (over the limit)
    with pytest.raises(DurabilityError):
        engine.append("a", AppendBatch([b"3"]))


def test_a_synced_stream_the_cache_closes_under_everysec_leaves_its_marker_to_the_round():
    """The marker is a file to create: the call that needed the room does not wait for it."""
    fs, engine = new_engine()
    engine.append("a", AppendBatch([b"1"]))
    engine.maintain()  # "a" is synced, its creation committed: only the marker is left to a close
    engine.append("b", AppendBatch([b"2"]))  # closes "a"
    assert not marked_clean(fs, "a")
    engine.maintain()
    assert marked_clean(fs, "a")
    state = fs.crashed_copy(random.Random(3), "power")
    after = Engine(ROOT, EngineConfig(**SMALL), fs=state)
    assert contents(after, "a") == [b"1"] and after.info("a").damaged == ()


def test_a_stream_opened_and_closed_without_a_write_hands_nothing_to_the_round():
    fs, engine = new_engine()
    engine.append("a", AppendBatch([b"1"]))
    engine.append("b", AppendBatch([b"2"]))
    engine.maintain()  # "a" closed and marked; "b" synced
    engine.append("c", AppendBatch([b"3"]))  # closes "b": its marker goes to the round
    engine.maintain()
    assert contents(engine, "a") == [b"1"]  # reopens "a", closes "c" (its marker to the round)
    engine.maintain()
    writes = fs.writes
    assert contents(engine, "b") == [b"2"]  # reopens "b", closes "a": as its marker says already
    engine.maintain()
    # No marker rewritten, by the close or the round (the catalog's journal notes the reopen).
    assert [p for p in fs.written[writes:] if "streams" in p.parts] == []
    assert any("streams" in p.parts for p in fs.written[:writes])  # the filter does see stream files


# ---------------------------------------------------------------- many closes: one file-system sync

HASHED_NAME = "h" * 250  # longer than a directory name holds: kept in stream.meta.new until its commit


def many_closes(renames: bool) -> tuple[FaultFS, Engine, dict[str, list[bytes]], dict[str, list[bytes]]]:
    """More closes than SYNCFS_BATCH waiting for the round: streams an earlier round synced and
    that were written again, and new ones (with `renames`, one of a hashed name and one created
    empty: both keep a stream.meta.new for the round to rename). The stream "open" stays open.
    Returns the file system, the engine, what each stream was given and what is synced of it."""
    fs, engine = new_engine()
    written: dict[str, list[bytes]] = {}
    for i in range(4):
        written[f"old-{i}"] = [b"synced-%d" % i]
        engine.append(f"old-{i}", AppendBatch(written[f"old-{i}"]))
    engine.maintain()
    engine.maintain()  # (the first round found the last of them still open)
    synced = {name: list(items) for name, items in written.items()}
    for i in range(4):
        engine.append(f"old-{i}", AppendBatch([b"more-%d" % i] * 3))
        written[f"old-{i}"] += [b"more-%d" % i] * 3
    names = [f"new-{i}" for i in range(SYNCFS_BATCH + 4)] + ([HASHED_NAME] if renames else [])
    for i, name in enumerate(names):
        written[name] = [b"%d-%d" % (i, j) * (1 + j * 20) for j in range(1 + i % 3)]
        engine.append(name, AppendBatch(written[name]))
    if renames:
        engine.create_stream("empty")
        written["empty"] = []
    engine.append("open", AppendBatch([b"open"]))
    written["open"] = [b"open"]
    assert engine.open_streams() == 1 and len(engine._unsynced) == len(written) - 1
    return fs, engine, written, synced


def counting_syncfs(fs: FaultFS) -> list[Path]:
    calls: list[Path] = []
    real = fs.sync_filesystem

    def sync_filesystem(path: Path) -> None:
        calls.append(path)
        real(path)

    fs.sync_filesystem = sync_filesystem  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize("renames", [False, True])
def test_a_round_with_more_closes_than_the_batch_finishes_them_with_one_filesystem_sync(renames):
    fs, engine, written, _ = many_closes(renames)
    calls = counting_syncfs(fs)
    before = fs.syncs
    engine.maintain()
    assert calls == [ROOT] * (2 if renames else 1)  # a second one for the renames, only if any
    # The open stream's own syncs (its segment, its directory, the streams directory) besides:
    # one by one the closes took about three each.
    assert fs.syncs - before <= len(calls) + 3
    assert len(engine._unsynced) == 0 and engine.stats()["closes_waiting"] == 0
    assert all(marked_clean(fs, name) for name in written if name not in ("open", "empty"))
    lost = Engine(ROOT, EngineConfig(**SMALL), fs=fs.crashed_copy(mode="lost"))
    assert {name: contents(lost, name) for name in lost.list_streams()} == written
    assert lost.unreadable == [] and all(lost.info(name).damaged == () for name in written)


def finished(engine: Engine, written: dict[str, list[bytes]]) -> set[str]:
    """The closed streams the round reported finished: their close done (or gone: done and dropped)."""
    waiting = engine._unsynced._closes
    gone_or_done = {name for name in written if name not in waiting or waiting[name].state.name == "DONE"}
    return gone_or_done - {"open"}


@pytest.mark.parametrize("renames", [False, True])
def test_a_power_loss_at_every_sync_point_of_a_batch_keeps_every_finished_stream_and_tears_none(renames):
    fs, engine, _, _ = many_closes(renames)
    before = fs.syncs
    engine.maintain()
    points = fs.syncs - before
    assert points >= 2
    for k in range(1, points + 2):  # points + 1: the round ended, then the power went
        fs, engine, written, synced = many_closes(renames)
        fs.crash_at_sync = fs.syncs + k
        try:
            engine.maintain()
            assert k == points + 1, "the round ended before its last sync point"
        except Crash:
            pass
        done = finished(engine, written)
        assert (done == set()) if k == 1 else True  # nothing is reported before the syncfs
        if k == points + 1:
            assert done == set(written) - {"open"}
        for seed, mode in [(0, "lost"), (1, "power"), (2, "power"), (3, "power")]:
            state = fs.crashed_copy(random.Random(seed * 1000 + k), mode)
            after = Engine(ROOT, EngineConfig(**SMALL), fs=state)
            assert after.unreadable == [], (k, mode)
            for name, items in written.items():
                got = contents(after, name) if after.exists(name) else None
                if name in done:
                    assert got == items, (k, mode, name)  # finished: every acknowledged entry
                elif got is None:
                    assert not synced.get(name), (k, mode, name)  # only a creation never synced is gone
                else:  # a prefix, no less than an earlier round synced, never torn
                    assert got == items[: len(got)] and len(got) >= len(synced.get(name, [])), (k, mode, name)
                if got is not None:
                    assert after.info(name).damaged == (), (k, mode, name)
            after.close()


def test_a_failed_filesystem_sync_fails_every_close_of_its_batch():
    fs, engine, written, _ = many_closes(renames=False)
    assert engine.stats()["closes_waiting"] == len(written) - 1  # every stream but the open one
    fs.fail_at_sync = fs.syncs + 1  # the round's first sync: the batch's syncfs
    engine.maintain()
    assert fs.failed_syncs == 1
    assert engine.stats()["closes_waiting"] == 0  # failed: kept for their reopening, not waiting
    closed = [name for name in written if name != "open"]
    assert not any(marked_clean(fs, name) for name in closed if not name.startswith("old-"))
    for name in closed:  # reopened, each refuses appends, as after its own failed fsync
        with pytest.raises(DurabilityError):
            engine.append(name, AppendBatch([b"after"]))
    assert contents(engine, "new-0") == written["new-0"]  # what it holds is still read


def test_closes_piling_up_past_the_bound_wake_the_round_at_once():
    fs = FaultFS()
    fs.prepare_dir(ROOT)
    config = EngineConfig(
        **{**SMALL, "background": True}, fsync="everysec", max_open_streams=1, maintenance_interval_ms=600_000
    )
    engine = Engine(ROOT, config, fs=fs)
    rounds = threading.Event()
    maintain = engine.maintain

    def a_round() -> None:
        maintain()
        rounds.set()

    engine.maintain = a_round  # type: ignore[method-assign]
    calls = counting_syncfs(fs)
    try:
        for i in range(BACKLOG_BOUND + 1):  # each closes the one before: BACKLOG_BOUND closes wait
            engine.append(f"s{i}", AppendBatch([b"x"]))
        assert len(engine._unsynced) == BACKLOG_BOUND
        assert not rounds.is_set()  # at the bound: the round waits for its interval (ten minutes)
        engine.append("past", AppendBatch([b"x"]))
        assert rounds.wait(60)  # woken at once, not ten minutes later
        assert calls == [ROOT] and marked_clean(fs, "s0")
    finally:
        engine.close()


def test_a_clean_close_of_many_open_streams_syncs_them_with_one_filesystem_sync():
    fs, engine = new_engine(max_open_streams=SYNCFS_BATCH + 8)
    written = {f"s{i}": [b"%d" % i] * (1 + i % 3) for i in range(SYNCFS_BATCH + 8)}
    for name, items in written.items():
        engine.append(name, AppendBatch(items))
    assert engine.open_streams() == len(written)
    calls = counting_syncfs(fs)
    before = fs.syncs
    engine.close()
    assert calls == [ROOT]
    assert fs.syncs - before <= 4  # the syncfs, the catalog file's 3 (one by one: ~4 syncs a stream)
    assert all(marked_clean(fs, name) for name in written)
    lost = Engine(ROOT, EngineConfig(**SMALL), fs=fs.crashed_copy(mode="lost"))
    assert {name: contents(lost, name) for name in lost.list_streams()} == written
    assert all(lost.info(name).damaged == () for name in written)


def test_the_round_looks_for_a_synced_file_only_in_a_directory_that_had_one(monkeypatch):
    """A round writing a new stream's marker into its segment's slot looks for no `SYNCED` file
    to remove (a stat per close): the stream was created since, its directory has none. A stream
    opened with one (a segment without a slot wrote it) still has it removed once its marker
    moves into a slot."""
    fs, engine = new_engine()
    looked: list[str] = []
    exists = fs.exists
    monkeypatch.setattr(fs, "exists", lambda path: looked.append(path.name) or exists(path))
    for i in range(4):
        engine.append(f"new-{i}", AppendBatch([b"x"] * 3))
    engine.maintain()
    assert all(marked_clean(fs, f"new-{i}") for i in range(3)) and "SYNCED" not in looked
    directory = stream_directory(ROOT, "new-0")
    fs.write_file(directory / "SYNCED", b"left by a segment without a slot")
    engine.append("new-0", AppendBatch([b"y"]))  # reopened: its directory has a SYNCED file
    engine.append("new-9", AppendBatch([b"z"]))  # closes it
    engine.maintain()
    assert "SYNCED" in looked and not fs.exists(directory / "SYNCED") and marked_clean(fs, "new-0")
    assert contents(engine, "new-0") == [b"x"] * 3 + [b"y"]


@pytest.mark.parametrize("blocked", [1, 2])  # the batch's first syncfs, or its second (after the renames)
def test_a_stream_reopened_while_its_batch_syncs_is_not_held_by_the_syncfs_and_keeps_every_entry(blocked):
    fs, engine, written, _ = many_closes(renames=True)
    real = fs.sync_filesystem
    calls: list[Path] = []
    entered, release = threading.Event(), threading.Event()

    def sync_filesystem(path: Path) -> None:
        calls.append(path)
        if len(calls) == blocked:
            entered.set()
            assert release.wait(60), "the test never released the syncfs"
        real(path)

    fs.sync_filesystem = sync_filesystem  # type: ignore[method-assign]
    round_ = threading.Thread(target=engine.maintain)
    round_.start()
    try:
        assert entered.wait(60)
        reopened = threading.Thread(
            target=lambda: [engine.append(name, AppendBatch([b"during"])) for name in ("new-3", HASHED_NAME)]
        )
        reopened.start()
        reopened.join(30)  # the syncfs is still blocked: the reopens must not wait for it
        assert not reopened.is_alive(), "a reopen waited for the round's syncfs"
        assert contents(engine, "new-3") == written["new-3"] + [b"during"]
    finally:
        release.set()
        round_.join()
    for name in ("new-3", HASHED_NAME):
        written[name] = written[name] + [b"during"]
    assert not marked_clean(fs, "new-3")  # taken back during the batch: left to the stream
    assert marked_clean(fs, "new-4")
    assert not any(close.state.name == "FAILED" for close in engine._unsynced._closes.values())
    engine.maintain()  # the reopened streams' own syncs (the one open now, and the one handed off)
    engine.maintain()
    for seed, mode in [(0, "lost"), (1, "power"), (2, "power")]:
        after = Engine(ROOT, EngineConfig(**SMALL), fs=fs.crashed_copy(random.Random(seed), mode))
        assert after.unreadable == [], mode
        assert {name: contents(after, name) for name in after.list_streams()} == written, mode
        assert all(after.info(name).damaged == () for name in written), mode
        after.close()


def test_closes_of_streams_synced_before_they_closed_write_their_markers_without_a_filesystem_sync():
    """Calls to closed streams close as many streams, most of them synced by an earlier round:
    their closes leave only a marker to write, and a syncfs (the whole file system's write-back)
    for them would be all cost."""
    count = SYNCFS_BATCH + 8
    fs, engine = new_engine(max_open_streams=count)
    for i in range(count):
        engine.append(f"synced-{i}", AppendBatch([b"%d" % i]))
    engine.maintain()  # syncs every open stream: none has a marker yet (they are open)
    for i in range(count):  # closes each synced stream: a marker to write, nothing to sync
        engine.append(f"new-{i}", AppendBatch([b"n"]))
    assert engine.stats()["closes_waiting"] == count
    assert not any(close.has_syncs for close in engine._unsynced._closes.values())
    calls = counting_syncfs(fs)
    engine.maintain()
    assert calls == []
    assert all(marked_clean(fs, f"synced-{i}") for i in range(count))
    assert engine.stats()["closes_waiting"] == 0
