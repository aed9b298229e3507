"""Idempotent appends (producer id + sequence) and conditional appends (expected next offset)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from storage import (
    AppendBatch,
    Engine,
    EngineConfig,
    InvalidArgumentError,
    OffsetMismatchError,
    PreconditionError,
)

from .conftest import SMALL
from .faultfs import FaultFS

ROOT_DATA = "/faultfs/data"


def test_a_retry_returns_the_first_offsets_and_writes_nothing(open_engine):
    engine = open_engine()
    engine.append("s", AppendBatch([b"before"]))
    first = engine.append("s", AppendBatch([b"a", b"b"]), producer=("p1", 7))
    again = engine.append("s", AppendBatch([b"a", b"b"]), producer=("p1", 7))
    assert (first.first_offset, first.last_offset, first.duplicate) == (1, 2, False)
    assert (again.first_offset, again.last_offset, again.duplicate) == (1, 2, True)
    assert again.timestamp_ms == first.timestamp_ms
    assert engine.info("s").end_offset == 3
    other = engine.append("s", AppendBatch([b"c"]), producer=("p2", 7))  # another producer
    assert (other.first_offset, other.duplicate) == (3, False)
    last = engine.read("s", 2, 1).entries()[0]
    assert (last.producer_id, last.producer_sequence, last.payload) == ("p1", 7, b"b")


def test_duplicates_do_not_wake_readers(open_engine):
    engine = open_engine()
    woken = []
    engine.add_append_listener(lambda name, nxt: woken.append(nxt))
    engine.append("s", AppendBatch([b"a"]), producer=("p", 1))
    engine.append("s", AppendBatch([b"a"]), producer=("p", 1))
    assert woken == [1]


def test_dedup_survives_a_clean_restart_and_a_crash(tmp_path, clock):
    config = EngineConfig(**SMALL)
    engine = Engine(tmp_path / "d", config, clock=clock)
    engine.append("s", AppendBatch([b"x"] * 3), producer=("spark-q1-0", 0))
    engine.close()
    engine = Engine(tmp_path / "d", config, clock=clock)
    assert engine.append("s", AppendBatch([b"x"] * 3), producer=("spark-q1-0", 0)).duplicate
    engine.append("s", AppendBatch([b"y"] * 2), producer=("spark-q1-0", 1))
    # kill -9: no clean close, so no fresh snapshot; the batch is found by scanning the stream.
    os.close(engine._lock_fd)
    engine._lock_fd = None
    engine = Engine(tmp_path / "d", config, clock=clock)
    retry = engine.append("s", AppendBatch([b"y"] * 2), producer=("spark-q1-0", 1))
    assert (retry.first_offset, retry.last_offset, retry.duplicate) == (3, 4, True)
    assert engine.info("s").end_offset == 5
    engine.close()


def test_after_a_power_loss_a_lost_batch_is_appended_again(clock):
    """The snapshot may outlive entries a power loss took back: those must not count as written."""
    fs = FaultFS()
    root = Path(ROOT_DATA)
    fs.prepare_dir(root)
    config = EngineConfig(**{**SMALL, "fsync": "no"})
    engine = Engine(root, config, clock=clock, fs=fs)
    engine.append("s", AppendBatch([b"kept"]), producer=("p", 1))
    engine.sync()
    engine.append("s", AppendBatch([b"lost"]), producer=("p", 2))
    engine._stream("s").save_producers(clock())  # the snapshot lands, the entry does not
    crashed = fs.crashed_copy(random.Random(1), "power", fate=lambda write: "drop")
    engine = Engine(root, config, clock=clock, fs=crashed)
    assert engine.info("s").end_offset == 1
    again = engine.append("s", AppendBatch([b"lost"]), producer=("p", 2))
    assert (again.first_offset, again.duplicate) == (1, False)
    assert engine.append("s", AppendBatch([b"kept"]), producer=("p", 1)).duplicate


def test_window_limits(open_engine, clock):
    engine = open_engine(dedup_batches_per_producer=3, dedup_window_ms=10_000)
    for seq in range(5):
        engine.append("s", AppendBatch([b"%d" % seq]), producer=("p", seq))
    with pytest.raises(PreconditionError, match="older than the deduplication window"):
        engine.append("s", AppendBatch([b"0"]), producer=("p", 0))
    assert engine.append("s", AppendBatch([b"4"]), producer=("p", 4)).duplicate
    clock.advance(20_000)
    engine.maintain()  # the producer was idle past the window: forgotten
    assert not engine.append("s", AppendBatch([b"4"]), producer=("p", 4)).duplicate


@pytest.mark.parametrize(
    ("producer_id", "sequence"),
    [("p", None), (None, 1), ("", 1), ("p", -1), ("x" * 256, 1), ("\udcff", 1)],
)
def test_bad_producer_fields_are_refused(open_engine, producer_id, sequence):
    engine = open_engine()
    with pytest.raises(InvalidArgumentError):
        engine.append("s", AppendBatch([b"a"]), producer=(producer_id, sequence))
    assert not engine.exists("s")


def test_conditional_append(open_engine):
    engine = open_engine()
    with pytest.raises(OffsetMismatchError) as too_far:
        engine.append("s", AppendBatch([b"a"]), expected_end=5)
    assert too_far.value.end_offset == 0 and not engine.exists("s")
    assert engine.append("s", AppendBatch([b"a", b"b"]), expected_end=0).first_offset == 0
    assert engine.append("s", AppendBatch([b"c"]), expected_end=2).first_offset == 2
    with pytest.raises(OffsetMismatchError) as moved:
        engine.append("s", AppendBatch([b"d"]), expected_end=2)
    assert (moved.value.expected, moved.value.end_offset) == (2, 3)
    assert "3" in str(moved.value)
    assert engine.info("s").end_offset == 3
    with pytest.raises(InvalidArgumentError):
        engine.append("s", AppendBatch([b"d"]), expected_end=-1)
