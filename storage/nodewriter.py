"""The write half of a stream: placing encoded records into nodes and segments.

`Stream.append` checks and locks; these write, with the stream's `lock` held: a
client's batch (encoded here), replicated records as they are stored, and a
replicated compacted log as a sealed packed segment. A node takes a batch while
it has room; a segment takes a node while it has room; else the next one starts.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import chain, repeat
from operator import add
from typing import TYPE_CHECKING

import zstandard

from storage.dedup import BatchRecord
from storage.errors import CorruptionError, LimitExceededError
from storage.format import NODE_DELAYED, NODE_PREFIX_SIZE, NODE_PRODUCER, SLOTTED_HEADER_SIZE, NodeBody
from storage.growing import GrowingNode
from storage.layout import segment_name
from storage.packed import encode_packed_node, write_packed_segment
from storage.records import attach_producer, encode_batch
from storage.results import AppendResult
from storage.segment import Segment
from storage.types import AppendBatch

if TYPE_CHECKING:
    from storage.stream import Stream

FIRST_NODE_SLOTS = 16


def append_one(stream: Stream, batch: AppendBatch, producer: tuple[str, int] | None) -> AppendResult:
    """Write one batch, or find the first attempt of a producer's retry. Call with `lock` held."""
    n = len(batch.payloads)
    earlier = stream.producers.lookup(*producer) if producer else None
    if earlier is not None:
        first = earlier.first_offset if earlier.first_offset >= 0 else earlier.last_offset - n + 1
        return AppendResult(first, earlier.last_offset, earlier.timestamp_ms, duplicate=True)
    first, ts = write_batch(stream, batch, n, producer)
    if producer:
        stream.producers.record(*producer, BatchRecord(first, first + n - 1, ts))
    return AppendResult(first, first + n - 1, ts)


def append_together(stream: Stream, batches: Sequence[AppendBatch]) -> list[AppendResult]:
    """Write payload-only batches without a producer as one batch (one encoding, one write into
    the node: the records are those the batches would make one after another, with one
    timestamp), each with its own result. Call with `lock` held. Nothing is written when it
    fails (LimitExceededError when together they encode past max_batch_bytes)."""
    payloads = list(chain.from_iterable(batch.payloads for batch in batches))
    first, ts = write_batch(stream, AppendBatch(payloads), len(payloads), None)
    results = []
    for batch in batches:
        n = len(batch.payloads)
        results.append(AppendResult(first, first + n - 1, ts))
        first += n
    return results


def write_batch(
    stream: Stream, batch: AppendBatch, n: int, producer: tuple[str, int] | None
) -> tuple[int, int]:
    """Encode and write one batch of `n` entries into the active node (or a new one). Call with
    `lock` held."""
    ctx = stream.ctx
    ts = max(ctx.clock(), stream.last_ts)
    first = stream.end_offset
    node = stream.active
    if (
        node is not None
        and node.ref.header.count + n <= node.ref.header.slots
        and node.ref.segment is stream.segments[-1]
        and not node.in_sync
    ):
        start = node.positions[-1]  # the batch may go on in the active node
    else:
        node, start = None, 0
    blob, positions = encode_batch(first, ts, batch, start)
    delayed = batch.deliver_at_ms is not None and any(batch.deliver_at_ms)
    flags = NODE_DELAYED if delayed else 0
    if producer:
        blob = attach_producer(blob, positions[-2] - start, *producer)
        positions[-1] = start + len(blob)
        flags |= NODE_PRODUCER
    size = len(blob)
    if size > (limit := ctx.config.max_batch_bytes):
        raise LimitExceededError("max_batch_bytes", limit, f"batch encodes to {size} bytes")
    if node is None or not node.make_room(n, size):
        if start:
            positions = array("I", [p - start for p in positions])
        node = _start_node(stream, n, size, ts)
    node.append(blob, positions, ts, ts, flags)
    _wrote(stream, node, first + n, ts)
    return first, ts


def write_records(
    stream: Stream, blob: bytes, positions: array, first_ts: int, last_ts: int, flags: int
) -> None:
    """Write stored records as they are at end_offset (replication, storage/replica.py; call with
    `lock` held). `positions`: their count+1 boundaries from 0; they fit one batch's limits."""
    stream.home.unmark_clean()
    n = len(positions) - 1
    node = stream.active
    if (
        node is None
        or node.ref.segment is not stream.segments[-1]
        or node.in_sync
        or not node.make_room(n, len(blob))
    ):
        node = _start_node(stream, n, len(blob), stream.ctx.clock())
    start = node.positions[-1]
    if start:
        positions = array("I", map(add, positions, repeat(start, n + 1)))
    node.append(blob, positions, first_ts, last_ts, flags)
    _wrote(stream, node, stream.end_offset + n, last_ts)


def write_packed(stream: Stream, bodies: Sequence[tuple[NodeBody, int, int, int]], end_offset: int) -> None:
    """Write stored records with holes (replication of a compacted log, storage/replica.py; call
    with `lock` held) as a sealed packed segment from end_offset up to `end_offset`, durable when
    this returns: `bodies` are its nodes (body, min and max timestamp, carried flags), sparse
    where offsets are missing. The growing tail is sealed first (synced, queued for packing),
    so that the next append starts a new segment after this one."""
    stream.directory_home()  # (a stream in a slot moves to a directory first: a second segment)
    tail = stream.segments[-1] if stream.segments else None
    if tail is not None and not tail.packed:
        tail.file.sync()  # complete on disk before the next segment exists, as _roll does
        if stream.ctx.config.compression:
            stream.pack_queue.append(tail)
    stream.active = None
    cfg = stream.ctx.config
    compressor = zstandard.ZstdCompressor(level=cfg.compression_level) if cfg.compression else None
    path = stream.directory / segment_name(stream.end_offset)
    nodes = (encode_packed_node(body, lo, hi, flags, compressor) for body, lo, hi, flags in bodies)
    write_packed_segment(stream.ctx.fs, path, stream.end_offset, end_offset, stream.ctx.clock(), nodes)
    segment, cut = Segment.open(stream.ctx.fs, path, writable=False, verify=False)
    if cut:
        raise CorruptionError(f"replicated segment {path.name} does not read back: {cut}")
    stream.segments.append(segment)
    for ref in segment.nodes:
        stream.index.append(ref)
    stream.end_offset = end_offset
    if bodies:
        stream.last_ts = bodies[-1][2]  # timestamps never decrease along a stream
    stream.write_seq += 1


def _wrote(stream: Stream, node: GrowingNode, end_offset: int, last_ts: int) -> None:
    stream.index.grew(last_ts)
    stream.end_offset = end_offset
    stream.last_ts = last_ts
    stream.write_seq += 1
    stream.dirty.add(node.ref.segment.file)


def _start_node(stream: Stream, entries: int, nbytes: int, ts: int) -> GrowingNode:
    slots = _node_slots(stream, entries)
    tail = stream.segments[-1] if stream.segments else None
    need = NODE_PREFIX_SIZE + 4 * slots + nbytes
    if tail is not None and tail.end_pos + need > tail.capacity and stream.in_slot:
        stream.directory_home()  # outgrew its slot: promoted, its segment's capacity the engine's
        tail = stream.segments[-1]
    if (
        tail is None
        or tail.packed
        or tail.end_offset() != stream.end_offset
        or tail.end_pos + need > tail.capacity
    ):
        tail = _roll(stream, ts, need)
    else:
        tail.reserve(tail.end_pos + need)
    node = GrowingNode.start(tail, slots, stream.end_offset)
    tail.nodes.append(node.ref)
    stream.index.append(node.ref)
    stream.active = node
    return node


def _node_slots(stream: Stream, entries: int) -> int:
    """Offset-table slots for a new node: a stream's first node reserves few (a small stream
    costs what it holds), each next one four times the last, up to node_entries."""
    last = stream.index.nodes[-1].header.slots if len(stream.index) else FIRST_NODE_SLOTS // 4
    return max(entries, min(stream.ctx.config.node_entries, 4 * last))


def _roll(stream: Stream, now_ms: int, need: int) -> Segment:
    old = stream.segments[-1] if stream.segments else None
    if old is not None and not old.packed:
        # Whatever the policy, a segment is complete on disk before the next one exists:
        # otherwise a power loss could leave a hole in the middle of the stream.
        old.file.sync()
    segment = Segment.create(
        stream.ctx.fs,
        stream.directory,
        stream.end_offset,
        SLOTTED_HEADER_SIZE + need,
        stream.ctx.config.segment_bytes,
        now_ms,
        durable=old is not None or stream.creation is None,  # a new stream's first: its commit syncs it
    )
    if stream.creation is not None:
        stream.creation.has_segment = True
    stream.segments.append(segment)
    if old is not None and not old.packed and stream.ctx.config.compression:
        stream.pack_queue.append(old)
    return segment
