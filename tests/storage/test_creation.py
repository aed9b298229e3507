"""Cheap creation (issue 17, storage/creation.py): creating a stream syncs nothing; its first
sync (the everysec round's, an "always" append's, a close's) makes it durable, sharing the
streams directory's sync with every stream created meanwhile. A power loss before that leaves
the new stream whole or absent, never torn or reported damaged."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from storage import AppendBatch, Engine, EngineConfig
from tests.storage.conftest import SMALL
from tests.storage.faultfs import FaultFS

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
    # Each stream: its segment, its meta file, its directory; the streams directory once for all.
    assert fs.syncs - before == 10 * 3 + 1
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
