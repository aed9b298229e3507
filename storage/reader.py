"""The stream's read paths: forward reads (the hot path), reverse reads, seeking a
time, counting entries.

They take the stream and scan its node index; `Stream.read` holds its lock around
the forward and reverse reads, the others take it themselves.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import TYPE_CHECKING

from storage.errors import CorruptionError
from storage.format import NODE_SPARSE
from storage.results import Gap, ReadResult
from storage.types import GapReason

if TYPE_CHECKING:
    from storage.stream import Stream


def read_forward(stream: Stream, offset: int, count: int, max_bytes: int) -> ReadResult:
    end, first = stream.visible_end, stream.first_offset
    gap = Gap(offset, first, GapReason.EVICTED) if offset < first else None
    start = max(offset, first)
    records: list[bytes] = []
    taken = size = 0
    last = None
    nodes = stream.index.nodes
    i = max(bisect_right(stream.index.bases, start) - 1, 0)  # index.holding(start), inline: the hot path
    while count > taken and start < end and i < len(nodes):
        ref = nodes[i]
        i += 1
        if ref.end_offset <= start:
            continue
        if ref.base_offset >= end:
            break
        try:
            view = stream.view(ref)
        except CorruptionError as exc:
            if taken:
                break
            gap = stream.corrupt(ref, exc)
            start = ref.end_offset
            continue
        lo, hi = view.index_of(start), view.index_of(end)
        if lo >= hi:
            continue
        if not taken and gap is None and view.offset_at(lo) > start:
            gap = Gap(start, view.offset_at(lo), _hole_reason(stream, start))
        hi = min(hi, lo + count - taken)
        budget_stop = False
        if max_bytes:
            limit = view.positions[lo] + max_bytes - size
            fit = bisect_right(view.positions, limit, lo, hi + 1) - 1
            if fit < hi:
                hi, budget_stop = max(fit, lo if taken else lo + 1), True
        if hi > lo:
            chunk = view.slice(lo, hi)
            records.append(chunk)
            taken += hi - lo
            size += len(chunk)
            last = view.offset_at(hi - 1)
            start = last + 1
        if budget_stop:
            break
    if count and not taken and gap is None and start < end:
        gap = Gap(start, end, _hole_reason(stream, start))  # nothing left but a hole
    # Where the reader continues: after the last entry, else after the gap, else where it asked.
    resume = last + 1 if last is not None else offset if gap is None else max(offset, gap.end_offset)
    return ReadResult(records, taken, first, end, resume, gap, last)


def read_backward(stream: Stream, offset: int, count: int, max_bytes: int) -> ReadResult:
    end, first = stream.visible_end, stream.first_offset
    if offset < first:
        return ReadResult([], 0, first, end, -1, Gap(offset, first, GapReason.EVICTED), None)
    start = min(offset, end - 1)  # the highest offset wanted
    records: list[bytes] = []
    taken = size = 0
    last = None
    nodes = stream.index.nodes
    i = stream.index.last_at_or_before(start)
    while count > taken and i >= 0 and start >= first:
        ref = nodes[i]
        i -= 1
        try:
            view = stream.view(ref)
        except CorruptionError as exc:
            if taken:
                break
            stream.corrupt(ref, exc)
            continue
        hi = view.index_of(start + 1)
        lo = view.index_of(first)
        positions = view.positions
        for j in range(hi - 1, max(lo, hi - (count - taken)) - 1, -1):
            length = positions[j + 1] - positions[j]
            if max_bytes and taken and size + length > max_bytes:
                return ReadResult(records, taken, first, end, _before(last, first), None, last)
            records.append(view.slice(j, j + 1))
            taken += 1
            size += length
            last = view.offset_at(j)
        if last is not None:
            start = last - 1
    return ReadResult(records, taken, first, end, _before(last, first), None, last)


def seek_time(stream: Stream, timestamp_ms: int) -> int:
    with stream.lock:
        end = stream.visible_end
        nodes = stream.index.nodes
        i = stream.index.first_reaching(timestamp_ms)
        while i < len(nodes) and nodes[i].base_offset < end:
            ref = nodes[i]
            i += 1
            try:
                view = stream.view(ref)
            except CorruptionError as exc:
                stream.corrupt(ref, exc)
                continue
            lo = view.first_at_or_after(timestamp_ms)
            if lo < view.count:
                return min(max(view.offset_at(lo), stream.first_offset), end)
        return end


def count_entries(stream: Stream, start: int, end: int) -> int:
    with stream.lock:
        start = max(start, stream.first_offset)
        end = min(end, stream.visible_end)
        if start >= end:
            return 0
        if not stream.index.has_holes(stream.first_offset, bool(stream.damaged)):
            return end - start
        total = 0
        nodes = stream.index.nodes
        for ref in nodes[stream.index.holding(start) :]:
            if ref.base_offset >= end:
                break
            if ref.end_offset <= start or ref.corrupt:
                continue
            if ref.header.flags & NODE_SPARSE:
                view = stream.view(ref)
                total += view.index_of(end) - view.index_of(start)
            else:
                total += min(end, ref.end_offset) - max(start, ref.base_offset)
        return total


def _before(last: int | None, first: int) -> int:
    """Where a reverse read continues: below its last entry, or -1 when nothing older remains."""
    return -1 if last is None or last - 1 < first else last - 1


def _hole_reason(stream: Stream, offset: int) -> GapReason:
    damaged = any(g.start_offset <= offset < g.end_offset for g in stream.damaged)
    return GapReason.CORRUPT if damaged else GapReason.COMPACTED
