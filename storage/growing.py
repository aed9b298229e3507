"""The growing node layout: the active node of a growing segment, written in place.

A growing node reserves its whole offset table up front (`slots` entries),
then its blob follows:

    header slot A, header slot B, offset table (4 * slots bytes), blob

Each append writes the new records, then the new table entries, then the
header slot the sequence number picks; the CRCs grow incrementally with the
table and blob. docs/FORMAT.md has the tables.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

from crc32c import crc32c

from storage.errors import CorruptionError
from storage.format import NODE_HEADER_SIZE, NODE_PREFIX_SIZE, NodeBody, NodeHeader, check_positions
from storage.fs import SegmentFile

if TYPE_CHECKING:  # segment.py reads growing nodes with the functions above GrowingNode
    from storage.segment import NodeRef, Segment


def plausible_growing(header: NodeHeader) -> bool:
    """A growing node's stored length is its whole table plus its blob."""
    return header.stored_len == 4 * header.slots + header.blob_len


def read_growing_body(file: SegmentFile, pos: int, header: NodeHeader) -> NodeBody:
    """Read and check the growing node at `pos`. Raises CorruptionError on any mismatch."""
    start = pos + NODE_PREFIX_SIZE
    table = file.read(start, 4 * header.count)
    blob = file.read(start + 4 * header.slots, header.blob_len)
    if crc32c(table) != header.body_crc or crc32c(blob) != header.blob_crc:
        raise CorruptionError("node CRC mismatch")
    positions = array("I")
    positions.frombytes(table)
    positions.append(header.blob_len)
    body = NodeBody(header.base_offset, positions, blob)
    check_positions(body)
    return body


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
        return cls(segment.ref_at(segment.end_pos, header), array("I", [0]))

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

    def make_room(self, entries: int, nbytes: int) -> bool:
        """Whether `entries` records of `nbytes` fit this node within its segment's capacity; when
        they do, the bytes they need are reserved on disk (DiskFullError if they cannot be)."""
        h = self.ref.header
        end = self.blob_start + h.blob_len + nbytes
        if h.count + entries > h.slots or end > self.ref.segment.capacity:
            return False
        self.ref.segment.reserve(end)
        return True

    def append(self, blob: bytes, positions: array, first_ts: int, last_ts: int, flags: int) -> None:
        """Write records whose positions already start at this node's blob length; `first_ts` and
        `last_ts` are the timestamps of the first and last of them."""
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
            min_ts=first_ts if h.count == 0 else h.min_ts,
            max_ts=last_ts,
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
