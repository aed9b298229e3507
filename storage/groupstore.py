"""Where each stream's consumer groups are kept: their state, its journal, their lock.

One `GroupStore` per stream holds its groups (storage.groupstate), the journal
of their ops (storage.grouplog), the lock every group call takes, and the sync
gate. `GroupStores` finds a stream's store and runs each group call inside
`writing`, which journals the ops the call applied and applies the stream's
fsync policy to them:

- `always`: a call returns after its journal record was fdatasync'ed; calls
  running at the same time share one sync (`SyncGate`, as appends do). A
  read that delivered nothing (only seen times changed) does not wait.
- `everysec`: `maintain_journal` syncs dirty journals; `no`: the OS writes back.

In every mode a record is in the (page-cached) journal before the call
returns, so group state survives kill -9; what a power loss takes back is
redelivered (at-least-once), never lost.

A store's state is rebuilt by applying ops, whoever made them: its own
journal at start-up, or (for a replica) another node's ops through
`apply_ops`, or a snapshot of them (`snapshot_ops`).

Replication (cluster/replication/) names each op batch (one call's ops, one
journal record) by the store's op sequence number, `op_seq`, durable with the
journal (storage.grouplog). A leader's store keeps its recent batches
(`retain`, bounded by bytes; started by the first snapshot a follower takes,
so a node with no followers keeps none) to ship "the batches after N", or
says they are gone (send a snapshot). A stream with no store (no group yet)
gets an empty store's snapshot and no store is made for it: a leader
snapshots every stream it replicates, most with no group (the store its
first group makes retains from its start). A follower's store is *passive*: it
applies the leader's batches (`apply_batch`, each at the next seq) and
snapshots (`install`), journaled like its own ops, and serves no group call:
no deliveries, no redelivery, no expiry, no dead letters, until the node
leads the stream and makes it active again, from the state it holds.

Locking: a store's lock is taken before any stream lock (group calls read
the stream). A stream asks for its retention floor while holding its own
lock, so the floor is published as a precomputed tuple (`GroupStore.holds`)
and read without the store lock: the two lock orders never meet.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from storage.durability import SyncGate
from storage.errors import (
    CorruptionError,
    DurabilityError,
    GroupNotFoundError,
    PreconditionError,
    StorageError,
    StreamNotFoundError,
)
from storage.fs import FileSystem
from storage.grouplog import JOURNAL_PREFIX, JOURNAL_SUFFIX, GroupLog, JournalFullError
from storage.groupops import (
    DeleteConsumer,
    GroupOp,
    Release,
    Remove,
    RemoveReason,
    Seek,
    Seen,
    SetConfig,
    encode_ops,
)
from storage.groupregistry import GroupRegistry
from storage.groupstate import GroupSet
from storage.groupstreams import GroupStreams
from storage.layout import stream_directory
from storage.names import validate_name
from storage.types import FsyncPolicy

log = logging.getLogger("streamlog.storage")

GroupListener = Callable[[str, str], None]
BatchListener = Callable[[str, int], None]  # (stream, op seq of the batch just made)

# Recent op batches a leader's store keeps for its followers (beyond: a snapshot).
RETAINED_BATCH_BYTES = 4 << 20

# Ops after which a reader waiting on the group may find something new (room, a release, a new cursor).
_WAKING = frozenset({Remove, Release, Seek, SetConfig, DeleteConsumer})
# What `GroupStores.snapshot` answers for a stream with no store: an empty store's ops.
_NO_GROUPS = encode_ops(())
# Ops whose loss in a crash costs nothing but accuracy of a seen time: not worth a sync on their own.
_SOFT = frozenset({Seen})


def _served_by_leader(stream: str) -> PreconditionError:
    """What a passive store answers a group call (GroupStore.check_active)."""
    return PreconditionError(
        f"the consumer groups of stream {stream!r} are served by its leader: this node's copy "
        "follows the leader's"
    )


class GroupStore:
    """One stream's groups: state, journal, lock, sync gate, and its published retention holds."""

    def __init__(
        self,
        name: str,
        directory: Path,
        fs: FileSystem,
        journal_bytes: int,
        registry: GroupRegistry,
        *,
        passive: bool = False,
    ) -> None:
        self.name = name
        self.directory = directory
        self._fs = fs
        self._registry = registry  # the stream is registered while it has group files
        self._journal_bytes = journal_bytes
        self.lock = threading.RLock()
        self.gate = SyncGate()
        self.state = GroupSet()
        self.log: GroupLog | None = None
        # ((hold offset, active ms, idle_release_ms, group), ...) for groups with retention_hold.
        self.holds: tuple[tuple[int, int, int | None, str], ...] = ()
        self.closed = False
        self.broken: StorageError | None = None  # set when state and disk can no longer be trusted to agree
        self.op_seq = 0  # op batches made (or applied, by a follower): see the module doc
        self.passive = passive
        # (op seq, encoded ops) of recent batches, oldest first, while a follower may ask for them.
        self.retained: deque[tuple[int, bytes]] | None = None
        self.retained_bytes = 0

    # ------------------------------------------------------------------ recovery

    def load(self, end_offset: int) -> None:
        """Rebuild the state from the journal; `end_offset` is the stream's end (see `_clamp`)."""
        journal = GroupLog(self._fs, self.directory, self._journal_bytes)
        try:
            for op in journal.load():
                self.state.apply(op)
        except (CorruptionError, KeyError, ValueError, TypeError) as exc:
            log.error("stream %r: consumer group state is unreadable: %s", self.name, exc)
            journal.close()
            self.broken = CorruptionError(f"consumer groups of stream {self.name!r} are unreadable: {exc}")
            return
        self.log = journal
        self.op_seq = journal.op_seq
        changed = self._clamp(end_offset)
        self.state.drain()  # the checkpoint below holds these changes
        if not self.state.groups:
            self._destroy(journal)
        elif journal.replayed or journal.cut is not None or changed:
            # Appends must never land in front of stale bytes of a cut tail: start a fresh journal.
            journal.checkpoint(self.state.snapshot_ops(), self.op_seq)
        self.refresh_holds()

    def _clamp(self, end: int) -> bool:
        """Forget what refers past the stream's end: entries a power loss took from the stream.

        Groups only see visible entries and a cursor is never set past the end, so this happens
        only when the journal kept more than the stream did (e.g. everysec, both lost a second).
        """
        changed = False
        for group in self.state.groups.values():
            lost = [o for o in group.pending if o >= end] + [o for o in group.scheduled if o >= end]
            if lost:
                log.warning(
                    "stream %r group %r: %d entries past the end are gone", self.name, group.name, len(lost)
                )
                group.remove(sorted(lost), RemoveReason.EVICTED)
                changed = True
            if group.cursor > end:
                group.seek(end, end if group.entries_read == group.cursor else group.entries_read)
                changed = True
        return changed

    # ------------------------------------------------------------------ changes

    def check_open(self) -> None:
        if self.closed:
            raise StreamNotFoundError(f"stream {self.name!r} does not exist")

    def check_active(self) -> None:
        if self.passive:
            raise _served_by_leader(self.name)

    def check_writable(self) -> None:
        if self.closed:
            raise StreamNotFoundError(f"stream {self.name!r} does not exist")
        if self.broken is not None:
            raise type(self.broken)(str(self.broken))
        if self.gate.error is not None:
            raise DurabilityError(
                f"consumer groups of stream {self.name!r} refuse changes: {self.gate.error}"
            )

    def reserve(self) -> None:
        """Checkpoint before a call if the journal is nearly full, so the call's record fits.

        Done before any change: if the checkpoint fails (a full disk), nothing has changed.
        """
        journal = self.log
        if journal is not None and journal.free_bytes < journal.capacity_bytes // 4:
            journal.checkpoint(self.state.snapshot_ops(), self.op_seq)

    def persist(self) -> tuple[int | None, set[str]]:
        """Journal the ops applied since the last call, as op batch `op_seq` + 1; returns the
        journal seq to wait for (None: nothing to sync) and the groups a waiting reader may now
        find something new in."""
        ops = self.state.drain()
        if not ops:
            return None, set()
        changed = {op.group for op in ops if type(op) in _WAKING}
        if self.closed:
            return None, changed  # the stream was deleted during the call
        body = encode_ops(ops)
        self.op_seq += 1
        seq = None
        if self.log is None:  # the first group: snapshot and journal
            journal = GroupLog(self._fs, self.directory, self._journal_bytes)
            try:
                self._registry.add(self.name)
                journal.checkpoint(self.state.snapshot_ops(), self.op_seq)
            except StorageError:
                # Nothing was on disk before, nor in memory (no files means no groups): forget the call.
                self.state = GroupSet()
                self.op_seq -= 1
                self.refresh_holds()
                raise
            self.log = journal
            self._retain(body)
            return None, changed
        with self._saving():
            try:
                seq = self.log.append(body)
            except JournalFullError:
                self.log.checkpoint(self.state.snapshot_ops(), self.op_seq)
            if not self.state.groups:
                self._destroy(self.log)
                seq = None
        self._retain(body)
        if seq is not None and all(type(op) in _SOFT for op in ops):
            seq = None
        return seq, changed

    # ------------------------------------------------------------------ replication

    def _retain(self, body: bytes) -> None:
        retained = self.retained
        if retained is None:
            return
        retained.append((self.op_seq, body))
        self.retained_bytes += len(body)
        while self.retained_bytes > RETAINED_BATCH_BYTES and len(retained) > 1:
            self.retained_bytes -= len(retained.popleft()[1])

    def batches_since(self, op_seq: int, max_bytes: int) -> list[tuple[int, bytes]] | None:
        """The batches after `op_seq`, oldest first, within about `max_bytes` (at least one);
        None when they are not all retained (or `op_seq` is not one of this store's). Lock-free
        (a fetch asks on the event loop): it reads one copy of the retained batches."""
        retained = self.retained
        batches = list(retained) if retained is not None else []  # one C-level copy, under the GIL
        if not batches:
            return [] if op_seq == self.op_seq else None
        first, last = batches[0][0], batches[-1][0]
        if op_seq == last:
            return []
        if not first - 1 <= op_seq < last:
            return None
        out: list[tuple[int, bytes]] = []
        size = 0
        for batch in batches[op_seq - first + 1 :]:
            if out and size + len(batch[1]) > max_bytes:
                break
            out.append(batch)
            size += len(batch[1])
        return out

    def snapshot(self) -> tuple[int, bytes]:
        """(op seq, encoded ops that rebuild the groups) now; from here on, batches are retained."""
        if self.retained is None:
            self.retained = deque()
        return self.op_seq, encode_ops(self.state.snapshot_ops())

    def install(self, op_seq: int, ops: Sequence[GroupOp]) -> None:
        """Replace the groups with a leader's snapshot standing at `op_seq`, durably."""
        state = GroupSet()
        try:
            state.apply_ops(ops)
        except (KeyError, ValueError, TypeError) as exc:
            raise CorruptionError(f"a group snapshot of stream {self.name!r} does not apply: {exc}") from exc
        state.drain()
        self.check_open()
        if self.gate.error is not None or isinstance(self.broken, DurabilityError):
            self.check_writable()  # (an unreadable state, though, is what a snapshot replaces)
        self.state, self.op_seq = state, op_seq
        self.retained, self.retained_bytes = None, 0
        with self._saving():
            if not state.groups:
                if self.log is not None:
                    self._destroy(self.log)
                return
            if self.log is None:
                self._registry.add(self.name)
                self.log = GroupLog(self._fs, self.directory, self._journal_bytes)
            self.log.checkpoint(state.snapshot_ops(), op_seq)
            self.broken = None

    def _destroy(self, journal: GroupLog) -> None:
        """The stream has no groups left: their files go, then its registry entry."""
        journal.destroy()
        self.log = None
        self._registry.remove(self.name)

    @contextmanager
    def _saving(self) -> Iterator[None]:
        """Write what memory now holds; if that fails, memory holds changes the disk does not:
        refuse further changes until a restart recovers."""
        try:
            yield
        except BaseException as exc:
            self.broken = DurabilityError(
                f"consumer group state of stream {self.name!r} could not be saved: {exc}"
            )
            raise
        finally:
            self.refresh_holds()

    def snapshot_ops(self) -> list[GroupOp]:
        """Ops that rebuild the stream's groups from nothing."""
        return self.state.snapshot_ops()

    # ------------------------------------------------------------------ journal upkeep

    def sync(self) -> None:
        journal = self.log
        if journal is not None and journal.dirty and self.broken is None:
            self.gate.wait(journal.seq, journal.sync)

    def maintain_journal(self, fsync: FsyncPolicy) -> None:
        """Sync an everysec journal; compact one that is more than half full."""
        journal = self.log
        if journal is None:
            return
        if fsync is FsyncPolicy.EVERYSEC and journal.dirty:
            self.gate.wait(journal.seq, journal.sync)
        with self.lock:
            if self.log is not None and self.log.used_bytes > self.log.capacity_bytes // 2:
                self.log.checkpoint(self.state.snapshot_ops(), self.op_seq)

    def close(self, *, sync: bool) -> None:
        with self.lock:
            self.closed = True
            self.holds = ()
            if self.log is None:
                return
            try:
                if sync and self.broken is None and self.gate.error is None and self.log.dirty:
                    self.log.sync()
            except DurabilityError as exc:
                log.error("stream %r: consumer group journal did not sync at close: %s", self.name, exc)
            self.log.close()
            self.log = None

    # ------------------------------------------------------------------ retention

    def refresh_holds(self) -> None:
        self.holds = tuple(
            (group.hold_offset(), group.active_ms, group.config.idle_release_ms, group.name)
            for group in self.state.groups.values()
            if group.config.retention_hold
        )

    def retention_holder(self, now: int) -> tuple[str, int] | None:
        """(group, offset) of the group holding the stream's retention back, or None. Lock-free."""
        best: tuple[str, int] | None = None
        for offset, active_ms, release_ms, name in self.holds:
            if release_ms is not None and now - active_ms > release_ms:
                continue  # idle too long: no longer holds retention
            if best is None or offset < best[1] or (offset == best[1] and name < best[0]):
                best = (name, offset)
        return best


class GroupStores:
    """Every stream's group store: found by stream name, loaded at start-up, changed through `writing`."""

    def __init__(
        self, streams: GroupStreams, fs: FileSystem, *, journal_bytes: int, passive: bool = False
    ) -> None:
        """`passive`: stores start passive (a cluster node's: active only where it leads)."""
        self._streams = streams
        self._fs = fs
        self._journal_bytes = journal_bytes
        self._passive = passive
        self._modes: dict[str, bool] = {}  # stream -> active, as `set_active` last said
        # Streams a follower's snapshot found with no store (`snapshot`): the store their first
        # group makes retains its batches from its start.
        self._retaining: set[str] = set()
        self._stores: dict[str, GroupStore] = {}
        self._lock = threading.Lock()
        self._listeners: list[GroupListener] = []
        self._batch_listeners: list[BatchListener] = []
        self._registry = GroupRegistry(fs, streams.data_dir)
        for name in self._registry.load(self._probe):
            self._load(name)

    def _probe(self) -> list[str]:
        """The streams whose directories hold group files: looked for in every directory, once,
        when a data directory of an earlier version gets its registry (storage/groupregistry.py),
        as that version did at every start-up (leftover journals removed on the way)."""
        found = []
        for name in self._streams.list_streams():
            directory = stream_directory(self._streams.data_dir, name)
            if GroupLog.exists(self._fs, directory):
                found.append(name)
            else:
                self._remove_leftovers(directory)
        return found

    def _remove_leftovers(self, directory: Path) -> None:
        """Journals without a snapshot: a first checkpoint that crashed before its snapshot."""
        for leftover in self._fs.listdir(directory):
            if leftover.startswith(JOURNAL_PREFIX) and leftover.endswith(JOURNAL_SUFFIX):
                self._fs.remove(directory / leftover)

    def _new(self, stream: str) -> GroupStore:
        return GroupStore(
            stream,
            stream_directory(self._streams.data_dir, stream),
            self._fs,
            self._journal_bytes,
            self._registry,
            passive=not self._modes.get(stream, not self._passive),
        )

    def _load(self, name: str) -> None:
        store = self._new(name)
        fs, directory = self._fs, store.directory
        if not self._streams.exists(name) or not GroupLog.exists(fs, directory):
            self._remove_leftovers(directory)
            self._registry.remove(name)  # stale: see storage/groupregistry.py
            return
        store.load(self._streams.bounds(name).end_offset)
        self._stores[name] = store

    def get(self, stream: str) -> GroupStore:
        """The stream's store (an empty one if it has no groups yet); StreamNotFoundError if no stream.
        Only a call that may write a group makes one: the others take `find`."""
        store = self.find(stream)
        if store is None:
            with self._lock:
                store = self._stores.get(stream)
                if store is None:
                    store = self._stores[stream] = self._new(stream)
                    if stream in self._retaining:
                        self._retaining.discard(stream)
                        store.retained = deque()
        return store

    def find(self, stream: str, *, serving: bool = False) -> GroupStore | None:
        """The stream's store, or None if it has none (no call that writes a group made one):
        a call that only reads answers as an empty store would, and makes nothing (issue 17: a
        metrics scrape lists the groups of every open stream, a million of them with no group).
        Errors as `get`'s; `serving`: and, with no store, a passive one's (PreconditionError), as
        `writing` checks."""
        validate_name(stream)
        if not self._streams.exists(stream):
            raise StreamNotFoundError(f"stream {stream!r} does not exist")
        store = self._stores.get(stream)
        if store is None and serving and not self._modes.get(stream, not self._passive):
            raise _served_by_leader(stream)
        return store

    def peek(self, stream: str) -> GroupStore | None:
        """The stream's store if it has one, without checks or locks (for the retention floor)."""
        return self._stores.get(stream)

    def all(self) -> list[GroupStore]:
        with self._lock:
            return list(self._stores.values())

    def add_listener(self, listener: GroupListener) -> None:
        """`listener(stream, group)` runs after a change that may let a waiting reader of the group proceed.

        Acks and expiries that free room, nacks and released consumers, offset and config changes.
        It runs on the calling thread after the change is durable. It must not block, nor call
        group methods itself: hand the news to another thread or an event loop. (Dead letters are
        appended while the source stream's groups are locked, so append listeners that call into
        groups synchronously could deadlock two streams that dead-letter into each other.)
        """
        self._listeners.append(listener)

    def add_batch_listener(self, listener: BatchListener) -> None:
        """`listener(stream, op_seq)` runs after a store that retains batches (a leader's, with
        followers) made one, durable as the fsync policy says; the same rules as `add_listener`."""
        self._batch_listeners.append(listener)

    def having(self, stream: str, group: str, *, serving: bool) -> GroupStore:
        """The store of a call that needs `group`: `find`'s, and on a stream with no store,
        GroupNotFoundError (as the store's state would say) instead of making one."""
        store = self.find(stream, serving=serving)
        if store is None:
            raise GroupNotFoundError(f"consumer group {group!r} does not exist")
        return store

    @contextmanager
    def writing(
        self, stream: str, *, replica: bool = False, group: str | None = None
    ) -> Iterator[GroupStore]:
        """Run a group call under the stream's group lock; journal its ops and honour the fsync
        policy. A passive store refuses calls (PreconditionError) but a `replica`'s apply.
        `group`: the call needs that group to exist; on a stream with no store, GroupNotFoundError
        (as the store's state would say) without making one."""
        store = self.get(stream) if group is None else self.having(stream, group, serving=not replica)
        seq: int | None = None
        changed: set[str] = set()
        with store.lock:
            store.check_writable()
            if not replica:
                store.check_active()
            store.reserve()
            try:
                yield store
            except Exception:
                # A call that failed half-way may have taken timers it never used; what it did change
                # is journaled like any other change.
                for held in store.state.groups.values():
                    held.rebuild_timers()
                store.persist()
                raise
            except BaseException:
                store.broken = DurabilityError(f"consumer groups of stream {stream!r} were interrupted")
                raise
            before = store.op_seq
            seq, changed = store.persist()
            made = store.op_seq if store.retained is not None and store.op_seq != before else None
        journal = store.log
        if seq is not None and journal is not None and self._streams.fsync_policy(stream).blocks:
            store.gate.wait(seq, journal.sync)
        for changed_group in sorted(changed):
            for listener in self._listeners:
                listener(stream, changed_group)
        if made is not None:
            for batch_listener in self._batch_listeners:
                batch_listener(stream, made)

    def apply_ops(self, stream: str, ops: Sequence[GroupOp]) -> None:
        """Apply another node's ops (or a snapshot of them) to the stream's groups, durably."""
        with self.writing(stream, replica=True) as store:
            store.state.apply_ops(ops)

    def apply_batch(self, stream: str, op_seq: int, ops: Sequence[GroupOp]) -> None:
        """Apply the leader's op batch `op_seq`, which must be the one after this store's, durably
        (PreconditionError otherwise; CorruptionError if the ops do not apply to this state: the
        follower then takes a snapshot)."""
        with self.writing(stream, replica=True) as store:
            if op_seq != store.op_seq + 1:
                raise PreconditionError(
                    f"stream {stream!r}: group op batch {op_seq} does not follow batch {store.op_seq}"
                )
            try:
                store.state.apply_ops(ops)
            except (KeyError, ValueError, TypeError) as exc:
                raise CorruptionError(
                    f"group op batch {op_seq} of stream {stream!r} does not apply: {exc}"
                ) from exc

    def install(self, stream: str, op_seq: int, ops: Sequence[GroupOp]) -> None:
        """Replace the stream's groups with a leader's snapshot standing at `op_seq`, durably."""
        store = self.get(stream)
        with store.lock:
            store.install(op_seq, ops)
        for listener in self._listeners:
            for group in sorted(store.state.groups):
                listener(stream, group)

    def set_active(self, stream: str, active: bool) -> None:
        """Make the stream's groups active (this node leads it) or passive (module doc)."""
        with self._lock:
            self._modes[stream] = active
            store = self._stores.get(stream)
            if not active:
                self._retaining.discard(stream)
        if store is not None:
            with store.lock:
                store.passive = not active
                if store.passive:
                    store.retained, store.retained_bytes = None, 0

    def snapshot(self, stream: str) -> tuple[int, bytes]:
        """(op seq, encoded ops that rebuild the groups) for a follower; from here on, batches are
        retained. A stream with no store gets an empty one's snapshot and none is made (a cluster
        leader snapshots every stream it replicates, most of them with no group, issue 17): its
        first group's store retains from its start."""
        store = self.find(stream)
        if store is None:
            with self._lock:
                store = self._stores.get(stream)
                if store is None:
                    self._retaining.add(stream)
                    return 0, _NO_GROUPS
        with store.lock:
            store.check_open()
            return store.snapshot()

    def snapshot_ops(self, stream: str) -> list[GroupOp]:
        """Ops that rebuild the stream's groups from nothing (what a new replica starts from)."""
        store = self.get(stream)
        with store.lock:
            return store.snapshot_ops()

    def drop(self, stream: str) -> None:
        """The stream is being deleted: forget its groups (its directory, files included, goes next)."""
        with self._lock:
            store = self._stores.pop(stream, None)
            self._modes.pop(stream, None)
            self._retaining.discard(stream)
        self._registry.forget(stream)
        if store is not None:
            store.close(sync=False)

    def close(self) -> None:
        for store in self.all():
            store.close(sync=True)
