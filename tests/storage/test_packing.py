"""Packing rewrites a full segment node by node: never the whole segment in memory, never half a file."""

from __future__ import annotations

import os
import tracemalloc

from storage import AppendBatch
from storage.fs import FileSystem

SEGMENT = 4 << 20
PAYLOAD = 1000  # random bytes: incompressible, so packed nodes are as big as raw ones


def full_segment(open_engine):
    """An engine whose stream "s" has one full (sealed, unpacked) segment and a second one begun."""
    engine = open_engine(
        segment_bytes=SEGMENT, node_entries=200, max_batch_entries=200, max_batch_bytes=1 << 20
    )
    total = 0
    while engine.info("s").segments < 2 if total else True:
        engine.append("s", AppendBatch([os.urandom(PAYLOAD) for _ in range(200)]))
        total += 200
    return engine, total


def segment_sizes(data_dir):
    return sorted(p.stat().st_size for p in data_dir.rglob("*.seg"))


def test_packing_holds_one_node_at_a_time(open_engine, tmp_path):
    engine, total = full_segment(open_engine)
    # The full one grew to segment_bytes, the new one holds one node; nothing packed yet.
    assert max(segment_sizes(tmp_path)) == SEGMENT and engine.info("s").packed_segments == 0
    tracemalloc.start()
    try:
        engine.maintain()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert max(segment_sizes(tmp_path)) < SEGMENT  # the full one is packed: exactly its nodes
    assert engine.info("s").packed_segments == 1
    # One node is 200 x 1000 B = 200 KB, held in a few copies while it is read, encoded and
    # written (about 1 MB at the peak); the segment is 4 MiB. Before packing streamed, the
    # whole segment was in memory about four times over (16 MB).
    assert peak < SEGMENT // 2, f"packing peaked at {peak} bytes for a {SEGMENT}-byte segment"
    entries = list(engine.read("s", 0, total).entries())
    assert [e.offset for e in entries] == list(range(total))


def test_a_failed_rewrite_leaves_the_segment_and_no_temporary_file(tmp_path):
    fs = FileSystem()
    target = tmp_path / "seg"
    target.write_bytes(b"old contents")

    def parts():
        yield b"new"
        raise RuntimeError("a node failed to read")

    try:
        fs.write_file_atomic(target, parts(), head=lambda size: size.to_bytes(8, "little"))
    except RuntimeError:
        pass
    else:
        raise AssertionError("the error from the parts must reach the caller")
    assert target.read_bytes() == b"old contents"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["seg"]


def test_the_head_is_written_first_in_the_file_and_last_in_time(tmp_path):
    fs = FileSystem()
    target = tmp_path / "seg"
    fs.write_file_atomic(target, iter([b"abc", b"defg"]), head=lambda size: size.to_bytes(8, "little"))
    raw = target.read_bytes()
    assert raw == (15).to_bytes(8, "little") + b"abcdefg"
