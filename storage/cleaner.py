"""The jobs that rewrite a stream's sealed segments (Kafka's log cleaner, and more):

- packing: a full growing segment is rewritten as a packed file, its nodes
  compressed one by one;
- compaction: only the latest entry per tag survives in sealed segments (an
  empty payload with a tag is a tombstone, removed after a delay);
- merging: runs of adjacent packed segments that compaction left small are
  merged into one file (at most `segment_bytes`), so a long-lived keyed stream
  does not keep one small file per `segment_bytes` ever written.

Each rewrite is crash-safe (storage/packed.py writes the new file next to the
old one and renames it over), then swaps the segments in the stream's list and
index under its lock. All of them run under the stream's `maintenance_lock`,
so they never race each other or retention.
"""

from __future__ import annotations

import logging
from array import array
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import zstandard

from storage.errors import CorruptionError, StorageError
from storage.format import NodeBody
from storage.packed import decompressor, encode_packed_node, write_packed_segment
from storage.records import decode_record
from storage.segment import Segment

if TYPE_CHECKING:
    from storage.stream import Stream

log = logging.getLogger("streamlog.storage")

Bodies = Iterable[tuple[NodeBody, int, int, int]]  # node body, min and max timestamp, flags


class Cleaner:
    def __init__(self, stream: Stream) -> None:
        self._stream = stream
        self.tags = TagIndex()  # compaction's index, built up round by round
        self.last_compaction_ms = 0

    # ------------------------------------------------------------------ packing

    def pack_pending(self) -> int:
        """Compress full segments waiting in the stream's queue. Returns how many were packed."""
        stream = self._stream
        packed = 0
        with stream.maintenance_lock:
            while True:
                with stream.lock:
                    if not stream.pack_queue:
                        return packed
                    segment = stream.pack_queue.pop(0)
                    if segment not in stream.segments:
                        continue
                try:
                    self._rewrite(segment, self._bodies(segment))
                    packed += 1
                except CorruptionError as exc:
                    # It stays readable as it is, node by node; packing it would drop the bad node.
                    log.error("stream %r: segment %s not packed: %s", stream.name, segment.path.name, exc)
                except StorageError:
                    with stream.lock:
                        stream.pack_queue.insert(0, segment)  # e.g. disk full: try again next round
                    raise

    # ------------------------------------------------------------------ compaction

    def compact(self, now_ms: int) -> int:
        """Keep only the latest entry per tag in sealed segments, then merge the small segments
        that leaves. Returns the entries removed.

        Incremental, like Kafka's cleaner with its dirty section: the index of the
        latest offset per tag is kept between rounds, with the superseded offsets of
        each segment, and only records appended since the last round are decoded. A
        round rewrites only the sealed segments that hold a superseded entry or an
        expired tombstone, selecting survivors by offset without decoding their
        records. Memory: one entry per tag, and 8 bytes per superseded entry not yet
        removed. (After a restart the first round rebuilds the index from the whole
        stream.)
        """
        stream = self._stream
        # Superseding entries must be on disk before what they supersede is removed,
        # or a power loss could lose a key altogether.
        stream.sync()
        with stream.maintenance_lock:
            with stream.lock:
                if not stream.segments:
                    return 0
                *sealed, active = stream.segments
                refs = list(stream.index.nodes)
            index = self.tags
            bases = [segment.base_offset for segment in sealed] + [active.base_offset]
            index.keep_segments(bases)
            self._scan_tags(refs, bases)
            expired = index.expired(now_ms - stream.config.tombstone_retention_ms)
            removed = 0
            for segment in sealed:
                base, end = segment.base_offset, segment.end_offset()
                doomed = {o for o in expired if base <= o < end}
                doomed.update(index.superseded.get(base, ()))
                if not doomed:
                    continue
                before = _entries_from(segment, stream.first_offset)
                survivors = (
                    (kept, lo, hi, flags)
                    for body, lo, hi, flags in self._bodies(segment)
                    if (kept := _without_offsets(body, doomed)) is not None
                )
                try:
                    packed = self._rewrite(segment, survivors)
                except CorruptionError as exc:
                    log.error("stream %r: segment %s not compacted: %s", stream.name, segment.path.name, exc)
                    continue
                removed += before - _entries_from(packed, stream.first_offset)
                index.forget(base, doomed)
            self._merge_small()
            self.last_compaction_ms = now_ms
            return removed

    def _scan_tags(self, refs: Sequence, bases: Sequence[int]) -> None:
        """Note the tag of every record appended since the last round."""
        index = self.tags
        for ref in refs:
            if ref.end_offset <= index.scanned_to:
                continue
            try:
                view = self._stream.view(ref)
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

    # ------------------------------------------------------------------ merging

    def _merge_small(self) -> None:
        """Merge each run of adjacent packed sealed segments that fits in `segment_bytes` together."""
        stream = self._stream
        limit = stream.ctx.config.segment_bytes
        with stream.lock:
            sealed = stream.segments[:-1]
            damaged = list(stream.damaged)
        run: list[Segment] = []
        size = 0
        for segment in sealed:
            mergeable = segment.packed and not _holds_damage(segment, damaged)
            if mergeable and run and size + segment.file.size <= limit:
                run.append(segment)
                size += segment.file.size
                continue
            self._merge(run)
            run, size = ([segment], segment.file.size) if mergeable else ([], 0)
        self._merge(run)

    def _merge(self, run: list[Segment]) -> None:
        """One packed file in place of the run (if it has two segments or more): their nodes copied
        as they are (a packed node does not depend on where it sits), named after the first."""
        if len(run) < 2:
            return
        stream = self._stream
        first = stream.first_offset
        nodes = (
            segment.file.read(ref.pos, ref.disk_size)
            for segment in run
            for ref in segment.nodes
            if ref.end_offset > first
        )
        try:
            self._replace(run, nodes)
        except CorruptionError as exc:
            log.error("stream %r: segments from %s not merged: %s", stream.name, run[0].path.name, exc)
            return
        self.tags.merge_segments([segment.base_offset for segment in run])

    # ------------------------------------------------------------------ rewriting one segment

    def _bodies(self, segment: Segment) -> Iterator[tuple[NodeBody, int, int, int]]:
        """The segment's retained nodes, read one at a time (CorruptionError at a bad one)."""
        for ref in segment.nodes:
            if ref.end_offset <= self._stream.first_offset:
                continue
            body = segment.read_body(ref, decompressor())
            yield body, ref.header.min_ts, ref.header.max_ts, ref.header.flags

    def _rewrite(self, old: Segment, bodies: Bodies) -> Segment:
        """Replace `old` with a packed file holding `bodies`, each node read, encoded and written in
        turn. An error from `bodies` (a corrupt node) leaves `old` as it was."""
        cfg = self._stream.ctx.config
        compressor = zstandard.ZstdCompressor(level=cfg.compression_level) if cfg.compression else None
        nodes = (encode_packed_node(body, lo, hi, flags, compressor) for body, lo, hi, flags in bodies)
        return self._replace([old], nodes)

    def _replace(self, old: list[Segment], nodes: Iterable[bytes]) -> Segment:
        """Replace adjacent segments `old` with one packed file, named after the first, holding
        `nodes` (encoded packed nodes); returns it.

        The new file replaces the first one atomically; the others are removed after, and a crash
        in between leaves segments that the new one covers, which recovery removes. An error from
        `nodes` (a corrupt node) leaves every segment as it was.
        """
        stream = self._stream
        fs = stream.ctx.fs
        head = old[0]
        end = old[-1].end_offset()
        write_packed_segment(fs, head.path, head.base_offset, end, head.header.created_ms, nodes)
        new, cut = Segment.open(fs, head.path, writable=False, verify=False)
        if cut:
            raise CorruptionError(f"rewritten segment {head.path.name} does not read back: {cut}")
        with stream.lock:
            at = stream.segments.index(head)
            stream.segments[at : at + len(old)] = [new]
            stream.index.replace_segments(old, (r for r in new.nodes if r.end_offset > stream.first_offset))
            for segment in old:
                stream.release(segment)
        for segment in old[1:]:
            fs.remove(segment.path)
        return new


class TagIndex:
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

    def merge_segments(self, bases: Sequence[int]) -> None:
        """The segments at `bases` are now one, at bases[0]: what was superseded in them is in it."""
        rows = [row for base in bases if (row := self.superseded.pop(base, None)) is not None]
        if rows:
            self.superseded[bases[0]] = array("q", [o for row in rows for o in row])


def _holds_damage(segment: Segment, damaged: Sequence) -> bool:
    """Whether a damaged range falls in the segment: it stays as it is, for the operator."""
    base, end = segment.base_offset, segment.end_offset()
    return any(g.start_offset < end and base < g.end_offset for g in damaged)


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
