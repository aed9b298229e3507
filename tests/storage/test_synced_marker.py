"""The SYNCED marker (storage/cleanmark.py): a clean close records how far the stream was synced,
in its last segment's SYNCED slot (no file of its own), so the first write after a reopen costs
no sync, and recovery trusts that prefix and checks only what lies past it; a marker that does
not match the disk is not trusted; the `SYNCED` file of formats 3 and 4 and a version-2 `CLEAN`
marker still mean what they meant."""

from __future__ import annotations

import dataclasses
import random
import tarfile
from pathlib import Path

import pytest

from storage import AppendBatch, Engine, EngineConfig, inspect
from storage.cleanmark import SYNCED_MARKER, SyncedEnd, marker_in
from storage.format import SEGMENT_HEADER_SIZE, SLOTTED_HEADER_SIZE, SYNCED_SLOT_SIZE, SegmentHeader
from storage.fs import FileSystem
from storage.layout import CLEAN_MARKER, stream_directory
from storage.segment import Segment
from tests.storage import conftest
from tests.storage.conftest import last_segment, synced_marker
from tests.storage.faultfs import FaultFS

# Streams in directories of their own (small_streams off, not the default slots): the SYNCED marker
# is a directory stream's (a slot stream's close writes none; its open checks its slot whole).
SMALL = {**conftest.SMALL, "small_streams": "off"}

ROOT = Path("/faultfs/data")


def new_engine(fs: FaultFS | None = None, fsync: str = "everysec") -> tuple[FaultFS, Engine]:
    if fs is None:
        fs = FaultFS()
        fs.prepare_dir(ROOT)
    return fs, Engine(ROOT, EngineConfig(**SMALL, fsync=fsync, max_open_streams=1), fs=fs)


def contents(engine: Engine, name: str) -> list[bytes]:
    return [e.payload for e in engine.read(name, 0, 10_000).entries()]


def marker(fs: FaultFS, name: str) -> SyncedEnd | None:
    return synced_marker(stream_directory(ROOT, name), fs)


def tail(fs: FaultFS, name: str) -> Path:
    return last_segment(fs, stream_directory(ROOT, name))


def marker_bytes(fs: FaultFS, name: str) -> bytes:
    return fs.file_bytes(tail(fs, name))[SEGMENT_HEADER_SIZE:SLOTTED_HEADER_SIZE]


@pytest.fixture
def body_checks(monkeypatch) -> list[int]:
    """The node bodies recovery checks (by position), across every segment opened."""
    checked: list[int] = []
    original = Segment._body_ok

    def spy(self, pos, header):
        checked.append(pos)
        return original(self, pos, header)

    monkeypatch.setattr(Segment, "_body_ok", spy)
    return checked


def closed_stream(fsync: str = "everysec") -> tuple[FaultFS, Engine]:
    """Stream "a" with three entries, synced and closed by the cache (its marker written)."""
    fs, engine = new_engine(fsync=fsync)
    engine.append("a", AppendBatch([b"1", b"2"]))
    engine.append("a", AppendBatch([b"3"]))
    engine.maintain()
    engine.append("b", AppendBatch([b"b"]))  # closes "a": nothing unsynced, only the marker left
    if fsync == "everysec":
        assert marker(fs, "a") is None
        engine.maintain()  # which the round writes (storage/handoff.py)
    assert marker(fs, "a") is not None
    assert fs.listdir(stream_directory(ROOT, "a")) == ["00000000000000000000.seg"]  # no marker file
    return fs, engine


@pytest.mark.parametrize("fsync", ["everysec", "always"])
def test_the_first_write_to_a_closed_stream_makes_no_sync_of_its_own(fsync):
    fs, engine = closed_stream(fsync)
    engine.maintain()
    before = fs.syncs
    engine.append("a", AppendBatch([b"4"]))  # reopens "a" (closing "b", synced), then writes
    # everysec: nothing on the caller's path; always: the entry's own sync, and only that.
    assert fs.syncs == before + (fsync == "always")
    assert marker(fs, "a") is not None  # it stays: it names the prefix synced at the close


def test_kill9_after_the_first_write_keeps_every_acknowledged_entry():
    fs, engine = closed_stream()
    engine.append("a", AppendBatch([b"4"]))
    engine.append("a", AppendBatch([b"5", b"6"]))
    _, after = new_engine(fs.crashed_copy(random.Random(1), "process"))
    assert contents(after, "a") == [b"1", b"2", b"3", b"4", b"5", b"6"]
    assert after.info("a").damaged == ()


@pytest.mark.parametrize("seed", range(40))
def test_a_power_loss_after_writes_to_a_reopened_stream_keeps_what_the_marker_names(seed):
    """Several unsynced appends into the marked node can leave both of its header slots newer
    than the marked state and their bodies torn: the marked header is put back. (The marker is
    not synced: the test lets its write reach the disk. A power loss that takes it back too
    leaves the stream as an unmarked one, whose node two torn slots cut: tests/storage/
    test_handoff.py writes each node once between syncs for that.)"""
    fs, engine = closed_stream()
    durable_marker(fs, "a")
    rng = random.Random(seed)
    written = [b"1", b"2", b"3"]
    for i in range(rng.randint(1, 12)):
        items = [b"w%d-%d" % (i, k) * rng.randint(1, 40) for k in range(rng.randint(1, 5))]
        engine.append("a", AppendBatch(items))
        written += items
    state = fs.crashed_copy(random.Random(seed), "power")
    _, after = new_engine(state)
    got = contents(after, "a")
    assert got == written[: len(got)] and len(got) >= 3
    assert after.info("a").damaged == ()
    after.close()
    _, again = new_engine(state.crashed_copy(mode="lost"))  # the repair was durable: same answer
    assert contents(again, "a") == got


def durable_marker(fs: FaultFS, name: str) -> None:
    """Let the marker's write (never synced by the engine) reach the disk, as writeback does (the
    segment holds nothing else unsynced: its close synced it)."""
    fs.sync_file(tail(fs, name))


def keep_only_headers(write) -> str:
    """A power loss that kept the node header writes but none of the data they describe."""
    return "keep" if len(write.data) == 64 and write.data[:4] == b"SLND" else "drop"


def test_both_header_slots_overwritten_and_torn_fall_back_to_the_marked_header(body_checks):
    fs, engine = closed_stream()
    durable_marker(fs, "a")
    engine.append("a", AppendBatch([b"x" * 300]))
    engine.append("a", AppendBatch([b"y" * 300]))  # the second overwrites the marked slot
    state = fs.crashed_copy(mode="power", fate=keep_only_headers)
    _, after = new_engine(state)
    assert contents(after, "a") == [b"1", b"2", b"3"] and after.info("a").damaged == ()
    assert after.append("a", AppendBatch([b"z"])).first_offset == 3
    after.close()
    body_checks.clear()
    _, again = new_engine(state)  # a clean start: the marker names the new state, no body read
    assert contents(again, "a") == [b"1", b"2", b"3", b"z"]
    assert body_checks == []


def test_a_reopen_after_a_clean_close_reads_no_node_body(body_checks):
    fs, engine = closed_stream()
    engine.close()
    _, after = new_engine(fs)
    assert contents(after, "a") == [b"1", b"2", b"3"]
    assert body_checks == []


def test_after_a_crash_only_what_lies_past_the_marker_is_checked(body_checks):
    fs, engine = closed_stream()
    for i in range(4):  # nodes of 8 entries: the marked one is the fourth
        engine.append("a", AppendBatch([b"m%d" % i] * 6))
    engine.maintain()
    engine.append("b", AppendBatch([b"b"]))  # closes "a" again
    engine.maintain()  # the round writes its marker: it moves on
    marked = marker(fs, "a")
    for i in range(3):  # three new nodes after the marked one (a batch is never split)
        engine.append("a", AppendBatch([b"n%d" % i] * 5))
    _, after = new_engine(fs.crashed_copy(mode="process"))
    assert len(contents(after, "a")) == 42
    # The three new nodes; neither the marked node (its slot is on disk) nor any before it.
    assert len(body_checks) == 3 and min(body_checks) > marked.node_pos
    assert after.info("a").nodes == 8


def rewrite_marker(fs: FaultFS, name: str, raw: bytes) -> None:
    """Put `raw` into the slot, durably."""
    path = tail(fs, name)
    fs.write_at(path, SEGMENT_HEADER_SIZE, raw.ljust(SYNCED_SLOT_SIZE, b"\0"))
    fs.sync_file(path)


def lying_markers(marked: SyncedEnd) -> dict[str, SyncedEnd]:
    header = marked.node_header
    assert header is not None
    more = header._replace(seq=header.seq + 2, count=header.count + 3, blob_len=header.blob_len + 9)
    return {
        "a longer node than is there": dataclasses.replace(marked, node_header=more),
        "a node past the chain": dataclasses.replace(marked, node_pos=marked.node_pos + 4096),
        "a node inside another": dataclasses.replace(marked, node_pos=marked.node_pos + 8),
        "a node past the end of the file": dataclasses.replace(marked, node_pos=1 << 40),
        "another segment": dataclasses.replace(marked, created_ms=marked.created_ms + 1),
    }


@pytest.mark.parametrize(
    "lie",
    [
        "a longer node than is there",
        "a node past the chain",
        "a node inside another",
        "a node past the end of the file",
        "another segment",
    ],
)
def test_a_marker_that_does_not_match_the_disk_is_not_trusted(lie, body_checks):
    fs, engine = closed_stream()
    engine.append("a", AppendBatch([b"4"]))
    engine.close()
    marked = marker(fs, "a")
    rewrite_marker(fs, "a", lying_markers(marked)[lie].encode())
    body_checks.clear()
    _, after = new_engine(fs)
    assert contents(after, "a") == [b"1", b"2", b"3", b"4"] and after.info("a").damaged == ()
    assert body_checks  # the last segment was checked, whatever the marker said


def test_a_torn_marker_counts_as_none(body_checks):
    fs, engine = closed_stream()
    engine.close()
    raw = bytearray(marker_bytes(fs, "a"))
    raw[20] ^= 0xFF
    rewrite_marker(fs, "a", bytes(raw))
    body_checks.clear()
    _, after = new_engine(fs)
    assert contents(after, "a") == [b"1", b"2", b"3"] and body_checks


def test_a_version_2_clean_marker_is_trusted_and_removed_durably_before_the_first_write(body_checks):
    """The upgrade path: a directory closed by the version before the SYNCED marker."""
    fs, engine = closed_stream()
    engine.close()
    rewrite_marker(fs, "a", b"")  # no SYNCED marker then
    fs.create_marker(stream_directory(ROOT, "a") / CLEAN_MARKER)  # what version 2 wrote
    fs.sync_dir(stream_directory(ROOT, "a"))
    body_checks.clear()
    _, after = new_engine(fs)
    assert contents(after, "a") == [b"1", b"2", b"3"] and body_checks == []
    before = fs.syncs
    after.append("a", AppendBatch([b"4"]))
    assert fs.syncs == before + 1 and not fs.exists(stream_directory(ROOT, "a") / CLEAN_MARKER)
    _, crashed = new_engine(fs.crashed_copy(random.Random(3), "power"))
    assert contents(crashed, "a")[:3] == [b"1", b"2", b"3"] and crashed.info("a").damaged == ()


def test_a_truncation_removes_the_marker_durably():
    fs, engine = closed_stream()
    engine.append("a", AppendBatch([b"4"]))
    engine.truncate("a", 2)
    assert not any(marker_bytes(fs, "a"))
    lost = fs.crashed_copy(mode="lost")
    assert not any(lost.file_bytes(tail(fs, "a"))[SEGMENT_HEADER_SIZE:SLOTTED_HEADER_SIZE])  # durably
    engine.append("a", AppendBatch([b"5", b"6", b"7"]))  # past the old marker's end, unsynced
    crashed = fs.crashed_copy(random.Random(4), "power")
    engine.close()
    assert marker(fs, "a").node_header.count == 5  # a new one
    _, after = new_engine(crashed)
    got = contents(after, "a")
    assert got[:2] == [b"1", b"2"] and got == [b"1", b"2", b"5", b"6", b"7"][: len(got)]
    assert after.info("a").damaged == ()


FORMAT_4 = Path(__file__).parent / "fixtures" / "format-v4.tar.gz"
ROLLED = [b"r%03d-%02d" % (i, j) * 40 for i in range(40) for j in range(10)]


def test_a_format_4_data_directory_opens_and_keeps_working(tmp_path, body_checks):
    """Formats 3 and 4 kept the marker in a `SYNCED` file beside version-2 segments, which have no
    slot (fixtures/format-v4.tar.gz, written by that writer: fixtures/make_format_v4.py)."""
    with tarfile.open(FORMAT_4) as tar:
        tar.extractall(tmp_path, filter="data")
    data = tmp_path / "data"
    engine = Engine(data, EngineConfig(**SMALL))
    assert contents(engine, "closed") == [b"c1", b"c2", b"c3"]
    assert contents(engine, "rolled") == ROLLED
    assert body_checks == []  # their SYNCED files are trusted
    assert contents(engine, "reopened") == [b"o1", b"o2", b"o3", b"o4", b"o5", b"o6"]  # a kill -9 after
    assert body_checks and engine.info("reopened").damaged == ()  # what lies past its marker: checked
    engine.append("closed", AppendBatch([b"c4"]))  # into its version-2 segment, in place
    more = [b"m%03d" % i * 100 for i in range(30)]
    for i in range(0, len(more), 10):  # "rolled" fills its version-2 segment: a version-3 one follows
        engine.append("rolled", AppendBatch(more[i : i + 10]))
    engine.close()
    closed, rolled = stream_directory(data, "closed"), stream_directory(data, "rolled")
    assert (closed / SYNCED_MARKER).exists()  # its last segment has no slot: the file is still the place
    assert SegmentHeader.decode(last_segment(FileSystem(), rolled).read_bytes()).version == 3
    assert synced_marker(rolled) is not None and not (rolled / SYNCED_MARKER).exists()  # moved into the slot
    body_checks.clear()
    after = Engine(data, EngineConfig(**SMALL))
    assert contents(after, "closed") == [b"c1", b"c2", b"c3", b"c4"]
    assert contents(after, "rolled") == ROLLED + more
    assert contents(after, "reopened") == [b"o1", b"o2", b"o3", b"o4", b"o5", b"o6"]
    assert body_checks == []  # every marker, in a file or a slot, trusted
    after.close()
    assert inspect.verify(data) == []


def test_a_truncation_erases_the_marker_of_every_segment_that_may_end_the_stream():
    """An older segment's slot still holds the marker of a close from when it was the last one: a
    cut that removes the segments after it makes it the last again, and that marker would name
    nodes the cut rewrites."""
    fs, engine = closed_stream()
    first = tail(fs, "a")
    while tail(fs, "a") == first:  # a roll: the first segment keeps its (stale) marker
        engine.append("a", AppendBatch([b"r" * 1000] * 8))
    assert marker_in(fs, first) is not None
    engine.truncate("a", 2)
    lost = fs.crashed_copy(mode="lost")
    assert [f for f in lost.listdir(stream_directory(ROOT, "a")) if f.endswith(".seg")] == [first.name]
    assert not any(lost.file_bytes(first)[SEGMENT_HEADER_SIZE:SLOTTED_HEADER_SIZE])  # erased, durably
    _, after = new_engine(lost)
    assert contents(after, "a") == [b"1", b"2"] and after.info("a").damaged == ()


def test_a_torn_segment_header_is_salvaged_past_its_slot_and_its_marker_not_trusted(body_checks):
    fs, engine = closed_stream()
    engine.close()
    fs.poke(tail(fs, "a"), 0, random.Random(5).randbytes(SEGMENT_HEADER_SIZE))  # the header, not the slot
    body_checks.clear()
    _, after = new_engine(fs)
    assert contents(after, "a") == [b"1", b"2", b"3"] and after.info("a").damaged == ()
    assert body_checks  # checked whole: the salvaged header has no creation time to match the marker
    assert SegmentHeader.decode(fs.file_bytes(tail(fs, "a"))).version == 3
