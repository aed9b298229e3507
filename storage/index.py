"""A stream's in-memory node index: seeking an offset or a time is a bisect over node headers.

It holds the retained nodes in offset order, with their base offsets and max
timestamps in arrays (8 bytes a node), and is rebuilt at start-up from the
node headers alone. The stream owns it and guards it with its lock.
"""

from __future__ import annotations

import itertools
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterable

from storage.format import NODE_DELAYED, NODE_SPARSE
from storage.results import EntriesMeta
from storage.segment import NodeRef, Segment


class NodeIndex:
    __slots__ = ("_gaps", "bases", "max_ts", "nodes")

    def __init__(self, refs: Iterable[NodeRef] = ()) -> None:
        self.nodes: list[NodeRef] = []  # retained nodes in offset order
        self.bases = array("q")  # their base offsets, for bisect
        self.max_ts = array("q")  # their max timestamps (non-decreasing), for seek by time
        # Whether a node is sparse or does not start where the one before it ends: kept as nodes
        # come (a stream's close asks, issue 17); None: not known, looked for by has_holes.
        self._gaps: bool | None = False
        for ref in refs:
            self.append(ref)

    def __len__(self) -> int:
        return len(self.nodes)

    def append(self, ref: NodeRef) -> None:
        """Add the node after the last (sealed now: its end is final)."""
        nodes = self.nodes
        if not nodes:
            self._gaps = bool(ref.header.flags & NODE_SPARSE)
        elif self._gaps is False:
            self._gaps = bool(ref.header.flags & NODE_SPARSE) or nodes[-1].end_offset != ref.base_offset
        nodes.append(ref)
        self.bases.append(ref.base_offset)
        self.max_ts.append(ref.header.max_ts)

    def grew(self, timestamp_ms: int) -> None:
        """The last node took entries appended at `timestamp_ms`."""
        self.max_ts[-1] = timestamp_ms

    def drop_first(self, k: int) -> None:
        """Forget the first k nodes (retention passed them)."""
        del self.nodes[:k]
        del self.bases[:k]
        del self.max_ts[:k]
        if self._gaps:  # (none left, maybe)
            self._gaps = None if self.nodes else False

    def replace_segments(self, old: list[Segment], fresh: Iterable[NodeRef]) -> None:
        """Segments `old` were rewritten: their nodes give way to `fresh` ones."""
        keep = [ref for ref in self.nodes if ref.segment not in old]
        self.nodes, self.bases, self.max_ts, self._gaps = [], array("q"), array("q"), False
        for ref in sorted([*keep, *fresh], key=lambda r: r.base_offset):
            self.append(ref)

    def clear(self) -> None:
        self.drop_first(len(self.nodes))

    def last_at_or_before(self, offset: int) -> int:
        """Index of the last node whose base is at or before `offset` (-1 if none)."""
        return bisect_right(self.bases, offset) - 1

    def holding(self, offset: int) -> int:
        """Index of the node a forward scan for `offset` starts at (0 when it precedes every node)."""
        return max(bisect_right(self.bases, offset) - 1, 0)

    def describe(self, start: int, stop: int) -> EntriesMeta:
        """What the headers of the nodes holding offsets start..stop-1 say (see EntriesMeta)."""
        nodes = self.nodes
        delayed, max_ts = False, 0
        i = self.holding(start)
        while i < len(nodes):
            header = nodes[i].header
            if header.base_offset >= stop:
                break
            delayed = delayed or bool(header.flags & NODE_DELAYED)
            max_ts = max(max_ts, header.max_ts)
            i += 1
        return EntriesMeta(delayed, max_ts)

    def first_reaching(self, timestamp_ms: int) -> int:
        """Index of the first node whose newest entry is at or after `timestamp_ms`."""
        return bisect_left(self.max_ts, timestamp_ms)

    def base_after(self, offset: int) -> int | None:
        """The base offset of the first node after `offset`, if any."""
        i = bisect_right(self.bases, offset)
        return self.bases[i] if i < len(self.bases) else None

    def mark_holes(self) -> None:
        """A node failed its checks: offsets are missing now."""
        self._gaps = True

    def has_holes(self, first_offset: int, damaged: bool) -> bool:
        """Whether any offset from first_offset on is missing (compaction or damage): the gaps
        between nodes as kept, the stream's first offset and damage as they are now."""
        nodes = self.nodes
        if damaged or (nodes and nodes[0].base_offset > first_offset):
            return True
        if self._gaps is None:
            self._gaps = any(ref.header.flags & NODE_SPARSE for ref in nodes) or any(
                a.end_offset != b.base_offset for a, b in itertools.pairwise(nodes)
            )
        return self._gaps
