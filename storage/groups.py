"""Consumer groups: their configuration, the per-stream state machine, and what group calls return.

Pure logic, in the style of h11: no I/O, no locks, no clock of its own. Every
call that changes state takes `now_ms`, builds *ops* (storage.groupops: one
typed record per kind of change), applies them with `apply` and queues them in
`GroupSet.ops`.
`storage.grouplog` writes the queued ops to the journal and recovery applies
the same ops again, so a recovered state equals the live one by construction.
Decisions that need the stream's content (does an entry still exist, when was
it appended, does it carry `deliver_at_ms`) are split: this module picks
offsets and judges what it is told; `storage.groupmanager` reads the stream.

One group (Redis stream.h's `streamCG` plus RCP 11's RETRY and bounded pending):

- `cursor`: the next offset new entries are scanned from (Redis `last_id` + 1).
- `entries_read`: Redis's logical read counter. Offsets are contiguous and
  every appended entry takes one, so a group at offset c has read exactly c
  entries; a counter given explicitly (Redis ENTRIESREAD) that disagrees is
  kept as given and makes lag unknown until the group reaches the end of the
  stream, where the counter is known again (seed 002's "recovers once the
  group catches up").
- `pending`: offset -> `Pending` (owner, delivery count, delivery times,
  when it is retried, when it expires). An owner of None means released
  (nacked, or its consumer was deleted): waiting to be redelivered.
- `scheduled`: offsets the cursor passed while their `deliver_at_ms` was
  still ahead, so the entries behind them were not held back; each is
  delivered as a new entry once due.
- `consumers` (seen and active times, pending count) and counters.

Timers. A pending entry is *due* at `retry_at` (redelivered to the next
reader before new entries) and *doomed* at `expire_at`, or at `retry_at` once
it has been delivered `max_deliveries` times (it leaves the pending list,
dropped or dead-lettered, instead of being delivered again). Heaps keyed by
those times make "anything due?" O(1); entries re-armed since an item was
pushed are recognised by value (the entry's current time differs) and skipped.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields

from storage.errors import GroupNotFoundError
from storage.groupops import (
    AckUnknown,
    Advance,
    Claim,
    CreateGroup,
    DeleteConsumer,
    Deliver,
    DeliverUntracked,
    DropGroup,
    GroupOp,
    PendingRecord,
    Release,
    Remove,
    RemoveReason,
    RestoreConsumer,
    RestoreGroup,
    RestorePending,
    Schedule,
    Seek,
    Seen,
    SetConfig,
    Touch,
)
from storage.grouptypes import (
    MAX_COUNT,
    AckResult,
    ConsumerInfo,
    GroupConfig,
    GroupCounters,
    NackResult,
    PendingInfo,
    PendingRow,
)

COUNTER_NAMES = tuple(f.name for f in fields(GroupCounters))

# Verdicts of Group.admit on an entry the cursor reaches.
ADMIT, SCHEDULE, STOP = "admit", "schedule", "stop"

# A doomed entry whose dead-lettering failed for a passing reason is tried again after this long.
DEAD_LETTER_RETRY_MS = 1000


# ---------------------------------------------------------------------- state


class Pending:
    """One pending entry (Redis streamNACK, with RCP 11's retry and expire times)."""

    __slots__ = (
        "consumer",
        "count",
        "delivered_ms",
        "doom_at",
        "expire_at",
        "first_ms",
        "offset",
        "retry_at",
        "retry_due",
        "retry_ms",
    )

    def __init__(
        self,
        offset: int,
        first_ms: int,
        expire_at: int | None,
        consumer: str | None = None,
        retry_ms: int | None = None,
        retry_at: int | None = None,
    ) -> None:
        self.offset = offset
        self.consumer = consumer
        self.count = 1
        self.first_ms = first_ms
        self.delivered_ms = first_ms
        self.expire_at = expire_at
        self.retry_ms = retry_ms  # the interval of the last delivery, reused by claims
        self.retry_at = retry_at
        # Derived by Group._arm: when it is redelivered (retry_at unless exhausted) and when it leaves.
        self.retry_due: int | None = None
        self.doom_at: int | None = None


class Consumer:
    __slots__ = ("active_ms", "name", "pending", "seen_ms")

    def __init__(self, name: str, seen_ms: int) -> None:
        self.name = name
        self.seen_ms = seen_ms
        self.active_ms: int | None = None
        self.pending = 0


@dataclass(frozen=True, slots=True)
class Doomed:
    """A pending entry that must leave the list now: expired, or delivered max_deliveries times."""

    offset: int
    delivery_count: int
    reason: str  # "expired" or "max_deliveries" (the x-reason header of a dead letter)


class Group:
    def __init__(
        self, name: str, config: GroupConfig, cursor: int, entries_read: int, created_ms: int, emit
    ) -> None:
        self.name = name
        self.config = config
        self.cursor = cursor
        self.entries_read = entries_read
        self.created_ms = created_ms
        self.active_ms = created_ms
        self.pending: dict[int, Pending] = {}
        self.consumers: dict[str, Consumer] = {}
        self.scheduled: dict[int, int] = {}  # offset -> due ms
        self.counters = dict.fromkeys(COUNTER_NAMES, 0)
        self._emit = emit
        self._order: list[int] = []  # pending offsets, ascending (summaries, ranges, autoclaim)
        # Pending offsets, least recently delivered first (a dict keeps insertion order).
        self._idle: dict[int, None] = {}
        self._sched_order: list[int] = []  # scheduled offsets, ascending (the retention hold)
        self._retry_heap: list[tuple[int, int]] = []  # (retry_due, offset)
        self._doom_heap: list[tuple[int, int]] = []  # (doom_at, offset)
        self._sched_heap: list[tuple[int, int]] = []  # (due, offset)
        self._apply = {
            Seek: self._on_seek,
            SetConfig: self._on_config,
            Seen: self._on_seen,
            Touch: self._on_touch,
            Deliver: self._on_deliver,
            DeliverUntracked: self._on_noack,
            Schedule: self._on_schedule,
            Advance: self._on_advance,
            Remove: self._on_remove,
            AckUnknown: self._on_ack_unknown,
            Release: self._on_release,
            Claim: self._on_claim,
            DeleteConsumer: self._on_del_consumer,
            RestoreGroup: self._on_restore_group,
            RestoreConsumer: self._on_restore_consumer,
            RestorePending: self._on_restore_pending,
        }

    def apply(self, op: GroupOp) -> None:
        self._apply[type(op)](op)

    # ------------------------------------------------------------------ applying ops

    def _on_seek(self, op: Seek) -> None:
        self.cursor = op.cursor
        self.entries_read = op.entries_read

    def _on_config(self, op: SetConfig) -> None:
        self.config = op.config
        self.rebuild_timers()  # max_deliveries decides which timer each entry sits in

    def _consumer(self, name: str, now: int) -> Consumer:
        consumer = self.consumers.get(name)
        if consumer is None:
            consumer = self.consumers[name] = Consumer(name, now)
        return consumer

    def _on_seen(self, op: Seen) -> None:
        now = op.now_ms
        consumer = self._consumer(op.consumer, now)
        consumer.seen_ms = now
        if op.active:
            consumer.active_ms = now
        self.active_ms = now

    def _on_touch(self, op: Touch) -> None:
        self.active_ms = op.now_ms

    def _disown(self, entry: Pending) -> None:
        if entry.consumer is not None:
            owner = self.consumers.get(entry.consumer)
            if owner is not None:
                owner.pending -= 1
            entry.consumer = None

    def _own(self, entry: Pending, consumer: Consumer, now: int) -> None:
        entry.consumer = consumer.name
        consumer.pending += 1
        entry.delivered_ms = now
        idle = self._idle
        idle.pop(entry.offset, None)
        idle[entry.offset] = None  # to the end: the most recently delivered

    def all_new(self, offsets: Sequence[int]) -> bool:
        """Whether none of `offsets` is pending or scheduled: a first delivery of each."""
        order = self._order
        return (not order or min(offsets) > order[-1]) and self.scheduled.keys().isdisjoint(offsets)

    def _on_deliver(self, op: Deliver) -> None:
        now, retry_ms, expire_ms, offsets = op.now_ms, op.retry_ms, op.expire_ms, op.offsets
        consumer = self._consumer(op.consumer, now)
        if offsets and self.all_new(offsets):
            self._deliver_new(consumer, now, retry_ms, expire_ms, offsets)
            return
        counters = self.counters
        for offset in offsets:
            if offset in self.scheduled:
                self._unschedule(offset)
            entry = self.pending.get(offset)
            if entry is None:
                entry = Pending(offset, now, None if expire_ms is None else now + expire_ms)
                self.pending[offset] = entry
                if not self._order or offset > self._order[-1]:
                    self._order.append(offset)
                else:
                    insort(self._order, offset)
                counters["delivered"] += 1
            else:
                self._disown(entry)
                entry.count += 1
                counters["redelivered"] += 1
            self._own(entry, consumer, now)
            entry.retry_ms = retry_ms
            entry.retry_at = None if retry_ms is None else now + retry_ms
            self._arm(entry)

    def _deliver_new(
        self,
        consumer: Consumer,
        now: int,
        retry_ms: int | None,
        expire_ms: int | None,
        offsets: Sequence[int],
    ) -> None:
        """_on_deliver for a batch of first deliveries (the common case), with no per-entry lookups."""
        expire_at = None if expire_ms is None else now + expire_ms
        retry_at = None if retry_ms is None else now + retry_ms
        name = consumer.name
        entries = [Pending(offset, now, expire_at, name, retry_ms, retry_at) for offset in offsets]
        if retry_at is not None or expire_at is not None:
            for entry in entries:
                self._arm(entry)
        self.pending.update(zip(offsets, entries, strict=True))
        self._order.extend(sorted(offsets))  # all past the last pending offset (all_new)
        self._idle.update(dict.fromkeys(offsets))
        consumer.pending += len(entries)
        self.counters["delivered"] += len(entries)

    def _on_noack(self, op: DeliverUntracked) -> None:
        n = 0
        for offset in op.offsets:
            n += 1
            if offset in self.scheduled:
                self._unschedule(offset)
        self.counters["delivered"] += n

    def _on_schedule(self, op: Schedule) -> None:
        for offset, due in op.due:
            if offset not in self.scheduled:
                insort(self._sched_order, offset)
            self.scheduled[offset] = due
            heapq.heappush(self._sched_heap, (due, offset))

    def _unschedule(self, offset: int) -> None:
        del self.scheduled[offset]
        i = bisect_left(self._sched_order, offset)
        del self._sched_order[i]

    def _on_advance(self, op: Advance) -> None:
        cursor = op.cursor
        self.entries_read += cursor - self.cursor
        self.cursor = cursor
        if op.caught_up:
            self.entries_read = cursor

    def _on_remove(self, op: Remove) -> None:
        take, forget_idle = self.pending.pop, self._idle.pop
        removed: list[int] = []
        owners: dict[str | None, int] = {}  # consumer -> entries of its removed, counted once each
        unscheduled = 0
        for offset in op.offsets:
            entry = take(offset, None)
            if entry is not None:
                owners[entry.consumer] = owners.get(entry.consumer, 0) + 1
                entry.consumer = None
                forget_idle(offset, None)
                removed.append(offset)
            elif offset in self.scheduled:
                self._unschedule(offset)
                unscheduled += 1
        for name, n in owners.items():
            owner = self.consumers.get(name) if name is not None else None
            if owner is not None:
                owner.pending -= n
        self.counters[op.reason.counter] += len(removed) + unscheduled
        order = self._order
        if len(removed) > 16:
            removed.sort()
            first = bisect_left(order, removed[0])
            if order[first : first + len(removed)] == removed:
                del order[first : first + len(removed)]  # a run of the list (a range ack): one cut
            else:
                gone = set(removed)
                self._order = [o for o in order if o not in gone]
        else:
            for offset in removed:
                del order[bisect_left(order, offset)]
        self._maybe_compact_heaps()

    def _on_ack_unknown(self, op: AckUnknown) -> None:
        self.counters["ack_unknown"] = min(self.counters["ack_unknown"] + op.count, MAX_COUNT)

    def _on_release(self, op: Release) -> None:
        for offset in op.offsets:
            entry = self.pending.get(offset)
            if entry is not None:
                self._disown(entry)
                entry.retry_at = op.due_ms
                self._arm(entry)

    def _on_claim(self, op: Claim) -> None:
        now = op.now_ms
        consumer = self._consumer(op.consumer, now)
        for offset in op.offsets:
            entry = self.pending.get(offset)
            if entry is None:
                continue
            self._disown(entry)
            entry.count += 1
            self.counters["redelivered"] += 1
            self._own(entry, consumer, now)
            entry.retry_at = None if entry.retry_ms is None else now + entry.retry_ms
            self._arm(entry)

    def _on_del_consumer(self, op: DeleteConsumer) -> None:
        name = op.consumer
        consumer = self.consumers.pop(name, None)
        if consumer is not None and consumer.pending:
            for entry in self.pending.values():  # only after a release that missed some: keep counts exact
                if entry.consumer == name:
                    entry.consumer = None

    def _on_restore_group(self, op: RestoreGroup) -> None:
        self.active_ms = op.active_ms
        self.counters = {name: getattr(op.counters, name) for name in COUNTER_NAMES}

    def _on_restore_consumer(self, op: RestoreConsumer) -> None:
        consumer = self._consumer(op.consumer, op.seen_ms)
        consumer.seen_ms = op.seen_ms
        consumer.active_ms = op.active_ms

    def _on_restore_pending(self, op: RestorePending) -> None:
        for row in op.rows:
            offset = row.offset
            entry = Pending(offset, row.first_ms, row.expire_at)
            entry.count = row.count
            entry.retry_ms = row.retry_ms
            entry.retry_at = row.retry_at
            self.pending[offset] = entry
            if row.consumer is None:
                entry.delivered_ms = row.delivered_ms
                self._idle[offset] = None
            else:
                self._own(entry, self._consumer(row.consumer, row.delivered_ms), row.delivered_ms)
            self._arm(entry)
        self._order = sorted(self.pending)

    # ------------------------------------------------------------------ timers

    def _exhausted(self, entry: Pending) -> bool:
        limit = self.config.max_deliveries
        return limit is not None and entry.count >= limit

    def _set_times(self, entry: Pending) -> None:
        """Derive when the entry is redelivered (retry_due) and when it leaves the list (doom_at)."""
        if entry.retry_at is None and entry.expire_at is None:
            entry.retry_due = entry.doom_at = None
            return
        exhausted = self._exhausted(entry)
        entry.retry_due = None if exhausted else entry.retry_at
        doom = entry.expire_at
        if exhausted and entry.retry_at is not None:
            doom = entry.retry_at if doom is None else min(doom, entry.retry_at)
        entry.doom_at = doom

    def _arm(self, entry: Pending) -> None:
        """Recompute the entry's times and push them on the heaps."""
        self._set_times(entry)
        # Always push, even an unchanged time: a take may have popped the entry's only item.
        pushed = False
        if entry.retry_due is not None:
            heapq.heappush(self._retry_heap, (entry.retry_due, entry.offset))
            pushed = True
        if entry.doom_at is not None:
            heapq.heappush(self._doom_heap, (entry.doom_at, entry.offset))
            pushed = True
        if pushed:
            self._maybe_compact_heaps()

    def _maybe_compact_heaps(self) -> None:
        # Stale items (entries re-armed or gone) are skipped when they surface; rebuild before they pile up.
        bound = 2 * len(self.pending) + 64
        if len(self._retry_heap) > bound or len(self._doom_heap) > bound:
            self.rebuild_timers()
        if len(self._sched_heap) > 2 * len(self.scheduled) + 64:
            self._sched_heap = [(due, offset) for offset, due in self.scheduled.items()]
            heapq.heapify(self._sched_heap)

    def rebuild_timers(self) -> None:
        """Rebuild the heaps from the entries (after a config change, or to undo takes that were not used)."""
        self._retry_heap, self._doom_heap = [], []
        for entry in self.pending.values():
            self._set_times(entry)
            if entry.retry_due is not None:
                self._retry_heap.append((entry.retry_due, entry.offset))
            if entry.doom_at is not None:
                self._doom_heap.append((entry.doom_at, entry.offset))
        heapq.heapify(self._retry_heap)
        heapq.heapify(self._doom_heap)
        self._sched_heap = [(due, offset) for offset, due in self.scheduled.items()]
        heapq.heapify(self._sched_heap)

    def _valid_retry(self, item: tuple[int, int]) -> bool:
        entry = self.pending.get(item[1])
        return entry is not None and entry.retry_due == item[0]

    def _valid_doom(self, item: tuple[int, int]) -> bool:
        entry = self.pending.get(item[1])
        return entry is not None and entry.doom_at == item[0]

    def _valid_sched(self, item: tuple[int, int]) -> bool:
        return self.scheduled.get(item[1]) == item[0]

    def _top(self, heap: list[tuple[int, int]], valid) -> int | None:
        while heap and not valid(heap[0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def take_due_retries(self, now: int, limit: int) -> list[int]:
        """Pending entries whose retry time has passed, earliest first (then by offset), at most `limit`.

        They are taken off the retry heap: deliver them, or hand back the unused with `restore_retries`.
        """
        out: list[int] = []
        seen: set[int] = set()
        heap = self._retry_heap
        while heap and len(out) < limit and heap[0][0] <= now:
            item = heapq.heappop(heap)
            if self._valid_retry(item) and item[1] not in seen:
                seen.add(item[1])
                out.append(item[1])
        return out

    def restore_retries(self, offsets: Iterable[int]) -> None:
        for offset in offsets:
            entry = self.pending.get(offset)
            if entry is not None and entry.retry_due is not None:
                heapq.heappush(self._retry_heap, (entry.retry_due, offset))

    def take_doomed(self, now: int) -> list[Doomed]:
        """Entries that must leave the pending list by now (expired, or exhausted and due), earliest first."""
        out: list[Doomed] = []
        seen: set[int] = set()
        heap = self._doom_heap
        while heap and heap[0][0] <= now:
            item = heapq.heappop(heap)
            if self._valid_doom(item) and item[1] not in seen:
                seen.add(item[1])
                out.append(self._doomed(self.pending[item[1]], now))
        return out

    def _doomed(self, entry: Pending, now: int) -> Doomed:
        expired = entry.expire_at is not None and entry.expire_at <= now
        return Doomed(entry.offset, entry.count, "expired" if expired else "max_deliveries")

    def defer_doom(self, offsets: Iterable[int], until_ms: int) -> None:
        """Retry retiring entries whose dead-lettering failed (in memory only: a restart retries at once)."""
        for offset in offsets:
            entry = self.pending.get(offset)
            if entry is not None:
                entry.doom_at = until_ms
                heapq.heappush(self._doom_heap, (until_ms, offset))

    def take_due_scheduled(self, now: int, limit: int) -> list[int]:
        """Scheduled (delayed) entries now due, earliest first; `restore_scheduled` hands back unused ones."""
        out: list[int] = []
        seen: set[int] = set()
        heap = self._sched_heap
        while heap and len(out) < limit and heap[0][0] <= now:
            item = heapq.heappop(heap)
            if self._valid_sched(item) and item[1] not in seen:
                seen.add(item[1])
                out.append(item[1])
        return out

    def scheduled_below(self, offset: int) -> list[int]:
        """Scheduled offsets below `offset`, ascending (below a stream's first offset: evicted)."""
        order = self._sched_order
        return order[: bisect_left(order, offset)]

    def restore_scheduled(self, offsets: Iterable[int]) -> None:
        for offset in offsets:
            due = self.scheduled.get(offset)
            if due is not None:
                heapq.heappush(self._sched_heap, (due, offset))

    # ------------------------------------------------------------------ decisions

    def admit(self, now: int, timestamp_ms: int, deliver_at_ms: int) -> str:
        """What the cursor does with the entry it reaches: deliver it, schedule it, or stop before it.

        Timestamps never decrease along a stream, so an entry still inside the group's delay stops the
        cursor (every later one is inside it too); an entry whose own deliver_at_ms is ahead is
        scheduled and passed, so it does not hold back the entries after it.
        """
        if timestamp_ms + self.config.delay_ms > now:
            return STOP
        if deliver_at_ms > now:
            return SCHEDULE
        return ADMIT

    def room(self) -> int | None:
        """How many more entries may become pending (bounded pending); None: no bound."""
        limit = self.config.max_pending
        return None if limit is None else max(limit - len(self.pending), 0)

    def _claimable(self, entry: Pending, now: int, min_idle_ms: int) -> bool:
        if now - entry.delivered_ms < min_idle_ms:
            return False
        # A released entry waits for its nack delay; automatic claims do not cut it short.
        return not (entry.consumer is None and entry.retry_at is not None and entry.retry_at > now)

    def select_idle(
        self, now: int, min_idle_ms: int, limit: int, exclude: set[int]
    ) -> tuple[list[int], list[Doomed]]:
        """Claim-on-read: entries idle for at least min_idle_ms, least recently delivered first."""
        claims: list[int] = []
        doomed: list[Doomed] = []
        for offset in self._idle:
            if len(claims) >= limit:
                break
            entry = self.pending[offset]
            if now - entry.delivered_ms < min_idle_ms:
                break  # ordered by delivery time: nothing after this one is idle enough
            if offset in exclude or not self._claimable(entry, now, min_idle_ms):
                continue
            if self._exhausted(entry):
                doomed.append(Doomed(offset, entry.count, "max_deliveries"))
            else:
                claims.append(offset)
        return claims, doomed

    def select_claims(
        self, now: int, min_idle_ms: int, offsets: Iterable[int]
    ) -> tuple[list[int], list[Doomed]]:
        """Explicit claim (Redis XCLAIM): the named pending entries idle for at least min_idle_ms."""
        claims: list[int] = []
        doomed: list[Doomed] = []
        seen: set[int] = set()
        for offset in offsets:
            entry = self.pending.get(offset)
            if entry is None or offset in seen or now - entry.delivered_ms < min_idle_ms:
                continue
            seen.add(offset)
            if self._exhausted(entry):
                doomed.append(Doomed(offset, entry.count, "max_deliveries"))
            else:
                claims.append(offset)
        return claims, doomed

    def select_autoclaim(
        self, now: int, min_idle_ms: int, cursor: int, limit: int
    ) -> tuple[int, list[int], list[Doomed]]:
        """Auto-claim (Redis XAUTOCLAIM): scan pending entries in offset order from `cursor`.

        Looks at no more than 10 x limit entries per call, as Redis does; returns the cursor to
        continue from, 0 once the scan has reached the end.
        """
        claims: list[int] = []
        doomed: list[Doomed] = []
        order = self._order
        i = bisect_left(order, cursor)
        budget = max(limit, 1) * 10
        while i < len(order) and len(claims) < limit and budget > 0:
            offset = order[i]
            i += 1
            budget -= 1
            entry = self.pending[offset]
            if not self._claimable(entry, now, min_idle_ms):
                continue
            if self._exhausted(entry):
                doomed.append(Doomed(offset, entry.count, "max_deliveries"))
            else:
                claims.append(offset)
        return (order[i] if i < len(order) else 0), claims, doomed

    def delivery_count(self, offset: int) -> int:
        """An entry's delivery count once delivered: its pending count, or 1 when not tracked."""
        entry = self.pending.get(offset)
        return 1 if entry is None else entry.count

    def owned_by(self, consumer: str) -> list[int]:
        return [o for o in self._order if self.pending[o].consumer == consumer]

    def next_due_ms(
        self, now: int, *, retries: bool, new_entries: bool, claim_idle_ms: int | None, cursor_due: int | None
    ) -> int | None:
        """Earliest time a read with these options finds something not deliverable now."""
        times: list[int] = []
        if retries:
            top = self._top(self._retry_heap, self._valid_retry)
            if top is not None:
                times.append(top)
            if claim_idle_ms is not None:
                for offset in self._idle:
                    entry = self.pending[offset]
                    if entry.consumer is None and entry.retry_at is not None and entry.retry_at > now:
                        continue  # released: its retry time is on the retry heap already
                    times.append(entry.delivered_ms + claim_idle_ms)
                    break
        if new_entries:
            top = self._top(self._sched_heap, self._valid_sched)
            if top is not None:
                times.append(top)
            if cursor_due is not None:
                times.append(cursor_due)
        return min(times) if times else None

    def hold_offset(self) -> int:
        """The lowest offset this group still needs: its lowest pending or scheduled entry, or its cursor."""
        low = self.cursor
        if self._order:
            low = min(low, self._order[0])
        if self._sched_order:
            low = min(low, self._sched_order[0])
        return low

    # ------------------------------------------------------------------ commands (emit ops)

    def seek(self, cursor: int, entries_read: int) -> None:
        self._emit(Seek(self.name, cursor, entries_read))

    def set_config(self, config: GroupConfig) -> None:
        self._emit(SetConfig(self.name, config))

    def seen(self, consumer: str, now: int, active: bool) -> None:
        self._emit(Seen(self.name, consumer, now, active))

    def touch(self, now: int) -> None:
        self._emit(Touch(self.name, now))

    def deliver(
        self, consumer: str, now: int, retry_ms: int | None, expire_ms: int | None, offsets: Sequence[int]
    ) -> None:
        if offsets:
            self._emit(Deliver(self.name, consumer, now, retry_ms, expire_ms, offsets))

    def deliver_untracked(self, offsets: Sequence[int]) -> None:
        if offsets:
            self._emit(DeliverUntracked(self.name, offsets))

    def schedule(self, pairs: Sequence[tuple[int, int]]) -> None:
        if pairs:
            self._emit(Schedule(self.name, tuple(pairs)))

    def advance(self, cursor: int, caught_up: bool) -> None:
        if cursor > self.cursor or (caught_up and self.entries_read != cursor):
            self._emit(Advance(self.name, max(cursor, self.cursor), caught_up))

    def remove(self, offsets: Sequence[int], reason: RemoveReason) -> None:
        if offsets:
            self._emit(Remove(self.name, reason, tuple(offsets)))

    def ack(self, now: int, offsets: Iterable[int], ranges: Iterable[tuple[int, int]]) -> AckResult:
        """Acknowledge offsets and half-open ranges [start, end). Unknown offsets are counted, not errors."""
        found: list[int] = []
        taken: set[int] = set()
        unknown = 0
        for offset in offsets:
            if offset in self.pending and offset not in taken:
                taken.add(offset)
                found.append(offset)
            else:
                unknown += 1
        order = self._order
        for start, end in ranges:
            hits = order[bisect_left(order, start) : bisect_left(order, end)]
            if taken:
                hits = [o for o in hits if o not in taken]
            taken.update(hits)
            found.extend(hits)
            unknown += max(end - start, 0) - len(hits)
        self.touch(now)
        self.remove(found, RemoveReason.ACK)
        unknown = min(unknown, MAX_COUNT)
        if unknown:
            self._emit(AckUnknown(self.name, unknown))
        return AckResult(len(found), unknown)

    def nack(self, now: int, offsets: Sequence[int], delay_ms: int) -> NackResult:
        """Release pending entries for redelivery delay_ms from now (NATS NAK with delay, Redis XNACK)."""
        found = list(dict.fromkeys(o for o in offsets if o in self.pending))
        self.touch(now)
        if found:
            self._emit(Release(self.name, now + delay_ms, tuple(found)))
        return NackResult(len(found), len(offsets) - len(found))

    def claim(self, consumer: str, now: int, offsets: Sequence[int]) -> None:
        if offsets:
            self._emit(Claim(self.name, consumer, now, tuple(offsets)))

    def delete_consumer(self, consumer: str, now: int) -> int:
        """Forget a consumer; its pending entries go back to the group, due at once. Returns how many."""
        if consumer not in self.consumers:
            return 0
        owned = self.owned_by(consumer)
        self.touch(now)
        if owned:
            self._emit(Release(self.name, now, tuple(owned)))
        self._emit(DeleteConsumer(self.name, consumer))
        return len(owned)

    # ------------------------------------------------------------------ queries

    def pending_info(
        self,
        now: int,
        *,
        consumer: str | None,
        min_idle_ms: int,
        start: int,
        end: int | None,
        count: int,
    ) -> PendingInfo:
        order = self._order
        rows: list[PendingRow] = []
        lo = bisect_left(order, start)
        hi = len(order) if end is None else bisect_left(order, end)
        for offset in order[lo:hi]:
            if len(rows) >= count:
                break
            entry = self.pending[offset]
            if consumer is not None and entry.consumer != consumer:
                continue
            idle = now - entry.delivered_ms
            if idle < min_idle_ms:
                continue
            rows.append(PendingRow(offset, entry.consumer, idle, entry.count, entry.retry_due))
        per_consumer = {c.name: c.pending for c in self.consumers.values() if c.pending}
        owned = sum(per_consumer.values())
        return PendingInfo(
            count=len(order),
            lowest=order[0] if order else None,
            highest=order[-1] if order else None,
            consumers=per_consumer,
            released=len(order) - owned,
            rows=tuple(rows),
        )

    def consumer_infos(self) -> tuple[ConsumerInfo, ...]:
        return tuple(
            ConsumerInfo(c.name, c.pending, c.seen_ms, c.active_ms)
            for c in sorted(self.consumers.values(), key=lambda c: c.name)
        )

    def counter_values(self) -> GroupCounters:
        return GroupCounters(**self.counters)

    def snapshot_ops(self) -> list[GroupOp]:
        """Ops that rebuild this group from nothing (a snapshot is the journal compacted)."""
        name = self.name
        ops: list[GroupOp] = [
            CreateGroup(name, self.config, self.cursor, self.entries_read, self.created_ms),
            RestoreGroup(name, self.active_ms, GroupCounters(**self.counters)),
        ]
        for consumer in self.consumers.values():
            ops.append(RestoreConsumer(name, consumer.name, consumer.seen_ms, consumer.active_ms))
        if self.pending:
            pending = self.pending
            rows = [  # in delivery order, so claim-on-read order survives a restart
                PendingRecord(
                    offset,
                    e.consumer,
                    e.count,
                    e.delivered_ms,
                    e.first_ms,
                    e.retry_ms,
                    e.retry_at,
                    e.expire_at,
                )
                for offset in self._idle
                for e in (pending[offset],)
            ]
            ops.append(RestorePending(name, tuple(rows)))
        if self.scheduled:
            ops.append(Schedule(name, tuple(sorted(self.scheduled.items()))))
        return ops

    def dump(self) -> dict:
        """Everything that defines the group, as plain data (tests compare it across restarts)."""
        return {
            "config": self.config,
            "cursor": self.cursor,
            "entries_read": self.entries_read,
            "created_ms": self.created_ms,
            "active_ms": self.active_ms,
            "counters": dict(self.counters),
            "consumers": {c.name: (c.seen_ms, c.active_ms, c.pending) for c in self.consumers.values()},
            "pending": {
                o: (e.consumer, e.count, e.delivered_ms, e.first_ms, e.retry_ms, e.retry_at, e.expire_at)
                for o, e in sorted(self.pending.items())
            },
            "idle_order": list(self._idle),
            "scheduled": dict(sorted(self.scheduled.items())),
        }


class GroupSet:
    """All consumer groups of one stream. Changes are ops: applied at once and queued in `ops`."""

    def __init__(self) -> None:
        self.groups: dict[str, Group] = {}
        self.ops: list[GroupOp] = []

    def apply(self, op: GroupOp) -> None:
        kind = type(op)
        if kind is CreateGroup:
            name = op.group
            self.groups[name] = Group(name, op.config, op.cursor, op.entries_read, op.now_ms, self._emit)
        elif kind is DropGroup:
            self.groups.pop(op.group, None)
        else:
            self.groups[op.group].apply(op)

    def _emit(self, op: GroupOp) -> None:
        self.apply(op)
        self.ops.append(op)

    def drain(self) -> list[GroupOp]:
        ops, self.ops = self.ops, []
        return ops

    def group(self, name: str) -> Group:
        group = self.groups.get(name)
        if group is None:
            raise GroupNotFoundError(f"consumer group {name!r} does not exist")
        return group

    def create(self, name: str, config: GroupConfig, cursor: int, entries_read: int, now: int) -> Group:
        self._emit(CreateGroup(name, config, cursor, entries_read, now))
        return self.groups[name]

    def drop(self, name: str) -> None:
        self.group(name)
        self._emit(DropGroup(name))

    def snapshot_ops(self) -> list[GroupOp]:
        ops: list[GroupOp] = []
        for name in sorted(self.groups):
            ops.extend(self.groups[name].snapshot_ops())
        return ops

    def dump(self) -> dict:
        return {name: self.groups[name].dump() for name in sorted(self.groups)}
