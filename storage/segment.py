"""Segment files and the nodes inside them.

A segment is a file named by the zero-padded offset of its first entry. It is
either *growing* (fixed size, preallocated, nodes appended in place, the last
node still being written) or *packed* (rewritten once full or compacted:
immutable, sized to its content, nodes usually zstd-compressed).
"""

from __future__ import annotations

import itertools
from array import array
from pathlib import Path

import zstandard
from crc32c import crc32c

from storage.errors import CorruptionError
from storage.format import (
    NODE_HEADER_SIZE,
    NODE_PREFIX_SIZE,
    NODE_SPARSE,
    SEGMENT_HEADER_SIZE,
    SEGMENT_PACKED,
    NodeBody,
    NodeHeader,
    SegmentHeader,
    check_positions,
    decode_packed_body,
    pick_header,
)
from storage.fs import FileSystem, SegmentFile

SEGMENT_SUFFIX = ".seg"
_uids = itertools.count(1)


def segment_name(base_offset: int) -> str:
    return f"{base_offset:020d}{SEGMENT_SUFFIX}"


class NodeRef:
    """Where a node lives and what its header says; the in-memory index holds these."""

    __slots__ = ("corrupt", "header", "pos", "segment")

    def __init__(self, segment: Segment, pos: int, header: NodeHeader) -> None:
        self.segment = segment
        self.pos = pos
        self.header = header
        self.corrupt = False

    @property
    def base_offset(self) -> int:
        return self.header.base_offset

    @property
    def end_offset(self) -> int:
        """One past the last offset this node covers (holes included for compacted nodes)."""
        h = self.header
        return h.base_offset + (h.slots if h.flags & NODE_SPARSE else h.count)

    @property
    def disk_size(self) -> int:
        return self.header.disk_size


class Segment:
    """One open segment file and its nodes, in offset order."""

    def __init__(self, file: SegmentFile, header: SegmentHeader) -> None:
        self.file = file
        self.header = header
        self.nodes: list[NodeRef] = []
        self.uid = next(_uids)  # cache key part: a rewritten file at the same path is a new segment
        self.end_pos = SEGMENT_HEADER_SIZE  # where the next node goes

    @property
    def path(self) -> Path:
        return self.file.path

    @property
    def base_offset(self) -> int:
        return self.header.base_offset

    @property
    def packed(self) -> bool:
        return self.header.packed

    def end_offset(self) -> int:
        """The offset that the next segment must start at."""
        if self.packed:
            return self.header.end_offset
        return self.nodes[-1].end_offset if self.nodes else self.base_offset

    @classmethod
    def create(cls, fs: FileSystem, directory: Path, base_offset: int, size: int, now_ms: int) -> Segment:
        header = SegmentHeader(base_offset, 0, size, now_ms)
        file = fs.create_segment(directory / segment_name(base_offset), size, header.encode())
        return cls(file, header)

    @classmethod
    def open(cls, fs: FileSystem, path: Path, *, writable: bool, verify: bool) -> tuple[Segment, str | None]:
        """Open a segment and index its node headers.

        With `verify`, every node body is checked against its CRCs too (the
        tail scan after an unclean shutdown). Returns the segment and, when
        the node chain stopped before the end of the written data, why.
        """
        file = fs.open_segment(path, writable)
        try:
            header = SegmentHeader.decode(file.read(0, SEGMENT_HEADER_SIZE))
        except CorruptionError:
            file.close()
            raise
        segment = cls(file, header)
        return segment, segment._scan(verify)

    @classmethod
    def salvage(cls, fs: FileSystem, path: Path, base_offset: int) -> Segment | None:
        """Open a segment whose header is damaged, trusting the base offset in its name.

        Nodes carry their own checksums, so the chain can be found without the header:
        try the growing layout, then the packed one. When nodes are found the header is
        rewritten (durably) and the segment is returned; otherwise None.
        """
        file = fs.open_segment(path, writable=True)
        for flags in (0, SEGMENT_PACKED):
            segment = cls(file, SegmentHeader(base_offset, 0, file.size, 0, flags))
            segment._scan(verify=True)
            if segment.nodes:
                end = segment.nodes[-1].end_offset if flags else 0
                segment.header = SegmentHeader(base_offset, end, file.size, 0, flags)
                file.write(0, segment.header.encode())
                file.sync()
                return segment
        file.close()
        return None

    def _scan(self, verify: bool) -> str | None:
        pos = SEGMENT_HEADER_SIZE
        expected = self.base_offset
        size = self.file.size
        while pos + NODE_PREFIX_SIZE <= size:
            prefix = self.file.read(pos, NODE_PREFIX_SIZE)
            candidates = pick_header(prefix[:NODE_HEADER_SIZE], prefix[NODE_HEADER_SIZE:])
            self.end_pos = pos  # where a cut, if any, falls: the end of the valid prefix
            if not candidates:
                if any(prefix):
                    return f"unreadable node header at byte {pos}"
                break  # zeros: the end of what was written
            chosen = None
            for header in candidates:
                if self._plausible(header, pos, expected) and (not verify or self._body_ok(pos, header)):
                    chosen = header
                    break
            if chosen is None:
                return f"node at byte {pos} (offset {expected}) failed its checks"
            if chosen is not candidates[0] and self.file.writable:
                # The newer slot describes an append that never fully landed. Erase it (durably),
                # or a later start that skips body checks would trust it.
                rejected = candidates[0].seq % 2
                self.file.write(pos + NODE_HEADER_SIZE * rejected, bytes(NODE_HEADER_SIZE))
                self.file.sync()
            ref = NodeRef(self, pos, chosen)
            self.nodes.append(ref)
            expected = ref.end_offset
            pos += chosen.disk_size
        self.end_pos = pos
        return None

    def _plausible(self, header: NodeHeader, pos: int, expected: int) -> bool:
        if header.count < 1 or pos + header.disk_size > self.file.size:
            return False
        if self.packed:
            return header.base_offset >= expected
        return header.base_offset == expected and header.stored_len == 4 * header.slots + header.blob_len

    def _body_ok(self, pos: int, header: NodeHeader) -> bool:
        try:
            self.read_body(NodeRef(self, pos, header), decompressor=None)
        except CorruptionError:
            return False
        return True

    def read_body(self, ref: NodeRef, decompressor) -> NodeBody:
        """Read and check one node's entries. Raises CorruptionError on any mismatch."""
        header = ref.header
        start = ref.pos + NODE_PREFIX_SIZE
        if self.packed:
            stored = self.file.read(start, header.stored_len)
            return decode_packed_body(header, stored, decompressor or zstandard.ZstdDecompressor())
        table = self.file.read(start, 4 * header.count)
        blob = self.file.read(start + 4 * header.slots, header.blob_len)
        if crc32c(table) != header.body_crc or crc32c(blob) != header.blob_crc:
            raise CorruptionError("node CRC mismatch")
        positions = array("I")
        positions.frombytes(table)
        positions.append(header.blob_len)
        body = NodeBody(header.base_offset, positions, blob)
        check_positions(body)
        return body

    def truncate_after(self, pos: int) -> None:
        """Zero everything from `pos` on, so no stale node beyond a cut can ever be read back."""
        chunk = 1 << 20
        zeros = bytes(chunk)
        while pos < self.file.size:
            n = min(chunk, self.file.size - pos)
            self.file.write(pos, zeros[:n])
            pos += n
        self.end_pos = min(self.end_pos, self.file.size)

    def close(self) -> None:
        self.file.close()


class GrowingNode:
    """The active node: entries are appended in place, then a header slot is rewritten.

    The two header slots are written alternately (by sequence number), so a
    torn header write leaves the previous header, and the prefix it
    describes, intact. The CRCs grow incrementally with the table and blob.
    """

    def __init__(self, ref: NodeRef, positions: array) -> None:
        self.ref = ref
        self.positions = positions  # count+1 entries: the last is the blob length

    @classmethod
    def start(cls, segment: Segment, slots: int, base_offset: int) -> GrowingNode:
        header = NodeHeader(0, 0, base_offset, slots, 0, 4 * slots, 0, 0, 0, 0)
        ref = NodeRef(segment, segment.end_pos, header)
        return cls(ref, array("I", [0]))

    @classmethod
    def resume(cls, ref: NodeRef) -> GrowingNode:
        table = ref.segment.file.read(ref.pos + NODE_PREFIX_SIZE, 4 * ref.header.count)
        positions = array("I")
        positions.frombytes(table)
        positions.append(ref.header.blob_len)
        return cls(ref, positions)

    @property
    def count(self) -> int:
        return self.ref.header.count

    @property
    def blob_start(self) -> int:
        return self.ref.pos + NODE_PREFIX_SIZE + 4 * self.ref.header.slots

    def room(self, entries: int, nbytes: int) -> bool:
        h = self.ref.header
        return (
            h.count + entries <= h.slots
            and self.blob_start + h.blob_len + nbytes <= self.ref.segment.file.size
        )

    def append(self, blob: bytes, positions: array, timestamp_ms: int, flags: int) -> None:
        """Write a batch whose positions already start at this node's blob length."""
        h = self.ref.header
        file = self.ref.segment.file
        file.write(self.blob_start + h.blob_len, blob)
        table = positions[:-1].tobytes()
        file.write(self.ref.pos + NODE_PREFIX_SIZE + 4 * h.count, table)
        count = h.count + len(positions) - 1
        header = NodeHeader(
            seq=h.seq + 1,
            count=count,
            base_offset=h.base_offset,
            slots=h.slots,
            blob_len=positions[-1],
            stored_len=4 * h.slots + positions[-1],
            body_crc=crc32c(table, h.body_crc),
            blob_crc=crc32c(blob, h.blob_crc),
            min_ts=timestamp_ms if h.count == 0 else h.min_ts,
            max_ts=timestamp_ms,
            flags=h.flags | flags,
        )
        file.write(self.ref.pos + NODE_HEADER_SIZE * (header.seq % 2), header.encode())
        self.ref.header = header
        del self.positions[-1]
        self.positions.extend(positions)
        self.ref.segment.end_pos = self.ref.pos + header.disk_size

    def body(self) -> NodeBody:
        """The node's entries as they stand now (a copy of the blob)."""
        h = self.ref.header
        blob = self.ref.segment.file.read(self.blob_start, h.blob_len)
        return NodeBody(h.base_offset, array("I", self.positions), blob)

    def slice(self, lo: int, hi: int) -> bytes:
        """Records lo..hi-1 straight from the mapping."""
        start = self.positions[lo]
        return self.ref.segment.file.read(self.blob_start + start, self.positions[hi] - start)
