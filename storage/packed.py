"""The packed node layout: immutable nodes of rewritten segments, usually zstd-compressed.

Packing (a full segment), compaction and the merge of small compacted segments
all write the same thing: a packed segment file, its header then its nodes
back to back. A packed node is two identical header slots and a body:

    offset table (4 bytes per entry) [offset-delta table, if sparse] blob

stored raw or compressed as one zstd frame (flag NODE_ZSTD), padded to 8 bytes.
A packed node does not depend on where it sits in its file, so merging packed
segments copies nodes as they are. docs/FORMAT.md has the tables.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Iterable
from pathlib import Path

import zstandard
from crc32c import crc32c

from storage.errors import CorruptionError
from storage.format import (
    NODE_CARRIED_FLAGS,
    NODE_PREFIX_SIZE,
    NODE_SPARSE,
    NODE_ZSTD,
    SEGMENT_PACKED,
    NodeBody,
    NodeHeader,
    SegmentHeader,
    check_positions,
)
from storage.fs import FileSystem, SegmentFile

_decompressors = threading.local()


def decompressor() -> zstandard.ZstdDecompressor:
    """This thread's zstd decompressor (one per thread: they are not thread-safe)."""
    d = getattr(_decompressors, "d", None)
    if d is None:
        d = _decompressors.d = zstandard.ZstdDecompressor()
    return d


def encode_packed_node(
    body: NodeBody, min_ts: int, max_ts: int, flags: int, compressor: zstandard.ZstdCompressor | None
) -> bytes:
    """A complete immutable node: two identical header slots and its body."""
    count = body.count
    parts = [body.positions[:count].tobytes()]
    node_flags = flags & NODE_CARRIED_FLAGS
    if body.deltas is not None:
        parts.append(body.deltas.tobytes())
        node_flags |= NODE_SPARSE
        span = body.deltas[-1] + 1 if count else 0
    else:
        span = count
    parts.append(body.blob)
    raw = b"".join(parts)
    stored = raw
    if compressor is not None:
        squeezed = compressor.compress(raw)
        # Keep the node raw unless zstd saves at least an eighth (as ZFS does): a raw node is
        # cheaper to read, and incompressible payloads would only pay decompression for nothing.
        if len(squeezed) <= len(raw) - len(raw) // 8:
            stored = squeezed
            node_flags |= NODE_ZSTD
    header = NodeHeader(
        seq=1,
        count=count,
        base_offset=body.base_offset,
        slots=span,
        blob_len=len(body.blob),
        stored_len=len(stored),
        body_crc=crc32c(stored),
        blob_crc=crc32c(raw),
        min_ts=min_ts,
        max_ts=max_ts,
        flags=node_flags,
    ).encode()
    node = header + header + stored
    return node + b"\x00" * (-len(node) % 8)


def decode_packed_body(
    header: NodeHeader, stored: bytes, decompressor: zstandard.ZstdDecompressor
) -> NodeBody:
    if crc32c(stored) != header.body_crc:
        raise CorruptionError("node body CRC mismatch")
    raw = stored
    if header.flags & NODE_ZSTD:
        try:
            raw = decompressor.decompress(stored, max_output_size=packed_raw_size(header))
        except zstandard.ZstdError as exc:
            raise CorruptionError(f"node body does not decompress: {exc}") from exc
        if crc32c(raw) != header.blob_crc:
            raise CorruptionError("decompressed node body does not match its CRC")
    if len(raw) != packed_raw_size(header):
        raise CorruptionError("node body length does not match its header")
    count = header.count
    positions = array("I")
    positions.frombytes(raw[: 4 * count])
    positions.append(header.blob_len)
    deltas = None
    start = 4 * count
    if header.flags & NODE_SPARSE:
        deltas = array("I")
        deltas.frombytes(raw[start : start + 4 * count])
        start += 4 * count
    body = NodeBody(header.base_offset, positions, raw[start:], deltas)
    check_positions(body)
    return body


def packed_raw_size(header: NodeHeader) -> int:
    """The body's size before compression: its tables and its blob."""
    tables = 2 if header.flags & NODE_SPARSE else 1
    return 4 * header.count * tables + header.blob_len


def compression_ratio(headers: Iterable[NodeHeader]) -> float:
    """Uncompressed over stored size of these packed nodes (1.0 when there are none)."""
    raw = stored = 0
    for h in headers:
        raw += packed_raw_size(h)
        stored += h.stored_len if h.flags & NODE_ZSTD else packed_raw_size(h)
    return raw / stored if stored else 1.0


def read_packed_body(
    file: SegmentFile, pos: int, header: NodeHeader, decompressor: zstandard.ZstdDecompressor
) -> NodeBody:
    """Read and check the packed node at `pos`. Raises CorruptionError on any mismatch."""
    stored = file.read(pos + NODE_PREFIX_SIZE, header.stored_len)
    return decode_packed_body(header, stored, decompressor)


def write_packed_segment(
    fs: FileSystem, path: Path, base: int, end: int, created_ms: int, nodes: Iterable[bytes]
) -> None:
    """Replace `path` with a packed segment covering offsets base..end-1 and holding `nodes`
    (encoded packed nodes), crash-safe (write, fsync, rename, fsync dir). The nodes are written
    as they come: a segment is never whole in memory. An error from `nodes` leaves `path` as it was.
    """

    def header(size: int) -> bytes:
        return SegmentHeader(base, end, size, created_ms, flags=SEGMENT_PACKED).encode()

    fs.write_file_atomic(path, nodes, head=header)
