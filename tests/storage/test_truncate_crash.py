"""Crash sweep of truncation (the replica's KIP-101 cut), on the fault-injecting file system.

A seeded stream (growing and packed segments, idempotent batches, epochs) is
truncated at a random offset, and the post-crash state at every sync and
write point of the truncation is kept (power loss: pending writes kept,
dropped, garbled or torn; kill -9: the page cache survives, the write under
way torn). Each state must reopen to the old log or to the truncated one,
never a mix: same entries, timestamps, epochs and producers as one of the
two. Appends then go on from its end, and a clean close followed by a power
loss changes nothing.
"""

from __future__ import annotations

import random

import pytest

from storage import AppendBatch, Engine
from tests.storage.faultfs import FaultFS
from tests.storage.test_crash_sweep import MAIN, ROOT, Clock, key, open_engine, read_all


def content(engine: Engine) -> tuple:
    problems: list[str] = []
    first, end, entries, gaps = read_all(engine, MAIN, problems)
    assert not problems and not gaps and not engine.info(MAIN).damaged, (problems, gaps)
    return first, end, [key(e) for e in entries], engine.epochs(MAIN)


def build(seed: int, fsync: str) -> tuple[FaultFS, Engine, int]:
    rng = random.Random(seed)
    fs = FaultFS()
    fs.prepare_dir(ROOT)
    engine = open_engine(fs, fsync, Clock())
    engine.create_stream(MAIN, incarnation=5)
    for epoch in range(1, rng.randint(2, 5)):
        engine.begin_epoch(MAIN, epoch)
        for _ in range(rng.randint(3, 25)):
            n = rng.randint(1, 9)
            payloads = [rng.randbytes(rng.randint(1, 700)) for _ in range(n)]
            producer = ("p", rng.randrange(1000)) if rng.random() < 0.3 else None
            engine.append(MAIN, AppendBatch(payloads), producer=producer)
        if rng.random() < 0.5:
            engine.maintain()  # pack the full segments: the cut may fall in a packed one
    engine.sync()
    info = engine.info(MAIN)
    return fs, engine, rng.randint(info.first_offset, info.end_offset - 1)


@pytest.mark.parametrize(
    ("fsync", "crash"), [("always", "power"), ("everysec", "power"), ("always", "process")]
)
def test_a_crash_during_truncation_leaves_the_old_log_or_the_truncated_one(fsync, crash):
    checked = truncated = 0
    failures: list[str] = []
    for seed in range(12):
        fs, engine, cut = build(seed, fsync)
        old = content(engine)
        states: list[tuple[str, FaultFS]] = []

        def keep(point: str, f: FaultFS, torn: bool, states=states) -> None:
            states.append((point, f.crashed_copy(random.Random(point), crash, torn_inflight=torn)))

        fs.on_sync = lambda f: keep(f"sync {f.syncs}", f, False)
        fs.on_write = lambda f: keep(f"write {f.writes}", f, True)
        engine.truncate(MAIN, cut)
        fs.on_sync = fs.on_write = None
        new = content(engine)
        assert new[1] == cut and new[2] == old[2][: cut - old[0]]
        states.append(("after", fs.crashed_copy(random.Random(seed), crash)))
        for point, state in states:
            label = f"{fsync}/{crash} seed={seed} cut={cut} {point}"
            later = Clock(1_800_000_000_000)
            try:
                after = Engine(ROOT, engine.config, clock=later, fs=state)
                got = content(after)
                assert got in (old, new), "neither the old log nor the truncated one"
                truncated += got == new
                end = got[1]
                assert after.append(MAIN, AppendBatch([b"later"] * 3)).first_offset == end
                after.close()
                again = Engine(
                    ROOT, engine.config, clock=Clock(1_800_000_000_000), fs=state.crashed_copy(mode="lost")
                )
                assert content(again)[2][-3:] == [
                    (end + i, 1_800_000_000_000, "", b"later", (), 0) for i in range(3)
                ]
                again.close()
            except Exception as exc:
                failures.append(f"{label}: {type(exc).__name__}: {exc}")
            checked += 1
        engine.close()
    print(f"{fsync}/{crash}: {checked} crash points, {truncated} recovered truncated")
    assert not failures, f"{len(failures)} of {checked} crash points failed:\n" + "\n".join(failures[:10])
    assert truncated and truncated < checked  # both outcomes were met
