"""Replica chunks: a stream's stored records as a follower copies them (Kafka's fetch, in storage).

`read_chunk` hands out records exactly as stored, from an offset, whatever
the commit cap (followers need entries not yet committed), with what a
follower needs to append them without decoding each one: their boundaries,
and per run of records that the leader keeps in one node, its offsets, first
and last timestamps and node flags, plus the idempotent batches that end in
the chunk. `append_chunk` writes a chunk at the follower's end as it is
(timestamps as recorded, never re-stamped), records its producers for
deduplication and returns once it is as durable as the stream's fsync
policy promises. The follower's copy then reads back byte for byte as the
leader's.

A chunk covers the offsets from where it was asked (the follower's end) to
its `end_offset`, holes included: compaction on the leader removed records
inside the log, so its runs may start past the chunk's first offset and
leave gaps between them, and its end may lie past its last record (a hole
up to the next epoch's start). `append_chunk` writes a chunk without holes
into the growing tail as appends do; one with holes as a sealed, packed
segment with sparse nodes (as compaction writes them), so the follower's
copy gets the same holes and reads back the same offsets and gaps. A chunk
stops before a range the leader lost to damage (that is no hole to copy).
The checks `append_chunk` makes (offsets, boundaries, timestamps, runs)
keep a malformed chunk from being written; the records' own bytes are
trusted as the leader stored them.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate, chain, islice, repeat
from operator import add, lt, sub
from typing import TYPE_CHECKING

from storage.dedup import BatchRecord
from storage.errors import CorruptionError, InvalidArgumentError, OffsetMismatchError, PreconditionError
from storage.format import NODE_CARRIED_FLAGS, NODE_PRODUCER, NodeBody
from storage.nodewriter import write_packed, write_records
from storage.records import find_producers, record_offset_and_timestamp
from storage.types import FsyncPolicy

if TYPE_CHECKING:
    from storage.stream import Stream


@dataclass(frozen=True, slots=True)
class ReplicaRun:
    """Records of a chunk that the leader keeps in one node: contiguous offsets, one byte range."""

    first_offset: int
    count: int
    first_ts: int  # timestamp of its first record (timestamps never decrease along a stream)
    last_ts: int  # timestamp of its last record
    flags: int  # NODE_DELAYED / NODE_PRODUCER, as the leader's node has them


@dataclass(frozen=True, slots=True)
class ProducerMark:
    """An idempotent batch that ends in the chunk (what the follower's dedup table needs)."""

    producer_id: str
    sequence: int
    last_offset: int
    timestamp_ms: int


@dataclass(frozen=True, slots=True)
class ReplicaChunk:
    """Stored records covering `first_offset` up to `end_offset`, back to back in `records`: record
    i spans records[positions[i]:positions[i+1]]; their offsets are the runs'. Offsets of the range
    that no run holds are holes. Empty (no runs, `end_offset == first_offset`) when there is
    nothing past the offset."""

    first_offset: int
    records: bytes
    positions: array  # array('I'), count+1 boundaries, from 0 to len(records)
    runs: tuple[ReplicaRun, ...]
    producers: tuple[ProducerMark, ...]
    log_end: int  # the leader's end offset when it was read
    end_offset: int  # where the copy ends once the chunk is appended (past its last record over a hole)

    @property
    def count(self) -> int:
        return len(self.positions) - 1

    @property
    def dense(self) -> bool:
        """No hole: the runs hold every offset from first_offset to end_offset."""
        return self.end_offset == self.first_offset + self.count and (
            not self.runs or self.runs[0].first_offset == self.first_offset
        )


def read_chunk(stream: Stream, offset: int, max_bytes: int, stop: int | None = None) -> ReplicaChunk:
    """Records from `offset` up to about `max_bytes` (always one at least, if there is one), and
    not at or past `stop` if given (a leader stops a chunk where the next epoch starts), with the
    holes between them: the chunk ends after its last record, or at `stop` (or the stream's end)
    when only holes are left before it."""
    if offset < 0 or max_bytes < 1:
        raise InvalidArgumentError("offset must not be negative and max_bytes must be positive")
    with stream.lock:
        log_end = end = stream.end_offset
        if offset < stream.first_offset or offset > end:
            raise PreconditionError(
                f"offset {offset} is outside stream {stream.name!r} ({stream.first_offset}..{end})"
            )
        if stop is not None:
            end = max(offset, min(end, stop))
        parts: list[bytes] = []
        positions = array("I", [0])
        runs: list[ReplicaRun] = []
        producers: list[ProducerMark] = []
        start = covered = offset  # the next offset to look at; the chunk's end so far
        size = 0
        nodes = stream.index.nodes
        i = stream.index.holding(start)
        full = False  # stopped by the byte budget, or before damage: the chunk ends at its last record
        while start < end and i < len(nodes):
            ref = nodes[i]
            if ref.end_offset <= start:
                i += 1
                continue
            if ref.base_offset >= end:
                break  # only holes are left before the end
            if size >= max_bytes:
                full = True
                break
            try:
                view = stream.view(ref)
            except CorruptionError:
                if runs:
                    full = True
                    break
                raise
            lo, limit = view.index_of(start), view.index_of(end)
            if lo >= limit:
                i += 1
                continue
            if view.offset_at(lo) != start and _damaged(stream, start, view.offset_at(lo)):
                full = True
                break  # a range lost to damage is no hole to copy: the chunk stops before it
            start = view.offset_at(lo)
            hi = limit
            deltas = view.deltas
            if deltas is not None:  # only as far as the offsets run on without a hole
                hi = bisect_right(range(hi), deltas[lo] - lo, lo, hi, key=lambda j: deltas[j] - j)
            fit = bisect_right(view.positions, view.positions[lo] + max_bytes - size, lo, hi + 1) - 1
            taken = max(min(hi, fit), lo if runs else lo + 1)
            if taken <= lo:
                full = True
                break
            blob = view.slice(lo, taken)
            shift = size - view.positions[lo]
            ends = view.positions[lo + 1 : taken + 1]
            # A chunk that starts at a node's first record (a follower at the leader's last append)
            # takes the node's boundaries as they are: a copy, no per-record arithmetic.
            positions.extend(ends if not shift else map(add, ends, repeat(shift, taken - lo)))
            _, first_ts = record_offset_and_timestamp(blob, 0)
            _, last_ts = record_offset_and_timestamp(blob, view.positions[taken - 1] + shift - size)
            flags = ref.header.flags & NODE_CARRIED_FLAGS
            runs.append(ReplicaRun(start, taken - lo, first_ts, last_ts, flags))
            if flags & NODE_PRODUCER:
                producers.extend(ProducerMark(p, q, o, t) for o, t, p, q in find_producers(blob))
            parts.append(blob)
            size += len(blob)
            start = covered = start + taken - lo
            if taken < hi:
                full = True
                break  # the byte budget
            if taken >= view.count:
                i += 1
            # else a hole inside the node: on from its next record
        if not full and covered < end and not _damaged(stream, covered, end):
            covered = end  # only holes are left before the end: the chunk covers them
        return ReplicaChunk(
            offset, b"".join(parts), positions, tuple(runs), tuple(producers), log_end, covered
        )


def _damaged(stream: Stream, start: int, end: int) -> bool:
    """Whether a range the stream lost to damage overlaps start..end-1."""
    return any(g.start_offset < end and start < g.end_offset for g in stream.damaged)


def append_chunk(stream: Stream, chunk: ReplicaChunk) -> int:
    """Write the chunk's records at the stream's end, holes included; returns the new end offset."""
    _check_shape(chunk)
    cfg = stream.ctx.config
    with stream.lock:
        if stream.closed:
            raise InvalidArgumentError(f"stream {stream.name!r} was deleted")
        if chunk.first_offset != stream.end_offset:
            raise OffsetMismatchError(chunk.first_offset, stream.end_offset)
        _check_runs(stream, chunk)
        if chunk.dense:
            _write_dense(stream, chunk, cfg.max_batch_entries, cfg.max_batch_bytes)
        else:
            _write_sparse(stream, chunk, cfg.node_entries, cfg.max_batch_bytes)
        for mark in chunk.producers:
            # As recovery notes them (storage/loader.py): a retry's batch length gives the first offset.
            batch = BatchRecord(-1, mark.last_offset, mark.timestamp_ms)
            stream.producers.record(mark.producer_id, mark.sequence, batch)
        if stream.fsync is not FsyncPolicy.ALWAYS:
            stream.publish(stream.end_offset)
            return chunk.end_offset
    stream.sync()
    return chunk.end_offset


def _write_dense(stream: Stream, chunk: ReplicaChunk, max_entries: int, max_bytes: int) -> None:
    """A chunk without holes goes into the growing tail, as appends do, node by node."""
    records, positions = chunk.records, chunk.positions
    at = 0
    for run in chunk.runs:
        stop = at + run.count
        while at < stop:
            # No more per node write than one batch may take: it then fits a fresh segment.
            upto = _batch_end(stream, positions, at, stop, max_entries, max_bytes)
            lo, hi = positions[at], positions[upto]
            part = positions[at : upto + 1]
            if lo:
                part = array("I", map(sub, part, repeat(lo, len(part))))
            _, first_ts = record_offset_and_timestamp(records, lo)
            _, last_ts = record_offset_and_timestamp(records, positions[upto - 1])
            write_records(stream, records[lo:hi], part, first_ts, last_ts, run.flags)
            at = upto


def _write_sparse(stream: Stream, chunk: ReplicaChunk, node_entries: int, max_bytes: int) -> None:
    """A chunk with holes becomes a sealed packed segment of sparse nodes (as compaction leaves
    them), each record at its own offset, ending at the chunk's end."""
    records, positions, count = chunk.records, chunk.positions, chunk.count
    offsets = array(
        "q", chain.from_iterable(range(r.first_offset, r.first_offset + r.count) for r in chunk.runs)
    )
    run_ends = list(accumulate(r.count for r in chunk.runs))
    bodies: list[tuple[NodeBody, int, int, int]] = []
    at = 0
    while at < count:
        upto = _batch_end(stream, positions, at, count, node_entries, max_bytes)
        base, lo = offsets[at], positions[at]
        body = NodeBody(
            base,
            array("I", map(sub, positions[at : upto + 1], repeat(lo, upto - at + 1))),
            records[lo : positions[upto]],
            array("I", map(sub, offsets[at:upto], repeat(base, upto - at))),
        )
        first_run, last_run = bisect_right(run_ends, at), bisect_right(run_ends, upto - 1)
        flags = 0
        for run in chunk.runs[first_run : last_run + 1]:
            flags |= run.flags
        _, first_ts = record_offset_and_timestamp(records, lo)
        _, last_ts = record_offset_and_timestamp(records, positions[upto - 1])
        bodies.append((body, first_ts, last_ts, flags))
        at = upto
    write_packed(stream, bodies, chunk.end_offset)


def _batch_end(stream: Stream, positions: array, at: int, stop: int, max_entries: int, max_bytes: int) -> int:
    """Where the records from `at` (short of `stop`) that one node write may take end."""
    limit = positions[at] + max_bytes
    upto = min(stop, at + max_entries, bisect_right(positions, limit, at, stop + 1) - 1)
    if upto <= at:
        raise InvalidArgumentError(f"the record at {stream.end_offset} exceeds max_batch_bytes={max_bytes}")
    return upto


def _check_shape(chunk: ReplicaChunk) -> None:
    """Boundaries from 0 to the end of the records, strictly increasing; runs that cover them."""
    positions = chunk.positions
    if not isinstance(positions, array) or positions.typecode != "I" or not positions:
        raise InvalidArgumentError("a chunk's positions must be an array('I')")
    if positions[0] != 0 or positions[-1] != len(chunk.records):
        raise InvalidArgumentError("a chunk's positions must run from 0 to the length of its records")
    if not all(map(lt, positions, islice(positions, 1, None))):
        raise InvalidArgumentError("a chunk's positions must increase")
    if sum(run.count for run in chunk.runs) != chunk.count or any(run.count < 1 for run in chunk.runs):
        raise InvalidArgumentError("a chunk's runs must cover its records")
    for mark in chunk.producers:
        if not chunk.first_offset <= mark.last_offset < chunk.end_offset or not mark.producer_id:
            raise InvalidArgumentError(f"a chunk's producer mark at {mark.last_offset} is outside it")


def _check_runs(stream: Stream, chunk: ReplicaChunk) -> None:
    """Each run's first and last records carry the offsets and timestamps it names, in order, with
    holes (if any) between them, all within the chunk."""
    records, positions = chunk.records, chunk.positions
    expected, last_ts, at = chunk.first_offset, stream.last_ts, 0
    for run in chunk.runs:
        if run.first_offset < expected or not last_ts <= run.first_ts <= run.last_ts:
            raise InvalidArgumentError(f"a chunk's run at {run.first_offset} is out of order")
        expected = run.first_offset
        head = record_offset_and_timestamp(records, positions[at])
        tail = record_offset_and_timestamp(records, positions[at + run.count - 1])
        if head != (expected, run.first_ts) or tail != (expected + run.count - 1, run.last_ts):
            raise InvalidArgumentError(f"a chunk's records at {expected} do not match its run")
        expected += run.count
        last_ts = run.last_ts
        at += run.count
    if chunk.end_offset < expected:
        raise InvalidArgumentError(f"a chunk's end {chunk.end_offset} is before its last record")
