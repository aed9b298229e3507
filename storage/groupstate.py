"""Consumer groups' state machine: one stream's groups, changed only by applying ops.

Pure logic, in the style of h11: no I/O, no locks, no clock of its own. Every
call that changes state takes `now_ms`, builds *ops* (storage.groupops: one
typed record per kind of change), applies them with `apply` and queues them in
`GroupSet.ops`. `storage.grouplog` writes the queued ops to the journal and
recovery applies the same ops again, so a recovered state equals the live one
by construction. What a group read does with this state (which entries it
fetches, which it delivers) is `storage.groups`.

One group (Redis stream.h's `streamCG` plus RCP 11's RETRY and bounded pending):

- `cursor`: the next offset new entries are scanned from (Redis `last_id` + 1).
- `entries_read`: Redis's logical read counter. Offsets are contiguous and
  every appended entry takes one, so a group at offset c has read exactly c
  entries; a counter given explicitly (Redis ENTRIESREAD) that disagrees is
  kept as given and makes lag unknown until the group reaches the end of the
  stream, where the counter is known again (seed 002's "recovers once the
  group catches up").
- `pending`: the pending list (storage.grouppending: owner, delivery count,
  delivery times, when each entry is retried and when it expires). An owner
  of None means released (nacked, or its consumer was deleted): waiting to be
  redelivered.
- `scheduled`: offsets the cursor passed while their `deliver_at_ms` was
  still ahead, so the entries behind them were not held back; each is
  delivered as a new entry once due.
- `consumers` (seen and active times, pending count) and counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import astuple, fields

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
from storage.grouppending import Pending, PendingList, Scheduled
from storage.grouptypes import (
    MAX_COUNT,
    AckResult,
    ConsumerInfo,
    GroupConfig,
    GroupCounters,
    NackResult,
    PendingInfo,
)

COUNTER_NAMES = tuple(f.name for f in fields(GroupCounters))

# Verdicts of Group.admit on an entry the cursor reaches.
ADMIT, SCHEDULE, STOP = "admit", "schedule", "stop"


class Consumer:
    __slots__ = ("active_ms", "name", "pending", "seen_ms")

    def __init__(self, name: str, seen_ms: int) -> None:
        self.name = name
        self.seen_ms = seen_ms
        self.active_ms: int | None = None
        self.pending = 0


class Group:
    """One consumer group: its position, consumers, counters, pending and scheduled entries.

    Commands (`deliver`, `ack`, `nack`, ...) emit ops; `apply` is the one way state changes.
    """

    def __init__(
        self,
        name: str,
        config: GroupConfig,
        cursor: int,
        entries_read: int,
        created_ms: int,
        emit: Callable[[GroupOp], None],
    ) -> None:
        self.name = name
        self.config = config
        self.cursor = cursor
        self.entries_read = entries_read
        self.created_ms = created_ms
        self.active_ms = created_ms
        self.pending = PendingList(config.max_deliveries)
        self.consumers: dict[str, Consumer] = {}
        self.scheduled = Scheduled()
        self.counters = dict.fromkeys(COUNTER_NAMES, 0)
        self._emit = emit
        self._apply: dict[type[GroupOp], Callable] = {
            Seek: self._on_seek,
            SetConfig: self._on_config,
            Seen: self._on_seen,
            Touch: self._on_touch,
            Deliver: self._on_deliver,
            DeliverUntracked: self._on_deliver_untracked,
            Schedule: self._on_schedule,
            Advance: self._on_advance,
            Remove: self._on_remove,
            AckUnknown: self._on_ack_unknown,
            Release: self._on_release,
            Claim: self._on_claim,
            DeleteConsumer: self._on_delete_consumer,
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
        self.pending.max_deliveries = op.config.max_deliveries
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
        self.pending.delivered(entry, now)

    def all_new(self, offsets: Sequence[int]) -> bool:
        """Whether none of `offsets` is pending or scheduled: a first delivery of each."""
        return self.pending.all_after(offsets) and self.scheduled.due.keys().isdisjoint(offsets)

    def _on_deliver(self, op: Deliver) -> None:
        now, retry_ms, expire_ms, offsets = op.now_ms, op.retry_ms, op.expire_ms, op.offsets
        consumer = self._consumer(op.consumer, now)
        expire_at = None if expire_ms is None else now + expire_ms
        retry_at = None if retry_ms is None else now + retry_ms
        if offsets and self.all_new(offsets):  # the common case, with no per-entry lookups
            name = consumer.name
            entries = [Pending(offset, now, expire_at, name, retry_ms, retry_at) for offset in offsets]
            self.pending.add_new(offsets, entries, timed=retry_at is not None or expire_at is not None)
            consumer.pending += len(entries)
            self.counters["delivered"] += len(entries)
            return
        counters = self.counters
        for offset in offsets:
            self.scheduled.discard(offset)
            entry = self.pending.get(offset)
            if entry is None:
                entry = Pending(offset, now, expire_at)
                self.pending.add(entry)
                counters["delivered"] += 1
            else:
                self._disown(entry)
                entry.count += 1
                counters["redelivered"] += 1
            self._own(entry, consumer, now)
            entry.retry_ms = retry_ms
            entry.retry_at = retry_at
            self.pending.arm(entry)

    def _on_deliver_untracked(self, op: DeliverUntracked) -> None:
        for offset in op.offsets:
            self.scheduled.discard(offset)
        self.counters["delivered"] += len(op.offsets)

    def _on_schedule(self, op: Schedule) -> None:
        self.scheduled.add(op.due)

    def _on_advance(self, op: Advance) -> None:
        cursor = op.cursor
        self.entries_read += cursor - self.cursor
        self.cursor = cursor
        if op.caught_up:
            self.entries_read = cursor

    def _on_remove(self, op: Remove) -> None:
        owners, removed, missing = self.pending.remove(op.offsets)
        for name, n in owners.items():
            owner = self.consumers.get(name)
            if owner is not None:
                owner.pending -= n
        unscheduled = sum(1 for offset in missing if self.scheduled.discard(offset)) if missing else 0
        self.counters[op.reason.counter] += removed + unscheduled

    def _on_ack_unknown(self, op: AckUnknown) -> None:
        self.counters["ack_unknown"] = min(self.counters["ack_unknown"] + op.count, MAX_COUNT)

    def _on_release(self, op: Release) -> None:
        for offset in op.offsets:
            entry = self.pending.get(offset)
            if entry is not None:
                self._disown(entry)
                entry.retry_at = op.due_ms
                self.pending.arm(entry)

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
            self.pending.arm(entry)

    def _on_delete_consumer(self, op: DeleteConsumer) -> None:
        name = op.consumer
        consumer = self.consumers.pop(name, None)
        if consumer is not None and consumer.pending:
            for entry in self.pending.entries.values():  # only after a release that missed some
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
            entry = Pending(row.offset, row.first_ms, row.expire_at)
            entry.count = row.count
            entry.retry_ms = row.retry_ms
            entry.retry_at = row.retry_at
            entry.delivered_ms = row.delivered_ms
            if row.consumer is not None:
                entry.consumer = row.consumer
                self._consumer(row.consumer, row.delivered_ms).pending += 1
            self.pending.restore(entry)
            self.pending.arm(entry)
        self.pending.restored()

    # ------------------------------------------------------------------ timers

    def rebuild_timers(self) -> None:
        """Rebuild the timer heaps from the entries (after a config change, or to undo takes)."""
        self.pending.rebuild_timers()
        self.scheduled.rebuild_timers()

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
        return None if limit is None else max(limit - len(self.pending.entries), 0)

    def delivery_count(self, offset: int) -> int:
        """An entry's delivery count once delivered: its pending count, or 1 when not tracked."""
        entry = self.pending.get(offset)
        return 1 if entry is None else entry.count

    def next_due_ms(
        self, now: int, *, retries: bool, new_entries: bool, claim_idle_ms: int | None, cursor_due: int | None
    ) -> int | None:
        """Earliest time a read with these options finds something not deliverable now."""
        times: list[int | None] = []
        if retries:
            times.append(self.pending.next_retry())
            if claim_idle_ms is not None:
                times.append(self.pending.next_idle(now, claim_idle_ms))
        if new_entries:
            times += (self.scheduled.next_due(), cursor_due)
        return min((t for t in times if t is not None), default=None)

    def hold_offset(self) -> int:
        """The lowest offset this group still needs: its lowest pending or scheduled entry, or its cursor."""
        return min(o for o in (self.cursor, self.pending.lowest(), self.scheduled.lowest()) if o is not None)

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
        found, unknown = self.pending.select(offsets, ranges)
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
        owned = self.pending.owned_by(consumer)
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
        rows = self.pending.rows(now, consumer, min_idle_ms, start, end, count)
        per_consumer = {c.name: c.pending for c in self.consumers.values() if c.pending}
        order = self.pending.order
        return PendingInfo(
            count=len(order),
            lowest=order[0] if order else None,
            highest=order[-1] if order else None,
            consumers=per_consumer,
            released=len(order) - sum(per_consumer.values()),
            rows=rows,
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
            RestoreGroup(name, self.active_ms, self.counter_values()),
        ]
        for consumer in self.consumers.values():
            ops.append(RestoreConsumer(name, consumer.name, consumer.seen_ms, consumer.active_ms))
        if self.pending:
            ops.append(RestorePending(name, self.pending.records()))
        if self.scheduled:
            ops.append(Schedule(name, self.scheduled.pairs()))
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
            "pending": {r.offset: astuple(r)[1:] for r in self.pending.records()},
            "idle_order": list(self.pending.idle),
            "scheduled": dict(self.scheduled.pairs()),
        }


class GroupSet:
    """All consumer groups of one stream. Changes are ops: applied at once and queued in `ops`."""

    def __init__(self) -> None:
        self.groups: dict[str, Group] = {}
        self.ops: list[GroupOp] = []

    def apply(self, op: GroupOp) -> None:
        if type(op) is CreateGroup:  # type(), not isinstance: this runs for every op
            name = op.group
            self.groups[name] = Group(name, op.config, op.cursor, op.entries_read, op.now_ms, self._emit)
        elif type(op) is DropGroup:
            self.groups.pop(op.group, None)
        else:
            self.groups[op.group].apply(op)

    def _emit(self, op: GroupOp) -> None:
        self.apply(op)
        self.ops.append(op)

    def apply_ops(self, ops: Iterable[GroupOp]) -> None:
        """Apply ops made elsewhere (another node's, or `snapshot_ops`), queued like the state's own."""
        for op in ops:
            self._emit(op)

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
