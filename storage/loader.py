"""Recovery: opening one stream's directory at start-up (Kafka's LogLoader).

`LogLoader.load` turns what a clean shutdown, a crash or a power loss left on
disk into the state a stream starts from (`LoadedLog`), repairing what it
must, in this order (docs/FORMAT.md, "Recovery rules"):

- `*.tmp` files (a rewrite that crashed before its rename) are removed;
- trailing segments in which no node was ever written are removed;
- each segment's node headers are read; the last segment's node bodies are
  checked too, but for the prefix its `SYNCED` marker names (in its slot, or in the
  stream's `SYNCED` file: storage/cleanmark.py; all of it after a version-2 `CLEAN`
  marker), and a torn tail is cut (durably);
- a segment whose header is damaged is salvaged from its node chain;
- a segment that the packed segment before it covers entirely is what a
  merge of small segments left behind when a crash came before its removal:
  it is removed;
- every other range that cannot be read is reported as damaged (`corrupt`
  gaps), and no offset it may hold is handed out again;
- the node index is built from the headers alone, and the idempotent-append
  table is loaded and caught up with the batches written after its snapshot.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from storage.cleanmark import SyncedEnd, slot_marker
from storage.context import EngineContext
from storage.dedup import BatchRecord, ProducerTable
from storage.errors import CorruptionError
from storage.format import (
    NODE_PREFIX_SIZE,
    NODE_PRODUCER,
    SEGMENT_HEADER_SIZE,
    SLOTTED_HEADER_SIZE,
    SegmentHeader,
)
from storage.fs import SegmentFile
from storage.growing import GrowingNode
from storage.index import NodeIndex
from storage.layout import (
    DAMAGED_SUFFIX,
    PRODUCERS_FILE,
    SEGMENT_SUFFIX,
    TMP_SUFFIX,
    segment_base,
    segment_name,
)
from storage.packed import decompressor
from storage.records import find_producers
from storage.results import Gap
from storage.segment import NodeRef, Segment
from storage.types import GapReason

log = logging.getLogger("streamlog.storage")


@dataclass
class LoadedLog:
    """What a stream starts from."""

    segments: list[Segment]
    index: NodeIndex  # the retained nodes
    active: GrowingNode | None  # the node appends resume into
    first_offset: int
    end_offset: int
    damaged: list[Gap]
    producers: ProducerTable
    synced: SyncedEnd | None  # the SYNCED marker recovery went by (None after a clean close)


def new_producer_table(ctx: EngineContext) -> ProducerTable:
    cfg = ctx.config
    return ProducerTable(cfg.dedup_batches_per_producer, cfg.dedup_window_ms, cfg.dedup_max_producers)


def record_producers(producers: ProducerTable, records: bytes | memoryview) -> None:
    """Note in the table the idempotent batches that end among `records` (stored records)."""
    for offset, timestamp_ms, producer, sequence in find_producers(records):
        # Its first offset is not stored: a retry carries the same batch, whose length tells.
        producers.record(producer, sequence, BatchRecord(-1, offset, timestamp_ms))


class LogLoader:
    def __init__(self, ctx: EngineContext, name: str, directory: Path) -> None:
        self.ctx = ctx
        self.name = name
        self.directory = directory
        self.damaged: list[Gap] = []  # an end of -1: "up to the next retained node"
        self.set_aside: list[str] = []  # segment files set aside as damaged (DAMAGED_SUFFIX)

    def load(
        self, meta_first: int, clean: bool, synced: SyncedEnd | None, files: list[str], held: int = 0
    ) -> LoadedLog:
        """The stream's state, from the first offset its meta file holds, whether nothing was
        written since a clean close (node bodies are trusted and not read), otherwise how far
        its last clean close synced it (its `SYNCED` file's marker, if any: the last segment's
        slot says it otherwise; the bodies past that are checked), the names in its directory
        (sorted), and the entries the catalog counted in it at its last close (`held`)."""
        self.set_aside = [f for f in files if f.endswith(SEGMENT_SUFFIX + DAMAGED_SUFFIX)]
        names, synced = self._segment_files(files, synced, held)
        if clean:
            synced = None
        segments = self._open_segments(names, clean, synced)
        if not segments and self.set_aside:
            # What the stream held is unknown (its offsets too): unreadable, never opened empty.
            raise CorruptionError(f"no readable segment: {', '.join(self.set_aside)} set aside as damaged")
        tail = segments[-1] if segments else None
        resumed = tail.nodes[-1] if tail is not None and not tail.packed and tail.nodes else None
        # The node appends resume into stays indexed even when trimmed past, as it is live.
        index = NodeIndex(r for s in segments for r in s.nodes if r.end_offset > meta_first or r is resumed)
        end = tail.end_offset() if tail is not None else 0
        # Never hand out an offset that a damaged segment may hold.
        damage_ends = (max(g.start_offset, g.end_offset) for g in self.damaged)
        end_offset = max([end, meta_first, *damage_ends])
        # Resolve damage ranges that ran to "the next segment" once that is known.
        damaged = [
            g
            if g.end_offset >= 0
            else Gap(g.start_offset, _or(index.base_after(g.start_offset), end_offset), g.reason)
            for g in self.damaged
        ]
        active = GrowingNode.resume(resumed) if resumed is not None else None
        producers = self._load_producers(index.nodes, active, end_offset, damaged, PRODUCERS_FILE in files)
        return LoadedLog(segments, index, active, max(meta_first, 0), end_offset, damaged, producers, synced)

    def load_slot(self, file: SegmentFile) -> LoadedLog:
        """The state of a stream in a slot (storage/slothome.py): its one segment, every node
        checked (a slot stream has no SYNCED marker: at most 3.5 KiB to read, from the copy
        the slot's open read), a torn tail cut, durably, before an append goes on; its producers
        rebuilt from its nodes (it keeps no snapshot). CorruptionError if the segment's header
        fails its checks: the stream is unreadable, its slot kept for the operator."""
        segment, cut = Segment.over(file, verify=True)
        if cut:
            log.warning("stream %r: its slot: %s", self.name, cut)
            segment.truncate_after(segment.end_pos)
            segment.file.sync()
        resumed = segment.nodes[-1] if segment.nodes else None
        index = NodeIndex(segment.nodes)
        end_offset = segment.end_offset()
        active = GrowingNode.resume(resumed) if resumed is not None else None
        producers = self._load_producers(index.nodes, active, end_offset, self.damaged, False)
        return LoadedLog([segment], index, active, 0, end_offset, self.damaged, producers, None)

    # ------------------------------------------------------------------ segments

    def _segment_files(
        self, files: list[str], synced: SyncedEnd | None, held: int
    ) -> tuple[list[str], SyncedEnd | None]:
        """The segment files to open, and the SYNCED marker to go by: the last one's slot's if it
        holds one, else `synced` (the stream's `SYNCED` file's). The stream's only segment is set
        aside as damaged, not removed, if neither its header nor a node reads though the catalog
        counted `held` entries in it."""
        fs = self.ctx.fs
        for leftover in (f for f in files if f.endswith(TMP_SUFFIX)):
            fs.remove(self.directory / leftover)  # a rewrite that crashed before its rename
        names = [f for f in files if f.endswith(SEGMENT_SUFFIX)]
        # A trailing growing segment in which no node was ever written holds no entry: remove it.
        # It may be a creation that a crash cut short (header torn or missing, preallocation
        # lost), and a new segment of the same name must be creatable at the same base offset. A
        # packed one is written whole (renamed into place): without nodes it covers a hole that a
        # follower copied from its leader (storage/replica.py), and its end counts. The segment
        # a SYNCED file names held a node when it was synced: its head need not be read.
        marked = segment_name(synced.base_offset) if synced is not None and synced.node_pos else None
        while names and names[-1] != marked:
            head = fs.read_head(self.directory / names[-1], SLOTTED_HEADER_SIZE + NODE_PREFIX_SIZE)
            header = _header(head)
            if header is not None and header.packed:
                break
            if _holds_node(head, header):
                return names, (slot_marker(head, header) if header is not None else None) or synced
            if held and len(names) == 1 and header is None:
                # Not a creation a crash cut short: the stream had entries (a file cut short or
                # overwritten). Kept for the operator: the stream is unreadable, not empty. (A
                # whole header without nodes may be a truncation the catalog did not see yet.)
                log.error("stream %r: its only segment holds none of its %d entries", self.name, held)
                self._set_aside(self.directory / names.pop())
                break
            fs.remove(self.directory / names.pop())
        return names, synced

    def _open_segments(self, names: list[str], clean: bool, synced: SyncedEnd | None) -> list[Segment]:
        fs = self.ctx.fs
        segments: list[Segment] = []
        expected = segment_base(names[0]) if names else None
        for i, fname in enumerate(names):
            last = i == len(names) - 1
            verify = last and not clean
            opened = self._open_segment(self.directory / fname, verify, synced if verify else None)
            if opened is None:
                continue
            segment, cut = opened
            if expected is not None and segment.base_offset != expected:
                if segment.base_offset < expected:
                    if segments and segments[-1].packed and segment.end_offset() <= expected:
                        # A merge wrote this segment's nodes into the one before, then a crash
                        # came before this file was removed: finish the merge.
                        log.warning("stream %r: segment %s was merged into its predecessor", self.name, fname)
                        segment.close()
                        fs.remove(segment.path)
                        continue
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
            segments.append(segment)
            expected = segment.end_offset()
        return segments

    def _open_segment(
        self, path: Path, verify: bool, synced: SyncedEnd | None
    ) -> tuple[Segment, str | None] | None:
        """Open one segment; salvage it if its header is damaged; None if nothing can be read."""
        try:
            return Segment.open(self.ctx.fs, path, writable=True, verify=verify, synced=synced)
        except CorruptionError as exc:
            log.error("stream %r: segment %s has a damaged header (%s)", self.name, path.name, exc)
        base = segment_base(path.name)
        salvaged = Segment.salvage(self.ctx.fs, path, base)
        if salvaged is None:
            self._set_aside(path)
            self._note_damage(Gap(base, -1, GapReason.CORRUPT))
            return None
        log.warning("stream %r: segment %s salvaged: header rewritten", self.name, path.name)
        return salvaged, None

    def _set_aside(self, path: Path) -> None:
        """Keep a damaged segment for the operator, out of the way of a new one of the same name."""
        self.ctx.fs.rename(path, path.with_name(path.name + DAMAGED_SUFFIX))
        self.set_aside.append(path.name + DAMAGED_SUFFIX)

    def _note_damage(self, gap: Gap) -> None:
        log.error(
            "stream %r: offsets %d..%d are damaged and will be skipped",
            self.name,
            gap.start_offset,
            gap.end_offset,
        )
        self.damaged.append(gap)

    # ------------------------------------------------------------------ idempotent appends

    def _load_producers(
        self,
        nodes: Sequence[NodeRef],
        active: GrowingNode | None,
        end_offset: int,
        damaged: list[Gap],
        snapshot: bool,
    ) -> ProducerTable:
        """The idempotent-append table: its snapshot (if `snapshot`: the file is there), then the
        batches written after it."""
        fs = self.ctx.fs
        path = self.directory / PRODUCERS_FILE
        producers = new_producer_table(self.ctx)
        if snapshot:
            try:
                producers.load(fs.read_file(path))
            except CorruptionError as exc:
                log.error("stream %r: %s; rebuilding it from the stream", self.name, exc)
                producers = new_producer_table(self.ctx)
        producers.forget_from(end_offset)  # batches a power loss took back
        horizon = self.ctx.clock() - self.ctx.config.dedup_window_ms
        for ref in nodes:
            h = ref.header
            if ref.end_offset <= producers.scanned_to or not h.flags & NODE_PRODUCER or h.max_ts < horizon:
                continue
            if active is not None and ref is active.ref:
                body = active.body()
            else:
                try:
                    body = ref.segment.read_body(ref, decompressor())
                except CorruptionError as exc:
                    if ref.mark_corrupt(self.name, exc):
                        damaged.append(ref.damage())
                    continue
            record_producers(producers, body.blob)
        producers.scanned_to = end_offset
        return producers


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def _header(head: bytes) -> SegmentHeader | None:
    """The segment header these bytes start with; None if it is torn or missing."""
    try:
        return SegmentHeader.decode(head)
    except CorruptionError:
        return None


def _holds_node(head: bytes, header: SegmentHeader | None) -> bool:
    """Whether a growing segment's first bytes show a node written. Under a torn header, any
    byte past byte 64 counts: a version 3 file's SYNCED slot is written only after a close's
    sync, which made its header durable."""
    if header is None:
        return any(head[SEGMENT_HEADER_SIZE:])
    return any(head[header.size : header.size + NODE_PREFIX_SIZE])
