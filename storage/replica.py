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

A chunk covers contiguous offsets: it stops before a hole in the leader's
log (compaction, damage), and the record at `offset` need not be there (the
chunk then starts later). The checks `append_chunk` makes (offsets,
boundaries, timestamps, runs) keep a malformed chunk from being written;
the records' own bytes are trusted as the leader stored them.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from dataclasses import dataclass
from itertools import islice, repeat
from operator import add, lt, sub
from typing import TYPE_CHECKING

from storage.dedup import BatchRecord
from storage.errors import CorruptionError, InvalidArgumentError, OffsetMismatchError, PreconditionError
from storage.format import NODE_CARRIED_FLAGS, NODE_PRODUCER
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
    """Stored records from `first_offset` on, back to back in `records`: record i spans
    records[positions[i]:positions[i+1]]. Empty (no runs) when there is nothing past the offset."""

    first_offset: int
    records: bytes
    positions: array  # array('I'), count+1 boundaries, from 0 to len(records)
    runs: tuple[ReplicaRun, ...]
    producers: tuple[ProducerMark, ...]
    log_end: int  # the leader's end offset when it was read

    @property
    def count(self) -> int:
        return len(self.positions) - 1

    @property
    def end_offset(self) -> int:
        """The offset after the chunk's last record."""
        return self.first_offset + self.count


def read_chunk(stream: Stream, offset: int, max_bytes: int, stop: int | None = None) -> ReplicaChunk:
    """Records from `offset` up to about `max_bytes` (always one at least, if there is one), and
    not at or past `stop` if given (a leader stops a chunk where the next epoch starts)."""
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
        start, size, first = offset, 0, None
        nodes = stream.index.nodes
        i = stream.index.holding(start)
        while start < end and i < len(nodes) and size < max_bytes:
            ref = nodes[i]
            i += 1
            if ref.end_offset <= start:
                continue
            try:
                view = stream.view(ref)
            except CorruptionError:
                if runs:
                    break
                raise
            lo = view.index_of(start)
            if lo >= view.count:
                continue
            if view.offset_at(lo) != start:
                if runs:
                    break  # a hole: the chunk stops before it
                start = view.offset_at(lo)
            hi = view.index_of(end)
            deltas = view.deltas
            if deltas is not None:  # only as far as the offsets run on without a hole
                hi = bisect_right(range(hi), deltas[lo] - lo, lo, hi, key=lambda j: deltas[j] - j)
            fit = bisect_right(view.positions, view.positions[lo] + max_bytes - size, lo, hi + 1) - 1
            hi = max(min(hi, fit), lo if runs else lo + 1)
            if hi <= lo:
                break
            blob = view.slice(lo, hi)
            shift = size - view.positions[lo]
            positions.extend(map(add, view.positions[lo + 1 : hi + 1], repeat(shift, hi - lo)))
            _, first_ts = record_offset_and_timestamp(blob, 0)
            _, last_ts = record_offset_and_timestamp(blob, view.positions[hi - 1] + shift - size)
            flags = ref.header.flags & NODE_CARRIED_FLAGS
            runs.append(ReplicaRun(start, hi - lo, first_ts, last_ts, flags))
            if flags & NODE_PRODUCER:
                producers.extend(ProducerMark(p, q, o, t) for o, t, p, q in find_producers(blob))
            first = start if first is None else first
            parts.append(blob)
            size += len(blob)
            start += hi - lo
            if hi < view.count:
                break  # stopped inside the node: by the byte budget, or before a hole
        start = offset if first is None else first
        return ReplicaChunk(start, b"".join(parts), positions, tuple(runs), tuple(producers), log_end)


def append_chunk(stream: Stream, chunk: ReplicaChunk) -> int:
    """Write the chunk's records at the stream's end; returns the new end offset."""
    _check_shape(chunk)
    cfg = stream.ctx.config
    with stream.lock:
        if stream.closed:
            raise InvalidArgumentError(f"stream {stream.name!r} was deleted")
        if chunk.first_offset != stream.end_offset:
            raise OffsetMismatchError(chunk.first_offset, stream.end_offset)
        _check_runs(stream, chunk)
        records, positions = chunk.records, chunk.positions
        at = 0
        for run in chunk.runs:
            stop = at + run.count
            while at < stop:
                # No more per node write than one batch may take: it then fits a fresh segment.
                limit = positions[at] + cfg.max_batch_bytes
                upto = min(stop, at + cfg.max_batch_entries, bisect_right(positions, limit, at, stop + 1) - 1)
                if upto <= at:
                    raise InvalidArgumentError(
                        f"the record at {stream.end_offset} exceeds max_batch_bytes={cfg.max_batch_bytes}"
                    )
                lo, hi = positions[at], positions[upto]
                blob = records[lo:hi]
                part = positions[at : upto + 1]
                if lo:
                    part = array("I", map(sub, part, repeat(lo, len(part))))
                _, first_ts = record_offset_and_timestamp(records, lo)
                _, last_ts = record_offset_and_timestamp(records, positions[upto - 1])
                stream.write_records(blob, part, first_ts, last_ts, run.flags)
                at = upto
        for mark in chunk.producers:
            # As recovery notes them (storage/loader.py): a retry's batch length gives the first offset.
            batch = BatchRecord(-1, mark.last_offset, mark.timestamp_ms)
            stream.producers.record(mark.producer_id, mark.sequence, batch)
        if stream.fsync is not FsyncPolicy.ALWAYS:
            stream.publish(stream.end_offset)
            return chunk.end_offset
    stream.sync()
    return chunk.end_offset


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
    """Each run's first and last records carry the offsets and timestamps it names, in order."""
    records, positions = chunk.records, chunk.positions
    expected, last_ts, at = chunk.first_offset, stream.last_ts, 0
    for run in chunk.runs:
        if run.first_offset != expected or not last_ts <= run.first_ts <= run.last_ts:
            raise InvalidArgumentError(f"a chunk's run at {run.first_offset} is out of order")
        head = record_offset_and_timestamp(records, positions[at])
        tail = record_offset_and_timestamp(records, positions[at + run.count - 1])
        if head != (expected, run.first_ts) or tail != (expected + run.count - 1, run.last_ts):
            raise InvalidArgumentError(f"a chunk's records at {expected} do not match its run")
        expected += run.count
        last_ts = run.last_ts
        at += run.count
