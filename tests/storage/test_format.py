"""Exact bytes of the on-disk format (docs/FORMAT.md), and the inspector that reads it."""

from __future__ import annotations

import hashlib
import struct
from array import array

import pytest
import zstandard
from crc32c import crc32c

from storage import AppendBatch, GroupReadOptions
from storage.errors import CorruptionError
from storage.format import (
    NODE_SPARSE,
    NODE_ZSTD,
    SLOT_BYTES,
    SLOT_HEADER_BYTES,
    NodeBody,
    NodeHeader,
    PackHeader,
    SegmentHeader,
    SlotHeader,
    pick_header,
)
from storage.inspect import main as inspect_main
from storage.names import dirname_for, name_of_dirname
from storage.packed import decode_packed_body, encode_packed_node
from storage.records import decode_records, encode_batch, encode_varint


def test_segment_header_bytes():
    raw = SegmentHeader(base_offset=1000, end_offset=2000, capacity=65536, created_ms=7, flags=1).encode()
    assert len(raw) == 64
    assert raw[:8] == b"SLOGSEG\x00"
    assert struct.unpack_from("<HHIQQQq", raw, 8) == (2, 1, 64, 1000, 2000, 65536, 7)
    assert raw[48:60] == bytes(12)
    assert struct.unpack_from("<I", raw, 60)[0] == crc32c(raw[:60])
    assert SegmentHeader.decode(raw) == SegmentHeader(1000, 2000, 65536, 7, 1)
    for i in range(64):
        damaged = bytearray(raw)
        damaged[i] ^= 0x10
        with pytest.raises(CorruptionError):
            SegmentHeader.decode(bytes(damaged))


def test_a_growing_segment_header_is_version_3_and_leaves_room_for_its_synced_slot():
    """Nodes of a version 3 (growing) file start at byte 192: bytes 64-191 are its SYNCED slot."""
    raw = SegmentHeader(base_offset=1000, end_offset=0, capacity=65536, created_ms=7).encode()
    assert struct.unpack_from("<HHI", raw, 8) == (3, 0, 192)
    header = SegmentHeader.decode(raw)
    assert header == SegmentHeader(1000, 0, 65536, 7, 0, 3) and header.has_slot and header.size == 192
    packed = SegmentHeader.decode(SegmentHeader(1000, 2000, 65536, 7, 1).encode())
    assert packed.version == 2 and not packed.has_slot and packed.size == 64
    for version, flags, size in ((3, 0, 64), (2, 0, 192), (3, 1, 192)):  # sizes that do not go together
        body = bytearray(raw[:60])
        struct.pack_into("<HHI", body, 8, version, flags, size)
        with pytest.raises(CorruptionError):
            SegmentHeader.decode(bytes(body) + struct.pack("<I", crc32c(bytes(body))))


def _outcome(decode, *args):
    """What a decode gives: its value, or the reason it refuses."""
    try:
        return decode(*args)
    except CorruptionError as exc:
        return f"refused: {exc}"


def test_a_segment_header_is_checked_as_it_is_decoded_without_building_one():
    """`check` (a scan of the slots: no SegmentHeader built) refuses what `decode` refuses, for the
    same reason, and gives the fields `decode` builds from."""
    for header in (SegmentHeader(1000, 0, 65536, 7), SegmentHeader(1000, 2000, 65536, 7, 1)):
        raw = header.encode()
        assert SegmentHeader.check(raw)[4:] == (1000, header.end_offset, 65536, 7)
        variants = [raw[:63]]
        for i in range(64):
            damaged = bytearray(raw)
            damaged[i] ^= 0x10
            variants.append(bytes(damaged))
        for version, flags, size in ((3, 0, 64), (2, 0, 192), (3, 1, 192), (4, 0, 192)):
            body = bytearray(raw[:60])
            struct.pack_into("<HHI", body, 8, version, flags, size)
            variants.append(bytes(body) + struct.pack("<I", crc32c(bytes(body))))
        for variant in variants:
            refused = _outcome(SegmentHeader.decode, variant)
            assert isinstance(refused, str)
            assert _outcome(SegmentHeader.check, variant) == refused


def test_a_slot_header_decodes_in_place_in_a_chunk_of_slots_as_on_its_own():
    """A scan decodes each header where it lies in its chunk (`at`): the same header, free slot,
    or refusal and reason as the header's own bytes give."""
    used = SlotHeader("orders/é", 3, 5).encode()
    flipped = bytearray(used)
    flipped[30] ^= 0x01
    slots = [used, bytes(SLOT_HEADER_BYTES), bytes(flipped), b"\x01" + bytes(SLOT_HEADER_BYTES - 1)]
    chunk = b"".join(raw + bytes(SLOT_BYTES - SLOT_HEADER_BYTES) for raw in slots)
    for i, raw in enumerate(slots):
        assert _outcome(SlotHeader.decode, chunk, i * SLOT_BYTES) == _outcome(SlotHeader.decode, raw)
    assert SlotHeader.decode(chunk, 0) == SlotHeader("orders/é", 3, 5)
    with pytest.raises(CorruptionError, match="cut short at 300 bytes"):
        SlotHeader.decode(chunk, len(chunk) - 300)


def _with_new_crc(raw: bytes | bytearray, crc_at: int) -> bytes:
    """`raw` with its CRC32C (of the bytes before `crc_at`) recomputed: a field changed on purpose."""
    raw = bytearray(raw)
    raw[crc_at : crc_at + 4] = struct.pack("<I", crc32c(bytes(raw[:crc_at])))
    return bytes(raw)


def test_slot_header_bytes():
    raw = SlotHeader("orders/é", generation=7, created_ms=1_700_000_000_123, flags=2).encode()
    name = "orders/é".encode()
    assert len(raw) == 512
    assert raw[:4] == b"SLPK"
    assert struct.unpack_from("<HHIqH", raw, 4) == (1, 2, 7, 1_700_000_000_123, len(name))
    assert raw[22 : 22 + len(name)] == name
    assert raw[22 + len(name) : 508] == bytes(508 - 22 - len(name))
    assert struct.unpack_from("<I", raw, 508)[0] == crc32c(raw[:508])
    assert SlotHeader.decode(raw + b"segment bytes") == SlotHeader("orders/é", 7, 1_700_000_000_123, 2)
    longest = SlotHeader("n" * 255, 1, 0)
    assert SlotHeader.decode(longest.encode()) == longest
    with pytest.raises(ValueError):
        SlotHeader("n" * 256, 1, 0).encode()


def test_a_free_slot_header_is_all_zeros_and_every_damaged_field_is_refused():
    assert SlotHeader.decode(bytes(512)) is None
    raw = SlotHeader("s", generation=3, created_ms=5).encode()
    for i in range(512):  # any bit flip: the CRC (or the magic) catches it
        damaged = bytearray(raw)
        damaged[i] ^= 0x04
        with pytest.raises(CorruptionError):
            SlotHeader.decode(damaged)
    fields = {  # each field wrong under a CRC that matches: refused for its own reason
        "bad magic": (0, b"SLPX"),
        "version": (4, struct.pack("<H", 2)),
        "a name of 0 bytes": (20, struct.pack("<H", 0)),
        "a name of 256 bytes": (20, struct.pack("<H", 256)),
        "not UTF-8": (22, b"\xff"),
    }
    for why, (pos, value) in fields.items():
        damaged = bytearray(raw)
        damaged[pos : pos + len(value)] = value
        with pytest.raises(CorruptionError, match=why):
            SlotHeader.decode(_with_new_crc(damaged, 508))
    with pytest.raises(CorruptionError, match="cut short"):
        SlotHeader.decode(raw[:300])


def test_pack_header_bytes():
    raw = PackHeader(pack_id=12).encode()
    assert len(raw) == 4096  # the whole of slot 0
    assert raw[:8] == b"SLOGPACK"
    assert struct.unpack_from("<HHIII", raw, 8) == (1, 0, 12, 4096, 512)
    assert raw[24:60] == bytes(36)
    assert struct.unpack_from("<I", raw, 60)[0] == crc32c(raw[:60])
    assert raw[64:] == bytes(4096 - 64)
    assert PackHeader.decode(raw) == PackHeader(12)
    for i in range(64):
        damaged = bytearray(raw)
        damaged[i] ^= 0x10
        with pytest.raises(CorruptionError):
            PackHeader.decode(damaged)
    fields = {
        "bad magic": (0, b"SLOGPACX"),
        "version 2": (8, struct.pack("<H", 2)),
        "flags 0x1": (10, struct.pack("<H", 1)),
        "8192-byte slots": (16, struct.pack("<I", 8192)),
        "256-byte headers": (20, struct.pack("<I", 256)),
    }
    for why, (pos, value) in fields.items():
        damaged = bytearray(raw)
        damaged[pos : pos + len(value)] = value
        with pytest.raises(CorruptionError, match=why):
            PackHeader.decode(_with_new_crc(damaged[:64], 60))
    with pytest.raises(CorruptionError, match="shorter"):
        PackHeader.decode(raw[:63])


def test_node_header_bytes_and_slot_choice():
    header = NodeHeader(
        seq=5,
        count=3,
        base_offset=42,
        slots=8,
        blob_len=30,
        stored_len=62,
        body_crc=11,
        blob_crc=22,
        min_ts=100,
        max_ts=200,
        flags=0,
    )
    raw = header.encode()
    assert len(raw) == 64 and raw[:4] == b"SLND" and raw[4] == 1
    assert struct.unpack_from("<IIQIIIIIqq", raw, 8) == (5, 3, 42, 8, 30, 62, 11, 22, 100, 200)
    assert struct.unpack_from("<I", raw, 60)[0] == crc32c(raw[:60])
    older = NodeHeader(4, 2, 42, 8, 20, 52, 1, 2, 100, 150).encode()
    assert [h.seq for h in pick_header(raw, older)] == [5, 4]
    torn = raw[:40] + bytes(24)
    assert [h.seq for h in pick_header(torn, older)] == [4]  # a torn slot falls back to the other
    assert pick_header(bytes(64), bytes(64)) == []
    assert header.disk_size == (128 + 62 + 7) & ~7


def test_packed_node_round_trip_dense_sparse_and_compressed():
    blob, positions = encode_batch(10, 5, AppendBatch([b"a" * 50, b"b" * 60, b"c" * 70]))
    dense = NodeBody(10, positions, blob)
    compressor = zstandard.ZstdCompressor(level=3)
    for body, flags in ((dense, 0), (NodeBody(10, array("I", [0, len(blob)]), blob, array("I", [4])), 0)):
        node = encode_packed_node(body, 5, 5, flags, compressor)
        assert len(node) % 8 == 0 and node[:64] == node[64:128]
        header = NodeHeader.decode(node[:64])
        stored = node[128 : 128 + header.stored_len]
        assert header.flags & NODE_ZSTD  # repetitive payloads compress
        assert bool(header.flags & NODE_SPARSE) == (body.deltas is not None)
        decoded = decode_packed_body(header, stored, zstandard.ZstdDecompressor())
        assert decoded.blob == body.blob and list(decoded.positions) == list(body.positions)
        damaged = bytearray(stored)
        damaged[len(damaged) // 2] ^= 1
        with pytest.raises(CorruptionError):
            decode_packed_body(header, bytes(damaged), zstandard.ZstdDecompressor())


def test_incompressible_node_is_stored_raw():
    import os

    payloads = [os.urandom(100) for _ in range(50)]
    blob, positions = encode_batch(0, 1, AppendBatch(payloads))
    node = encode_packed_node(NodeBody(0, positions, blob), 1, 1, 0, zstandard.ZstdCompressor())
    header = NodeHeader.decode(node[:64])
    assert not header.flags & NODE_ZSTD
    assert header.stored_len == 4 * 50 + len(blob)


def test_records_decode_what_they_encode():
    blob, positions = encode_batch(
        2**40,
        1_700_000_000_000,
        AppendBatch([b"x", b"", b"z" * 20000], ["t", "", "é"], [None, {"h": b"1"}, {}], [0, 9, 0]),
    )
    entries = decode_records(blob)
    assert [e.offset for e in entries] == [2**40, 2**40 + 1, 2**40 + 2]
    assert [e.tag for e in entries] == ["t", "", "é"]
    assert entries[1].headers == {"h": b"1"} and entries[1].deliver_at_ms == 9
    assert entries[2].payload == b"z" * 20000
    assert list(positions)[-1] == len(blob)


def _varint_bytewise(value: int) -> bytes:
    """The protobuf varint, 7 bits a byte, as the specification spells it."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def test_varints_from_tables_are_the_protobuf_varints():
    edges = [2**k + d for k in range(64) for d in (-1, 0, 1)]
    for value in [*range(20000), *edges, 1_700_000_000_000, 2**64 - 1]:
        assert encode_varint(value) == _varint_bytewise(value), value
    with pytest.raises(ValueError):
        encode_varint(-1)


@pytest.mark.parametrize("offset", [0, 127, 128, 2**14, 2**40])
@pytest.mark.parametrize("size", [1, 100, 2**14 - 33, 2**14 - 32])
def test_one_entry_batch_encodes_as_the_general_path(offset, size):
    """The one-entry fast path writes the bytes the per-entry loop does (an empty tag is left out)."""
    payload = bytes(range(256)) * (size // 256) + b"p" * (size % 256)
    fast = encode_batch(offset, 1_700_000_000_000, AppendBatch([payload]), start=300)
    general = encode_batch(offset, 1_700_000_000_000, AppendBatch([payload], tags=[""]), start=300)
    assert fast[0] == general[0] and fast[1] == general[1]
    assert list(fast[1]) == [300, 300 + len(fast[0])]
    [entry] = decode_records(fast[0])
    assert (entry.offset, entry.payload) == (offset, payload)


@pytest.mark.parametrize("first", [0, 100, 2**14 - 5, 2**40])
@pytest.mark.parametrize("sizes", [[100] * 10, [1] * 300, [2**14 - 33] * 3, [100, 101, 100], [5, 2**14 - 33]])
def test_plain_batches_encode_as_the_general_path(first, sizes):
    """The payload-only fast paths (one payload size, or several) write the bytes and positions
    the per-entry loop does, also for a batch whose offsets' varints change length in it."""
    payloads = [bytes([i % 251]) * size for i, size in enumerate(sizes)]
    fast = encode_batch(first, 1_700_000_000_000, AppendBatch(payloads), start=300)
    general = encode_batch(first, 1_700_000_000_000, AppendBatch(payloads, tags=[""] * len(sizes)), start=300)
    assert fast[0] == general[0] and fast[1] == general[1]
    entries = decode_records(fast[0])
    assert [(e.offset, e.payload) for e in entries] == [(first + i, p) for i, p in enumerate(payloads)]


def test_dirnames_are_safe_and_distinct():
    names = ["../x", "a/b", "..", ".", "%2E", "A", "a", "x" * 255, "x" * 254 + "y"]
    dirs = [dirname_for(n) for n in names]
    assert len(set(dirs)) == len(dirs)
    for d in dirs:
        assert "/" not in d and d not in (".", "..") and len(d) <= 200


@pytest.mark.parametrize(
    ("name", "dirname"),
    [
        ("room-0000001", "room-0000001"),
        ("Az09_-", "Az09_-"),
        ("a b", "a%20b"),
        ("a.b", "a%2Eb"),
        ("é", "%C3%A9"),
        ("x" * 200, "x" * 200),
        ("%" * 66, "%25" * 66),
    ],
)
def test_a_dirname_is_the_name_with_unsafe_bytes_percent_encoded(name, dirname):
    assert dirname_for(name) == dirname and name_of_dirname(dirname) == name


@pytest.mark.parametrize("name", ["x" * 201, "%" * 67, "é" * 40])
def test_a_name_encoding_longer_than_200_characters_is_stored_under_its_hash(name):
    assert dirname_for(name) == "~" + hashlib.sha256(name.encode()).hexdigest()
    assert name_of_dirname(dirname_for(name)) is None


def test_inspector_lists_and_verifies(tmp_path, capsys):
    from storage import Engine, EngineConfig

    from .conftest import SMALL

    with Engine(tmp_path / "d", EngineConfig(**SMALL)) as engine:
        for i in range(400):
            engine.append("s", AppendBatch([b"%d" % i * 30] * 5))
        engine.maintain()
    assert inspect_main([str(tmp_path / "d")]) == 0
    listing = capsys.readouterr().out
    assert "packed" in listing and "growing" in listing and " ok" in listing
    assert inspect_main(["verify", str(tmp_path / "d")]) == 0
    assert "ok: no damage found" in capsys.readouterr().out
    packed = sorted((tmp_path / "d" / "streams").rglob("*.seg"))[0]
    original = packed.read_bytes()
    for where, what in ((64 + 128 + 10, "CRC"), (64 + 20, "header copy")):  # first node: body, header slot A
        data = bytearray(original)
        data[where] ^= 0xFF
        packed.write_bytes(bytes(data))
        assert inspect_main(["verify", str(tmp_path / "d")]) == 1
        assert what in capsys.readouterr().out
    assert inspect_main([str(tmp_path / "missing")]) == 2


def test_inspector_lists_the_streams_in_slots_of_pack_files_beside_directories(tmp_path, capsys):
    from storage import Engine, EngineConfig

    from .conftest import SMALL

    data = tmp_path / "d"
    with Engine(data, EngineConfig(**SMALL, small_streams="slots")) as engine:
        engine.append("small", AppendBatch([b"x" * 10] * 3))
        engine.append("small", AppendBatch([b"y"] * 2))
        engine.append("big", AppendBatch([b"z" * 3000] * 2))  # too big for a slot: a directory
    assert inspect_main([str(data)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{data}/streams/big/00000000000000000000.seg  base=0  growing")
    assert out[3] == f"{data}/packs/00000.pack slot 1 (stream 'small')  base=0  growing  3584 bytes  1 nodes"
    assert out[5].split()[:3] == ["0", "5", "5"] and out[5].endswith(" ok")
    with (data / "packs" / "00000.pack").open("r+b") as f:
        f.seek(SLOT_BYTES + SLOT_HEADER_BYTES + 400)  # inside its node's blob (from 384)
        f.write(b"\xff")
    assert inspect_main([str(data)]) == 1
    assert "problem: node 0..5: node CRC mismatch" in capsys.readouterr().out


def test_verify_checks_group_and_producer_files(tmp_path, capsys):
    from storage import Engine, EngineConfig

    from .conftest import SMALL

    with Engine(tmp_path / "d", EngineConfig(**SMALL)) as engine:
        engine.append("s", AppendBatch([b"a"] * 5), producer=("p", 1))
        engine.create_group("s", "g")
        engine.read_group("s", "g", GroupReadOptions("c", 3))
    assert inspect_main(["verify", str(tmp_path / "d")]) == 0
    capsys.readouterr()
    directory = tmp_path / "d" / "streams" / "s"
    for name in ("producers.snap", "groups.snapshot"):
        path = directory / name
        original = path.read_bytes()
        path.write_bytes(original[:-1] + bytes([original[-1] ^ 0xFF]))
        assert inspect_main(["verify", str(tmp_path / "d")]) == 1
        assert name in capsys.readouterr().out
        path.write_bytes(original)
