"""One stream: its state (segments, node index, active node, ends), the append and
read entry points, open, close and configuration.

Its halves live beside it, each taking the stream: the writes into nodes and
segments in storage/nodewriter.py, the reads in storage/reader.py, a sync in
storage/durability.py (`sync_now`), its figures and catalog summary in
storage/streaminfo.py; where its bytes live (its directory: creation, open,
markers, the hand-off of a close) in storage/home.py; recovery in storage/loader.py, retention in
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
from storage.config import DEFAULT_STREAM_CONFIG, StreamConfig
from storage.context import EngineContext
from storage.creation import PendingCreation
from storage.durability import sync_now
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
from storage.home import DirectoryHome
from storage.index import NodeIndex
from storage.nodewriter import append_one, append_together
from storage.packed import decompressor
from storage.reader import count_entries, read_backward, read_forward, seek_time
from storage.results import AppendResult, EntriesMeta, Gap, ReadResult
from storage.segment import NodeRef, NodeView, Segment
from storage.slothome import SlotHome, Slots
from storage.streaminfo import stream_summary
from storage.streamparts import StreamParts
from storage.types import AppendBatch, FsyncPolicy, StreamBounds

log = logging.getLogger("streamlog.storage")


class Stream(StreamParts):
    # Fields most streams never change, read from the class until one is set: CPython (3.11)
    # keeps an instance's fields inline, with no dict of their own, only up to 29 of them, and
    # __init__ set 30, so every stream built a dict of 30 (an object the collector walks while
    # the stream is open; issue 17).
    blocked_writers = 0  # appends waiting on `sync_ended` (StreamParts), under "always"
    commit: int | None = None  # a cap replication sets (set_commit); None: no cap
    cuts = 0  # truncations so far: a sync that began before one does not publish its end
    # What maintenance last did here (write_seq then, wall-clock ms): when to visit it again.
    upkept_seq = 0
    upkept_ms = 0
    closed_summary: StreamSummary | None = None  # set by close
    has_epochs = False  # its epochs file exists (a replicated stream's): the catalog lists it

    def __init__(
        self, ctx: EngineContext, name: str, home: DirectoryHome | SlotHome, config: StreamConfig
    ) -> None:
        self.ctx = ctx
        self.name = name
        self.home = home  # where its bytes live (storage/home.py)
        self.config = config
        self.fsync: FsyncPolicy = config.fsync or ctx.config.fsync  # kept by set_config; no property
        self.lock = threading.RLock()
        self.maintenance_lock = threading.Lock()
        self.segments: list[Segment] = []
        self.index = NodeIndex()
        self.active: GrowingNode | None = None
        self.first_offset = 0
        self.end_offset = 0
        # The end this replica vouches for: in "always" mode only synced entries count, else all.
        self.local_end = 0
        self.visible_end = 0  # reads stop here: local_end, capped at commit
        self.last_ts = 0
        self.write_seq = 0
        self.dirty: set[SegmentFile] = set()
        self.pack_queue: list[Segment] = []  # full segments waiting to be packed
        self.damaged: list[Gap] = []
        self.closed = False
        # OpenStreams' bookkeeping: one item per call using it now (a list: append and pop are
        # atomic, so a pin takes no lock), set when it is being closed, and when it was last
        # handed out unpinned (monotonic seconds).
        self.pins: list[None] = []
        self.evicted = False
        self.touched = 0.0
        # Its producers, epochs, cleaner, retention and truncation are made on first use (StreamParts).

    # ------------------------------------------------------------------ open / create

    @property
    def directory(self) -> Path:
        return self.home.directory

    @property
    def creation(self) -> PendingCreation | None:
        """Its creation, while it is not durable yet (storage/creation.py)."""
        return self.home.creation

    @property
    def in_slot(self) -> bool:
        """Whether it lives in a slot of a pack file (storage/slothome.py), not a directory."""
        return type(self.home) is SlotHome

    def directory_home(self) -> DirectoryHome:
        """Its directory, promoted to one first if it is in a slot (with `lock` held, as for the
        changes that need it: a meta file, epochs, groups, a truncation, a second segment)."""
        home = self.home
        if isinstance(home, DirectoryHome):
            return home
        with self.lock:
            home = self.home
            return home if isinstance(home, DirectoryHome) else home.promote(self)

    @classmethod
    def create_in_slot(cls, ctx: EngineContext, slots: Slots, name: str, root: Path) -> Stream:
        """A new stream in a slot (storage/slothome.py), `root` the streams directory: the default
        config, no epochs."""
        home, segment = SlotHome.create(ctx, slots, name, root)
        stream = cls(ctx, name, home, DEFAULT_STREAM_CONFIG)
        stream.segments.append(segment)
        stream.write_seq = 1  # a sync is due, written or not: its slot and `p` record
        return stream

    @classmethod
    def open_in_slot(cls, ctx: EngineContext, slots: Slots, name: str, root: Path, place: int) -> Stream:
        """Open a stream in the slot at `place` (`root`: the streams directory)."""
        return cls._opened(ctx, SlotHome(ctx, slots, name, root, place), None, 0)

    @classmethod
    def create(
        cls, ctx: EngineContext, name: str, directory: Path, config: StreamConfig, incarnation: int = 0
    ) -> Stream:
        """A new stream; with an `incarnation` (a replicated stream) durable at once."""
        epochs = EpochHistory(incarnation) if incarnation else None
        stream = cls(ctx, name, DirectoryHome.create(ctx, name, directory, config, epochs), config)
        if epochs is not None:
            stream.epochs = epochs
            stream.has_epochs = True
        return stream

    @classmethod
    def open(
        cls, ctx: EngineContext, directory: Path, handed: UnsyncedClose | None = None, held: int = 0
    ) -> Stream:
        """Open a stream's directory; `handed`: its last close, which left its files unsynced and
        which it takes back (storage/handoff.py); `held`: the entries the catalog counted in it
        (storage/home.py's `load`)."""
        return cls._opened(ctx, DirectoryHome(ctx, directory), handed, held)

    @classmethod
    def _opened(
        cls, ctx: EngineContext, home: DirectoryHome | SlotHome, handed: UnsyncedClose | None, held: int
    ) -> Stream:
        opened = home.load(handed, held)
        loaded = opened.loaded
        stream = cls(ctx, opened.name, home, opened.config)
        stream.segments, stream.index, stream.active = loaded.segments, loaded.index, loaded.active
        stream.first_offset = loaded.first_offset
        stream.end_offset = stream.local_end = stream.visible_end = loaded.end_offset
        stream.damaged, stream.producers = loaded.damaged, loaded.producers
        stream.last_ts = stream.index.max_ts[-1] if len(stream.index) else 0
        if ctx.config.compression:
            stream.pack_queue = [s for s in stream.segments[:-1] if not s.packed]
        if opened.epochs is not None:
            stream.epochs = opened.epochs
            stream.has_epochs = True
        if opened.truncating:
            stream.truncation.finish_pending()
        if isinstance(home, SlotHome):
            home.take_back(stream)
        elif handed is not None:
            home.take_back(stream, handed)
        return stream

    # ------------------------------------------------------------------ append

    def append(
        self, batch: AppendBatch, producer: tuple[str, int] | None = None, expected_end: int | None = None
    ) -> AppendResult:
        """Append a batch; `producer` (id, sequence) makes it idempotent, `expected_end` conditional."""
        with self.lock:
            always = self.fsync is FsyncPolicy.ALWAYS  # read under the lock: set_config may change it
            if (
                always
                or self.closed
                or self.sync_error is not None
                or self.home.sync_error is not None
                or self.home.clean_marker
            ):
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
        result or error), under one lock and, under "always", one sync for all of them."""
        results, seq = self.write_many(appends)
        if seq is not None:
            self.wait_durable(seq)
        return results

    def write_many(
        self, appends: Sequence[tuple[AppendBatch, tuple[str, int] | None]]
    ) -> tuple[list[AppendResult | StorageError], int | None]:
        """`append_many`'s write without its wait: the results, and under "always" the write
        sequence to pass to `wait_durable` before any result is handed out (None: nothing to
        wait for). Runs of payload-only batches without a producer (a Publish session's
        coalesced messages) are written together, as one batch (`append_together`), within
        max_batch_entries."""
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
            if not always:
                self.publish(self.end_offset)
                return results, None
            return results, self.write_seq

    def wait_durable(self, seq: int) -> None:
        """Return once the writes up to `seq` are durable (group commit: a sync begun after them,
        by this caller or another, covers them); DurabilityError if that sync failed."""
        self.gate.wait(seq, partial(sync_now, self))

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
        if (failed := self.sync_error or self.home.sync_error) is not None:
            raise DurabilityError(f"appends are refused after a failed sync: {failed}")
        if self.home.clean_marker:  # tested here: this runs on every append, the removal once
            self.home.unmark_clean()

    # ------------------------------------------------------------------ durability

    def commit_creation(self) -> None:
        """Make a new stream's creation durable, if it is not yet (storage/creation.py). The
        segment files the commit synced leave `dirty` if nothing was written or cut meanwhile:
        the stream's own next sync (an "always" append's, waiting since its write) would sync
        them again for nothing."""
        with self.lock:
            if self.creation is None:
                return
            seq, cuts = self.write_seq, self.cuts
        synced: list[SegmentFile] = []

        def files() -> list[SegmentFile]:  # asked under the creation's lock, right before its syncs
            synced.extend(self._segment_files())
            return synced

        self.home.commit_creation(files)
        with self.lock:
            if self.write_seq == seq and self.cuts == cuts:
                self.dirty.difference_update(synced)

    def _segment_files(self) -> list[SegmentFile]:
        with self.lock:
            return [s.file for s in self.segments]

    def write_meta(self, first_offset: int, config: StreamConfig) -> None:
        """Replace the meta file, atomically and durably (a new stream's creation first)."""
        self.directory_home().write_meta(self.name, first_offset, config, self._segment_files)

    def sync(self) -> None:
        with self.lock:
            if self.creation is not None:
                self.write_seq += 1  # the creation's commit is due even with nothing written
            seq = self.write_seq
        self.wait_durable(seq)

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
        self.directory_home().save_epochs(epochs)
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
        if self._maybe_cached(segment):
            self.ctx.cache.drop_segment(segment.uid)
        segment.close(close_file)

    def _maybe_cached(self, segment: Segment) -> bool:
        """Whether the node cache may hold nodes of the segment: only sealed nodes are read
        through it (`view`; a truncation drops those of the segment it resumes a node in), so not
        if it holds none but the active node, as a small stream's one does at its close (this
        check costs 0.12 us, the cache's drop of a segment it holds nothing of 0.29, issue 17)."""
        nodes = segment.nodes
        if not nodes:
            return False
        active = self.active
        return len(nodes) > 1 or active is None or nodes[0] is not active.ref

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
        unmap and close once the stream is closed (storage/closer.py); else they are closed here,
        as a slot stream's always are (its file holds no descriptor or mapping: its close is a flag)."""
        handed = None
        files: list[SegmentFile] = []
        in_place = closer is None or type(self.home) is SlotHome
        with self.maintenance_lock:
            if self.closed:
                return None
            if clean and self.sync_error is None:
                handed = self.home.close(self, hand_off)
            with self.lock:
                self.closed_summary = stream_summary(self)
                self.closed = True
                for segment in self.segments:
                    self.release(segment, close_file=in_place)
                    files.append(segment.file)
                self.segments.clear()
                self.index.clear()
        if closer is not None and not in_place and files:
            closer(files)
        return handed


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
