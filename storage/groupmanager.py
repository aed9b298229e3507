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

from storage import groups as g
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
from storage.groups import GroupSet
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
from storage.results import Gap
from storage.types import AppendBatch, FsyncPolicy, GapReason

log = logging.getLogger("streamlog.storage")

GroupListener = Callable[[str, str], None]

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


class _Out:
    """A group read's reply as it is assembled: records in delivery order, a byte budget, and the
    offsets it holds.

    One reply draws on redeliveries, delayed entries now due and entries from the cursor. Once the
    cursor is moved back over pending entries these can name the same entry, and a reply holds each
    offset once: single offsets are kept in a set, the cursor's contiguous runs as ranges (no cost
    per entry on the hot path).
    """

    __slots__ = ("bytes", "counts", "max_bytes", "offsets", "records", "runs", "singles")

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.records: list[bytes] = []
        self.offsets: list[int] = []
        self.counts: list[int] = []
        self.singles: set[int] = set()
        self.runs: list[range] = []

    def fits(self, nbytes: int) -> bool:
        """Whether nbytes more stay within max_bytes; the first entry always fits, as in plain reads."""
        return not self.max_bytes or not self.offsets or self.bytes + nbytes <= self.max_bytes

    def budget(self) -> int | None:
        """max_bytes for the next stream read: 0 = unbounded, None = no room left."""
        if not self.max_bytes or not self.offsets:
            return self.max_bytes
        left = self.max_bytes - self.bytes
        return left if left > 0 else None

    def holds(self, offset: int) -> bool:
        return offset in self.singles or any(offset in run for run in self.runs)

    def holds_any(self, run: range) -> bool:
        if not self.singles and not self.runs:
            return False  # the common case: a reply of new entries only, so far
        return any(o in run for o in self.singles) or any(
            r.start < run.stop and run.start < r.stop for r in self.runs
        )

    def add(self, record: bytes, offset: int) -> None:
        """One entry the caller found not held and fitting."""
        self.records.append(record)
        self.offsets.append(offset)
        self.singles.add(offset)
        self.bytes += len(record)

    def add_run(self, records: list[bytes], run: range) -> None:
        """The records of a run of offsets the caller found not held and fitting."""
        self.records.extend(records)
        self.offsets.extend(run)
        self.runs.append(run)
        self.bytes += sum(map(len, records))

    def take(self, offsets: Iterable[int], records: dict[int, bytes]) -> list[int]:
        """Add the records of `offsets` in their order; returns the offsets left out: held already,
        or past the byte budget (and every one after it). Offsets with no record (gone) are skipped.
        """
        left: list[int] = []
        full = False
        for offset in offsets:
            record = records.get(offset)
            if record is None:
                continue
            if full or self.holds(offset):
                left.append(offset)
            elif self.fits(len(record)):
                self.add(record, offset)
            else:
                full = True
                left.append(offset)
        return left

    def count_from(self, start: int, delivery_count: Callable[[int], int]) -> None:
        self.counts.extend(delivery_count(o) for o in self.offsets[start:])

    def result(self, **extra) -> GroupReadResult:
        return GroupReadResult(self.records, self.offsets, self.counts, **extra)


def _spanning(a: Gap | None, b: Gap | None) -> Gap | None:
    """One gap covering two eviction gaps of a reply (every offset between them is evicted too)."""
    if a is None or b is None:
        return a or b
    return Gap(min(a.start_offset, b.start_offset), max(a.end_offset, b.end_offset), GapReason.EVICTED)


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

    def _settle(self, stream: str, group: g.Group, now: int) -> list[int]:
        """Retire the entries whose time is up before anything else looks at the group."""
        doomed = group.take_doomed(now)
        return self._dispose(stream, group, doomed, now) if doomed else []

    def _dispose(self, stream: str, group: g.Group, doomed: list[g.Doomed], now: int) -> list[int]:
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
                    g.DEAD_LETTER_RETRY_MS,
                )
                group.defer_doom(offsets, now + g.DEAD_LETTER_RETRY_MS)
            else:
                group.remove(offsets, RemoveReason.DEAD_LETTERED)
        return gone

    def _dead_letter_batches(self, doomed: list[g.Doomed], records: dict[int, bytes]):
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

    def _hand_over(
        self,
        stream: str,
        group: g.Group,
        consumer: str,
        now: int,
        offsets: list[int],
        out: _Out,
        *,
        retry_ms: int | None,
        claim: bool,
    ) -> tuple[list[int], list[int]]:
        """Redeliver pending entries to `consumer` (a retry, a claim-on-read, or a claim when `claim`).

        Returns (offsets the stream no longer has, offsets left out by the byte budget).
        """
        records = self._fetch(stream, offsets)
        gone = [o for o in offsets if o not in records]
        group.remove(gone, RemoveReason.EVICTED)
        start = len(out.offsets)
        left = out.take(offsets, records)
        taken = out.offsets[start:]
        if claim:
            group.claim(consumer, now, taken)
        else:
            group.deliver(consumer, now, retry_ms, None, taken)
        out.count_from(start, group.delivery_count)
        return gone, left

    def _deliver_scheduled(self, stream, group, consumer, now, retry_ms, expire_ms, noack, room, out) -> int:
        """Delayed entries now due go first among new entries (their offsets are the oldest)."""
        offsets = group.take_due_scheduled(now, room)
        if not offsets:
            return 0
        records = self._fetch(stream, offsets)
        group.remove([o for o in offsets if o not in records], RemoveReason.EVICTED)
        start = len(out.offsets)
        group.restore_scheduled(out.take(offsets, records))
        self._record_new(group, consumer, now, retry_ms, expire_ms, noack, start, out)
        return len(out.offsets) - start

    def _evict_scheduled(self, stream: str, group: g.Group) -> Gap | None:
        """Drop the delayed entries the stream evicted before they fell due, as a gap for the reader.

        The group never got them, so the read that finds them gone says so, as it does for entries
        evicted ahead of the cursor (a trim to an offset goes past retention holds).
        """
        if not group.scheduled:
            return None
        evicted = group.scheduled_below(self._engine.bounds(stream).first_offset)
        if not evicted:
            return None
        group.remove(evicted, RemoveReason.EVICTED)
        return Gap(evicted[0], evicted[-1] + 1, GapReason.EVICTED)

    def _record_new(self, group, consumer, now, retry_ms, expire_ms, noack, start, out) -> None:
        """Record the first delivery of the entries added to `out` since `start`, and their counts."""
        offsets = out.offsets[start:]
        if not offsets:
            return
        first_delivery = group.all_new(offsets)
        if noack:
            group.deliver_untracked(offsets)
        else:
            group.deliver(consumer, now, retry_ms, expire_ms, offsets)
        if first_delivery:
            out.counts.extend([1] * len(offsets))
        else:  # a cursor moved back over entries still pending: they count up (untracked: as they are)
            out.count_from(start, group.delivery_count)

    def _scan(
        self, stream, group, consumer, now, retry_ms, expire_ms, noack, room, out
    ) -> tuple[int | None, Gap | None]:
        """New entries from the group's cursor. Returns (when the cursor's next entry is due, evicted gap).

        Contiguous runs with no delayed entry, past the group's delay and not in the reply yet go
        through as the stream returned them (one chunk per node). Otherwise each record is judged
        by `Group.admit`: delivered, scheduled for its deliver_at_ms (and passed), or the scan stops
        before it; an entry the reply holds already (a redelivery that a cursor moved back meets
        again) is passed.
        """
        delay = group.config.delay_ms
        cursor = group.cursor
        start = len(out.offsets)
        gap: Gap | None = None
        stop_due: int | None = None
        caught_up = False
        scheduled: list[tuple[int, int]] = []
        while room > 0:
            budget = out.budget()
            if budget is None:
                break
            result = self._engine.read(stream, cursor, room, max_bytes=budget)
            if cursor < result.first_offset:
                if gap is None:
                    gap = Gap(cursor, result.first_offset, GapReason.EVICTED)
                cursor = result.first_offset
            if result.count == 0:
                cursor = max(cursor, result.end_offset)  # what is left before the end is holes
                caught_up = cursor == result.end_offset
                break
            run = range(cursor, result.last_offset + 1)
            fast = False
            if len(run) == result.count and not out.holds_any(run):
                meta = self._engine.entries_meta(stream, run.start, run.stop)
                fast = (
                    not meta.delayed
                    and meta.max_timestamp_ms + delay <= now
                    and out.fits(sum(map(len, result.records)))
                )
            if fast:
                out.add_run(result.records, run)
                room -= result.count
                cursor = run.stop
            else:
                stopped = False
                for offset, timestamp, due, record in skim_records(result.records):
                    verdict = group.admit(now, timestamp, due)
                    if verdict == g.STOP:
                        stop_due = timestamp + delay
                        stopped = True
                        break
                    if verdict == g.SCHEDULE:
                        scheduled.append((offset, due))
                    elif out.holds(offset):
                        pass
                    elif out.fits(len(record)):
                        out.add(record, offset)
                        room -= 1
                    else:
                        stopped = True
                        break
                    cursor = offset + 1
                if stopped:
                    break
            if cursor >= result.end_offset:
                caught_up = cursor == result.end_offset
                break
        group.schedule(scheduled)
        self._record_new(group, consumer, now, retry_ms, expire_ms, noack, start, out)
        group.advance(cursor, caught_up)
        return stop_due, gap

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

    def _info(self, stream: str, store: _Store, group: g.Group) -> GroupInfo:
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
        """Up to `count` entries for `consumer` of `group`, each handed to no other consumer.

        In this order: pending entries whose retry time has passed (earliest first; their
        delivery count goes up and this consumer becomes their owner); with `claim_idle_ms`,
        pending entries idle at least that long (claim-on-read, least recently delivered first);
        then new entries: delayed entries that have become due, then entries from the group's
        cursor. New entries stop while `max_pending` entries are pending (`pending_full`). A cursor
        moved back over pending entries redelivers them as it passes them, and a reply holds each
        offset once whatever the mix (`_Out`). Delayed entries evicted before they fell due, and
        entries evicted ahead of the cursor, are reported in one `gap`.
        `retry_ms` / `expire_ms` override the group's for the entries this read delivers
        (expiry counts from an entry's first delivery). `noack` reads take only new entries
        and do not track them. `max_bytes` bounds the records' size (at least one entry).

        The consumer is created if new. The call is cheap for count=1: the service serves
        waiting readers in arrival order by calling it once per reader, arming one timer for
        `next_due_ms` and waking on appends and on group listeners (acks that free room).
        """
        if not isinstance(options, GroupReadOptions):
            raise InvalidArgumentError("options must be a GroupReadOptions")
        consumer, noack, claim_idle_ms = options.consumer, options.noack, options.claim_idle_ms
        retry_ms, expire_ms = options.retry_ms, options.expire_ms
        # Bounds the journal record of one read.
        count = min(options.count, self._engine.config.max_batch_entries)
        with self._writing(stream) as store:
            found = store.state.group(group)
            now = self._now()
            gone = self._settle(stream, found, now)
            cfg = found.config
            retry = retry_ms if retry_ms is not None else cfg.retry_ms
            expire = expire_ms if expire_ms is not None else cfg.expire_ms
            out = _Out(options.max_bytes)
            if not noack and count:
                due = found.take_due_retries(now, count)
                claims: list[int] = []
                if claim_idle_ms is not None and len(due) < count:
                    claims, doomed = found.select_idle(now, claim_idle_ms, count - len(due), set(due))
                    if doomed:
                        gone += self._dispose(stream, found, doomed, now)
                if due or claims:
                    lost, left = self._hand_over(
                        stream, found, consumer, now, due + claims, out, retry_ms=retry, claim=False
                    )
                    gone += lost
                    due_set = set(due)
                    found.restore_retries(o for o in left if o in due_set)
            room = count - len(out.offsets)
            full = False
            if not noack:
                free = found.room()
                if free is not None and free < room:
                    full, room = True, free
            gap = self._evict_scheduled(stream, found)
            cursor_due = None
            if room > 0 and out.budget() is not None:
                room -= self._deliver_scheduled(stream, found, consumer, now, retry, expire, noack, room, out)
                if room > 0 and out.budget() is not None:
                    cursor_due, cursor_gap = self._scan(
                        stream, found, consumer, now, retry, expire, noack, room, out
                    )
                    gap = _spanning(gap, cursor_gap)
            found.seen(consumer, now, active=bool(out.offsets))
            free = found.room()
            next_due = found.next_due_ms(
                now,
                retries=not noack,
                new_entries=noack or free is None or free > 0,
                claim_idle_ms=None if noack else claim_idle_ms,
                cursor_due=cursor_due,
            )
            return out.result(next_due_ms=next_due, pending_full=full, gap=gap, gone=gone)

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
            now = self._now()
            gone = self._settle(stream, found, now)
            claims, doomed = found.select_claims(now, min_idle_ms, offsets)
            if doomed:
                gone += self._dispose(stream, found, doomed, now)
            out = _Out(0)
            lost, _ = self._hand_over(stream, found, consumer, now, claims, out, retry_ms=None, claim=True)
            found.seen(consumer, now, active=bool(out.offsets))
            return out.result(gone=gone + lost)

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
            now = self._now()
            gone = self._settle(stream, found, now)
            next_cursor, claims, doomed = found.select_autoclaim(now, min_idle_ms, cursor, count)
            if doomed:
                gone += self._dispose(stream, found, doomed, now)
            out = _Out(0)
            lost, _ = self._hand_over(stream, found, consumer, now, claims, out, retry_ms=None, claim=True)
            found.seen(consumer, now, active=bool(out.offsets))
            return next_cursor, out.result(gone=gone + lost)

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
