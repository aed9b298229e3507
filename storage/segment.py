"""Segment files and the nodes inside them.

A segment is a file named by the zero-padded offset of its first entry
(storage/layout.py). It is either *growing* (nodes appended in place, the last
node still being written: storage/growing.py; the file starts small and grows
in steps up to its capacity, each step reserved on disk before it is mapped) or
*packed* (rewritten once full, compacted or merged: immutable, sized to its
content, nodes usually zstd-compressed: storage/packed.py). This module finds
and checks the chain of nodes in a file, whatever its layout; `NodeRef` is
where a node lives, `NodeView` its entries as the read path sees them.
"""

from __future__ import annotations

import itertools
import logging
from array import array
from bisect import bisect_left
from collections.abc import Callable
from pathlib import Path

import zstandard

from storage.cleanmark import SyncedEnd
from storage.errors import CorruptionError
from storage.format import (
    NODE_HEADER_SIZE,
    NODE_PREFIX_SIZE,
    NODE_SPARSE,
    PACKED_SEGMENT_VERSION,
    SEGMENT_HEADER_SIZE,
    SEGMENT_PACKED,
    NodeBody,
    NodeHeader,
    SegmentHeader,
    pick_header,
)
from storage.fs import FileSystem, SegmentFile
from storage.growing import plausible_growing, read_growing_body
from storage.layout import segment_name
from storage.packed import read_packed_body
from storage.records import record_offset_and_timestamp
from storage.results import Gap
from storage.types import GapReason

log = logging.getLogger("streamlog.storage")
_uids = itertools.count(1)
PAGE = 4096  # growing files are sized in whole pages: the disk allocates no less


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


class _MarkMismatch(Exception):
    """The SYNCED marker does not describe this segment's node chain."""


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

    def damage(self) -> Gap:
        """The range this node covers, as the damage its failed checks cause."""
        return Gap(self.base_offset, self.end_offset, GapReason.CORRUPT)

    def mark_corrupt(self, stream: str, exc: Exception) -> bool:
        """Flag the node as failing its checks; True the first time (the caller records the damage)."""
        if self.corrupt:
            return False
        self.corrupt = True
        log.error(
            "stream %r: node at offsets %d..%d is corrupt (%s)",
            stream,
            self.base_offset,
            self.end_offset,
            exc,
        )
        return True


class NodeView:
    """A node's entries as the read path sees them, whether the active node or a decoded one."""

    __slots__ = ("base", "deltas", "positions", "slice")

    def __init__(
        self, base: int, positions: array, deltas: array | None, slice_: Callable[[int, int], bytes]
    ):
        self.base = base
        self.positions = positions
        self.deltas = deltas
        self.slice = slice_  # records lo..hi-1, back to back

    @property
    def count(self) -> int:
        return len(self.positions) - 1

    def offset_at(self, index: int) -> int:
        return self.base + (self.deltas[index] if self.deltas is not None else index)

    def index_of(self, offset: int) -> int:
        """Index of the first entry whose offset is >= `offset`."""
        if self.deltas is None:
            return min(max(offset - self.base, 0), self.count)
        return bisect_left(self.deltas, offset - self.base)

    def first_at_or_after(self, timestamp_ms: int) -> int:
        """Index of the first entry appended at or after `timestamp_ms` (count if none)."""
        lo, hi = 0, self.count
        while lo < hi:
            mid = (lo + hi) // 2
            _, ts = record_offset_and_timestamp(self.slice(mid, mid + 1), 0)
            if ts < timestamp_ms:
                lo = mid + 1
            else:
                hi = mid
        return lo


class Segment:
    """One open segment file and its nodes, in offset order."""

    def __init__(self, file: SegmentFile, header: SegmentHeader) -> None:
        self.file = file
        self.header = header
        self.nodes: list[NodeRef] = []
        self.uid = next(_uids)  # cache key part: a rewritten file at the same path is a new segment
        self.end_pos = header.size  # where the next node goes

    @property
    def path(self) -> Path:
        return self.file.path

    @property
    def base_offset(self) -> int:
        return self.header.base_offset

    @property
    def packed(self) -> bool:
        return self.header.packed

    @property
    def capacity(self) -> int:
        """The size a growing segment may grow to (a version-1 file was created at it)."""
        return max(self.header.capacity, self.file.size)

    def reserve(self, end: int) -> None:
        """Make bytes up to `end` (at most the capacity) writable: grow the file, doubling it
        (a stream's cost follows what it holds, and a big one grows in few steps)."""
        file = self.file
        if end > file.reserved:
            file.reserve(end if end <= file.size else min(self.capacity, max(_pages(end), 2 * file.size)))

    def ref_at(self, pos: int, header: NodeHeader) -> NodeRef:
        return NodeRef(self, pos, header)

    def end_offset(self) -> int:
        """The offset that the next segment must start at."""
        if self.packed:
            return self.header.end_offset
        return self.nodes[-1].end_offset if self.nodes else self.base_offset

    @classmethod
    def create(
        cls,
        fs: FileSystem,
        directory: Path,
        base_offset: int,
        first_bytes: int,
        capacity: int,
        now_ms: int,
        *,
        durable: bool = True,
    ) -> Segment:
        """A new growing segment whose file starts large enough for `first_bytes` (its header
        included), in whole pages, and may grow to `capacity`."""
        header = SegmentHeader(base_offset, 0, capacity, now_ms)
        size = min(capacity, _pages(first_bytes))
        file = fs.create_segment(
            directory / segment_name(base_offset), size, header.encode(), durable=durable
        )
        return cls(file, header)

    @classmethod
    def open(
        cls, fs: FileSystem, path: Path, *, writable: bool, verify: bool, synced: SyncedEnd | None = None
    ) -> tuple[Segment, str | None]:
        """Open a segment and index its node headers.

        With `verify`, every node body is checked against its CRCs too (the
        tail scan after an unclean shutdown), except the prefix that `synced`
        (the SYNCED marker, storage/cleanmark.py) names if it is this segment's
        and agrees with the chain. Returns the segment and, when the node chain
        stopped before the end of the written data, why.
        """
        file = fs.open_segment(path, writable)
        try:
            header = SegmentHeader.decode(file.read(0, SEGMENT_HEADER_SIZE))
        except CorruptionError:
            file.close()
            raise
        segment = cls(file, header)
        if synced is not None and (synced.base_offset, synced.created_ms) == (
            header.base_offset,
            header.created_ms,
        ):
            if header.packed:
                return segment, segment._scan(verify=False)  # written whole and synced: as marked
            try:
                return segment, segment._scan(verify, synced)
            except _MarkMismatch as exc:
                log.warning(
                    "segment %s: the SYNCED marker is not trusted (%s): checking every node", path, exc
                )
                segment.nodes.clear()
        return segment, segment._scan(verify)

    @classmethod
    def over(cls, file: SegmentFile, *, verify: bool) -> tuple[Segment, str | None]:
        """A segment over a file already open (a slot's: storage/packs.py), its node chain indexed
        as `open` indexes one with no SYNCED marker to trust (CorruptionError: a damaged header).
        Returns the segment and, when the chain stopped before the end of the written data, why."""
        segment = cls(file, SegmentHeader.decode(file.read(0, SEGMENT_HEADER_SIZE)))
        return segment, segment._scan(verify)

    @classmethod
    def salvage(cls, fs: FileSystem, path: Path, base_offset: int) -> Segment | None:
        """Open a segment whose header is damaged, trusting the base offset in its name.

        Nodes carry their own checksums, so the chain can be found without the header: try the
        growing layout, then the packed one, then the growing one past a SYNCED slot. When nodes
        are found the header is rewritten (durably) and the segment is returned; otherwise None.
        """
        file = fs.open_segment(path, writable=True)
        # The layouts whose first node is at byte 64 first: read from there, a version 3 file
        # shows its SYNCED slot (or zeros), never a node header.
        for flags, version in ((0, PACKED_SEGMENT_VERSION), (SEGMENT_PACKED, PACKED_SEGMENT_VERSION), (0, 3)):
            segment = cls(file, SegmentHeader(base_offset, 0, file.size, 0, flags, version))
            segment._scan(verify=True)
            if segment.nodes:
                end = segment.nodes[-1].end_offset if flags else 0
                segment.header = SegmentHeader(base_offset, end, file.size, 0, flags, version)
                file.write(0, segment.header.encode())
                file.sync()
                return segment
        file.close()
        return None

    def _scan(self, verify: bool, synced: SyncedEnd | None = None) -> str | None:
        """Index the node chain (checking bodies with `verify`); with `synced`, the nodes before
        its node are trusted, its header too where a slot still holds it (else, if the slots
        fail, it is put back once its body checks out), and the nodes past it are checked.
        Raises _MarkMismatch if the chain does not reach the marked node."""
        marked = synced.node_header if synced is not None else None
        mark_pos = synced.node_pos if synced is not None and marked is not None else 0
        reached = not mark_pos
        pos = self.header.size
        expected = self.base_offset
        size = self.file.size
        while pos + NODE_PREFIX_SIZE <= size and (reached or pos <= mark_pos):
            prefix = self.file.read(pos, NODE_PREFIX_SIZE)
            candidates = pick_header(prefix[:NODE_HEADER_SIZE], prefix[NODE_HEADER_SIZE:])
            at_mark = marked is not None and pos == mark_pos
            on_disk = at_mark and marked in candidates
            if marked is not None and at_mark and not on_disk:
                # Newer slots first, then the marked state (its bytes were synced before the marker).
                candidates = sorted([*candidates, marked], key=lambda h: h.seq, reverse=True)
            reached = reached or at_mark
            self.end_pos = pos  # where a cut, if any, falls: the end of the valid prefix
            if not candidates:
                if any(prefix) and reached:
                    return f"unreadable node header at byte {pos}"
                break  # zeros: the end of what was written (or a marker not to trust: below)
            chosen = None
            for header in candidates:
                trusted = pos < mark_pos or (on_disk and header == marked)
                if self._plausible(header, pos, expected) and (
                    trusted or not verify or self._body_ok(pos, header)
                ):
                    chosen = header
                    break
            if chosen is None:
                if pos <= mark_pos:
                    raise _MarkMismatch(f"the node at byte {pos} fails its checks")
                return f"node at byte {pos} (offset {expected}) failed its checks"
            if (
                chosen is not candidates[0] or (at_mark and not on_disk and chosen is marked)
            ) and self.file.writable:
                # The newer slot describes an append that never fully landed. Erase it (durably),
                # or a later start that skips body checks would trust it; a marked header that no
                # slot holds any more goes back into its own.
                mine = chosen.seq % 2
                self.file.write(pos + NODE_HEADER_SIZE * (1 - mine), bytes(NODE_HEADER_SIZE))
                self.file.write(pos + NODE_HEADER_SIZE * mine, chosen.encode())
                self.file.sync()
            ref = NodeRef(self, pos, chosen)
            self.nodes.append(ref)
            expected = ref.end_offset
            pos += chosen.disk_size
        if not reached:
            raise _MarkMismatch(f"the node chain does not reach byte {mark_pos}")
        self.end_pos = pos
        left = size - pos
        if verify and not self.packed and 0 < left < NODE_PREFIX_SIZE and any(self.file.read(pos, left)):
            # Bytes past the chain too few for a node's header slots: a write past the file's end
            # that a power loss kept while it took back the growth step before it. Cut, or once the
            # file grows a new node here keeps that stale header in the slot it does not write.
            return f"a partial node at byte {pos}"
        return None

    def _plausible(self, header: NodeHeader, pos: int, expected: int) -> bool:
        if header.count < 1 or pos + header.disk_size > self.file.size:
            return False
        if self.packed:
            return header.base_offset >= expected
        return header.base_offset == expected and plausible_growing(header)

    def _body_ok(self, pos: int, header: NodeHeader) -> bool:
        try:
            self.read_body(NodeRef(self, pos, header), decompressor=None)
        except CorruptionError:
            return False
        return True

    def read_body(self, ref: NodeRef, decompressor: zstandard.ZstdDecompressor | None) -> NodeBody:
        """Read and check one node's entries. Raises CorruptionError on any mismatch."""
        if self.packed:
            return read_packed_body(
                self.file, ref.pos, ref.header, decompressor or zstandard.ZstdDecompressor()
            )
        return read_growing_body(self.file, ref.pos, ref.header)

    def truncate_after(self, pos: int) -> None:
        """Zero everything from `pos` on, so no stale node beyond a cut can ever be read back."""
        self.file.reserve(self.file.size)
        chunk = 1 << 20
        zeros = bytes(chunk)
        while pos < self.file.size:
            n = min(chunk, self.file.size - pos)
            self.file.write(pos, zeros[:n])
            pos += n
        self.end_pos = min(self.end_pos, self.file.size)

    def close(self, close_file: bool = True) -> None:
        """Let go of its nodes and, unless `close_file` is False (the caller closes it), its file."""
        if close_file:
            self.file.close()
        # Its node refs point back to it: dropped, so it is freed by its last reference, not left
        # to the collector's full passes (a closed stream's segments, issue 17).
        self.nodes = []
