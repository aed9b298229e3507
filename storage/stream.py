"""One stream: its segments, the in-memory node index, and every operation on it.

Locking: `lock` guards the index and the active node (appends, reads, index
changes); `maintenance_lock` serialises the slow jobs that rewrite or delete
files (packing, compaction, retention) so they never race each other. Syncs
run outside `lock`, so appenders keep writing while a flush is on its way.
"""

from __future__ import annotations

import itertools
import json
import logging
import struct
import threading
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import zstandard
from crc32c import crc32c

from storage.cache import NodeCache
from storage.config import EngineConfig, StreamConfig
from storage.dedup import SNAPSHOT_FILE as PRODUCERS_FILE
from storage.dedup import BatchRecord, ProducerTable
from storage.durability import SyncGate
from storage.errors import (
    CorruptionError,
    DurabilityError,
    InvalidArgumentError,
    LimitExceededError,
    OffsetMismatchError,
    StorageError,
)
from storage.format import (
    NODE_DELAYED,
    NODE_PREFIX_SIZE,
    NODE_PRODUCER,
    NODE_SPARSE,
    NODE_ZSTD,
    SEGMENT_HEADER_SIZE,
    NodeBody,
    SegmentHeader,
    encode_packed_node,
)
from storage.fs import FileSystem, SegmentFile
from storage.records import attach_producer, decode_record, encode_batch, record_offset_and_timestamp
from storage.results import AppendResult, Gap, ReadResult, StreamInfo
from storage.segment import SEGMENT_SUFFIX, GrowingNode, NodeRef, Segment
from storage.types import AppendBatch, FsyncPolicy, GapReason, StreamBounds

log = logging.getLogger("streamlog.storage")

META_FILE = "stream.meta"
CLEAN_MARKER = "CLEAN"
_META_MAGIC = b"SLMT"


@dataclass
class EngineContext:
    """What every stream shares with its engine."""

    fs: FileSystem
    config: EngineConfig
    clock: Callable[[], int]
    cache: NodeCache
    retention_floor: Callable[[str], int | None]


def encode_meta(name: str, first_offset: int, config: StreamConfig) -> bytes:
    body = json.dumps({"name": name, "first_offset": first_offset, "config": config.to_dict()}).encode()
    return _META_MAGIC + struct.pack("<I", crc32c(body)) + body


def decode_meta(raw: bytes) -> tuple[str, int, StreamConfig]:
    if raw[:4] != _META_MAGIC or len(raw) < 8:
        raise CorruptionError("stream metadata has a bad magic")
    body = raw[8:]
    if struct.unpack_from("<I", raw, 4)[0] != crc32c(body):
        raise CorruptionError("stream metadata CRC mismatch")
    data = json.loads(body)
    return data["name"], int(data["first_offset"]), StreamConfig.from_dict(data["config"])


class _NodeView:
    """Uniform access to a node's entries, whether it is the active node or a decoded one."""

    __slots__ = ("base", "deltas", "positions", "slice")

    def __init__(
        self, base: int, positions: array, deltas: array | None, slice_: Callable[[int, int], bytes]
    ):
        self.base = base
        self.positions = positions
        self.deltas = deltas
        self.slice = slice_

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


_decompressors = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_decompressors, "d", None)
    if d is None:
        d = _decompressors.d = zstandard.ZstdDecompressor()
    return d


class Stream:
    def __init__(self, ctx: EngineContext, name: str, directory: Path, config: StreamConfig) -> None:
        self.ctx = ctx
        self.name = name
        self.directory = directory
        self.config = config
        self.lock = threading.RLock()
        self.maintenance_lock = threading.Lock()
        self.gate = SyncGate()
        self.segments: list[Segment] = []
        self.nodes: list[NodeRef] = []  # the index: retained nodes in offset order
        self.bases = array("q")  # node base offsets, for bisect
        self.max_ts = array("q")  # node max timestamps (non-decreasing), for seek by time
        self.active: GrowingNode | None = None
        self.first_offset = 0
        self.end_offset = 0
        self.visible_end = 0  # reads stop here: in "always" mode, only synced entries are visible
        self.last_ts = 0
        self.write_seq = 0
        self.dirty: set[SegmentFile] = set()
        self.pack_queue: list[Segment] = []
        self.damaged: list[Gap] = []
        self.last_compaction_ms = 0
        self.closed = False
        self._holes: bool | None = None  # cached answer of _has_holes(); None = recompute
        self.producers = _producer_table(ctx.config)
        self._tags = _TagIndex()  # compaction's index, built up round by round

    # ------------------------------------------------------------------ open / create

    @classmethod
    def create(cls, ctx: EngineContext, name: str, directory: Path, config: StreamConfig) -> Stream:
        ctx.fs.makedirs(directory)
        ctx.fs.write_file_atomic(directory / META_FILE, encode_meta(name, 0, config))
        return cls(ctx, name, directory, config)

    @classmethod
    def open(cls, ctx: EngineContext, directory: Path) -> Stream:
        fs = ctx.fs
        name, first_offset, config = decode_meta(fs.read_file(directory / META_FILE))
        stream = cls(ctx, name, directory, config)
        clean = fs.exists(directory / CLEAN_MARKER)
        stream._load(first_offset, clean)
        if clean:
            fs.remove(directory / CLEAN_MARKER)  # from here on a crash must trigger the tail scan
        return stream

    def _load(self, meta_first: int, clean: bool) -> None:
        fs = self.ctx.fs
        files = fs.listdir(self.directory)
        for leftover in (f for f in files if f.endswith(".tmp")):
            fs.remove(self.directory / leftover)  # a rewrite that crashed before its rename
        names = [f for f in files if f.endswith(SEGMENT_SUFFIX)]
        # A trailing segment in which no node was ever written holds no entry: remove it. It may
        # be a creation that a crash cut short (header torn or missing, preallocation lost), and
        # a new segment of the same name must be creatable at the same base offset.
        while names:
            head = fs.read_head(self.directory / names[-1], SEGMENT_HEADER_SIZE + NODE_PREFIX_SIZE)
            if any(head[SEGMENT_HEADER_SIZE:]):
                break
            fs.remove(self.directory / names.pop())
        expected = int(names[0].split(".")[0]) if names else None
        for i, fname in enumerate(names):
            path = self.directory / fname
            last = i == len(names) - 1
            segment = self._open_segment(path, verify=last and not clean)
            if segment is None:
                continue
            segment, cut = segment
            if expected is not None and segment.base_offset != expected:
                if segment.base_offset < expected:
                    log.error(
                        "stream %r: segment %s overlaps its predecessor; dropping it and later ones",
                        self.name,
                        fname,
                    )
                    segment.close()
                    for later in names[i:]:
                        fs.remove(self.directory / later)
                    break
                self._note_damage(Gap(expected, segment.base_offset, GapReason.CORRUPT))
            if cut:
                log.warning("stream %r: segment %s: %s", self.name, fname, cut)
                if last and not segment.packed:
                    # Torn tail: keep the valid prefix, and make the cut durable before anything
                    # else is written, so a later power loss cannot bring the torn node back.
                    segment.truncate_after(segment.end_pos)
                    segment.file.sync()
                else:
                    self._note_damage(
                        Gap(
                            segment.nodes[-1].end_offset if segment.nodes else segment.base_offset,
                            segment.end_offset() if segment.packed else -1,
                            GapReason.CORRUPT,
                        )
                    )
            self.segments.append(segment)
            expected = segment.end_offset()
        tail = self.segments[-1] if self.segments else None
        resumed = tail.nodes[-1] if tail is not None and not tail.packed and tail.nodes else None
        for segment in self.segments:
            for ref in segment.nodes:
                # The node appends resume into stays indexed even when trimmed past, as it is live.
                if ref.end_offset > meta_first or ref is resumed:
                    self._index_append(ref)
        end = self.segments[-1].end_offset() if self.segments else 0
        # Never hand out an offset that a damaged segment may hold.
        self.end_offset = max([end, meta_first, *(max(g.start_offset, g.end_offset) for g in self.damaged)])
        self.first_offset = max(meta_first, 0)
        self.visible_end = self.end_offset
        self.last_ts = self.max_ts[-1] if self.max_ts else 0
        # Resolve damage ranges that ran to "the next segment" once that is known.
        self.damaged = [
            Gap(
                g.start_offset,
                g.end_offset if g.end_offset >= 0 else self._next_base_after(g.start_offset),
                g.reason,
            )
            for g in self.damaged
        ]
        if resumed is not None:
            self.active = GrowingNode.resume(resumed)
        self._load_producers()
        if self.ctx.config.compression:
            self.pack_queue = [s for s in self.segments[:-1] if not s.packed]

    def _load_producers(self) -> None:
        """The idempotent-append table: its snapshot, then the batches written after it."""
        fs = self.ctx.fs
        path = self.directory / PRODUCERS_FILE
        if fs.exists(path):
            try:
                self.producers.load(fs.read_file(path))
            except CorruptionError as exc:
                log.error("stream %r: %s; rebuilding it from the stream", self.name, exc)
                self.producers = _producer_table(self.ctx.config)
        self.producers.forget_from(self.end_offset)  # batches a power loss took back
        horizon = self.ctx.clock() - self.ctx.config.dedup_window_ms
        for ref in self.nodes:
            h = ref.header
            if (
                ref.end_offset <= self.producers.scanned_to
                or not h.flags & NODE_PRODUCER
                or h.max_ts < horizon
            ):
                continue
            try:
                view = self._view(ref)
            except CorruptionError as exc:
                self._corrupt(ref, exc)
                continue
            data = view.slice(0, view.count)
            pos = 0
            for _ in range(view.count):
                entry, pos = decode_record(data, pos)
                if entry.producer_id:
                    # Its first offset is not stored: a retry carries the same batch, whose length tells.
                    batch = BatchRecord(-1, entry.offset, entry.timestamp_ms)
                    self.producers.record(entry.producer_id, entry.producer_sequence, batch)
        self.producers.scanned_to = self.end_offset

    def save_producers(self, now_ms: int) -> None:
        """Expire idle producers and snapshot the table if it changed (maintenance, close)."""
        with self.lock:
            self.producers.expire(now_ms)
            if not self.producers.changed:
                return
            self.producers.scanned_to = self.end_offset
            raw = self.producers.encode()
            self.producers.changed = False
        self.ctx.fs.write_file_atomic(self.directory / PRODUCERS_FILE, raw)

    def _open_segment(self, path: Path, verify: bool) -> tuple[Segment, str | None] | None:
        """Open one segment; salvage it if its header is damaged; None if nothing can be read."""
        try:
            return Segment.open(self.ctx.fs, path, writable=True, verify=verify)
        except CorruptionError as exc:
            log.error("stream %r: segment %s has a damaged header (%s)", self.name, path.name, exc)
        base = int(path.name.split(".")[0])
        salvaged = Segment.salvage(self.ctx.fs, path, base)
        if salvaged is None:
            # Keep the file for the operator, out of the way of a new segment of the same name.
            self.ctx.fs.rename(path, path.with_name(path.name + ".damaged"))
            self._note_damage(Gap(base, -1, GapReason.CORRUPT))
            return None
        log.warning("stream %r: segment %s salvaged: header rewritten", self.name, path.name)
        return salvaged, None

    def _next_base_after(self, offset: int) -> int:
        i = bisect_right(self.bases, offset)
        return self.bases[i] if i < len(self.bases) else self.end_offset

    def _note_damage(self, gap: Gap) -> None:
        log.error(
            "stream %r: offsets %d..%d are damaged and will be skipped",
            self.name,
            gap.start_offset,
            gap.end_offset,
        )
        self.damaged.append(gap)

    def _index_append(self, ref: NodeRef) -> None:
        self._holes = None
        self.nodes.append(ref)
        self.bases.append(ref.base_offset)
        self.max_ts.append(ref.header.max_ts)

    @property
    def fsync(self) -> FsyncPolicy:
        return self.config.fsync or self.ctx.config.fsync

    # ------------------------------------------------------------------ append

    def append(
        self, batch: AppendBatch, producer: tuple[str, int] | None = None, expected_end: int | None = None
    ) -> AppendResult:
        """Append a batch; `producer` (id, sequence) makes it idempotent, `expected_end` conditional."""
        n = len(batch)
        limit = self.ctx.config.max_batch_bytes
        always = self.fsync is FsyncPolicy.ALWAYS
        with self.lock:
            if self.closed:
                raise InvalidArgumentError(f"stream {self.name!r} was deleted")
            if self.gate.error is not None:
                raise DurabilityError(f"appends are refused after a failed sync: {self.gate.error}")
            if expected_end is not None and expected_end != self.end_offset:
                raise OffsetMismatchError(expected_end, self.end_offset)
            earlier = self.producers.lookup(*producer) if producer else None
            if earlier is not None:
                seq = self.write_seq  # the first attempt may still be on its way to disk
            else:
                first, ts = self._write_batch(batch, producer, limit)
                if producer:
                    self.producers.record(*producer, BatchRecord(first, first + n - 1, ts))
                seq = self.write_seq
                if not always:
                    self.visible_end = self.end_offset
        if always:
            self.gate.wait(seq, self._sync_now)
        if earlier is not None:
            first = earlier.first_offset if earlier.first_offset >= 0 else earlier.last_offset - n + 1
            return AppendResult(first, earlier.last_offset, earlier.timestamp_ms, duplicate=True)
        return AppendResult(first, first + n - 1, ts)

    def _write_batch(
        self, batch: AppendBatch, producer: tuple[str, int] | None, limit: int
    ) -> tuple[int, int]:
        """Encode and write one batch into the active node (or a new one). Call with `lock` held."""
        n = len(batch)
        ts = max(self.ctx.clock(), self.last_ts)
        first = self.end_offset
        node = self.active
        fits = (
            node is not None
            and node.count + n <= node.ref.header.slots
            and node.ref.segment is self.segments[-1]
        )
        start = node.positions[-1] if fits else 0
        blob, positions = encode_batch(first, ts, batch, start)
        delayed = batch.deliver_at_ms is not None and any(batch.deliver_at_ms)
        flags = NODE_DELAYED if delayed else 0
        if producer:
            blob = attach_producer(blob, positions[-2] - start, *producer)
            positions[-1] = start + len(blob)
            flags |= NODE_PRODUCER
        if len(blob) > limit:
            raise LimitExceededError("max_batch_bytes", limit, f"batch encodes to {len(blob)} bytes")
        if not (fits and node.room(n, len(blob))):
            if start:
                positions = array("I", [p - start for p in positions])
            node = self._start_node(n, len(blob), ts)
        node.append(blob, positions, ts, flags)
        self.max_ts[-1] = ts
        self.end_offset = first + n
        self.last_ts = ts
        self.write_seq += 1
        self.dirty.add(node.ref.segment.file)
        return first, ts

    def _start_node(self, entries: int, nbytes: int, ts: int) -> GrowingNode:
        slots = max(self.ctx.config.node_entries, entries)
        tail = self.segments[-1] if self.segments else None
        need = 2 * 64 + 4 * slots + nbytes
        if (
            tail is None
            or tail.packed
            or tail.end_offset() != self.end_offset
            or tail.end_pos + need > tail.file.size
        ):
            tail = self._roll(ts)
        node = GrowingNode.start(tail, slots, self.end_offset)
        tail.nodes.append(node.ref)
        self._index_append(node.ref)
        self.active = node
        return node

    def _roll(self, now_ms: int) -> Segment:
        old = self.segments[-1] if self.segments else None
        if old is not None and not old.packed:
            # Whatever the policy, a segment is complete on disk before the next one exists:
            # otherwise a power loss could leave a hole in the middle of the stream.
            old.file.sync()
        segment = Segment.create(
            self.ctx.fs, self.directory, self.end_offset, self.ctx.config.segment_bytes, now_ms
        )
        self.segments.append(segment)
        if old is not None and not old.packed and self.ctx.config.compression:
            self.pack_queue.append(old)
        return segment

    # ------------------------------------------------------------------ durability

    def _sync_now(self) -> int:
        with self.lock:
            files = list(self.dirty)
            self.dirty.clear()
            seq = self.write_seq
            upto = self.end_offset
        for file in files:
            file.sync()
        with self.lock:
            self.visible_end = max(self.visible_end, upto)
        return seq

    def sync(self) -> None:
        with self.lock:
            seq = self.write_seq
        self.gate.wait(seq, self._sync_now)

    # ------------------------------------------------------------------ reading

    def _view(self, ref: NodeRef) -> _NodeView:
        active = self.active
        if active is not None and ref is active.ref:
            return _NodeView(ref.base_offset, active.positions, None, active.slice)
        segment = ref.segment
        body = self.ctx.cache.get((segment.uid, ref.pos), lambda: segment.read_body(ref, _decompressor()))
        blob, positions = body.blob, body.positions
        return _NodeView(
            body.base_offset, positions, body.deltas, lambda lo, hi: blob[positions[lo] : positions[hi]]
        )

    def _hole_reason(self, offset: int) -> GapReason:
        return (
            GapReason.CORRUPT
            if any(g.start_offset <= offset < g.end_offset for g in self.damaged)
            else GapReason.COMPACTED
        )

    def _corrupt(self, ref: NodeRef, exc: CorruptionError) -> Gap:
        gap = Gap(ref.base_offset, ref.end_offset, GapReason.CORRUPT)
        if not ref.corrupt:
            ref.corrupt = True
            log.error(
                "stream %r: node at offsets %d..%d is corrupt (%s)",
                self.name,
                gap.start_offset,
                gap.end_offset,
                exc,
            )
            self.damaged.append(gap)
            self._holes = True
        return gap

    def bounds(self) -> StreamBounds:
        with self.lock:
            return StreamBounds(self.first_offset, self.visible_end)

    def read(self, offset: int, count: int, max_bytes: int, reverse: bool) -> ReadResult:
        if offset < 0 or count < 0 or max_bytes < 0:
            raise InvalidArgumentError("offset, count and max_bytes must not be negative")
        with self.lock:
            if reverse:
                return self._read_backward(offset, count, max_bytes)
            return self._read_forward(offset, count, max_bytes)

    def _read_forward(self, offset: int, count: int, max_bytes: int) -> ReadResult:
        end, first = self.visible_end, self.first_offset
        gap = Gap(offset, first, GapReason.EVICTED) if offset < first else None
        start = max(offset, first)
        records: list[bytes] = []
        taken = size = 0
        last = None
        i = max(bisect_right(self.bases, start) - 1, 0)
        while count > taken and start < end and i < len(self.nodes):
            ref = self.nodes[i]
            i += 1
            if ref.end_offset <= start:
                continue
            if ref.base_offset >= end:
                break
            try:
                view = self._view(ref)
            except CorruptionError as exc:
                if taken:
                    break
                gap = self._corrupt(ref, exc)
                start = ref.end_offset
                continue
            lo, hi = view.index_of(start), view.index_of(end)
            if lo >= hi:
                continue
            if not taken and gap is None and view.offset_at(lo) > start:
                gap = Gap(start, view.offset_at(lo), self._hole_reason(start))
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
            gap = Gap(start, end, self._hole_reason(start))  # nothing left but a hole
        return ReadResult(records, taken, first, end, _after(offset, last, gap), gap, last)

    def _read_backward(self, offset: int, count: int, max_bytes: int) -> ReadResult:
        end, first = self.visible_end, self.first_offset
        if offset < first:
            return ReadResult([], 0, first, end, -1, Gap(offset, first, GapReason.EVICTED), None)
        start = min(offset, end - 1)  # the highest offset wanted
        records: list[bytes] = []
        taken = size = 0
        last = None
        i = bisect_right(self.bases, start) - 1
        while count > taken and i >= 0 and start >= first:
            ref = self.nodes[i]
            i -= 1
            try:
                view = self._view(ref)
            except CorruptionError as exc:
                if taken:
                    break
                self._corrupt(ref, exc)
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

    def seek_time(self, timestamp_ms: int) -> int:
        with self.lock:
            end = self.visible_end
            i = bisect_left(self.max_ts, timestamp_ms)
            while i < len(self.nodes) and self.nodes[i].base_offset < end:
                ref = self.nodes[i]
                i += 1
                try:
                    view = self._view(ref)
                except CorruptionError as exc:
                    self._corrupt(ref, exc)
                    continue
                lo, hi = 0, view.count
                while lo < hi:  # first entry with timestamp >= timestamp_ms
                    mid = (lo + hi) // 2
                    _, ts = record_offset_and_timestamp(view.slice(mid, mid + 1), 0)
                    if ts < timestamp_ms:
                        lo = mid + 1
                    else:
                        hi = mid
                if lo < view.count:
                    return min(max(view.offset_at(lo), self.first_offset), end)
            return end

    def count(self, start: int, end: int) -> int:
        with self.lock:
            start = max(start, self.first_offset)
            end = min(end, self.visible_end)
            if start >= end:
                return 0
            if not self._has_holes():
                return end - start
            total = 0
            i = max(bisect_right(self.bases, start) - 1, 0)
            for ref in self.nodes[i:]:
                if ref.base_offset >= end:
                    break
                if ref.end_offset <= start or ref.corrupt:
                    continue
                if ref.header.flags & NODE_SPARSE:
                    view = self._view(ref)
                    total += view.index_of(end) - view.index_of(start)
                else:
                    total += min(end, ref.end_offset) - max(start, ref.base_offset)
            return total

    def _has_holes(self) -> bool:
        """Whether any offset between first and next is missing (compaction or damage). Cached."""
        if self._holes is None:
            nodes = self.nodes
            starts_late = bool(nodes) and nodes[0].base_offset > self.first_offset
            self._holes = (
                bool(self.damaged)
                or starts_late
                or any(ref.header.flags & NODE_SPARSE for ref in nodes)
                or any(a.end_offset != b.base_offset for a, b in itertools.pairwise(nodes))
            )
        return self._holes

    # ------------------------------------------------------------------ retention

    def _guarded(self, target: int) -> int:
        floor = self.ctx.retention_floor(self.name)
        return target if floor is None else min(target, floor)

    def _set_first_offset(self, offset: int) -> None:
        """Move first_offset, persist it, then forget nodes and delete segments wholly below it."""
        if offset <= self.first_offset:
            return
        # Durable first: a trim that fails (disk full) must change nothing.
        self.ctx.fs.write_file_atomic(self.directory / META_FILE, encode_meta(self.name, offset, self.config))
        self.first_offset = offset
        k = 0
        keep_active = self.active.ref if self.active is not None else None
        while k < len(self.nodes) and self.nodes[k].end_offset <= offset and self.nodes[k] is not keep_active:
            k += 1
        if k:
            del self.nodes[:k]
            del self.bases[:k]
            del self.max_ts[:k]
        self.damaged = [g for g in self.damaged if g.end_offset > offset]
        self._holes = None
        while len(self.segments) > 1 and self.segments[0].end_offset() <= offset:
            segment = self.segments.pop(0)
            if segment in self.pack_queue:
                self.pack_queue.remove(segment)
            self.dirty.discard(segment.file)
            self.ctx.cache.drop_segment(segment.uid)
            segment.close()
            self.ctx.fs.remove(segment.path)

    def trim(self, first_offset: int) -> int:
        """Exact trim: first_offset becomes exactly `first_offset` (clamped to the stream's end)."""
        if first_offset < 0:
            raise InvalidArgumentError("trim offset must not be negative")
        with self.maintenance_lock, self.lock:
            self._set_first_offset(min(first_offset, self.end_offset))
            return self.first_offset

    def evict(self, up_to_offset: int) -> int:
        """RCP TEVICT with a positive offset: drop whole nodes whose entries are all <= up_to_offset."""
        if up_to_offset < 0:
            raise InvalidArgumentError("evict offset must not be negative")
        with self.maintenance_lock, self.lock:
            self._drop_whole_nodes(lambda ref: ref.end_offset - 1 <= up_to_offset)
            return self.first_offset

    def keep_last(self, n: int) -> int:
        """RCP TEVICT with a negative count: keep at least n entries, dropping whole nodes."""
        if n < 0:
            raise InvalidArgumentError("keep count must not be negative")
        with self.maintenance_lock, self.lock:
            self._keep_last(n)
            return self.first_offset

    def _keep_last(self, n: int) -> None:
        nxt = self.end_offset
        nodes = self.nodes
        k = 0
        while k + 1 < len(nodes) and nxt - nodes[k + 1].base_offset >= n:
            k += 1
        if k:
            self._set_first_offset(self._guarded(nodes[k].base_offset))

    def _drop_whole_nodes(self, drop: Callable[[NodeRef], bool]) -> None:
        k = 0
        while k + 1 < len(self.nodes) and drop(self.nodes[k]):
            k += 1
        if k:
            self._set_first_offset(self._guarded(self.nodes[k].base_offset))

    def apply_retention(self, now_ms: int) -> None:
        cfg = self.config
        if cfg.max_entries is None and cfg.max_age_ms is None and cfg.max_bytes is None:
            return
        with self.maintenance_lock:
            if cfg.max_age_ms is not None:
                cutoff = self.seek_time(now_ms - cfg.max_age_ms)
                with self.lock:
                    self._set_first_offset(self._guarded(cutoff))
            with self.lock:
                if cfg.max_entries is not None:
                    self._keep_last(cfg.max_entries)
                if cfg.max_bytes is not None:
                    total = sum(ref.disk_size for ref in self.nodes)
                    k = 0
                    while k + 1 < len(self.nodes) and total > cfg.max_bytes:
                        total -= self.nodes[k].disk_size
                        k += 1
                    if k:
                        self._set_first_offset(self._guarded(self.nodes[k].base_offset))

    # ------------------------------------------------------------------ packing and compaction

    def _rewrite(self, old: Segment, bodies: Iterable[tuple[NodeBody, int, int, int]]) -> Segment:
        """Replace `old` with a packed file holding `bodies`, and return it; crash-safe (write,
        fsync, rename, fsync dir). Each node is read, encoded and written in turn: a segment is
        never whole in memory. An error from `bodies` (a corrupt node) leaves `old` as it was.
        """
        cfg = self.ctx.config
        compressor = zstandard.ZstdCompressor(level=cfg.compression_level) if cfg.compression else None
        nodes = (encode_packed_node(body, lo, hi, flags, compressor) for body, lo, hi, flags in bodies)
        base, end, created = old.base_offset, old.end_offset(), old.header.created_ms

        def header(size: int) -> bytes:
            return SegmentHeader(base, end, size, created, flags=0x1).encode()

        self.ctx.fs.write_file_atomic(old.path, nodes, head=header)
        new, cut = Segment.open(self.ctx.fs, old.path, writable=False, verify=False)
        if cut:
            raise CorruptionError(f"rewritten segment {old.path.name} does not read back: {cut}")
        with self.lock:
            index = self.segments.index(old)
            self.segments[index] = new
            keep = [ref for ref in self.nodes if ref.segment is not old]
            self.nodes, self.bases, self.max_ts = [], array("q"), array("q")
            self._holes = None
            fresh = [ref for ref in new.nodes if ref.end_offset > self.first_offset]
            for ref in sorted(keep + fresh, key=lambda r: r.base_offset):
                self._index_append(ref)
            self.dirty.discard(old.file)
            self.ctx.cache.drop_segment(old.uid)
            old.close()
        return new

    def _bodies(self, segment: Segment) -> Iterator[tuple[NodeBody, int, int, int]]:
        """The segment's retained nodes, read one at a time (CorruptionError at a bad one)."""
        for ref in segment.nodes:
            if ref.end_offset <= self.first_offset:
                continue
            body = segment.read_body(ref, _decompressor())
            yield body, ref.header.min_ts, ref.header.max_ts, ref.header.flags

    def pack_pending(self) -> int:
        """Compress full segments waiting in the queue. Returns how many were packed."""
        packed = 0
        with self.maintenance_lock:
            while True:
                with self.lock:
                    if not self.pack_queue:
                        return packed
                    segment = self.pack_queue.pop(0)
                    if segment not in self.segments:
                        continue
                try:
                    self._rewrite(segment, self._bodies(segment))
                    packed += 1
                except CorruptionError as exc:
                    # It stays readable as it is, node by node; packing it would drop the bad node.
                    log.error("stream %r: segment %s not packed: %s", self.name, segment.path.name, exc)
                except StorageError:
                    with self.lock:
                        self.pack_queue.insert(0, segment)  # e.g. disk full: try again next round
                    raise

    def compact(self, now_ms: int) -> int:
        """Keep only the latest entry per tag in sealed segments. Returns the entries removed.

        Incremental, like Kafka's cleaner with its dirty section: the index of the
        latest offset per tag is kept between rounds, with the superseded offsets of
        each segment, and only records appended since the last round are decoded. A
        round rewrites only the sealed segments that hold a superseded entry or an
        expired tombstone, selecting survivors by offset without decoding their
        records. Memory: one entry per tag, and 8 bytes per superseded entry not yet
        removed. (After a restart the first round rebuilds the index from the whole
        stream.)
        """
        # Superseding entries must be on disk before what they supersede is removed,
        # or a power loss could lose a key altogether.
        self.sync()
        with self.maintenance_lock:
            with self.lock:
                if not self.segments:
                    return 0
                *sealed, active = self.segments
                refs = list(self.nodes)
            index = self._tags
            bases = [segment.base_offset for segment in sealed] + [active.base_offset]
            index.keep_segments(bases)
            for ref in refs:
                if ref.end_offset <= index.scanned_to:
                    continue
                try:
                    view = self._view(ref)
                except CorruptionError:
                    continue
                start = view.index_of(index.scanned_to)
                data = view.slice(start, view.count)
                pos = 0
                for _ in range(start, view.count):
                    entry, pos = decode_record(data, pos)
                    if entry.tag:
                        index.note(entry.tag, entry.offset, not entry.payload, entry.timestamp_ms, bases)
                index.scanned_to = max(index.scanned_to, ref.end_offset)
            expired = index.expired(now_ms - self.config.tombstone_retention_ms)
            removed = 0
            for segment in sealed:
                base, end = segment.base_offset, segment.end_offset()
                doomed = {o for o in expired if base <= o < end}
                doomed.update(index.superseded.get(base, ()))
                if not doomed:
                    continue
                before = _entries_from(segment, self.first_offset)
                survivors = (
                    (kept, lo, hi, flags)
                    for body, lo, hi, flags in self._bodies(segment)
                    if (kept := _without_offsets(body, doomed)) is not None
                )
                try:
                    packed = self._rewrite(segment, survivors)
                except CorruptionError as exc:
                    log.error("stream %r: segment %s not compacted: %s", self.name, segment.path.name, exc)
                    continue
                removed += before - _entries_from(packed, self.first_offset)
                index.forget(base, doomed)
            self.last_compaction_ms = now_ms
            return removed

    # ------------------------------------------------------------------ info

    def info(self) -> StreamInfo:
        with self.lock:
            raw = stored = 0
            for segment in self.segments:
                if not segment.packed:
                    continue
                for ref in segment.nodes:
                    h = ref.header
                    tables = 2 if h.flags & NODE_SPARSE else 1
                    raw += 4 * h.count * tables + h.blob_len
                    stored += h.stored_len if h.flags & NODE_ZSTD else 4 * h.count * tables + h.blob_len
            return StreamInfo(
                name=self.name,
                first_offset=self.first_offset,
                end_offset=self.visible_end,
                entries_added=self.visible_end,
                entries=self.count(self.first_offset, self.visible_end),
                bytes_on_disk=sum(s.file.size for s in self.segments),
                used_bytes=sum(s.file.size if s.packed else s.end_pos for s in self.segments),
                segments=len(self.segments),
                packed_segments=sum(1 for s in self.segments if s.packed),
                nodes=len(self.nodes),
                compression_ratio=(raw / stored) if stored else 1.0,
                last_timestamp_ms=self.last_ts,
                config=self.config,
                damaged=tuple(self.damaged),
            )

    def set_config(self, config: StreamConfig) -> None:
        with self.maintenance_lock, self.lock:
            self.ctx.fs.write_file_atomic(
                self.directory / META_FILE, encode_meta(self.name, self.first_offset, config)
            )
            self.config = config

    def close(self, clean: bool = True) -> None:
        """Sync, mark a clean shutdown, and release files."""
        with self.maintenance_lock:
            if self.closed:
                return
            if clean and self.gate.error is None:
                self.sync()
                self.save_producers(self.ctx.clock())
                self.ctx.fs.write_file_atomic(self.directory / CLEAN_MARKER, b"clean\n")
            with self.lock:
                self.closed = True
                for segment in self.segments:
                    self.ctx.cache.drop_segment(segment.uid)
                    segment.close()
                self.segments.clear()
                self.nodes.clear()


def _after(offset: int, last: int | None, gap: Gap | None) -> int:
    """Where a forward read at `offset` continues: after its last entry, else after its gap."""
    if last is not None:
        return last + 1
    return max(offset, gap.end_offset) if gap is not None else offset


def _before(last: int | None, first: int) -> int:
    """Where a reverse read continues: below its last entry, or -1 when nothing older remains."""
    return -1 if last is None or last - 1 < first else last - 1


def _producer_table(cfg: EngineConfig) -> ProducerTable:
    return ProducerTable(cfg.dedup_batches_per_producer, cfg.dedup_window_ms, cfg.dedup_max_producers)


class _TagIndex:
    """For compaction: the latest offset of each tag, and per segment the offsets that newer ones
    superseded (8 bytes each, kept until the segment is rewritten without them)."""

    def __init__(self) -> None:
        self.latest: dict[str, tuple[int, bool, int]] = {}  # tag -> (offset, is tombstone, timestamp)
        self.superseded: dict[int, array] = {}  # segment base offset -> offsets superseded in it
        self.scanned_to = 0  # records below this offset are in the index

    def note(self, tag: str, offset: int, tombstone: bool, timestamp_ms: int, bases: Sequence[int]) -> None:
        """Record `offset` as the latest of `tag`; `bases` are the stream's segments' base offsets."""
        previous = self.latest.get(tag)
        if previous is not None:
            at = bisect_right(bases, previous[0]) - 1
            if at >= 0:  # else it was evicted with its segment
                row = self.superseded.get(bases[at])
                if row is None:
                    row = self.superseded[bases[at]] = array("q")
                row.append(previous[0])
        self.latest[tag] = (offset, tombstone, timestamp_ms)

    def expired(self, tombstone_horizon_ms: int) -> list[int]:
        """Offsets of tombstones older than the horizon: their keys are removed altogether."""
        return [o for o, tomb, ts in self.latest.values() if tomb and ts < tombstone_horizon_ms]

    def keep_segments(self, bases: Sequence[int]) -> None:
        """Forget what was superseded in segments that are gone (evicted by retention)."""
        for base in set(self.superseded) - set(bases):
            del self.superseded[base]

    def forget(self, base: int, removed: set[int]) -> None:
        """The segment at `base` was rewritten without `removed`."""
        self.superseded.pop(base, None)
        for tag in [t for t, (o, _, _) in self.latest.items() if o in removed]:
            del self.latest[tag]  # an expired tombstone: the key is gone


def _entries_from(segment: Segment, first_offset: int) -> int:
    """Entries the segment holds in nodes that end after first_offset (the nodes a rewrite keeps)."""
    return sum(ref.header.count for ref in segment.nodes if ref.end_offset > first_offset)


def _without_offsets(body: NodeBody, drop: set[int]) -> NodeBody | None:
    """The body without the entries at the offsets in `drop` (None if nothing is left)."""
    keep = [i for i in range(body.count) if body.offset_at(i) not in drop]
    if len(keep) == body.count:
        return body
    if not keep:
        return None
    blob_parts = []
    positions = array("I", [0])
    deltas = array("I")
    for i in keep:
        record = body.blob[body.positions[i] : body.positions[i + 1]]
        blob_parts.append(record)
        positions.append(positions[-1] + len(record))
        deltas.append(body.offset_at(i) - body.base_offset)
    return NodeBody(body.base_offset, positions, b"".join(blob_parts), deltas)
