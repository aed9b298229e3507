"""Streams cost what they hold: segments start small and grow in steps (issue 17).

A growing segment's file starts at the pages its first node needs and doubles
as nodes fill it, up to `segment_bytes`; each step is reserved on disk before
it is mapped (a full disk is DiskFullError, never SIGBUS). Data directories
written by the version-1 format (segments preallocated at full size) open and
keep working: `fixtures/format-v1.tar.gz` was written by the version-1 writer
(`fixtures/make_format_v1.py`, run at commit bcd2ed5).
"""

from __future__ import annotations

import os
import random
import subprocess
import tarfile
from pathlib import Path

import pytest

import storage.fs
from storage import AppendBatch, DiskFullError, Engine, EngineConfig, StreamConfig, inspect
from storage.config import min_segment_bytes
from storage.format import (
    NODE_HEADER_SIZE,
    SEGMENT_HEADER_SIZE,
    SLOTTED_HEADER_SIZE,
    NodeHeader,
    SegmentHeader,
)
from tests.storage import conftest
from tests.storage.faultfs import FaultFS

# Streams in directories of their own (small_streams off, not the default slots): a segment file's
# growth steps are a directory stream's (a slot stream's segment is its slot's 3.5 KiB).
SMALL = {**conftest.SMALL, "small_streams": "off"}

FIXTURE = Path(__file__).parent / "fixtures" / "format-v1.tar.gz"
ROOT = Path("/faultfs/data")


def segment_sizes(directory: Path) -> list[int]:
    return [p.stat().st_size for p in sorted(directory.glob("*.seg"))]


def payloads(engine: Engine, name: str) -> list[bytes]:
    info = engine.info(name)
    result = engine.read(name, info.first_offset, info.end_offset - info.first_offset)
    assert result.gap is None
    return [e.payload for e in result.entries()]


def test_a_new_stream_takes_a_page_and_its_segment_grows_in_steps_up_to_segment_bytes(tmp_path):
    config = EngineConfig(
        segment_bytes=1 << 20,
        max_batch_bytes=512 << 10,
        max_entry_bytes=64 << 10,
        background=False,
        small_streams="off",
    )
    directory = tmp_path / "data" / "streams" / "s"
    with Engine(tmp_path / "data", config) as engine:
        engine.append("s", AppendBatch([b"x" * 100]))
        assert segment_sizes(directory) == [4096]  # not 1 MiB: one page holds it
        sizes = {4096}
        while engine.info("s").segments == 1:
            engine.append("s", AppendBatch([b"y" * 100] * 50))
            sizes.add(segment_sizes(directory)[0])
        # Doubling from one page (the first node's table is small too) up to segment_bytes, then a roll.
        assert sorted(sizes) == [4096 << i for i in range(9)]
        assert segment_sizes(directory)[0] == 1 << 20 and segment_sizes(directory)[1] < 1 << 20
        entries = engine.info("s").end_offset
        assert len(payloads(engine, "s")) == entries


def test_the_largest_batch_goes_into_a_small_stream(tmp_path):
    limits = dict(node_entries=8, max_batch_entries=64, max_batch_bytes=16 * 1024, max_entry_bytes=4 * 1024)
    config = EngineConfig(**limits, segment_bytes=min_segment_bytes(8, 64, 16 * 1024), background=False)
    big = [bytes([i]) * (16 * 1024 // 64 - 16) for i in range(64)]  # just under max_batch_bytes encoded
    with Engine(tmp_path / "data", config) as engine:
        engine.append("fresh", AppendBatch(big))
        engine.append("small", AppendBatch([b"tiny"]))
        engine.append("small", AppendBatch(big))  # more than the small file's room: a new segment
        engine.append("small", AppendBatch(big))
        assert payloads(engine, "fresh") == big
        assert payloads(engine, "small") == [b"tiny", *big, *big]


def test_a_full_disk_at_a_growth_step_refuses_cleanly_and_appends_resume_once_there_is_room():
    fs = FaultFS()
    fs.prepare_dir(ROOT)
    engine = Engine(ROOT, EngineConfig(**SMALL, fsync="always"), fs=fs)
    rng = random.Random(5)
    acked: list[bytes] = []
    segment = ROOT / "streams" / "main" / f"{0:020d}.seg"
    engine.append("main", AppendBatch([b"first"]))
    acked.append(b"first")
    size = len(fs.file_bytes(segment))
    fs.capacity_bytes = fs._used_bytes()  # not one more byte: the next growth step fails
    with pytest.raises(DiskFullError):
        for _ in range(100):
            items = [rng.randbytes(200) for _ in range(4)]
            engine.append("main", AppendBatch(items))
            acked.extend(items)
    assert len(fs.file_bytes(segment)) == size < SMALL["segment_bytes"]  # it failed growing, not rolling
    assert payloads(engine, "main") == acked
    lost = Engine(ROOT, EngineConfig(**SMALL), fs=fs.crashed_copy(random.Random(1), "lost"))
    assert payloads(lost, "main") == acked  # every acknowledged entry was durable (always)
    fs.capacity_bytes = None
    items = [rng.randbytes(200) for _ in range(4)]
    assert engine.append("main", AppendBatch(items)).first_offset == len(acked)
    acked.extend(items)
    assert payloads(engine, "main") == acked and len(fs.file_bytes(segment)) > size
    engine.close()


@pytest.fixture
def v1_data(tmp_path: Path) -> Path:
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(tmp_path, filter="data")
    return tmp_path / "data"


ROLLED = [b"r%03d-%02d" % (i, j) * 40 for i in range(40) for j in range(10)]
V1 = {
    "rolled": ROLLED,
    "small": [b"hello", b"world"],
    "empty": [],
    "crashed": [b"c%02d" % i for i in range(20)],
}


def test_a_version_1_data_directory_opens_and_keeps_working(v1_data):
    headers = {p: SegmentHeader.decode(p.read_bytes()[:64]) for p in v1_data.rglob("*.seg")}
    assert headers and all(h.capacity == 64 * 1024 or h.packed for h in headers.values())  # as written
    assert inspect.verify(v1_data) == []
    with Engine(v1_data, EngineConfig(**SMALL)) as engine:
        assert sorted(engine.list_streams()) == sorted(V1) and engine.unreadable == []
        for name, expected in V1.items():
            assert payloads(engine, name) == expected, name
        assert engine.stream_config("empty") == StreamConfig(max_entries=100)
        # The idempotent-append table came through: a retry is a duplicate.
        assert engine.append("small", AppendBatch([b"hello", b"world"]), producer=("p1", 1)).duplicate
        # The version-1 growing segment (64 KiB, preallocated) takes appends in place, then rolls
        # into version-2 segments that start small.
        rolled = v1_data / "streams" / "rolled"
        tail = sorted(rolled.glob("*.seg"))[-1]
        more = [b"m%04d" % i * 30 for i in range(150)]
        for i in range(0, len(more), 8):
            engine.append("rolled", AppendBatch(more[i : i + 8]))
        engine.append("crashed", AppendBatch([b"after"]))
        assert tail.stat().st_size == 64 * 1024
        newer = sorted(rolled.glob("*.seg"))[sorted(rolled.glob("*.seg")).index(tail) + 1 :]
        assert newer and all(SegmentHeader.decode(p.read_bytes()[:64]).capacity == 64 * 1024 for p in newer)
        assert segment_sizes(rolled)[-1] < 64 * 1024
        assert payloads(engine, "rolled") == ROLLED + more
    assert inspect.verify(v1_data) == []
    with Engine(v1_data, EngineConfig(**SMALL)) as engine:
        assert payloads(engine, "rolled") == ROLLED + more
        assert payloads(engine, "crashed") == V1["crashed"] + [b"after"]


def _mapped(path: Path) -> bool:
    with open("/proc/self/maps") as maps:
        return any(line.rstrip().endswith(str(path)) for line in maps)


def _descriptors(path: Path) -> int:
    fds = Path("/proc/self/fd")
    return sum(1 for fd in fds.iterdir() if fd.is_symlink() and _readlink(fd) == str(path))


def _readlink(link: Path) -> str:
    try:
        return str(link.readlink())
    except OSError:  # the descriptor listing itself, closed meanwhile
        return ""


def test_a_new_streams_first_page_is_written_through_and_mapped_once_it_grows(tmp_path):
    """No mapping for a stream that fits its first page (its creation costs five system calls
    and a page fault less); one descriptor either way; the bytes are the same when it grows."""
    data = tmp_path / "data"
    small = [b"s%d" % i * 40 for i in range(10)]
    big = [b"b%d" % i * 500 for i in range(8)]
    with Engine(data, EngineConfig(**SMALL, max_open_streams=4)) as engine:
        engine.append("room", AppendBatch(small))
        [segment] = sorted((data / "streams" / "room").glob("*.seg"))
        assert segment_sizes(segment.parent) == [4096]
        assert not _mapped(segment) and _descriptors(segment) == 1
        assert payloads(engine, "room") == small
        engine.append("room", AppendBatch(big))  # past the first page: the file grows, mapped
        assert _mapped(segment) and _descriptors(segment) == 1
        assert payloads(engine, "room") == small + big
        engine.append("other", AppendBatch(small))
        [other] = sorted((data / "streams" / "other").glob("*.seg"))
    assert not _mapped(other) and _descriptors(other) == 0  # closed with the engine
    with Engine(data, EngineConfig(**SMALL)) as engine:
        assert payloads(engine, "room") == small + big and payloads(engine, "other") == small
        assert engine.info("room").damaged == ()


def test_no_append_rewrites_the_header_slot_the_last_sync_made_durable(tmp_path, monkeypatch):
    """Each append into a new stream's page (written with pwrite while it is not mapped) writes
    its records, their table entries and its header, and nothing of the header slot the last
    sync made durable: one pwrite of the span they cover rewrote that slot (with its own bytes),
    which a power loss during the write can tear, acknowledged entries lost (the crash sweep's
    always-power variant found it with 9,000 crash points)."""
    calls: list[tuple[str, int, int]] = []
    pwrite, fallocate = os.pwrite, os.posix_fallocate

    def counted_pwrite(fd, data, pos):
        calls.append(("pwrite", pos, len(data)))
        return pwrite(fd, data, pos)

    def counted_fallocate(fd, start, n):
        calls.append(("fallocate", start, n))
        return fallocate(fd, start, n)

    monkeypatch.setattr(storage.fs.os, "pwrite", counted_pwrite)
    monkeypatch.setattr(storage.fs.os, "posix_fallocate", counted_fallocate)
    data = tmp_path / "data"
    entries = [b"e%d" % i * 30 for i in range(12)]

    def header_written() -> tuple[int, int]:
        """Where the append wrote its node's header: its last write (after records and table), or
        the start of a fresh node's one write (header, table, blob: nothing of it synced before)."""
        kind, pos, size = calls[-1]
        assert kind == "pwrite" and size >= NODE_HEADER_SIZE and (pos - SLOTTED_HEADER_SIZE) % 8 == 0
        return pos, NODE_HEADER_SIZE

    with Engine(data, EngineConfig(**SMALL, fsync="always")) as engine:
        engine.append("room", AppendBatch(entries[:3]))
        durable = header_written()  # the header the append's sync made durable
        for i in range(3, 12, 3):  # each append synced ("always"): its header is the durable one next
            calls.clear()
            engine.append("room", AppendBatch(entries[i : i + 3]))
            kept_pos, kept_len = durable
            assert not [c for c in calls if c[1] < kept_pos + kept_len and kept_pos < c[1] + c[2]], calls
            durable = header_written()
        assert payloads(engine, "room") == entries
    with Engine(data, EngineConfig(**SMALL)) as engine:
        assert payloads(engine, "room") == entries and engine.info("room").damaged == ()


def test_a_reopened_segment_is_reserved_again_only_when_it_has_a_hole(tmp_path, monkeypatch):
    """Re-reserving a segment that has every block costs a journal wait on the first write after
    each reopen (issue 17); one a sparse copy left with a hole is reserved again from its start
    before anything is written into its mapping."""
    reserved: list[tuple[str, int]] = []
    reserve = storage.fs._reserve
    monkeypatch.setattr(
        storage.fs,
        "_reserve",
        lambda fd, path, start, n: (reserved.append((path.name, start)), reserve(fd, path, start, n)),
    )
    data = tmp_path / "data"
    with Engine(data, EngineConfig(**SMALL)) as engine:
        engine.append("small", AppendBatch([b"s" * 100]))  # one page, every block written
        for _ in range(5):  # grown past its first page: a tail reserved, never written
            engine.append("sparse", AppendBatch([b"p" * 1000] * 8))
    (segment,) = (data / "streams" / "sparse").glob("*.seg")
    copy = segment.with_name("copy")
    subprocess.run(["cp", "--sparse=always", str(segment), str(copy)], check=True)
    copy.replace(segment)  # as a restore from a sparse copy leaves it
    assert os.stat(segment).st_blocks * 512 < os.stat(segment).st_size
    reserved.clear()
    with Engine(data, EngineConfig(**SMALL)) as engine:
        engine.append("small", AppendBatch([b"t"]))
        assert [start for name, start in reserved if start == 0] == []
        engine.append("sparse", AppendBatch([b"q"]))
        assert (segment.name, 0) in reserved
    with Engine(data, EngineConfig(**SMALL)) as engine:
        assert payloads(engine, "small") == [b"s" * 100, b"t"]
        assert payloads(engine, "sparse") == [b"p" * 1000] * 40 + [b"q"]


def test_a_new_streams_first_append_is_one_write_after_its_segment_header(tmp_path, monkeypatch):
    """A new stream's first append writes its fresh node (header, table, blob) with one pwrite,
    from the node's second header slot on (nothing of it was ever written or synced); the
    appends after it write records, table entries, then the header, as before."""
    calls: list[tuple[int, int]] = []
    pwrite = os.pwrite

    def counted_pwrite(fd, data, pos):
        calls.append((pos, len(data)))
        return pwrite(fd, data, pos)

    monkeypatch.setattr(storage.fs.os, "pwrite", counted_pwrite)
    entries = [b"e%d" % i * 30 for i in range(6)]
    with Engine(tmp_path / "data", EngineConfig(**SMALL)) as engine:
        engine.append("room", AppendBatch(entries[:3]))
        (header_pos, header_len), (node_pos, node_len) = calls
        assert (header_pos, header_len) == (0, SEGMENT_HEADER_SIZE)
        assert node_pos == SLOTTED_HEADER_SIZE + NODE_HEADER_SIZE  # the first slot is not written
        assert node_len > NODE_HEADER_SIZE
        calls.clear()
        engine.append("room", AppendBatch(entries[3:]))
        assert len(calls) == 3 and calls[-1][1] == NODE_HEADER_SIZE  # the header last
        assert payloads(engine, "room") == entries
    with Engine(tmp_path / "data", EngineConfig(**SMALL)) as engine:
        assert payloads(engine, "room") == entries and engine.info("room").damaged == ()


def test_a_fresh_nodes_write_torn_by_a_kill_9_leaves_a_torn_tail_cut_and_nothing_damaged():
    """The one write of a fresh node puts its header before its body: a kill -9 during it may
    leave a header whose body is missing, which start-up cuts as a torn tail (the append was
    not acknowledged), the stream's other nodes and every other stream whole."""
    fs = FaultFS()
    fs.prepare_dir(ROOT)
    engine = Engine(ROOT, EngineConfig(**SMALL), fs=fs)
    engine.append("old", AppendBatch([b"kept"]))
    engine.sync()
    states = []

    def torn(during: FaultFS) -> None:
        if during.written[-1].parent.name == "room" and during.written[-1].suffix == ".seg":
            for seed in range(12):
                states.append(during.crashed_copy(random.Random(seed), "process", torn_inflight=True))

    fs.on_write = torn
    engine.append("room", AppendBatch([b"r%d" % i * 40 for i in range(5)]))
    fs.on_write = None
    assert len(states) == 2 * 12  # the segment header, then the node's one write
    for state in states:
        after = Engine(ROOT, EngineConfig(**SMALL), fs=state)
        assert after.unreadable == [] and payloads(after, "old") == [b"kept"]
        if after.exists("room"):
            assert payloads(after, "room") == [] and after.info("room").damaged == ()
        after.close()


def test_a_partial_node_past_the_chain_is_cut_so_no_later_node_keeps_its_stale_header(tmp_path):
    """A power loss may take back a growth step and keep a write past it: the file then ends in a
    few bytes of a node past the chain (here its first header slot, with the highest seq), too
    few for its header slots. Recovery cuts them: else a node written there once the file grows,
    whose first header goes into the other slot, has that stale header beside it, which a start
    trusting the segment's headers (no longer the last one) takes (the crash sweep's no-power
    variant found it with 9,000 crash points)."""
    data = tmp_path / "data"
    first = [b"a%d" % i * 20 for i in range(3)]
    with Engine(data, EngineConfig(**SMALL)) as engine:
        engine.append("room", AppendBatch(first))
        end = engine._open.peek("room").segments[-1].end_pos
    [segment] = sorted((data / "streams" / "room").glob("*.seg"))
    stale = NodeHeader(2, 5, len(first), 8, 100, 4 * 8 + 100, 0, 0, 0, 0, 0).encode()
    with segment.open("r+b") as f:
        f.seek(end)
        f.write(stale)
        f.truncate(end + NODE_HEADER_SIZE)
    more = [b"m%03d" % i * 180 for i in range(128)]
    with Engine(data, EngineConfig(**SMALL)) as engine:  # its open checks what lies past its marker
        for i in range(0, len(more), 8):  # a node each (8 slots), past the first segment
            engine.append("room", AppendBatch(more[i : i + 8]))
        assert len(list(segment.parent.glob("*.seg"))) > 1
    with Engine(data, EngineConfig(**SMALL)) as engine:
        assert payloads(engine, "room") == first + more and engine.info("room").damaged == ()
