"""After a crash the figures of closed slot streams are unknown (their closes journal none) until
maintenance reads them from their slots: RECOUNT_BATCH a round, and with the background thread
in slices between rounds (storage/maintenance.py); the catalog counts the ones still unknown
(`uncounted`, the gauge streamlog_streams_uncounted)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from storage import AppendBatch, Engine, EngineConfig, StreamConfig, maintenance
from storage.maintenance import RECOUNT_BATCH
from tests.storage.conftest import SMALL
from tests.storage.faultfs import FaultFS

ROOT = Path("/faultfs/data")
ENTRY = b"e" * 100


def config(**overrides: object) -> EngineConfig:
    return EngineConfig(**{**SMALL, "max_open_streams": 1, "small_streams": "slots", **overrides})


def crashed(slot_streams: int, directory_streams: int = 0, **overrides: object) -> Engine:
    """An engine started after a kill -9 of one that created `slot_streams` slot streams of three
    entries ("s..."), then `directory_streams` streams with a config of their own ("z...", in
    directories, open at the crash: their figures unknown too)."""
    fs = FaultFS()
    fs.prepare_dir(ROOT)
    engine = Engine(ROOT, config(max_open_streams=1 + directory_streams), fs=fs)
    for i in range(slot_streams):
        engine.append(f"s{i:05d}", AppendBatch([ENTRY] * 3))
    for i in range(directory_streams):
        engine.create_stream(f"z{i}", StreamConfig(max_entries=100))
        engine.append(f"z{i}", AppendBatch([ENTRY] * 2))
    return Engine(ROOT, config(**overrides), fs=fs.crashed_copy(mode="process"))


def entries(engine: Engine) -> int:
    return engine.stats()["entries"]


def test_the_uncounted_streams_count_down_to_0_a_batch_a_round():
    streams = 2 * RECOUNT_BATCH + 100
    engine = crashed(streams)
    assert engine.uncounted_streams() == streams and entries(engine) == 0
    for left in (streams - RECOUNT_BATCH, streams - 2 * RECOUNT_BATCH, 0):
        engine.maintain()
        assert engine.uncounted_streams() == left
        assert entries(engine) == 3 * (streams - left)
    engine.close()


def test_a_stream_open_since_the_crash_is_counted_by_itself():
    """Its first use recovers it: no longer uncounted, its figures its own."""
    engine = crashed(5)
    engine.append("s00002", AppendBatch([ENTRY]))
    assert engine.uncounted_streams() == 4 and entries(engine) == 4
    engine.close()


def test_a_directory_stream_due_at_once_is_not_uncounted(tmp_path):
    """A directory stream closed with a limit not applied since its last write is due at once
    too (the catalog's first due item), with its figures known: the gauge counts slot streams."""
    engine = Engine(tmp_path, config(max_open_streams=1))
    engine.create_stream("limited", StreamConfig(max_entries=100))
    engine.append("limited", AppendBatch([ENTRY] * 4))
    engine.append("slot", AppendBatch([ENTRY]))  # closes "limited"
    assert engine._catalog._due[0] == (1, "limited")
    assert engine.uncounted_streams() == 0 and entries(engine) == 5
    engine.close()


def test_a_slice_recounts_slot_streams_and_visits_at_most_the_visits_left(monkeypatch):
    """Between rounds: the slot streams due are read from their slots, the others (here the
    directory streams open at the crash, due after them by name) visited, as many as allowed."""
    monkeypatch.setattr(maintenance, "RECOUNT_SLICE_S", 60.0)  # the slice ends for want of work
    engine = crashed(40, directory_streams=5)
    assert engine.uncounted_streams() == 40
    assert engine._recount_slice(2) == (False, 0)  # stopped by its visits
    assert engine.uncounted_streams() == 0
    visited = [name for name in ("z0", "z1", "z2", "z3", "z4") if engine._catalog.entries(name)]
    assert visited == ["z0", "z1"] and entries(engine) == 120 + 4
    assert engine._recount_slice(16) == (False, 13)  # nothing due any more
    assert entries(engine) == 120 + 10 and engine.open_streams() == 0
    engine.close()


def test_the_background_thread_recounts_them_between_rounds():
    """No round for ten minutes: the slices alone count them, soon after the start-up."""
    streams = 3 * RECOUNT_BATCH
    engine = crashed(streams, background=True, maintenance_interval_ms=600_000)
    deadline = time.monotonic() + 60
    while engine.uncounted_streams() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.uncounted_streams() == 0 and entries(engine) == 3 * streams
    engine.close()


@pytest.mark.parametrize("slice_s", [0.0005, 0.005])
def test_a_slice_keeps_to_its_cpu_budget(monkeypatch, slice_s):
    """A slice stops once it used RECOUNT_SLICE_S of the thread's CPU (at about 26 us a stream,
    well before the 3,000 due), and says more are due."""
    monkeypatch.setattr(maintenance, "RECOUNT_SLICE_S", slice_s)
    engine = crashed(3000)
    started = time.thread_time()
    assert engine._recount_slice(16) == (True, 16)
    used = time.thread_time() - started
    assert slice_s <= used < slice_s + 0.05
    assert 0 < 3000 - engine.uncounted_streams() < 3000
    engine.close()
