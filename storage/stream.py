"""One stream: its state (segments, node index, active node, ends), the append and
read entry points, open, close and configuration.

Its halves live beside it, each taking the stream: the writes into nodes and
segments in storage/nodewriter.py, the reads in storage/reader.py, a sync in
storage/durability.py (`sync_now`), its figures and catalog summary in
storage/streaminfo.py; recovery at start-up in storage/loader.py, retention in
storage/retention.py, and the rewrites of sealed segments (packing, compaction,
merging) in storage/cleaner.py; those it makes on first use in storage/streamparts.py.

Locking: `lock` guards the index and the active node (appends, reads, index
changes); `maintenance_lock` serialises the slow jobs that rewrite or delete
files (packing, compaction, retention) so they never race each other. Syncs
run outside `lock`, so appenders keep writing while a flush is on its way.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path

from storage.catalog import StreamSummary
from storage.cleanmark import SYNCED_MARKER, SyncedEnd, erase_slot, read_synced_end, write_synced_end
from storage.config import StreamConfig
from storage.context import EngineContext
from storage.creation import PendingCreation, start_creation
from storage.durability import SyncGate, sync_now
from storage.epochs import EpochHistory
from storage.errors import (
    CorruptionError,
    DurabilityError,
    InvalidArgumentError,
    LimitExceededError,
    OffsetMismatchError,
    StorageError,
)
from storage.fs import SegmentFile
from storage.growing import GrowingNode
from storage.handoff import UnsyncedClose
from storage.index import NodeIndex
from storage.layout import (
    CLEAN_MARKER,
    EPOCHS_FILE,
    TRUNCATE_MARKER,
    read_meta,
    write_meta,
)
from storage.loader import LogLoader
from storage.nodewriter import append_one, append_together
from storage.packed import decompressor
from storage.reader import count_entries, read_backward, read_forward, seek_time
from storage.results import AppendResult, EntriesMeta, Gap, ReadResult
from storage.segment import NodeRef, NodeView, Segment
from storage.streaminfo import stream_summary
from storage.streamparts import StreamParts
from storage.types import AppendBatch, FsyncPolicy, StreamBounds

log = logging.getLogger("streamlog.storage")


class Stream(StreamParts):
    def __init__(self, ctx: EngineContext, name: str, directory: Path, config: StreamConfig) -> None:
        self.ctx = ctx
        self.name = name
        self.directory = directory
        self.config = config
        self.fsync: FsyncPolicy = config.fsync or ctx.config.fsync  # kept by set_config; no property
        self.lock = threading.RLock()
        # Under "always" an append waits for the sync in flight (`_check_writable`): notified when
        # a sync ends, and when the appends that waited have written (the next sync waits for them).
        self.sync_ended = threading.Condition(self.lock)
        self.blocked_writers = 0
        self.maintenance_lock = threading.Lock()
        self.gate = SyncGate()
        self.segments: list[Segment] = []
        self.index = NodeIndex()
        self.active: GrowingNode | None = None
        self.first_offset = 0
        self.end_offset = 0
        # The end this replica vouches for: in "always" mode only synced entries count, else all.
        self.local_end = 0
        self.commit: int | None = None  # a cap replication sets (set_commit); None: no cap
        self.visible_end = 0  # reads stop here: local_end, capped at commit
        self.last_ts = 0
        self.write_seq = 0
        self.cuts = 0  # truncations so far: a sync that began before one does not publish its end
        self.dirty: set[SegmentFile] = set()
        self.creation: PendingCreation | None = None  # a new stream not yet durable
        # A version-2 CLEAN marker is still on disk (opened after a clean close by an earlier
        # version, nothing written since): removed, durably, before the first write
        # (`_check_writable`). The SYNCED marker that replaced it stays (storage/cleanmark.py).
        self.clean_marker = False
        self.synced_mark: SyncedEnd | None = None  # the SYNCED marker as the open found it
        self.marker_file = False  # a SYNCED file in its directory as the open found it (to remove)
        self.pack_queue: list[Segment] = []  # full segments waiting to be packed
        self.damaged: list[Gap] = []
        self.closed = False
        # OpenStreams' bookkeeping: one item per call using it now (a list: append and pop are
        # atomic, so a pin takes no lock), set when it is being closed, and when it was last
        # handed out unpinned (monotonic seconds).
        self.pins: list[None] = []
        self.evicted = False
        self.touched = 0.0
        # What maintenance last did here (write_seq then, wall-clock ms): when to visit it again.
        self.upkept_seq = 0
        self.upkept_ms = 0
        self.closed_summary: StreamSummary | None = None  # set by close
        self.has_epochs = False  # its epochs file exists (a replicated stream's): the catalog lists it
        # Its producers, epochs, cleaner, retention and truncation are made on first use (StreamParts).

    # ------------------------------------------------------------------ open / create

    @classmethod
    def create(
        cls, ctx: EngineContext, name: str, directory: Path, config: StreamConfig, incarnation: int = 0
    ) -> Stream:
        stream = cls(ctx, name, directory, config)
        if incarnation:  # a replicated stream: durable at once, epochs first
            ctx.fs.makedirs(directory)
            # Before the meta file: a crash in between leaves a directory start-up removes.
            stream.save_epochs(EpochHistory(incarnation))
            write_meta(ctx.fs, directory, name, 0, config)
        else:  # no sync now: the stream's first sync makes it durable (storage/creation.py)
            stream.creation = start_creation(ctx.fs, ctx.streams_dir, name, directory, config)
        return stream

    @classmethod
    def open(
        cls, ctx: EngineContext, directory: Path, handed: UnsyncedClose | None = None, held: int = 0
    ) -> Stream:
        """Open a stream's directory; `handed`: its last close, which left its files unsynced and
        which it takes back (storage/handoff.py: no crash came between, so its bodies are trusted);
        `held`: the entries the catalog counted in it (CorruptionError if its files hold none)."""
        fs = ctx.fs
        files = fs.listdir(directory)  # one listing answers every "is it there?" below
        present = set(files)
        name, first_offset, config = read_meta(fs, directory, present)
        stream = cls(ctx, name, directory, config)
        old_clean = CLEAN_MARKER in present
        clean = handed is not None or old_clean
        synced = read_synced_end(fs, directory) if not clean and SYNCED_MARKER in present else None
        loaded = LogLoader(ctx, name, directory).load(first_offset, clean, synced, files, held)
        stream.segments, stream.index, stream.active = loaded.segments, loaded.index, loaded.active
        stream.first_offset = loaded.first_offset
        stream.end_offset = stream.local_end = stream.visible_end = loaded.end_offset
        stream.damaged, stream.producers = loaded.damaged, loaded.producers
        stream.last_ts = stream.index.max_ts[-1] if len(stream.index) else 0
        if ctx.config.compression:
            stream.pack_queue = [s for s in stream.segments[:-1] if not s.packed]
        if EPOCHS_FILE in present:
            stream.epochs = EpochHistory.decode(fs.read_file(directory / EPOCHS_FILE))
            stream.has_epochs = True
        stream.clean_marker = old_clean
        stream.synced_mark = loaded.synced
        stream.marker_file = SYNCED_MARKER in present
        if not clean and stream.active is not None and not _vouched_for(loaded.synced, stream.active):
            # After a crash the recovered tail may be in the page cache only (a kill -9): sync it, so
            # the header appends keep (storage/growing.py) is one a power loss keeps too. A tail the
            # SYNCED marker names as it stands was synced at the close.
            stream.active.ref.segment.file.sync()
        if TRUNCATE_MARKER in present:
            stream.truncation.finish_pending()
        if handed is not None:
            stream._take_back(handed)
        return stream

    def _take_back(self, handed: UnsyncedClose) -> None:
        """Resume the unsynced state a close handed off (its files to sync, its creation)."""
        self.dirty = {s.file for s in self.segments if s.file.path in handed.files}
        if self.active is not None:  # its header may not be durable: keep the one that was
            self.active.set_durable(handed.durable_seq)
        self.creation = handed.creation
        self.write_seq += 1  # a sync is due (the gate counts writes since the open)
        if handed.error is not None:  # its sync failed after the close: refuse appends, as `gate` does
            self.gate.error = handed.error

    # ------------------------------------------------------------------ append

    def append(
        self, batch: AppendBatch, producer: tuple[str, int] | None = None, expected_end: int | None = None
    ) -> AppendResult:
        """Append a batch; `producer` (id, sequence) makes it idempotent, `expected_end` conditional."""
        with self.lock:
            always = self.fsync is FsyncPolicy.ALWAYS  # read under the lock: set_config may change it
            if always or self.closed or self.gate.error is not None or self.clean_marker:
                self._check_writable(always)  # only then has it anything to do (a call less per append)
            if expected_end is not None and expected_end != self.end_offset:
                raise OffsetMismatchError(expected_end, self.end_offset)
            result = append_one(self, batch, producer)
            seq = self.write_seq  # a duplicate's first attempt may still be on its way to disk
            if not always:
                self.publish(self.end_offset)
        if always:
            self.gate.wait(seq, partial(sync_now, self))
        return result

    def append_many(
        self, appends: Sequence[tuple[AppendBatch, tuple[str, int] | None]]
    ) -> list[AppendResult | StorageError]:
        """Append several batches in order, each on its own (its own producer check, its own
        result or error), under one lock and, under "always", one sync for all of them. Runs of
        payload-only batches without a producer (a Publish session's coalesced messages) are
        written together, as one batch (`append_together`), within max_batch_entries."""
        results: list[AppendResult | StorageError] = []
        with self.lock:
            always = self.fsync is FsyncPolicy.ALWAYS
            self._check_writable(always)
            for run, producer in _runs(appends, self.ctx.config.max_batch_entries):
                if len(run) > 1:
                    try:
                        results.extend(append_together(self, run))
                        continue
                    except LimitExceededError:
                        pass  # together past max_batch_bytes: each on its own, below
                for batch in run:
                    try:
                        results.append(append_one(self, batch, producer))
                    except StorageError as exc:
                        # This batch only (nothing of it was written); those before it stand.
                        results.append(exc)
            seq = self.write_seq
            if not always:
                self.publish(self.end_offset)
        if always:
            self.gate.wait(seq, partial(sync_now, self))
        return results

    def _check_writable(self, always: bool) -> None:
        """Before an append (call with `lock` held; `always`: the fsync policy is "always"):
        refuse it if the stream cannot take it. `append` calls it only when one of its tests
        may hold: a new test here goes into that condition too.

        Under "always", wait first while a sync of the active node's header runs: the append
        would rewrite that header's slot, and the sync could then vouch for nothing newer than
        the header before it (storage/growing.py). The append cannot be covered by the sync in
        flight anyway, so it loses only its own write's time, and the appends that waited share
        the next sync (group commit), in the node they fill."""
        if always and self.active is not None and self.active.in_sync:
            self.blocked_writers += 1
            try:
                while (node := self.active) is not None and node.in_sync:
                    self.sync_ended.wait()
            finally:
                # This append writes before it lets go of the lock: once the last one that waited
                # has taken it, the next sync may begin.
                self.blocked_writers -= 1
                if not self.blocked_writers:
                    self.sync_ended.notify_all()
        if self.closed:
            raise InvalidArgumentError(f"stream {self.name!r} was deleted")
        if self.gate.error is not None:
            raise DurabilityError(f"appends are refused after a failed sync: {self.gate.error}")
        if self.clean_marker:  # tested here: this runs on every append, the removal once
            self.unmark_clean()

    def unmark_clean(self) -> None:
        """Before the first write into the segments since the open (call with `lock` held): remove
        a version-2 CLEAN marker, durably, if it is still there: it vouches for every node, so
        from here on a crash must trigger the tail scan. Only a data directory written by an
        earlier version pays for it, once per stream."""
        if self.clean_marker:
            self.ctx.fs.remove(self.directory / CLEAN_MARKER)
            self.clean_marker = False

    def drop_markers(self) -> None:
        """Before bytes below the synced end are rewritten (a truncation; call with `lock` held):
        remove every marker, durably, as none would name a prefix that is still there: the
        SYNCED file, CLEAN, and the SYNCED slot of every segment that may end the stream once
        the later ones are gone."""
        self.unmark_clean()
        self.ctx.fs.remove(self.directory / SYNCED_MARKER)
        self.marker_file = False
        for segment in self.segments:
            if segment.header.has_slot and erase_slot(segment.file):
                segment.file.sync()
        self.synced_mark = None  # so the next close writes one

    def synced_end(self) -> SyncedEnd | None:
        """What the SYNCED marker says once every write so far is synced (call with `lock` held):
        the last segment, and its last node as it stands; None without a segment."""
        if not self.segments:
            return None
        tail = self.segments[-1]
        node = tail.nodes[-1] if tail.nodes and not tail.packed else None
        return SyncedEnd(
            tail.base_offset,
            tail.header.created_ms,
            node.pos if node is not None else 0,
            node.header if node is not None else None,
            in_slot=tail.header.has_slot,
        )

    # ------------------------------------------------------------------ durability

    def commit_creation(self, synced: bool = False) -> None:
        """Make a new stream's creation durable, if it is not yet (storage/creation.py); `synced`:
        every segment file was just synced (the sync path), so the commit syncs none again."""
        creation = self.creation
        if creation is not None:
            creation.commit(self.ctx.fs, self.directory, (lambda: []) if synced else self._segment_files)
            self.creation = None

    def _segment_files(self) -> list[SegmentFile]:
        with self.lock:
            return [s.file for s in self.segments]

    def write_meta(self, first_offset: int, config: StreamConfig) -> None:
        """Replace the meta file, atomically and durably (a new stream's creation first)."""
        self.commit_creation()
        write_meta(self.ctx.fs, self.directory, self.name, first_offset, config)

    def sync(self) -> None:
        with self.lock:
            if self.creation is not None:
                self.write_seq += 1  # the creation's commit is due even with nothing written
            seq = self.write_seq
        self.gate.wait(seq, partial(sync_now, self))

    # ------------------------------------------------------------------ visibility

    def publish(self, local_end: int) -> None:
        """Entries up to `local_end` are written (and synced, under "always"); readers see them up
        to the commit cap. Call with `lock` held."""
        self.local_end = local_end
        commit = self.commit
        self.visible_end = local_end if commit is None or commit > local_end else commit

    def set_commit(self, offset: int | None) -> bool:
        """Cap what readers see at `offset` (None: no cap). True if they now see further."""
        with self.lock:
            before = self.visible_end
            self.commit = offset
            self.publish(self.local_end)
            return self.visible_end > before

    def save_epochs(self, epochs: EpochHistory) -> None:
        """Replace the epoch history, durably and atomically (storage/epochs.py)."""
        self.ctx.fs.write_file_atomic(self.directory / EPOCHS_FILE, epochs.encode())
        self.epochs = epochs
        self.has_epochs = True

    # ------------------------------------------------------------------ reading

    def view(self, ref: NodeRef) -> NodeView:
        """The node's entries: the active node's straight from its mapping, others through the cache."""
        active = self.active
        if active is not None and ref is active.ref:
            return NodeView(ref.base_offset, active.positions, None, active.slice)
        segment = ref.segment
        body = self.ctx.cache.get((segment.uid, ref.pos), lambda: segment.read_body(ref, decompressor()))
        blob, positions = body.blob, body.positions
        return NodeView(
            body.base_offset, positions, body.deltas, lambda lo, hi: blob[positions[lo] : positions[hi]]
        )

    def corrupt(self, ref: NodeRef, exc: CorruptionError) -> Gap:
        if ref.mark_corrupt(self.name, exc):
            self.damaged.append(ref.damage())
            self.index.mark_holes()
        return ref.damage()

    def bounds(self) -> StreamBounds:
        with self.lock:
            return StreamBounds(self.first_offset, self.visible_end)

    def read(self, offset: int, count: int, max_bytes: int, reverse: bool) -> ReadResult:
        if offset < 0 or count < 0 or max_bytes < 0:
            raise InvalidArgumentError("offset, count and max_bytes must not be negative")
        with self.lock:
            if reverse:
                return read_backward(self, offset, count, max_bytes)
            return read_forward(self, offset, count, max_bytes)

    def seek_time(self, timestamp_ms: int) -> int:
        return seek_time(self, timestamp_ms)

    def entries_meta(self, start: int, stop: int) -> EntriesMeta:
        with self.lock:
            return self.index.describe(start, stop)

    def count(self, start: int, end: int) -> int:
        return count_entries(self, start, end)

    # ------------------------------------------------------------------ segments leaving

    def release(self, segment: Segment, close_file: bool = True) -> None:
        """Let go of a segment that left the stream (call with `lock` held): its file is being
        replaced or removed (retention, storage/cleaner.py), or the stream closes (`close_file`
        False: the caller closes the file)."""
        if segment in self.pack_queue:
            self.pack_queue.remove(segment)
        self.dirty.discard(segment.file)
        self.ctx.cache.drop_segment(segment.uid)
        segment.close(close_file)

    # ------------------------------------------------------------------ info, config, close

    def set_config(self, config: StreamConfig) -> None:
        with self.maintenance_lock, self.lock:
            self.write_meta(self.first_offset, config)
            self.config = config
            self.fsync = config.fsync or self.ctx.config.fsync

    def close(
        self,
        clean: bool = True,
        *,
        hand_off: bool = False,
        closer: Callable[[list[SegmentFile]], None] | None = None,
    ) -> UnsyncedClose | None:
        """Sync, mark a clean shutdown, and release files. With `hand_off` (the cache's close under
        a policy that promises writes to the next round) nothing is synced or written: what is
        unsynced, and the SYNCED marker, are returned for the round to finish (storage/handoff.py),
        None if there is nothing to finish. `closer` (the cache's close) takes the segment files to
        unmap and close once the stream is closed (storage/closer.py); else they are closed here."""
        handed = None
        files: list[SegmentFile] = []
        with self.maintenance_lock:
            if self.closed:
                return None
            if clean and self.gate.error is None:
                if hand_off:
                    handed = self._hand_off()
                if handed is None:
                    self.sync()
                    self.save_producers(self.ctx.clock())
                    # The sync above is done before the marker is written, so the marker needs no
                    # sync of its own: a power loss may take it back or tear it (the next open then
                    # checks the whole last segment), never make it vouch for unsynced bytes.
                    with self.lock:
                        synced = self.synced_end()
                    if synced is not None and synced != self.synced_mark:  # a read-only visit: as it was
                        write_synced_end(self.ctx.fs, self.directory, synced, file_may_exist=self.marker_file)
            with self.lock:
                self.closed_summary = stream_summary(self)
                self.closed = True
                for segment in self.segments:
                    self.release(segment, close_file=closer is None)
                    files.append(segment.file)
                self.segments.clear()
                self.index.clear()
        if closer is not None and files:
            closer(files)
        return handed

    def _hand_off(self) -> UnsyncedClose | None:
        """What a close under `hand_off` leaves to the round: the files to sync, the creation to
        commit, and the marker to write (even for a synced stream: a marker is a file the disk
        creates, about a millisecond under load, on the caller's path otherwise). None if the
        close has none of these to leave (a read-only visit)."""
        with self.lock:
            files = [file.path for file in self.dirty]
            synced = self.synced_end()
            if not files and self.creation is None and synced == self.synced_mark:
                return None
            self.dirty.clear()
            durable_seq = self.active.durable_seq if self.active is not None else 0
        handed = UnsyncedClose(self.directory, files, self.creation, durable_seq, synced, self.marker_file)
        self.creation = None
        return handed


def _vouched_for(synced: SyncedEnd | None, node: GrowingNode) -> bool:
    """Whether the SYNCED marker names `node` with the header it has now (synced at the close)."""
    return (
        synced is not None
        and synced.base_offset == node.ref.segment.base_offset
        and synced.node_pos == node.ref.pos
        and synced.node_header == node.ref.header
    )


def _runs(
    appends: Sequence[tuple[AppendBatch, tuple[str, int] | None]], max_entries: int
) -> Iterator[tuple[list[AppendBatch], tuple[str, int] | None]]:
    """`appends` in order as runs that may be written together: consecutive payload-only batches
    without a producer, up to `max_entries` entries in all, each such run with producer None; any
    other batch a run of its own, with its producer."""
    run: list[AppendBatch] = []
    entries = 0
    for batch, producer in appends:
        n = len(batch.payloads)
        if producer is None and batch.tags is None and batch.headers is None and batch.deliver_at_ms is None:
            if run and entries + n > max_entries:
                yield run, None
                run, entries = [], 0
            run.append(batch)
            entries += n
            continue
        if run:
            yield run, None
            run, entries = [], 0
        yield [batch], producer
    if run:
        yield run, None
