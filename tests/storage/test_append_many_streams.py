"""`Engine.append_many_streams`: several streams' batches written, then made durable together
under "always" (one sync of the packs and the journal for many slot streams), every result
handed out only once its stream's writes are durable, and a failed sync the error of the
streams it was to cover only."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from storage import AppendBatch, AppendResult, DurabilityError, Engine, EngineConfig, InvalidArgumentError
from storage.stream import Stream
from storage.streamsapi import DURABLE_TOGETHER
from tests.storage.conftest import SMALL
from tests.storage.faultfs import FaultFS

ROOT = Path("/faultfs/data")
ENTRY = b"e" * 100


def new_engine(fs: FaultFS, small_streams: str = "slots") -> Engine:
    fs.prepare_dir(ROOT)
    return Engine(ROOT, EngineConfig(**SMALL, fsync="always", small_streams=small_streams), fs=fs)


def batches(count: int, tag: str) -> list[tuple[AppendBatch, None]]:
    return [(AppendBatch([ENTRY, tag.encode()]), None) for _ in range(count)]


@pytest.mark.parametrize("small_streams", ["slots", "off"])
def test_every_result_handed_out_survives_a_power_loss(small_streams: str):
    fs = FaultFS()
    engine = new_engine(fs, small_streams)
    engine.append("old", AppendBatch([b"first"]))
    streams = [(f"s{i}", batches(2, f"s{i}")) for i in range(30)] + [("old", batches(1, "old"))]
    outcomes = engine.append_many_streams(streams)
    lost = Engine(ROOT, EngineConfig(**SMALL, fsync="always"), fs=fs.crashed_copy(mode="lost"))
    for (name, _), outcome in zip(streams, outcomes, strict=True):
        assert isinstance(outcome, list) and all(isinstance(r, AppendResult) for r in outcome)
        entries = [e.payload for e in lost.read(name, 0, 100).entries()]
        expected = [b"first"] if name == "old" else []
        assert entries == expected + [ENTRY, name.encode()] * len(outcome)


def test_new_slot_streams_share_a_handful_of_syncs_not_two_each():
    """Written one by one, each waited for the packs' sync and the journal's: 2 per stream."""
    fs = FaultFS()
    engine = new_engine(fs)
    engine.append("warm", AppendBatch([b"x"]))  # its pack file made and synced
    before = fs.syncs
    outcomes = engine.append_many_streams([(f"s{i}", batches(1, "x")) for i in range(60)])
    assert all(isinstance(o, list) and isinstance(o[0], AppendResult) for o in outcomes)
    assert fs.syncs - before == 2  # the packs', the journal's


def test_a_part_of_streams_is_written_and_synced_at_a_time():
    """The streams are pinned from their write to their sync: at most DURABLE_TOGETHER of them at once."""
    fs = FaultFS()
    engine = new_engine(fs)
    engine.append("warm", AppendBatch([b"x"]))
    count = DURABLE_TOGETHER + 10
    before = fs.syncs
    outcomes = engine.append_many_streams([(f"s{i}", batches(1, "x")) for i in range(count)])
    assert [o[0].first_offset for o in outcomes] == [0] * count  # type: ignore[index]
    assert fs.syncs - before == 4  # two parts, each the packs' sync and the journal's


class _SyncLog(FaultFS):
    """A FaultFS that keeps what each sync point synced."""

    def __init__(self) -> None:
        super().__init__()
        self.synced: list[str] = []

    def _sync_point(self, what: str) -> None:
        self.synced.append(what)
        super()._sync_point(what)


def test_a_round_between_the_writes_and_the_waits_leaves_no_segment_to_sync_twice(monkeypatch):
    """The maintenance round commits the creations of new directory streams written and not yet
    waited for, syncing their segments: their own syncs then have nothing of them left to sync."""
    fs = _SyncLog()
    engine = new_engine(fs, small_streams="off")
    rounds: list[None] = []
    wait_durable = Stream.wait_durable

    def round_then_wait(stream: Stream, seq: int) -> None:
        if not rounds:  # once, after every stream was written
            rounds.append(None)
            engine.maintain()
        wait_durable(stream, seq)

    monkeypatch.setattr(Stream, "wait_durable", round_then_wait)
    before = len(fs.synced)
    outcomes = engine.append_many_streams([(f"s{i}", batches(2, f"s{i}")) for i in range(20)])
    assert all(isinstance(o, list) and isinstance(o[0], AppendResult) for o in outcomes)
    segments = [what for what in fs.synced[before:] if what.endswith(".seg")]
    assert len(segments) == len(set(segments)) == 20
    lost = Engine(ROOT, EngineConfig(**SMALL, fsync="always"), fs=fs.crashed_copy(mode="lost"))
    for i in range(20):
        assert [e.payload for e in lost.read(f"s{i}", 0, 100).entries()] == [ENTRY, f"s{i}".encode()] * 2


def test_a_write_after_the_rounds_commit_began_is_synced_by_the_streams_own_sync():
    """A creation's commit that raced a write leaves the stream's segment dirty: its sync syncs it."""
    fs = _SyncLog()
    engine = new_engine(fs, small_streams="off")
    stream = engine._pinned_or_created("s", batches(1, "x"))  # new: its creation pending
    stream.write_many(batches(1, "x"))

    def write_after_the_segments_sync(_: FaultFS) -> None:
        if fs.synced[-1].startswith("sync_dir"):  # the segment's sync is done: "y" is not in it
            fs.on_sync = None
            stream.write_many(batches(1, "y"))

    fs.on_sync = write_after_the_segments_sync
    stream.commit_creation()  # as the round does
    assert stream.dirty
    stream.wait_durable(stream.write_seq)
    lost = Engine(ROOT, EngineConfig(**SMALL, fsync="always"), fs=fs.crashed_copy(mode="lost"))
    assert [e.payload for e in lost.read("s", 0, 100).entries()] == [ENTRY, b"x", ENTRY, b"y"]


class _FailingSegmentSync(FaultFS):
    """A FaultFS whose syncs of the segments under `bad` (a stream's directory name) fail with EIO."""

    bad = "\0"

    def _sync_point(self, what: str) -> None:
        if what.startswith("fsync ") and f"/{self.bad}/" in what:
            self.failed_syncs += 1
            raise OSError(errno.EIO, "injected I/O error", what)
        super()._sync_point(what)


def test_a_failed_sync_is_the_error_of_its_stream_only_and_refuses_its_appends_after():
    fs = _FailingSegmentSync()
    engine = new_engine(fs, small_streams="off")
    for name in ("a", "b", "c"):
        engine.append(name, AppendBatch([b"first"]))
    fs.bad = "b"
    outcomes = engine.append_many_streams(
        [("a", batches(2, "a")), ("b", batches(2, "b")), ("c", batches(1, "c")), ("", batches(1, "d"))]
    )
    assert [r.first_offset for r in outcomes[0]] == [1, 3]  # type: ignore[union-attr]
    assert isinstance(outcomes[1], DurabilityError)
    assert [r.first_offset for r in outcomes[2]] == [1]  # type: ignore[union-attr]
    assert isinstance(outcomes[3], InvalidArgumentError)  # a bad name: refused, the others go on
    assert fs.failed_syncs
    with pytest.raises(DurabilityError, match="refused after a failed sync"):
        engine.append("b", AppendBatch([b"again"]))
    assert engine.append("a", AppendBatch([b"again"])).first_offset == 5


def test_a_batch_refused_on_its_own_keeps_its_place_among_its_streams_results():
    engine = new_engine(FaultFS())
    empty = (AppendBatch([]), None)
    outcomes = engine.append_many_streams([("a", [empty, *batches(1, "a")]), ("b", [empty])])
    assert isinstance(outcomes[0], list) and isinstance(outcomes[0][0], InvalidArgumentError)
    assert outcomes[0][1].first_offset == 0  # type: ignore[union-attr]
    assert isinstance(outcomes[1], list) and isinstance(outcomes[1][0], InvalidArgumentError)
    assert not engine.exists("b")
