"""Compaction merges the small segments it leaves, so a keyed stream does not keep one file per segment."""

from __future__ import annotations

import os

import pytest

from storage import AppendBatch, StreamConfig, inspect
from storage.format import SegmentHeader
from storage.layout import segment_name

KEYS = 5


def keyed_stream(open_engine, segments: int = 8):
    """A compacted stream "kv" of several sealed segments: three keys written once at the start,
    then KEYS keys written over and over."""
    engine = open_engine(compaction_interval_ms=0)
    engine.create_stream("kv", StreamConfig(compaction=True))
    once = [(f"once-{i}", b"first %d" % i) for i in range(3)]
    engine.append("kv", AppendBatch([p for _, p in once], tags=[t for t, _ in once]))
    written: dict[int, tuple[str, bytes]] = dict(enumerate(once))
    while engine.info("kv").segments < segments:
        start = engine.info("kv").end_offset
        batch = [(f"k{(start + i) % KEYS}", b"%08d" % (start + i) * 25) for i in range(8)]
        engine.append("kv", AppendBatch([p for _, p in batch], tags=[t for t, _ in batch]))
        written.update((start + i, item) for i, item in enumerate(batch))
    return engine, written


def survivors(written: dict[int, tuple[str, bytes]], active_base: int) -> dict[int, tuple[str, bytes]]:
    """What compaction keeps: the latest entry of each key in sealed segments, all of the active one."""
    latest = {tag: offset for offset, (tag, _) in sorted(written.items())}
    return {o: item for o, item in written.items() if o >= active_base or latest[item[0]] == o}


def stored(engine, name: str) -> dict[int, tuple[str, bytes]]:
    return {e.offset: (e.tag, e.payload) for e in engine.read(name, 0, 100_000).entries()}


def segment_files(tmp_path) -> list:
    return sorted((tmp_path / "data" / "streams" / "kv").glob("*.seg"))


def test_compaction_merges_the_small_segments_it_leaves(open_engine, tmp_path):
    engine, written = keyed_stream(open_engine)
    before = engine.info("kv").segments
    active_base = engine._stream("kv").segments[-1].base_offset
    engine.compact("kv")
    info = engine.info("kv")
    # Eight sealed segments of 64 KiB shrink to a few entries each: one file holds them all.
    assert (before, info.segments) == (8, 2)
    assert len(segment_files(tmp_path)) == 2
    want = survivors(written, active_base)
    assert stored(engine, "kv") == want
    assert engine.count("kv", 0, info.end_offset) == len(want)
    merged = SegmentHeader.decode(segment_files(tmp_path)[0].read_bytes()[:64])
    assert (merged.base_offset, merged.end_offset, merged.packed) == (0, active_base, True)
    engine.close()
    reopened = open_engine()
    assert reopened.info("kv").segments == 2 and reopened.info("kv").damaged == ()
    assert stored(reopened, "kv") == want


def test_merged_files_stay_within_segment_bytes(open_engine, tmp_path):
    engine = open_engine(compaction_interval_ms=0)
    engine.create_stream("kv", StreamConfig(compaction=True))
    written: dict[int, tuple[str, bytes]] = {}
    while engine.info("kv").segments < 9:
        start = engine.info("kv").end_offset
        # Half the entries are superseded; random payloads do not compress: what is left of a
        # segment after compaction takes about half of segment_bytes.
        batch = [("hot" if i % 2 else f"unique-{start + i}", os.urandom(1500)) for i in range(8)]
        engine.append("kv", AppendBatch([p for _, p in batch], tags=[t for t, _ in batch]))
        written.update((start + i, item) for i, item in enumerate(batch))
    active_base = engine._stream("kv").segments[-1].base_offset
    engine.compact("kv")
    sizes = [path.stat().st_size for path in segment_files(tmp_path)]
    assert all(size <= engine.config.segment_bytes for size in sizes)
    assert 2 < len(sizes) < 9  # merged two by two, not all into one file
    assert stored(engine, "kv") == survivors(written, active_base)


def test_later_rounds_compact_a_merged_segment(open_engine, clock):
    engine, written = keyed_stream(open_engine)
    engine.compact("kv")
    assert engine.info("kv").segments == 2
    while engine.info("kv").segments < 4:  # new values of every key: the merged segment's are superseded
        start = engine.info("kv").end_offset
        batch = [(f"k{(start + i) % KEYS}", b"new-%08d" % (start + i)) for i in range(8)]
        engine.append("kv", AppendBatch([p for _, p in batch], tags=[t for t, _ in batch]))
        written.update((start + i, item) for i, item in enumerate(batch))
    active_base = engine._stream("kv").segments[-1].base_offset
    engine.compact("kv")
    assert stored(engine, "kv") == survivors(written, active_base)
    assert engine.info("kv").segments == 2


def test_a_segment_left_behind_by_a_merge_is_removed_at_start_up(open_engine, tmp_path, monkeypatch):
    """A crash after the merged file replaced the first segment and before the others were removed:
    the merged file covers them, and start-up finishes the merge instead of dropping later segments."""
    engine, written = keyed_stream(open_engine)
    active_base = engine._stream("kv").segments[-1].base_offset
    fs = engine._stream("kv").ctx.fs
    real_remove = fs.remove

    def crash_before_removing_segments(path):
        if path.suffix == ".seg":
            raise OSError("the process died here")
        real_remove(path)

    monkeypatch.setattr(fs, "remove", crash_before_removing_segments)
    with pytest.raises(OSError, match="died"):
        engine.compact("kv")
    monkeypatch.setattr(fs, "remove", real_remove)
    engine.close()
    assert len(segment_files(tmp_path)) == 8  # the merged file, its six other sources, the active one
    found = inspect.verify(tmp_path / "data")
    assert len(found) == 6 and all("leftover of a merge" in problem for problem in found)
    reopened = open_engine()
    info = reopened.info("kv")
    assert (info.segments, info.damaged, reopened.unreadable) == (2, (), [])
    assert [p.name for p in segment_files(tmp_path)] == [segment_name(0), segment_name(active_base)]
    assert stored(reopened, "kv") == survivors(written, active_base)
    assert inspect.verify(tmp_path / "data") == []
