"""Consumer groups on top of the engine: deliveries, acks, claims, dead letters, retention holds, durability.

`storage.groups` decides (a pure state machine), `storage.grouplog` persists
its ops; this module connects them to the streams. It reads entries for
deliveries and claims, appends dead letters, publishes each stream's
retention floor, and applies the stream's fsync policy to group changes:

- `always`: a call returns after its journal record was fdatasync'ed; calls
  running at the same time share one sync (`SyncGate`, as appends do). A
  read that delivered nothing (only seen times changed) does not wait.
- `everysec`: `maintain` syncs dirty journals; `no`: the OS writes back.

In every mode a record is in the (page-cached) journal before the call
returns, so group state survives kill -9; what a power loss takes back is
redelivered (at-least-once), never lost.

One `_Store` per stream holds its groups, journal, lock and sync gate.
Locking: a store's lock is taken before any stream lock (group calls read
the stream). A stream asks for its retention floor while holding its own
lock, so the floor is published as a precomputed tuple (`_Store.holds`) and
read without the store lock: the two lock orders never meet.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from storage import groups
from storage.durability import SyncGate
from storage.errors import (
    CorruptionError,
    DurabilityError,
    InvalidArgumentError,
    LimitExceededError,
    PreconditionError,
    StorageError,
    StreamNotFoundError,
)
from storage.fs import FileSystem
from storage.grouplog import JOURNAL_PREFIX, JOURNAL_SUFFIX, GroupLog, JournalFullError
from storage.groupops import DeleteConsumer, Release, Remove, RemoveReason, Seek, Seen, SetConfig
from storage.grouppending import Doomed
from storage.groups import DescribeRange, FetchRecords, ReadFrom, Retire, StreamStart
from storage.groupstate import Group, GroupSet
from storage.grouptypes import (
    AckResult,
    GroupConfig,
    GroupInfo,
    GroupReadOptions,
    GroupReadResult,
    NackResult,
    PendingInfo,
    check_duration,
    check_non_negative,
    validate_label,
)
from storage.layout import stream_directory
from storage.names import validate_name
from storage.records import decode_records, skim_records
from storage.results import EntriesMeta, ReadResult
from storage.types import AppendBatch, FsyncPolicy

log = logging.getLogger("streamlog.storage")

GroupListener = Callable[[str, str], None]
T = TypeVar("T")

# A doomed entry whose dead-lettering failed for a passing reason is tried again after this long.
DEAD_LETTER_RETRY_MS = 1000

# Ops after which a reader waiting on the group may find something new (room, a release, a new cursor).
_WAKING = frozenset({Remove, Release, Seek, SetConfig, DeleteConsumer})
# Ops whose loss in a crash costs nothing but accuracy of a seen time: not worth a sync on their own.
_SOFT = frozenset({Seen})


def _check_offsets(offsets: Iterable[int]) -> list[int]:
    out = list(offsets)
    for offset in out:
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise InvalidArgumentError("offsets must be non-negative integers")
    return out


class _Store:
    """One stream's groups: state, journal, lock, sync gate, and its published retention holds."""

    def __init__(self, name: str, directory: Path) -> None:
        self.name = name
        self.directory = directory
        self.lock = threading.RLock()
        self.gate = SyncGate()
        self.state = GroupSet()
        self.log: GroupLog | None = None
        # ((hold offset, active ms, idle_release_ms, group), ...) for groups with retention_hold.
        self.holds: tuple[tuple[int, int, int | None, str], ...] = ()
        self.closed = False
        self.broken: StorageError | None = None  # set when state and disk can no longer be trusted to agree


class GroupManager:
    """Every stream's consumer groups. The engine delegates its group calls here."""

    def __init__(self, engine, fs: FileSystem, clock: Callable[[], int], *, journal_bytes: int) -> None:
        self._engine = engine
        self._fs = fs
        self._clock = clock
        self._journal_bytes = journal_bytes
        self._stores: dict[str, _Store] = {}
        self._lock = threading.Lock()
        self._listeners: list[GroupListener] = []
        self._serve: dict[type, Callable[[str, Any], Any]] = {
            ReadFrom: self._read_from,
            DescribeRange: self._describe,
            FetchRecords: self._fetch_records,
            StreamStart: self._stream_start,
            Retire: self._retire,
        }
        for name in engine.list_streams():
            self._load(name)

    # ------------------------------------------------------------------ lifecycle

    def _directory(self, stream: str) -> Path:
        return stream_directory(self._engine.data_dir, stream)

    def _now(self) -> int:
        return max(self._clock(), 0)

    def _load(self, name: str) -> None:
        directory = self._directory(name)
        fs = self._fs
        if not GroupLog.exists(fs, directory):
            for leftover in fs.listdir(directory):  # a first checkpoint that crashed before its snapshot
                if leftover.startswith(JOURNAL_PREFIX) and leftover.endswith(JOURNAL_SUFFIX):
                    fs.remove(directory / leftover)
            return
        store = _Store(name, directory)
        journal = GroupLog(fs, directory, self._journal_bytes)
        try:
            for op in journal.load():
                store.state.apply(op)
        except (CorruptionError, KeyError, ValueError, TypeError) as exc:
            log.error("stream %r: consumer group state is unreadable: %s", name, exc)
            journal.close()
            store.broken = CorruptionError(f"consumer groups of stream {name!r} are unreadable: {exc}")
            self._stores[name] = store
            return
        store.log = journal
        changed = self._clamp(store)
        store.state.drain()  # the checkpoint below holds these changes
        if not store.state.groups:
            journal.destroy()
            store.log = None
        elif journal.replayed or journal.cut is not None or changed:
            # Appends must never land in front of stale bytes of a cut tail: start a fresh journal.
            journal.checkpoint(store.state.snapshot_ops())
        self._refresh_holds(store)
        self._stores[name] = store

    def _clamp(self, store: _Store) -> bool:
        """Forget what refers past the stream's end: entries a power loss took from the stream.

        Groups only see visible entries and a cursor is never set past the end, so this happens
        only when the journal kept more than the stream did (e.g. everysec, both lost a second).
        """
        end = self._engine.bounds(store.name).end_offset
        changed = False
        for group in store.state.groups.values():
            lost = [o for o in group.pending if o >= end] + [o for o in group.scheduled if o >= end]
            if lost:
                log.warning(
                    "stream %r group %r: %d entries past the end are gone", store.name, group.name, len(lost)
                )
                group.remove(sorted(lost), RemoveReason.EVICTED)
                changed = True
            if group.cursor > end:
                group.seek(end, end if group.entries_read == group.cursor else group.entries_read)
                changed = True
        return changed

    def close(self) -> None:
        with self._lock:
            stores = list(self._stores.values())
        for store in stores:
            with store.lock:
                store.closed = True
                if store.log is None:
                    continue
                try:
                    if store.broken is None and store.gate.error is None and store.log.dirty:
                        store.log.sync()
                except DurabilityError as exc:
                    log.error("stream %r: consumer group journal did not sync at close: %s", store.name, exc)
                store.log.close()
                store.log = None

    def drop_stream(self, stream: str) -> None:
        """The stream is being deleted: forget its groups (its directory, files included, goes next)."""
        with self._lock:
            store = self._stores.pop(stream, None)
        if store is None:
            return
        with store.lock:
            store.closed = True
            store.holds = ()
            if store.log is not None:
                store.log.close()
                store.log = None

    def add_listener(self, listener: GroupListener) -> None:
        """`listener(stream, group)` runs after a change that may let a waiting reader of the group proceed.

        Acks and expiries that free room, nacks and released consumers, offset and config changes.
        It runs on the calling thread after the change is durable. It must not block, nor call
        group methods itself: hand the news to another thread or an event loop. (Dead letters are
        appended while the source stream's groups are locked, so append listeners that call into
        groups synchronously could deadlock two streams that dead-letter into each other.)
        """
        self._listeners.append(listener)

    # ------------------------------------------------------------------ durability

    def _store(self, stream: str) -> _Store:
        validate_name(stream)
        if not self._engine.exists(stream):
            raise StreamNotFoundError(f"stream {stream!r} does not exist")
        store = self._stores.get(stream)
        if store is None:
            with self._lock:
                store = self._stores.setdefault(stream, _Store(stream, self._directory(stream)))
        return store

    @contextmanager
    def _writing(self, stream: str) -> Iterator[_Store]:
        """Run a group call under the stream's group lock; journal its ops and honour the fsync policy."""
        store = self._store(stream)
        seq: int | None = None
        changed: set[str] = set()
        with store.lock:
            if store.closed:
                raise StreamNotFoundError(f"stream {stream!r} does not exist")
            if store.broken is not None:
                raise type(store.broken)(str(store.broken))
            if store.gate.error is not None:
                raise DurabilityError(
                    f"consumer groups of stream {stream!r} refuse changes: {store.gate.error}"
                )
            self._reserve(store)
            try:
                yield store
            except Exception:
                # A call that failed half-way may have taken timers it never used; what it did change
                # is journaled like any other change.
                for group in store.state.groups.values():
                    group.rebuild_timers()
                seq, changed = self._persist(store)
                raise
            except BaseException:
                store.broken = DurabilityError(f"consumer groups of stream {stream!r} were interrupted")
                raise
            seq, changed = self._persist(store)
        journal = store.log
        if seq is not None and journal is not None and self._engine.fsync_policy(stream).blocks:
            store.gate.wait(seq, journal.sync)
        for changed_group in sorted(changed):
            for listener in self._listeners:
                listener(stream, changed_group)

    def _reserve(self, store: _Store) -> None:
        """Checkpoint before a call if the journal is nearly full, so the call's record fits.

        Done before any change: if the checkpoint fails (a full disk), nothing has changed.
        """
        journal = store.log
        if journal is not None and journal.free_bytes < journal.capacity_bytes // 4:
            journal.checkpoint(store.state.snapshot_ops())

    def _persist(self, store: _Store) -> tuple[int | None, set[str]]:
        """Journal the ops the call applied; returns the seq to wait for (None: nothing to sync)."""
        ops = store.state.drain()
        if not ops:
            return None, set()
        changed = {op.group for op in ops if type(op) in _WAKING}
        if store.closed:
            return None, changed  # the stream was deleted during the call
        seq = None
        if store.log is None:  # the first group: snapshot and journal
            journal = GroupLog(self._fs, store.directory, self._journal_bytes)
            try:
                journal.checkpoint(store.state.snapshot_ops())
            except StorageError:
                # Nothing was on disk before, nor in memory (no files means no groups): forget the call.
                store.state = GroupSet()
                self._refresh_holds(store)
                raise
            store.log = journal
            return None, changed
        try:
            try:
                seq = store.log.append(ops)
            except JournalFullError:
                store.log.checkpoint(store.state.snapshot_ops())
            if not store.state.groups:
                store.log.destroy()
                store.log = None
                seq = None
        except BaseException as exc:
            # Memory holds changes the disk does not: refuse further changes until a restart recovers.
            store.broken = DurabilityError(
                f"consumer group state of stream {store.name!r} could not be saved: {exc}"
            )
            raise
        finally:
            self._refresh_holds(store)
        if seq is not None and all(type(op) in _SOFT for op in ops):
            seq = None
        return seq, changed

    def sync(self) -> None:
        for store in list(self._stores.values()):
            journal = store.log
            if journal is not None and journal.dirty and store.broken is None:
                store.gate.wait(journal.seq, journal.sync)

    def maintain(self) -> None:
        """Retire expired entries (dead letters included), sync everysec journals, compact big journals."""
        now = self._now()
        for name, store in list(self._stores.items()):
            if store.closed or store.broken is not None:
                continue
            try:
                with self._writing(name) as st:
                    for group in list(st.state.groups.values()):
                        self._settle(name, group, now)
                journal = store.log
                if journal is None:
                    continue
                if self._engine.fsync_policy(name) is FsyncPolicy.EVERYSEC and journal.dirty:
                    store.gate.wait(journal.seq, journal.sync)
                with store.lock:
                    if store.log is not None and store.log.used_bytes > store.log.capacity_bytes // 2:
                        store.log.checkpoint(store.state.snapshot_ops())
            except StorageError as exc:
                log.error("maintenance of the consumer groups of stream %r failed: %s", name, exc)

    # ------------------------------------------------------------------ retention

    def _refresh_holds(self, store: _Store) -> None:
        store.holds = tuple(
            (group.hold_offset(), group.active_ms, group.config.idle_release_ms, group.name)
            for group in store.state.groups.values()
            if group.config.retention_hold
        )

    def retention_holder(self, stream: str) -> tuple[str, int] | None:
        """(group, offset) of the group holding the stream's retention back, or None. Lock-free."""
        store = self._stores.get(stream)
        if store is None or not store.holds:
            return None
        now = self._now()
        best: tuple[str, int] | None = None
        for offset, active_ms, release_ms, name in store.holds:
            if release_ms is not None and now - active_ms > release_ms:
                continue  # idle too long: no longer holds retention
            if best is None or offset < best[1] or (offset == best[1] and name < best[0]):
                best = (name, offset)
        return best

    def retention_floor(self, stream: str) -> int | None:
        """The engine's `retention_floor`: retention never evicts at or above this offset."""
        holder = self.retention_holder(stream)
        return None if holder is None else holder[1]

    # ------------------------------------------------------------------ stream access

    def _fetch(self, stream: str, offsets: Iterable[int]) -> dict[int, bytes]:
        """The records of those offsets that still exist, one stream read per run of consecutive offsets."""
        want = sorted(set(offsets))
        found: dict[int, bytes] = {}
        i = 0
        while i < len(want):
            j = i
            while j + 1 < len(want) and want[j + 1] == want[j] + 1:
                j += 1
            start, stop = want[i], want[j] + 1
            result = self._engine.read(stream, start, stop - start)
            for offset, _, _, record in skim_records(result.records):
                if start <= offset < stop:
                    found[offset] = record
            i = j + 1
        return found

    def _drive(self, stream: str, plan: groups.Plan[T]) -> T:
        """Run a group plan (storage.groups), serving what it asks of the stream."""
        serve = self._serve
        try:
            request = next(plan)
            while True:
                request = plan.send(serve[type(request)](stream, request))
        except StopIteration as done:
            return done.value

    def _read_from(self, stream: str, request: ReadFrom) -> ReadResult:
        return self._engine.read(stream, request.start, request.count, max_bytes=request.max_bytes)

    def _describe(self, stream: str, request: DescribeRange) -> EntriesMeta:
        return self._engine.entries_meta(stream, request.start, request.stop)

    def _fetch_records(self, stream: str, request: FetchRecords) -> dict[int, bytes]:
        return self._fetch(stream, request.offsets)

    def _stream_start(self, stream: str, request: StreamStart) -> int:
        return self._engine.bounds(stream).first_offset

    def _retire(self, stream: str, request: Retire) -> list[int]:
        return self._dispose(stream, request.group, request.doomed, request.now)

    def _settle(self, stream: str, group: Group, now: int) -> list[int]:
        """Retire the entries whose time is up before anything else looks at the group."""
        return self._drive(stream, groups.settle(group, now))

    def _dispose(self, stream: str, group: Group, doomed: list[Doomed], now: int) -> list[int]:
        """Drop or dead-letter doomed entries; returns the offsets found gone from the stream."""
        records = self._fetch(stream, [d.offset for d in doomed])
        gone = [d.offset for d in doomed if d.offset not in records]
        group.remove(gone, RemoveReason.EVICTED)
        live = [d for d in doomed if d.offset in records]
        target = group.config.dead_letter_stream
        if target is None:
            group.remove([d.offset for d in live], RemoveReason.EXPIRED)
            return gone
        for batch in self._dead_letter_batches(live, records):
            offsets = [d.offset for d, _ in batch]
            entries = [entry for _, entry in batch]
            headers = [
                {
                    **entry.headers,
                    "x-origin-stream": stream.encode(),
                    "x-origin-offset": str(d.offset).encode(),
                    "x-group": group.name.encode(),
                    "x-delivery-count": str(d.delivery_count).encode(),
                    "x-reason": d.reason.encode(),
                }
                for d, entry in batch
            ]
            try:
                letters = AppendBatch([e.payload for e in entries], [e.tag for e in entries], headers)
                self._engine.append(target, letters)
            except (InvalidArgumentError, LimitExceededError) as exc:
                # Will never fit (e.g. headers at the size limit): keeping it pending would block forever.
                log.error(
                    "stream %r group %r: offsets %s cannot go to dead-letter stream %r (%s); dropped",
                    stream,
                    group.name,
                    offsets,
                    target,
                    exc,
                )
                group.remove(offsets, RemoveReason.EXPIRED)
            except StorageError as exc:
                log.error(
                    "stream %r group %r: dead-lettering to %r failed (%s); retrying in %d ms",
                    stream,
                    group.name,
                    target,
                    exc,
                    DEAD_LETTER_RETRY_MS,
                )
                group.pending.defer_doom(offsets, now + DEAD_LETTER_RETRY_MS)
            else:
                group.remove(offsets, RemoveReason.DEAD_LETTERED)
        return gone

    def _dead_letter_batches(self, doomed: list[Doomed], records: dict[int, bytes]):
        """Doomed entries with their decoded entry, in batches within the engine's append limits."""
        cfg = self._engine.config
        batch: list = []
        size = 0
        for d in doomed:
            entry = decode_records(records[d.offset])[0]
            if batch and (
                len(batch) >= cfg.max_batch_entries or size + len(entry.payload) > cfg.max_batch_bytes
            ):
                yield batch
                batch, size = [], 0
            batch.append((d, entry))
            size += len(entry.payload)
        if batch:
            yield batch

    # ------------------------------------------------------------------ group calls

    def _position(self, stream: str, start: str | int, entries_read: int | None) -> tuple[int, int]:
        """A group's cursor and entries_read for `start` (and an explicit entries_read, if given).

        A group cannot have read more entries than the stream ever had (its entries_added): a
        larger count would also run past int64 as the group reads on.
        """
        check_non_negative("entries_read", entries_read, optional=True)
        bounds = self._engine.bounds(stream)
        end = bounds.end_offset
        if start == "oldest":
            cursor = bounds.first_offset
        elif start == "newest":
            cursor = end
        elif not isinstance(start, int) or isinstance(start, bool) or start < 0:
            raise InvalidArgumentError('start must be "oldest", "newest" or a non-negative offset')
        elif start > end:
            raise InvalidArgumentError(f"offset {start} is past the end of stream {stream!r} ({end})")
        else:
            cursor = start
        if entries_read is None:
            return cursor, cursor
        if entries_read > end:
            raise InvalidArgumentError(
                f"entries_read {entries_read} is more than stream {stream!r} has had (entries_added {end})"
            )
        return cursor, entries_read

    def _check_config(self, stream: str, config: GroupConfig) -> None:
        if not isinstance(config, GroupConfig):
            raise InvalidArgumentError("config must be a GroupConfig")
        if config.dead_letter_stream == stream:
            raise InvalidArgumentError("a group's dead-letter stream must not be the stream itself")

    def create_group(
        self,
        stream: str,
        group: str,
        *,
        start: str | int = "oldest",
        entries_read: int | None = None,
        config: GroupConfig | None = None,
    ) -> GroupInfo:
        validate_label("group", group)
        config = config or GroupConfig()
        self._check_config(stream, config)
        cursor, entries_read = self._position(stream, start, entries_read)
        with self._writing(stream) as store:
            if group in store.state.groups:
                raise PreconditionError(f"consumer group {group!r} already exists on stream {stream!r}")
            created = store.state.create(group, config, cursor, entries_read, self._now())
            return self._info(stream, store, created)

    def delete_group(self, stream: str, group: str) -> None:
        with self._writing(stream) as store:
            store.state.drop(group)

    def list_groups(self, stream: str) -> list[GroupInfo]:
        with self._writing(stream) as store:
            now = self._now()
            out = []
            for name in sorted(store.state.groups):
                group = store.state.groups[name]
                self._settle(stream, group, now)
                out.append(self._info(stream, store, group))
            return out

    def group_streams(self) -> list[str]:
        with self._lock:
            stores = list(self._stores.values())
        return [store.name for store in stores if store.state.groups and not store.closed]

    def group_info(self, stream: str, group: str) -> GroupInfo:
        with self._writing(stream) as store:
            found = store.state.group(group)
            self._settle(stream, found, self._now())
            return self._info(stream, store, found)

    def consumer_count(self, stream: str, group: str, consumer: str) -> tuple[int, bool]:
        """How many consumers the group has, and whether `consumer` is one of them.

        O(1), and changes nothing (no settling, no journal): for a limit checked before every call
        that may add a consumer, whose cost must not grow with the group.
        """
        store = self._store(stream)
        with store.lock:
            if store.closed:
                raise StreamNotFoundError(f"stream {stream!r} does not exist")
            consumers = store.state.group(group).consumers
            return len(consumers), consumer in consumers

    def _info(self, stream: str, store: _Store, group: Group) -> GroupInfo:
        end = self._engine.bounds(stream).end_offset
        lag = None
        if group.entries_read == group.cursor:
            lag = self._engine.count(stream, group.cursor, end) + len(group.scheduled)
        self._refresh_holds(store)
        holder = self.retention_holder(stream)
        return GroupInfo(
            stream=stream,
            name=group.name,
            config=group.config,
            cursor=group.cursor,
            entries_read=group.entries_read,
            lag=lag,
            entries_added=end,
            pending=len(group.pending),
            scheduled=len(group.scheduled),
            consumers=group.consumer_infos(),
            counters=group.counter_values(),
            created_ms=group.created_ms,
            active_ms=group.active_ms,
            hold_offset=group.hold_offset(),
            holds_retention=holder is not None and holder[0] == group.name,
        )

    def set_group_offset(
        self, stream: str, group: str, offset: str | int, entries_read: int | None = None
    ) -> GroupInfo:
        cursor, entries_read = self._position(stream, offset, entries_read)
        with self._writing(stream) as store:
            found = store.state.group(group)
            found.seek(cursor, entries_read)
            return self._info(stream, store, found)

    def set_group_config(self, stream: str, group: str, config: GroupConfig) -> GroupInfo:
        self._check_config(stream, config)
        with self._writing(stream) as store:
            found = store.state.group(group)
            found.set_config(config)
            return self._info(stream, store, found)

    def delete_consumer(self, stream: str, group: str, consumer: str) -> int:
        validate_label("consumer", consumer)
        with self._writing(stream) as store:
            return store.state.group(group).delete_consumer(consumer, self._now())

    def read_group(self, stream: str, group: str, options: GroupReadOptions) -> GroupReadResult:
        """Up to `options.count` entries for `options.consumer`, each handed to no other consumer:
        storage.groups.read says which, in which order.

        The consumer is created if new. The call is cheap for count=1: the service serves
        waiting readers in arrival order by calling it once per reader, arming one timer for
        `next_due_ms` and waking on appends and on group listeners (acks that free room).
        """
        if not isinstance(options, GroupReadOptions):
            raise InvalidArgumentError("options must be a GroupReadOptions")
        # Bounds the journal record of one read.
        count = min(options.count, self._engine.config.max_batch_entries)
        with self._writing(stream) as store:
            found = store.state.group(group)
            return self._drive(stream, groups.read(found, options, count, self._now()))

    def ack(
        self, stream: str, group: str, offsets: Iterable[int] = (), ranges: Iterable[tuple[int, int]] = ()
    ) -> AckResult:
        """Acknowledge offsets and half-open ranges [start, end) (RCP `TACK a-b` is the range (a, b + 1))."""
        offsets = _check_offsets(offsets)
        spans = []
        for span in ranges:
            start, end = span
            _check_offsets((start, end))
            if end < start:
                raise InvalidArgumentError(f"range [{start}, {end}) ends before it starts")
            spans.append((start, end))
        with self._writing(stream) as store:
            found = store.state.group(group)
            now = self._now()
            self._settle(stream, found, now)
            return found.ack(now, offsets, spans)

    def nack(self, stream: str, group: str, offsets: Iterable[int], delay_ms: int = 0) -> NackResult:
        offsets = _check_offsets(offsets)
        check_duration("delay_ms", delay_ms, optional=False)
        with self._writing(stream) as store:
            found = store.state.group(group)
            now = self._now()
            self._settle(stream, found, now)
            return found.nack(now, offsets, delay_ms)

    def claim(
        self, stream: str, group: str, consumer: str, min_idle_ms: int, offsets: Iterable[int]
    ) -> GroupReadResult:
        """Take over pending entries idle for at least min_idle_ms (Redis XCLAIM); returns them."""
        validate_label("consumer", consumer)
        check_non_negative("min_idle_ms", min_idle_ms)
        offsets = _check_offsets(offsets)
        with self._writing(stream) as store:
            found = store.state.group(group)
            plan = groups.claim(found, consumer, self._now(), min_idle_ms, offsets)
            return self._drive(stream, plan)

    def autoclaim(
        self, stream: str, group: str, consumer: str, min_idle_ms: int, cursor: int = 0, count: int = 100
    ) -> tuple[int, GroupReadResult]:
        """Claim up to `count` entries idle for min_idle_ms, scanning pending offsets from `cursor`.

        Returns the cursor for the next call (0 when the scan is complete) and the claimed entries.
        """
        validate_label("consumer", consumer)
        check_non_negative("min_idle_ms", min_idle_ms)
        check_non_negative("cursor", cursor)
        check_non_negative("count", count)
        count = min(count, self._engine.config.max_batch_entries)
        with self._writing(stream) as store:
            found = store.state.group(group)
            plan = groups.autoclaim(found, consumer, self._now(), min_idle_ms, cursor, count)
            return self._drive(stream, plan)

    def pending(
        self,
        stream: str,
        group: str,
        *,
        consumer: str | None = None,
        min_idle_ms: int = 0,
        start: int = 0,
        end: int | None = None,
        count: int = 100,
    ) -> PendingInfo:
        """Summary of the group's pending entries, and detail rows for offsets in [start, end)."""
        check_non_negative("min_idle_ms", min_idle_ms)
        check_non_negative("start", start)
        check_non_negative("count", count)
        if end is not None:
            check_non_negative("end", end)
        with self._writing(stream) as store:
            found = store.state.group(group)
            now = self._now()
            self._settle(stream, found, now)
            return found.pending_info(
                now, consumer=consumer, min_idle_ms=min_idle_ms, start=start, end=end, count=count
            )

    def dump(self, stream: str) -> dict:
        """The stream's group state as plain data (tests compare it across restarts)."""
        with self._writing(stream) as store:
            return store.state.dump()
