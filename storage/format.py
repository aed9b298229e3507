"""Byte layout of segment files and macro nodes (docs/FORMAT.md has the tables).

The segment header, the node header and its flags, and a node's entries in
memory (`NodeBody`); the two node layouts are in storage/growing.py and
storage/packed.py. All integers are little-endian. Every structure recovery
trusts carries a CRC32C: the segment header, each node header, and each node body.
"""

from __future__ import annotations

import struct
from array import array
from dataclasses import dataclass
from typing import NamedTuple

from crc32c import crc32c

from storage.errors import CorruptionError
from storage.names import MAX_NAME_BYTES

# Segment headers: version 2 files grow in steps up to their capacity (docs/FORMAT.md,
# "Segment file"); version 1 files were created at their full size and are read as such;
# a version 3 file (a growing one: packed files keep version 2) has its SYNCED slot after the
# header (storage/cleanmark.py).
SEGMENT_VERSION = 3
PACKED_SEGMENT_VERSION = 2
SEGMENT_VERSIONS = (1, 2, 3)
NODE_VERSION = 1

SEGMENT_MAGIC = b"SLOGSEG\x00"
SEGMENT_HEADER_SIZE = 64
SYNCED_SLOT_SIZE = 128  # a version 3 growing segment's SYNCED marker, bytes 64-191
SLOTTED_HEADER_SIZE = SEGMENT_HEADER_SIZE + SYNCED_SLOT_SIZE  # where its first node starts
SEGMENT_PACKED = 0x1  # nodes use the packed layout (a rewritten, immutable file)
# magic, version, flags, header size, base offset, end offset, capacity, created ms
_SEGMENT_HEADER = struct.Struct("<8sHHIQQQq12x")

NODE_MAGIC = b"SLND"
NODE_HEADER_SIZE = 64
NODE_PREFIX_SIZE = 2 * NODE_HEADER_SIZE  # two header slots, written alternately
NODE_ZSTD = 0x1  # packed body is zstd-compressed
NODE_SPARSE = 0x2  # packed body has an offset-delta table (compaction left holes)
NODE_DELAYED = 0x4  # some entry carries deliver_at_ms
NODE_PRODUCER = 0x8  # some entry carries a producer id and sequence (an idempotent batch ends there)
NODE_CARRIED_FLAGS = NODE_DELAYED | NODE_PRODUCER  # what packing keeps from a growing node's flags
# magic, version, flags, seq, count, base offset, slots, blob len, stored len,
# body crc, blob crc, min ts, max ts
_NODE_HEADER = struct.Struct("<4sBBxxIIQIIIIIqq")

assert _SEGMENT_HEADER.size == SEGMENT_HEADER_SIZE - 4
assert _NODE_HEADER.size == NODE_HEADER_SIZE - 4


_CRC = struct.Struct("<I")


def _with_crc(body: bytes) -> bytes:
    return body + _CRC.pack(crc32c(body))


def _crc_ok(raw: bytes) -> bool:
    return struct.unpack_from("<I", raw, len(raw) - 4)[0] == crc32c(raw[:-4])


@dataclass(frozen=True, slots=True)
class SegmentHeader:
    base_offset: int
    end_offset: int  # packed files: the offset after the last entry the file covers; else 0
    capacity: int  # growing files: the size they may grow to (version 1: their size); packed: their size
    created_ms: int
    flags: int = 0
    version: int = 0  # 0: the one a new file of its kind gets (3 growing, 2 packed)

    def __post_init__(self) -> None:
        if not self.version:
            object.__setattr__(self, "version", PACKED_SEGMENT_VERSION if self.packed else SEGMENT_VERSION)

    @property
    def packed(self) -> bool:
        return bool(self.flags & SEGMENT_PACKED)

    @property
    def size(self) -> int:
        """Where the first node starts: past the SYNCED slot in a version 3 file."""
        return SLOTTED_HEADER_SIZE if self.version >= 3 else SEGMENT_HEADER_SIZE

    @property
    def has_slot(self) -> bool:
        """Whether the file keeps its SYNCED marker in its slot (else in the stream's SYNCED file)."""
        return self.size == SLOTTED_HEADER_SIZE

    def encode(self) -> bytes:
        return _with_crc(
            _SEGMENT_HEADER.pack(
                SEGMENT_MAGIC,
                self.version,
                self.flags,
                self.size,
                self.base_offset,
                self.end_offset,
                self.capacity,
                self.created_ms,
            )
        )

    @classmethod
    def decode(cls, raw: bytes) -> SegmentHeader:
        _, version, flags, _, base, end, capacity, created = cls.check(raw)
        return cls(base, end, capacity, created, flags, version)

    @staticmethod
    def check(raw: bytes) -> tuple[bytes, int, int, int, int, int, int, int]:
        """The fields of the header in the first SEGMENT_HEADER_SIZE bytes of `raw`, once they
        pass every check (CorruptionError if one fails), with no SegmentHeader built: a scan of
        the slots checks a million of them (`decode` builds one from these)."""
        if len(raw) < SEGMENT_HEADER_SIZE:
            raise CorruptionError("segment file is shorter than its header")
        raw = raw[:SEGMENT_HEADER_SIZE]
        fields = _SEGMENT_HEADER.unpack_from(raw)
        magic, version, flags, size = fields[:4]
        if magic != SEGMENT_MAGIC:
            raise CorruptionError("not a streamlog segment (bad magic)")
        if not _crc_ok(raw):
            raise CorruptionError("segment header CRC mismatch")
        if version not in SEGMENT_VERSIONS:
            raise CorruptionError(f"unsupported segment format version {version}")
        slotted = version >= 3  # (`size` and `has_slot`, of the header these fields make)
        expected = SLOTTED_HEADER_SIZE if slotted else SEGMENT_HEADER_SIZE
        if size != expected or (slotted and flags & SEGMENT_PACKED):
            raise CorruptionError(f"segment header of version {version} gives a header size of {size}")
        return fields


class NodeHeader(NamedTuple):
    """One node header slot. See docs/FORMAT.md for what each field means per layout.

    A named tuple rather than a frozen dataclass: every append builds one, and a frozen
    dataclass sets each of its 11 fields through object.__setattr__ (about three times
    the instructions of a tuple's construction)."""

    seq: int
    count: int  # type: ignore[assignment]  # shadows tuple.count, which no caller uses
    base_offset: int
    slots: int
    blob_len: int
    stored_len: int
    body_crc: int
    blob_crc: int
    min_ts: int
    max_ts: int
    flags: int = 0

    def encode(self) -> bytes:
        # _with_crc, inline: every append encodes a header.
        body = _NODE_HEADER.pack(
            NODE_MAGIC,
            NODE_VERSION,
            self.flags,
            self.seq,
            self.count,
            self.base_offset,
            self.slots,
            self.blob_len,
            self.stored_len,
            self.body_crc,
            self.blob_crc,
            self.min_ts,
            self.max_ts,
        )
        return body + _CRC.pack(crc32c(body))

    @classmethod
    def decode(cls, raw: bytes) -> NodeHeader | None:
        """The header in `raw`, or None when the slot is empty, torn or damaged."""
        if len(raw) < NODE_HEADER_SIZE or raw[:4] != NODE_MAGIC or not _crc_ok(raw[:NODE_HEADER_SIZE]):
            return None
        (
            _,
            version,
            flags,
            seq,
            count,
            base,
            slots,
            blob_len,
            stored_len,
            body_crc,
            blob_crc,
            min_ts,
            max_ts,
        ) = _NODE_HEADER.unpack_from(raw)
        if version != NODE_VERSION or (count > slots and not flags & NODE_SPARSE):
            return None
        return cls(seq, count, base, slots, blob_len, stored_len, body_crc, blob_crc, min_ts, max_ts, flags)

    @property
    def disk_size(self) -> int:
        """Bytes the node takes in its segment, header slots included, 8-aligned."""
        return (NODE_PREFIX_SIZE + self.stored_len + 7) & ~7


def pick_header(slot_a: bytes, slot_b: bytes) -> list[NodeHeader]:
    """Valid header slots of a node, newest first (by sequence number)."""
    found = [h for h in (NodeHeader.decode(slot_a), NodeHeader.decode(slot_b)) if h is not None]
    return sorted(found, key=lambda h: h.seq, reverse=True)


@dataclass(slots=True)
class NodeBody:
    """A node's entries in memory: record i spans blob[positions[i]:positions[i+1]].

    `deltas` is None for a dense node (entry i has offset base+i); for a
    compacted node it holds offset-base for each surviving entry.
    """

    base_offset: int
    positions: array
    blob: bytes
    deltas: array | None = None

    @property
    def count(self) -> int:
        return len(self.positions) - 1

    def offset_at(self, index: int) -> int:
        return self.base_offset + (self.deltas[index] if self.deltas is not None else index)

    def byte_size(self) -> int:
        return len(self.blob) + 4 * len(self.positions)


def check_positions(body: NodeBody) -> None:
    """Positions must start at 0 and end at the blob's length.

    The CRC already vouches for every byte; this catches a header that
    disagrees with its body. A per-entry monotonicity check would cost more
    than decoding the node (it is Python per entry), and slicing a blob can
    never read outside it.
    """
    positions = body.positions
    if positions[0] != 0 or positions[-1] != len(body.blob):
        raise CorruptionError("node offset table does not span its blob")


# Small-stream slots (format 6, written by default: docs/FORMAT.md, "Pack files"). A pack file is
# made of SLOT_BYTES slots; slot 0 holds the pack header, every other slot a slot header and then
# the first SLOT_SEGMENT_BYTES of a growing segment, byte for byte what its `.seg` file would hold.
SLOT_BYTES = 4096
SLOT_HEADER_BYTES = 512
SLOT_SEGMENT_BYTES = SLOT_BYTES - SLOT_HEADER_BYTES
SLOT_VERSION = 1
SLOT_MAGIC = b"SLPK"
# magic, version, flags, generation, created ms, name length (the name follows at byte 22)
_SLOT_HEADER = struct.Struct("<4sHHIqH")
_SLOT_CRC_AT = SLOT_HEADER_BYTES - 4
_FREE_SLOT_HEADER = bytes(SLOT_HEADER_BYTES)

PACK_VERSION = 1
PACK_MAGIC = b"SLOGPACK"
PACK_HEADER_BYTES = 64  # at the start of slot 0; the rest of the slot is zeros
# magic, version, flags, pack id, slot bytes, slot header bytes
_PACK_HEADER = struct.Struct("<8sHHIII36x")

assert _PACK_HEADER.size == PACK_HEADER_BYTES - 4


class SlotHeader(NamedTuple):
    """The first SLOT_HEADER_BYTES of a used slot: whose stream it holds, since which reuse."""

    name: str
    generation: int  # +1 at each reuse of the slot (the catalog's place keeps it mod 2**24)
    created_ms: int
    flags: int = 0

    def encode(self) -> bytes:
        raw = self.name.encode()
        if not 0 < len(raw) <= MAX_NAME_BYTES:
            raise ValueError(f"a slot header cannot hold a name of {len(raw)} bytes")
        head = _SLOT_HEADER.pack(
            SLOT_MAGIC, SLOT_VERSION, self.flags, self.generation, self.created_ms, len(raw)
        )
        body = (head + raw).ljust(_SLOT_CRC_AT, b"\0")  # zeros up to the CRC
        return body + _CRC.pack(crc32c(body))

    @classmethod
    def decode(cls, raw: bytes, at: int = 0) -> SlotHeader | None:
        """The header in the SLOT_HEADER_BYTES of `raw` from byte `at` (a scan's chunk of slots is
        read in place: no copy of a header but the CRC's); None for a free slot (all zeros);
        CorruptionError for any other header that fails a check."""
        end = at + SLOT_HEADER_BYTES
        if len(raw) < end:
            raise CorruptionError(f"slot header cut short at {max(len(raw) - at, 0)} bytes")
        magic, version, flags, generation, created_ms, length = _SLOT_HEADER.unpack_from(raw, at)
        if magic != SLOT_MAGIC:
            if raw[at:end] == _FREE_SLOT_HEADER:  # (no used header is all zeros: its magic)
                return None
            raise CorruptionError("not a streamlog slot (bad magic)")
        if _CRC.unpack_from(raw, at + _SLOT_CRC_AT)[0] != crc32c(raw[at : at + _SLOT_CRC_AT]):
            raise CorruptionError("slot header CRC mismatch")
        if version != SLOT_VERSION:
            raise CorruptionError(f"unsupported slot format version {version}")
        if not 0 < length <= MAX_NAME_BYTES:
            raise CorruptionError(f"slot header names a name of {length} bytes")
        start = at + _SLOT_HEADER.size
        try:
            name = str(raw[start : start + length], "utf-8")
        except UnicodeDecodeError as exc:
            raise CorruptionError("slot header's name is not UTF-8") from exc
        return cls(name, generation, created_ms, flags)


class PackHeader(NamedTuple):
    """The header in slot 0 of a pack file."""

    pack_id: int  # also the file's name

    def encode(self) -> bytes:
        """The whole of slot 0."""
        head = _with_crc(
            _PACK_HEADER.pack(PACK_MAGIC, PACK_VERSION, 0, self.pack_id, SLOT_BYTES, SLOT_HEADER_BYTES)
        )
        return head + bytes(SLOT_BYTES - PACK_HEADER_BYTES)

    @classmethod
    def decode(cls, raw: bytes) -> PackHeader:
        if len(raw) < PACK_HEADER_BYTES:
            raise CorruptionError("pack file is shorter than its header")
        raw = bytes(raw[:PACK_HEADER_BYTES])
        magic, version, flags, pack_id, slot_bytes, header_bytes = _PACK_HEADER.unpack_from(raw)
        if magic != PACK_MAGIC:
            raise CorruptionError("not a streamlog pack (bad magic)")
        if not _crc_ok(raw):
            raise CorruptionError("pack header CRC mismatch")
        if version != PACK_VERSION or flags:
            raise CorruptionError(f"unsupported pack format version {version} (flags {flags:#x})")
        if (slot_bytes, header_bytes) != (SLOT_BYTES, SLOT_HEADER_BYTES):
            raise CorruptionError(f"pack of {slot_bytes}-byte slots with {header_bytes}-byte headers")
        return cls(pack_id)
