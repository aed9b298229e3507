"""The growing node layout: the active node of a growing segment, written in place.

A growing node reserves its whole offset table up front (`slots` entries),
then its blob follows:

    header slot A, header slot B, offset table (4 * slots bytes), blob

Each append writes the new records, then the new table entries, then the
header slot the sequence number picks; the CRCs grow incrementally with the
table and blob. The slot of the last header a sync made durable is never
overwritten before a newer one is durable (`durable_seq`). docs/FORMAT.md has
the tables.
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

NO_SLOT = 2  # no header slot is kept: a node none of whose headers is durable yet


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

    A header goes into the slot its sequence number picks (seq % 2). While
    no header of the node is durable the slots alternate, so a torn header
    write leaves the previous header, and the prefix it describes, intact.
    Once one is (`durable_seq`, set by the sync that covered it), an append
    whose seq would land in its slot skips a number: appends between syncs
    keep rewriting the other slot, and a power loss that keeps their
    headers but not their bodies falls back to the durable one (recovery
    takes the highest valid seq, whichever slot holds it). The CRCs grow
    incrementally with the table and blob.
    """

    def __init__(self, ref: NodeRef, positions: array, durable_seq: int) -> None:
        self.ref = ref
        self.positions = positions  # count+1 entries: the last is the blob length
        # A sync began while its header was not durable yet: until it ends, that header's slot and
        # the durable one's are both kept, so the stream appends into a new node (everysec, no) or
        # waits for the sync to end (always).
        self.in_sync = False
        self.set_durable(durable_seq)

    @classmethod
    def start(cls, segment: Segment, slots: int, base_offset: int) -> GrowingNode:
        header = NodeHeader(0, 0, base_offset, slots, 0, 4 * slots, 0, 0, 0, 0)
        return cls(segment.ref_at(segment.end_pos, header), array("I", [0]), durable_seq=0)

    @classmethod
    def resume(cls, ref: NodeRef) -> GrowingNode:
        """The node `ref` as appends go on in it, its header taken as durable (the stream makes it
        so: a clean close, a recovery, a truncation; a hand-off taken back says otherwise)."""
        table = ref.segment.file.read(ref.pos + NODE_PREFIX_SIZE, 4 * ref.header.count)
        positions = array("I")
        positions.frombytes(table)
        positions.append(ref.header.blob_len)
        return cls(ref, positions, ref.header.seq)

    def set_durable(self, seq: int) -> None:
        """The header with `seq` is the node's last durable one (0: none is): appends keep its slot."""
        self.durable_seq = seq
        self._kept_slot = seq % 2 if seq else NO_SLOT

    def made_durable(self, seq: int) -> None:
        """A sync that began when this node's header had `seq` (0: no header yet) completed. It
        vouches for that header only if no append rewrote its slot meanwhile (the header still has
        `seq`); otherwise the header kept so far stays the last durable one."""
        if self.ref.header.seq == seq and seq > self.durable_seq:
            self.set_durable(seq)

    @property
    def count(self) -> int:
        return self.ref.header.count

    @property
    def blob_start(self) -> int:
        return self.ref.pos + NODE_PREFIX_SIZE + 4 * self.ref.header.slots

    def make_room(self, entries: int, nbytes: int) -> bool:
        """Whether `entries` records of `nbytes` fit this node within its segment's capacity; when
        they do, the bytes they need are reserved on disk (DiskFullError if they cannot be)."""
        ref = self.ref
        h = ref.header
        if h.count + entries > h.slots:
            return False
        end = ref.pos + NODE_PREFIX_SIZE + 4 * h.slots + h.blob_len + nbytes  # blob_start, inline
        segment = ref.segment
        if end <= segment.file.reserved:
            return True  # on disk already (most appends): within the capacity, nothing to reserve
        if end > segment.capacity:
            return False
        segment.reserve(end)
        return True

    def append(self, blob: bytes, positions: array, first_ts: int, last_ts: int, flags: int) -> None:
        """Write records whose positions already start at this node's blob length; `first_ts` and
        `last_ts` are the timestamps of the first and last of them."""
        ref = self.ref
        h = ref.header
        pos = ref.pos
        segment = ref.segment
        file = segment.file
        table = positions[:-1].tobytes()
        seq = h.seq + 1
        if seq % 2 == self._kept_slot:  # never over the last durable header: skip a number
            seq += 1
        blob_len = positions[-1]
        header = NodeHeader(
            seq,
            h.count + len(positions) - 1,
            h.base_offset,
            h.slots,
            blob_len,
            4 * h.slots + blob_len,
            crc32c(table, h.body_crc),
            crc32c(blob, h.blob_crc),
            first_ts if h.count == 0 else h.min_ts,
            last_ts,
            h.flags | flags,
        )
        if h.count == 0 and seq == 1:
            # A fresh node (a new stream's): nothing from its second header slot to its blob's end
            # was ever written, so one write (header, table, unused slots, blob) puts nothing
            # durable at risk; the first slot, which a later header may be kept in, is not touched.
            # A write torn in flight leaves a header whose body fails its checks: a torn tail, cut.
            unused = bytes(4 * (h.slots - header.count))
            file.write(pos + NODE_HEADER_SIZE, b"".join((header.encode(), table, unused, blob)))
        else:  # records, table entries, then the header: a header is never ahead of its body
            table_start = pos + NODE_PREFIX_SIZE
            file.write(table_start + 4 * h.slots + h.blob_len, blob)  # blob_start, inline
            file.write(table_start + 4 * h.count, table)
            file.write(pos + NODE_HEADER_SIZE * (seq % 2), header.encode())
        ref.header = header
        del self.positions[-1]
        self.positions.extend(positions)
        segment.end_pos = pos + header.disk_size

    def body(self) -> NodeBody:
        """The node's entries as they stand now (a copy of the blob)."""
        h = self.ref.header
        blob = self.ref.segment.file.read(self.blob_start, h.blob_len)
        return NodeBody(h.base_offset, array("I", self.positions), blob)

    def slice(self, lo: int, hi: int) -> bytes:
        """Records lo..hi-1 straight from the mapping."""
        start = self.positions[lo]
        return self.ref.segment.file.read(self.blob_start + start, self.positions[hi] - start)
