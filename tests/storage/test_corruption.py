"""Damaged files on a real file system: truncation, bit flips in headers, blobs and metadata.

The rules under test (issue 2, "Recovery"): start-up never raises and never
serves garbage; a torn or truncated tail keeps the longest valid prefix; damage
in the middle is detected by its CRC, reported with its offsets
(`info().damaged`, and reads that start in it return a gap with reason
"corrupt"), and the rest of the stream stays readable; a stream whose metadata
is damaged is listed in `engine.unreadable` while the engine still opens.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from storage import (
    AppendBatch,
    CorruptionError,
    Engine,
    EngineConfig,
    StorageError,
    StreamConfig,
    StreamNotFoundError,
)
from storage.catalog import CATALOG_FILE
from storage.format import (
    NODE_HEADER_SIZE,
    NODE_PREFIX_SIZE,
    NODE_ZSTD,
    SEGMENT_HEADER_SIZE,
    NodeHeader,
    SegmentHeader,
    pick_header,
)
from storage.inspect import verify
from tests.storage.conftest import SMALL as CONFTEST_SMALL
from tests.storage.conftest import erase_slot

NAME = "s"
OTHER = "other"
SMALL = {**CONFTEST_SMALL, "fsync": "always"}

# Byte layout of the two headers, as docs/FORMAT.md tables them (checked against the encoder below).
SEGMENT_FIELDS = [
    ("magic", 0, 8),
    ("version", 8, 2),
    ("flags", 10, 2),
    ("header_size", 12, 4),
    ("base_offset", 16, 8),
    ("end_offset", 24, 8),
    ("capacity", 32, 8),
    ("created_ms", 40, 8),
    ("reserved", 48, 12),
    ("crc", 60, 4),
]
NODE_FIELDS = [
    ("magic", 0, 4),
    ("version", 4, 1),
    ("flags", 5, 1),
    ("reserved", 6, 2),
    ("seq", 8, 4),
    ("count", 12, 4),
    ("base_offset", 16, 8),
    ("slots", 24, 4),
    ("blob_len", 28, 4),
    ("stored_len", 32, 4),
    ("body_crc", 36, 4),
    ("blob_crc", 40, 4),
    ("min_ts", 44, 8),
    ("max_ts", 52, 8),
    ("crc", 60, 4),
]


class Clock:
    def __init__(self) -> None:
        self.now_ms = 1_700_000_000_000

    def __call__(self) -> int:
        self.now_ms += 1
        return self.now_ms


def open_engine(data: Path, **overrides) -> Engine:
    return Engine(data, EngineConfig(**{**SMALL, **overrides}), clock=Clock())


def payload(i: int) -> bytes:
    """Compressible, distinct, of varying size (zstd must shrink packed nodes)."""
    return (f'{{"ride": {i}, "city": "San Francisco", "rider": "user-{i % 97}"}} ' * (1 + i % 5)).encode()


def stream_dir(data: Path, name: str = NAME) -> Path:
    return data / "streams" / name


def segment_files(data: Path, name: str = NAME) -> list[Path]:
    return sorted(stream_dir(data, name).glob("*.seg"))


def nodes_of(path: Path) -> list[tuple[int, NodeHeader]]:
    """(position, newest valid header) of each node in a segment file."""
    raw = path.read_bytes()
    out = []
    pos = SegmentHeader.decode(raw).size
    while pos + NODE_PREFIX_SIZE <= len(raw):
        found = pick_header(
            raw[pos : pos + NODE_HEADER_SIZE], raw[pos + NODE_HEADER_SIZE : pos + NODE_PREFIX_SIZE]
        )
        if not found:
            break
        out.append((pos, found[0]))
        pos += found[0].disk_size
    return out


def flip(path: Path, pos: int, bit: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ (1 << bit)]))


def read_everything(engine: Engine, name: str = NAME) -> tuple[int, int, dict[int, bytes], list]:
    """All entries from first_offset on (offset -> payload) and the gaps met; fails on garbage."""
    info = engine.info(name)
    first, nxt = info.first_offset, info.end_offset
    got: dict[int, bytes] = {}
    gaps = []
    cursor = first
    for _ in range(nxt - first + 10):
        if cursor >= nxt:
            break
        result = engine.read(name, cursor, 50)
        try:
            entries = result.entries()  # garbage would not decode
        except CorruptionError as exc:
            pytest.fail(f"read at {cursor} returned records that do not decode: {exc}")
        if result.gap is not None:
            gaps.append(result.gap)
        if not entries:
            assert result.gap is not None and result.gap.end_offset > cursor, (
                f"read at {cursor}: nothing, no gap"
            )
            cursor = result.gap.end_offset
            continue
        for e in entries:
            assert e.offset >= cursor and e.offset not in got, f"offset {e.offset} out of order"
            got[e.offset] = e.payload
        cursor = entries[-1].offset + 1
    return first, nxt, got, gaps


def build(data: Path, *, compression: bool = True, batches: int = 160) -> dict[int, bytes]:
    """A stream of several segments (sealed ones packed when compression is on) and a second stream."""
    engine = open_engine(data, compression=compression, fsync="no")
    expected: dict[int, bytes] = {}
    offset = 0
    for b in range(batches):
        n = 8 if b % 7 else 3  # mostly full nodes, some partly filled ones
        items = [payload(offset + i) for i in range(n)]
        result = engine.append(NAME, AppendBatch(items))
        assert result.first_offset == offset
        expected.update({offset + i: p for i, p in enumerate(items)})
        offset += n
    engine.append(OTHER, AppendBatch([b"o1", b"o2"]))
    engine.set_stream_config(NAME, StreamConfig())  # a meta file to damage (a new stream has none)
    engine.maintain()  # pack the sealed segments
    engine.close()
    assert len(segment_files(data)) >= 4
    return expected


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> tuple[Path, dict[int, bytes]]:
    data = tmp_path_factory.mktemp("pristine") / "data"
    return data, build(data)


@pytest.fixture
def data(pristine, tmp_path) -> tuple[Path, dict[int, bytes]]:
    source, expected = pristine
    target = tmp_path / "data"
    shutil.copytree(source, target)
    return target, expected


def assert_rest_readable(engine: Engine, expected: dict[int, bytes]) -> tuple[dict[int, bytes], list]:
    """Every offset outside the reported damage reads back identical; nothing was made up."""
    first, _, got, gaps = read_everything(engine)
    damaged = engine.info(NAME).damaged
    for offset, value in got.items():
        assert expected.get(offset) == value, f"offset {offset} reads back bytes never appended there"
    for offset in expected:
        if offset in got or offset < first:
            continue
        assert any(g.start_offset <= offset < g.end_offset for g in damaged), (
            f"offset {offset} is missing and not inside a reported damaged range {damaged}"
        )
    for gap in gaps:
        assert gap.reason == "corrupt", f"a hole left by damage is reported as {gap}"
    assert engine.info(OTHER).end_offset == 2
    assert [e.payload for e in engine.read(OTHER, 0, 5).entries()] == [b"o1", b"o2"]
    return got, gaps


def appends_still_work(engine: Engine) -> None:
    nxt = engine.info(NAME).end_offset
    for i in range(6):  # enough to roll at least one new segment
        result = engine.append(NAME, AppendBatch([b"after-%d-" % i * 150] * 8))
        assert result.first_offset == nxt + 8 * i
    tail = engine.read(NAME, nxt, 48).entries()
    assert [e.offset for e in tail] == list(range(nxt, nxt + 48))


# ---------------------------------------------------------------------- the layout tables


def test_field_tables_match_the_encoder():
    seg = SegmentHeader(
        0x1112131415161718, 0x2122232425262728, 0x3132333435363738, 0x4142434445464748, 0x0101
    )
    raw = seg.encode()
    fields = {name: raw[pos : pos + size] for name, pos, size in SEGMENT_FIELDS}
    assert fields["magic"] == b"SLOGSEG\x00"
    assert int.from_bytes(fields["flags"], "little") == 0x0101
    assert int.from_bytes(fields["header_size"], "little") == SEGMENT_HEADER_SIZE
    assert int.from_bytes(fields["base_offset"], "little") == 0x1112131415161718
    assert int.from_bytes(fields["end_offset"], "little") == 0x2122232425262728
    assert int.from_bytes(fields["capacity"], "little") == 0x3132333435363738
    assert int.from_bytes(fields["created_ms"], "little") == 0x4142434445464748
    assert sum(size for _, _, size in SEGMENT_FIELDS) == SEGMENT_HEADER_SIZE
    node = NodeHeader(
        0x01020304,
        0x05060708,
        0x1112131415161718,
        0x21222324,
        0x31323334,
        0x41424344,
        0x51525354,
        0x61626364,
        0x7172737475767778,
        0x0102030405060708,
        flags=0x5,
    )
    raw = node.encode()
    fields = {name: int.from_bytes(raw[pos : pos + size], "little") for name, pos, size in NODE_FIELDS}
    assert raw[:4] == b"SLND"
    assert (fields["flags"], fields["seq"], fields["count"], fields["base_offset"]) == (
        0x5,
        0x01020304,
        0x05060708,
        0x1112131415161718,
    )
    assert (fields["slots"], fields["blob_len"], fields["stored_len"]) == (0x21222324, 0x31323334, 0x41424344)
    assert (fields["body_crc"], fields["blob_crc"], fields["min_ts"], fields["max_ts"]) == (
        0x51525354,
        0x61626364,
        0x7172737475767778,
        0x0102030405060708,
    )
    assert sum(size for _, _, size in NODE_FIELDS) == NODE_HEADER_SIZE


# ---------------------------------------------------------------------- truncation of the tail


def tail_prefix_counts(tail: Path, before: int) -> tuple[int, list[tuple[int, int, int]]]:
    """The tail's last node: its position and, per valid header slot, (data end, disk end, entries kept)."""
    raw = tail.read_bytes()
    pos, _ = nodes_of(tail)[-1]
    versions = []
    for slot in (0, 1):
        h = NodeHeader.decode(raw[pos + slot * NODE_HEADER_SIZE : pos + (slot + 1) * NODE_HEADER_SIZE])
        if h is not None:
            data_end = pos + NODE_PREFIX_SIZE + 4 * h.slots + h.blob_len
            versions.append((data_end, pos + h.disk_size, before + h.count))
    return pos, versions


@pytest.fixture(scope="module")
def torn_tail_source(tmp_path_factory) -> tuple[Path, dict[int, bytes], int]:
    """A tail segment of small entries whose last node took three batches, so that its two
    header slots hold different versions (the node is small: every byte of it gets cut)."""
    data = tmp_path_factory.mktemp("tail") / "data"
    engine = open_engine(data, fsync="no")
    expected: dict[int, bytes] = {}
    offset = 0
    for b in range(43):
        n = 8 if b < 40 else [3, 2, 2][b - 40]
        items = [b"e%05d" % (offset + i) + b"-" * (offset % 7) for i in range(n)]
        engine.append(NAME, AppendBatch(items))
        expected.update({offset + i: p for i, p in enumerate(items)})
        offset += n
    engine.append(OTHER, AppendBatch([b"o1", b"o2"]))
    engine.close()
    assert len(segment_files(data)) == 1
    erase_slot(segment_files(data)[0])  # a crash, not a clean shutdown: the tail gets its full scan
    return data, expected, 40 * 8


@pytest.mark.parametrize("how", ["truncate", "zero-fill"])
def test_tail_cut_at_every_byte_of_its_last_node_keeps_the_longest_valid_prefix(
    torn_tail_source, tmp_path, how
):
    """Cut the tail segment at every byte of its last node: the file shortened (a partial copy) or its
    end zeroed (pages that never reached the disk). Reopen must keep exactly the longest valid prefix,
    never raise, never return garbage; and a clean restart afterwards must give the same content."""
    source, expected, before = torn_tail_source
    tail_name = segment_files(source)[-1].name
    original = (stream_dir(source) / tail_name).read_bytes()
    node_pos, versions = tail_prefix_counts(stream_dir(source) / tail_name, before)
    assert len(versions) == 2, "the last node should hold two header versions"
    node_end = max(end for _, end, _ in versions)
    failures = []
    for cut in range(node_pos, node_end + 1):
        work = tmp_path / f"cut{cut}"
        shutil.copytree(source, work)
        tail = stream_dir(work) / tail_name
        if how == "truncate":
            os.truncate(tail, cut)
        else:
            tail.write_bytes(original[:cut] + bytes(len(original) - cut))
        # The longest valid prefix: the newest header version whose bytes all survive.
        keep = max(
            [
                count
                for data_end, disk_end, count in versions
                if data_end <= cut and (how == "zero-fill" or disk_end <= cut)
            ],
            default=before,
        )
        # A truncation inside a node's 8-byte alignment padding loses no data: either answer is fine.
        lenient = max([count for data_end, _, count in versions if data_end <= cut], default=before)
        try:
            engine = open_engine(work, fsync="no")
            first, nxt, got, gaps = read_everything(engine)
            assert first == 0 and not gaps and not engine.info(NAME).damaged, "a torn tail is not damage"
            assert got == {o: expected[o] for o in range(len(got))}, "not a prefix of what was appended"
            assert nxt == len(got), f"end_offset {nxt} but {len(got)} entries readable"
            assert len(got) in (keep, lenient), f"kept {len(got)} entries, the longest valid prefix is {keep}"
            engine.close()
            engine = open_engine(work, fsync="no")  # a clean start trusts what recovery left
            assert read_everything(engine)[2] == got, "a clean restart after recovery gives other content"
            if cut % 16 == 0 or cut == node_end:
                appends_still_work(engine)
            engine.close()
        except (Exception, pytest.fail.Exception) as exc:  # collect: one run shows how widespread it is
            failures.append(f"cut at byte {cut} (node at {node_pos}): {type(exc).__name__}: {exc}")
        shutil.rmtree(work)
    total = node_end + 1 - node_pos
    assert not failures, f"{len(failures)} of {total} cuts failed:\n" + "\n".join(failures[:8])


# ---------------------------------------------------------------------- segment header damage


def segment_index(data: Path, which: str) -> int:
    return {"first": 0, "middle": 1, "tail": len(segment_files(data)) - 1}[which]


@pytest.mark.parametrize("bit", [0, 7])
@pytest.mark.parametrize("field", [f[0] for f in SEGMENT_FIELDS])
@pytest.mark.parametrize(
    "which",
    ["middle", "first", "tail"],
)
def test_segment_header_bit_flip_is_reported_and_the_rest_stays_readable(data, which, field, bit):
    directory, expected = data
    files = segment_files(directory)
    target = files[segment_index(directory, which)]
    header = SegmentHeader.decode(target.read_bytes()[:SEGMENT_HEADER_SIZE])
    base = header.base_offset
    end = header.end_offset if header.packed else max(expected) + 1
    _, pos, size = next(f for f in SEGMENT_FIELDS if f[0] == field)
    flip(target, pos + (size - 1 if bit == 7 else 0), bit)
    engine = open_engine(directory)
    got, _ = assert_rest_readable(engine, expected)
    damaged = engine.info(NAME).damaged
    lost = [o for o in range(base, end) if o not in got]
    if lost:  # whatever was lost is reported as damage, and a read that starts there says so
        assert any(g.start_offset <= base < g.end_offset for g in damaged), (
            f"segment {base}..{end} lost, damage {damaged}"
        )
        result = engine.read(NAME, base, 5)
        assert result.gap is not None and result.gap.reason == "corrupt" and result.gap.start_offset == base
    assert engine.info(NAME).end_offset >= max(expected) + 1, "offsets would be reused"
    appends_still_work(engine)
    engine.close()


# ---------------------------------------------------------------------- node header damage


@pytest.mark.parametrize("slots", ["one slot", "both slots"])
@pytest.mark.parametrize("field", [f[0] for f in NODE_FIELDS])
def test_node_header_bit_flip_in_a_packed_segment(data, field, slots):
    directory, expected = data
    target = segment_files(directory)[1]
    assert SegmentHeader.decode(target.read_bytes()[:SEGMENT_HEADER_SIZE]).packed
    nodes = nodes_of(target)
    pos, header = nodes[len(nodes) // 2]
    _, at, _ = next(f for f in NODE_FIELDS if f[0] == field)
    for slot in (0, 1) if slots == "both slots" else (0,):
        flip(target, pos + slot * NODE_HEADER_SIZE + at, 3 if at else 0)
    engine = open_engine(directory)
    got, _ = assert_rest_readable(engine, expected)
    node = range(header.base_offset, header.base_offset + header.count)
    if slots == "one slot":  # the second slot is an identical copy: nothing is lost
        assert got == expected and engine.info(NAME).damaged == ()
    else:
        assert not any(o in got for o in node)
        damaged = engine.info(NAME).damaged
        assert any(g.start_offset <= node[0] and node[-1] < g.end_offset for g in damaged), damaged
        result = engine.read(NAME, node[0], 3)
        assert result.gap is not None and result.gap.reason == "corrupt"
        assert all(o in got for o in range(0, nodes[0][1].base_offset))  # earlier segments untouched
        later = SegmentHeader.decode(target.read_bytes()[:SEGMENT_HEADER_SIZE]).end_offset
        assert all(o in got for o in expected if o >= later)  # later segments untouched
    engine.close()


def test_damaged_newest_header_of_the_tail_node_falls_back_to_the_older_one(torn_tail_source, tmp_path):
    source, expected, before = torn_tail_source
    work = tmp_path / "data"
    shutil.copytree(source, work)
    tail = segment_files(work)[-1]
    pos, header = nodes_of(tail)[-1]
    flip(tail, pos + (header.seq % 2) * NODE_HEADER_SIZE + 12)  # the count field of the newest slot
    other = pos + (1 - header.seq % 2) * NODE_HEADER_SIZE
    older = NodeHeader.decode(tail.read_bytes()[other : other + NODE_HEADER_SIZE])
    engine = open_engine(work)
    got = read_everything(engine)[2]
    assert got == {o: expected[o] for o in range(before + older.count)}
    engine.close()
    engine = open_engine(work)
    assert read_everything(engine)[2] == got
    appends_still_work(engine)
    engine.close()


# ---------------------------------------------------------------------- blob damage


@pytest.mark.parametrize("where", ["first byte", "middle", "last byte"])
@pytest.mark.parametrize("compression", [True, False], ids=["packed-zstd", "uncompressed"])
def test_blob_bit_flip_in_a_sealed_node_is_reported_as_a_corrupt_gap(tmp_path, compression, where):
    directory = tmp_path / "data"
    expected = build(directory, compression=compression)
    target = segment_files(directory)[1]
    nodes = nodes_of(target)
    pos, header = nodes[len(nodes) // 2]
    if compression:
        assert header.flags & NODE_ZSTD, "the sealed nodes should be stored compressed"
        start, length = pos + NODE_PREFIX_SIZE, header.stored_len
    else:
        start, length = pos + NODE_PREFIX_SIZE + 4 * header.slots, header.blob_len
    flip(target, start + {"first byte": 0, "middle": length // 2, "last byte": length - 1}[where], 5)
    engine = open_engine(directory)
    node = range(header.base_offset, header.base_offset + header.count)
    result = engine.read(NAME, node[0], 3)  # the gap, then whatever follows it
    assert result.gap is not None
    assert (result.gap.start_offset, result.gap.reason) == (
        node[0],
        "corrupt",
    ) and result.gap.end_offset >= node[-1] + 1
    assert all(e.offset > node[-1] for e in result.entries())
    assert any(g.start_offset <= node[0] and node[-1] < g.end_offset for g in engine.info(NAME).damaged)
    got, _ = assert_rest_readable(engine, expected)
    assert set(expected) - set(got) == set(node), "only the damaged node is lost"
    before = engine.read(NAME, node[0] - 3, 10)  # a read running into the damage stops before it
    assert [e.offset for e in before.entries()] == list(range(node[0] - 3, node[0]))
    assert engine.count(NAME, 0, max(expected) + 1) == len(got)
    engine.close()


# ---------------------------------------------------------------------- metadata damage


def unreadable_at_first_use(directory: Path) -> None:
    """The damaged stream (NAME) is found at its first use (start-up takes its name from the
    catalog file, not its meta file; without that file, at start-up): only it is lost."""
    engine = open_engine(directory)
    try:
        if not engine.unreadable:
            with pytest.raises(StreamNotFoundError):
                engine.read(NAME, 0, 5)
        assert engine.unreadable == [NAME], engine.unreadable
        assert not engine.exists(NAME) and engine.list_streams() == [OTHER]
        assert [e.payload for e in engine.read(OTHER, 0, 5).entries()] == [b"o1", b"o2"]
    finally:
        engine.close()


def test_every_bit_flip_in_stream_meta_makes_only_that_stream_unreadable(data, tmp_path):
    directory, expected = data
    meta = stream_dir(directory) / "stream.meta"
    original = meta.read_bytes()
    failures = []
    for pos in range(len(original)):
        damaged = bytearray(original)
        damaged[pos] ^= 1 << (pos % 8)
        meta.write_bytes(bytes(damaged))
        try:
            unreadable_at_first_use(directory)
        except Exception as exc:
            failures.append(f"byte {pos}: {type(exc).__name__}: {exc}")
        if pos % 7 == 0:  # and without the catalog file: found at start-up
            (directory / CATALOG_FILE).unlink()
            engine = open_engine(directory)
            if engine.unreadable != [NAME]:
                failures.append(f"byte {pos}, no catalog: unreadable {engine.unreadable}")
            engine.close()
    meta.write_bytes(original)
    assert not failures, "\n".join(failures[:8])
    for broken in (b"", original[:7], original[:-1]):
        meta.write_bytes(broken)
        unreadable_at_first_use(directory)
    meta.write_bytes(original)
    engine = open_engine(directory)
    assert read_everything(engine)[2] == expected
    engine.close()


def test_append_to_an_unreadable_stream_is_refused_and_leaves_its_files_alone(data):
    directory, _ = data
    meta = stream_dir(directory) / "stream.meta"
    flip(meta, 20)
    damaged = meta.read_bytes()
    engine = open_engine(directory)
    with pytest.raises(StorageError):
        engine.append(NAME, AppendBatch([b"x"]))
    assert engine.unreadable == [NAME]
    with pytest.raises(StorageError):
        engine.append(NAME, AppendBatch([b"x"]))
    assert meta.read_bytes() == damaged, "the damaged metadata (the evidence) was overwritten"
    engine.close()


# ---------------------------------------------------------------------- a file the crash left empty


def test_zero_length_segment_file_does_not_stop_start_up(data):
    """A crash between creating a segment file and preallocating it leaves it empty."""
    directory, expected = data
    (stream_dir(directory) / f"{max(expected) + 1:020d}.seg").touch()
    engine = open_engine(directory)
    assert read_everything(engine)[2] == expected
    appends_still_work(engine)
    engine.close()


@pytest.mark.parametrize("config", [None, StreamConfig(max_entries=1000)], ids=["no meta file", "meta file"])
@pytest.mark.parametrize("size", [0, 1, SEGMENT_HEADER_SIZE - 1])
def test_a_stream_whose_only_segment_is_cut_below_its_header_stays_unreadable_not_empty(
    tmp_path, size, config
):
    """The catalog counted entries in the stream: a segment that short is damage (a disk, a bad
    copy), not a creation a crash cut short. The stream is unreadable at its first use and at
    every start-up after (the directory listed again), its file kept, never opened empty."""
    directory = tmp_path / "data"
    engine = open_engine(directory, small_streams="off")  # its segment file, not a slot
    if config is not None:  # else created by its first append, with no meta file
        engine.create_stream(NAME, config)
    engine.append(NAME, AppendBatch([b"a", b"b", b"c"]))
    engine.append(OTHER, AppendBatch([b"o1", b"o2"]))
    engine.close()
    [segment] = segment_files(directory)
    os.truncate(segment, size)
    cut = segment.read_bytes()
    for _ in range(3):
        unreadable_at_first_use(directory)
        engine = open_engine(directory)
        with pytest.raises(StorageError):
            engine.append(NAME, AppendBatch([b"x"]))
        engine.close()
        assert not segment_files(directory), "a new segment was made in the damaged one's place"
        assert segment.with_name(segment.name + ".damaged").read_bytes() == cut
    assert verify(directory), "python -m storage.inspect verify finds nothing wrong"
