"""Consumer groups: their configuration, the per-stream state machine, and what group calls return.

Pure logic, in the style of h11: no I/O, no locks, no clock of its own. Every
call that changes state takes `now_ms`, builds *ops* (small tuples, listed
below), applies them with `apply` and queues them in `GroupSet.ops`.
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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields

from storage.errors import GroupNotFoundError, InvalidArgumentError
from storage.names import validate_name
from storage.records import Entry, decode_records
from storage.results import Gap

# Op codes. An op is a tuple (code, group, *fields); storage.grouplog encodes each
# code's fields. Codes are persisted: never renumber, only add.
OP_CREATE = 1  # group, config, cursor, entries_read, now
OP_DROP = 2  # group
OP_SEEK = 3  # group, cursor, entries_read
OP_CONFIG = 4  # group, config
OP_SEEN = 5  # group, consumer, now, active: consumer seen (created if new); active = it got entries
OP_ACTIVE = 6  # group, now: the group was used without a consumer (acks, nacks)
OP_DELIVER = 7  # group, consumer, now, retry_ms, expire_ms, offsets: first delivery or redelivery
OP_NOACK = 8  # group, offsets: delivered without tracking (NOACK reads)
OP_SCHEDULE = 9  # group, ((offset, due_ms), ...): passed by the cursor before its deliver_at_ms
OP_ADVANCE = 10  # group, cursor, caught_up: the cursor moved forward over what a read scanned
OP_REMOVE = 11  # group, reason, offsets: leave the pending (or scheduled) list
OP_ACK_UNKNOWN = 12  # group, count: acks of offsets that were not pending
OP_RELEASE = 13  # group, due_ms, offsets: owner dropped, redelivered from due_ms on
OP_CLAIM = 14  # group, consumer, now, offsets
OP_DEL_CONSUMER = 15  # group, consumer
OP_RESTORE_GROUP = 16  # group, active_ms, *counters (snapshots only)
OP_RESTORE_CONSUMER = 17  # group, consumer, seen_ms, active_ms (snapshots only)
OP_RESTORE_PENDING = 18  # group, rows (snapshots only; see Group.snapshot_ops)

# Why an entry left the pending list (OP_REMOVE), and the counter each one feeds.
R_ACK, R_EXPIRED, R_DEAD, R_EVICTED = 0, 1, 2, 3
_REASON_COUNTER = {R_ACK: "acked", R_EXPIRED: "expired", R_DEAD: "dead_lettered", R_EVICTED: "evicted"}
COUNTER_NAMES = ("delivered", "redelivered", "acked", "ack_unknown", "expired", "dead_lettered", "evicted")
# Counts are int64 on the wire. An ack of huge ranges of offsets that are not pending names more
# unknown offsets than that: such counts saturate here rather than fail every later reply.
MAX_COUNT = 2**63 - 1

# Durations are added to clock times (ms since the epoch), and the sums are due times that go out as
# int64 (GetPending's due_ms) and arm timers: bounded far below int64, so that no sum can overflow.
MAX_DURATION_MS = 10**15

# Verdicts of Group.admit on an entry the cursor reaches.
ADMIT, SCHEDULE, STOP = "admit", "schedule", "stop"

# A doomed entry whose dead-lettering failed for a passing reason is tried again after this long.
DEAD_LETTER_RETRY_MS = 1000


def validate_label(kind: str, name: str) -> None:
    """Group and consumer names follow the stream-name rule (storage/names.py)."""
    validate_name(name, kind)


def check_non_negative(name: str, value: int | None, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgumentError(f"{name} must be a non-negative integer")


def check_duration(name: str, value: int | None, *, optional: bool = True) -> None:
    """A duration that is added to a clock time (a retry, an expiry, a delay): 0..MAX_DURATION_MS."""
    check_non_negative(name, value, optional=optional)
    if value is not None and value > MAX_DURATION_MS:
        raise InvalidArgumentError(
            f"{name} is {value} ms; the limit is {MAX_DURATION_MS} ms (about 31,700 years)"
        )


# ---------------------------------------------------------------------- configuration


@dataclass(frozen=True, kw_only=True)
class GroupConfig:
    """Per-group policy. None means "no limit" or "not used"."""

    # Redeliver an entry not acknowledged this long after its delivery (RCP RETRY retry-ms). A read may
    # set its own. None: entries stay pending (as Redis XREADGROUP) and come back only by nack or claim.
    retry_ms: int | None = None
    # Take an entry out of the pending list this long after its first delivery (RCP RETRY expire-ms).
    expire_ms: int | None = None
    # An entry delivered this many times leaves the pending list when it would be redelivered.
    max_deliveries: int | None = None
    # Bounded pending (RCP): while this many entries are pending, reads get only redeliveries.
    max_pending: int | None = None
    # Expired and exhausted entries are appended here (with x-origin-* headers) instead of dropped.
    dead_letter_stream: str | None = None
    # An entry reaches the group only once its timestamp + delay_ms has passed.
    delay_ms: int = 0
    # Retention never evicts what this group still needs (its cursor, pending and scheduled entries)...
    retention_hold: bool = False
    # ...unless the group has been idle (no read, ack or claim) for longer than this.
    idle_release_ms: int | None = None

    def __post_init__(self) -> None:
        for name in ("retry_ms", "expire_ms", "idle_release_ms"):
            check_duration(name, getattr(self, name))
        check_duration("delay_ms", self.delay_ms, optional=False)
        for name in ("max_deliveries", "max_pending"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise InvalidArgumentError(f"{name} must be a positive integer")
        if not isinstance(self.retention_hold, bool):
            raise InvalidArgumentError("retention_hold must be a bool")
        if self.dead_letter_stream is not None:
            validate_name(self.dead_letter_stream)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> GroupConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


# ---------------------------------------------------------------------- what a group read takes


@dataclass(frozen=True, slots=True)
class GroupReadOptions:
    """One group read's parameters besides its stream and group (see GroupManager.read_group).

    Checked when made (InvalidArgumentError), so a reader that repeats a read
    (a waiting one, a Consume session) checks its options once.
    """

    consumer: str
    count: int  # at most this many entries (the engine caps it at max_batch_entries)
    max_bytes: int = 0  # bound on the records' size, at least one entry; 0: none
    retry_ms: int | None = None  # overrides the group's for the entries this read delivers
    expire_ms: int | None = None  # likewise (expiry counts from an entry's first delivery)
    noack: bool = False  # take only new entries, and do not track them
    claim_idle_ms: int | None = None  # also claim pending entries idle this long (claim-on-read)

    def __post_init__(self) -> None:
        validate_label("consumer", self.consumer)
        check_non_negative("count", self.count)
        check_non_negative("max_bytes", self.max_bytes)
        for name in ("retry_ms", "expire_ms", "claim_idle_ms"):
            check_duration(name, getattr(self, name))

    @property
    def kind(self) -> tuple[bool, int | None]:
        """Reads of the same kind see the same entries: if one finds nothing, so do the others."""
        return self.noack, self.claim_idle_ms


# ---------------------------------------------------------------------- what calls return


@dataclass(frozen=True, slots=True)
class GroupCounters:
    delivered: int = 0  # first deliveries
    redelivered: int = 0  # retries, claims, and new deliveries of entries still pending
    acked: int = 0
    ack_unknown: int = 0  # acks of offsets that were not pending (unknown or acknowledged before)
    expired: int = 0  # dropped by expire_ms or max_deliveries (no dead-letter stream)
    dead_lettered: int = 0
    evicted: int = 0  # pending or scheduled entries dropped because the stream no longer has them


@dataclass(frozen=True, slots=True)
class ConsumerInfo:
    name: str
    pending: int
    seen_ms: int  # last read or claim, successful or not (Redis seen-time)
    active_ms: int | None  # last read or claim that returned entries (Redis active-time); None: never


@dataclass(frozen=True, slots=True)
class GroupInfo:
    stream: str
    name: str
    config: GroupConfig
    cursor: int  # next offset new entries come from
    entries_read: int
    lag: int | None  # entries the group has still to receive (scheduled ones included); None if unknown
    entries_added: int  # the stream's all-time count (= its next offset)
    pending: int
    scheduled: int
    consumers: tuple[ConsumerInfo, ...]
    counters: GroupCounters
    created_ms: int
    active_ms: int
    hold_offset: int  # lowest offset the group still needs (what it holds if retention_hold is on)
    holds_retention: bool  # this group is the one holding the stream's retention back


@dataclass(frozen=True, slots=True)
class PendingRow:
    offset: int
    consumer: str | None  # None: released, waiting for redelivery
    idle_ms: int  # since its last delivery
    delivery_count: int
    due_ms: int | None  # when it is redelivered automatically; None: only by claim


@dataclass(frozen=True, slots=True)
class PendingInfo:
    count: int  # the whole group's pending entries (not filtered)
    lowest: int | None
    highest: int | None
    consumers: dict[str, int]  # pending entries per consumer (consumers with none are left out)
    released: int  # pending entries without an owner
    rows: tuple[PendingRow, ...]  # the filtered detail, in offset order


@dataclass(frozen=True, slots=True)
class AckResult:
    acknowledged: int  # entries that were pending and are now acknowledged
    unknown: int  # offsets named that were not pending (harmless; counted in ack_unknown)


@dataclass(frozen=True, slots=True)
class NackResult:
    released: int  # pending entries released for redelivery
    unknown: int  # offsets named that were not pending


@dataclass(slots=True)
class GroupReadResult:
    """Entries handed to one consumer: records as `ReadResult.records` holds them, in delivery order.

    `offsets` and `delivery_counts` have one item per entry (not per chunk of
    `records`). `next_due_ms` is the earliest time a read with the same options
    could get something that is not deliverable now (a retry, a delayed or
    scheduled entry, an entry becoming idle enough to claim), or None; a
    waiting reader arms one timer for it instead of polling. New appends and
    acks that free room (`pending_full`) are signalled separately.
    """

    records: list[bytes] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    delivery_counts: list[int] = field(default_factory=list)
    next_due_ms: int | None = None
    pending_full: bool = False  # new entries were held back because max_pending entries are pending
    # Evicted entries never delivered to this group: those the cursor jumped over, and delayed entries
    # evicted before they fell due; one range spanning them all.
    gap: Gap | None = None
    gone: list[int] = field(default_factory=list)  # pending offsets dropped: the stream no longer has them

    @property
    def count(self) -> int:
        return len(self.offsets)

    def data(self) -> bytes:
        return b"".join(self.records)

    def entries(self) -> list[Entry]:
        return decode_records(self.data())


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
        self._apply: dict[int, Callable[..., None]] = {
            OP_SEEK: self._on_seek,
            OP_CONFIG: self._on_config,
            OP_SEEN: self._on_seen,
            OP_ACTIVE: self._on_active,
            OP_DELIVER: self._on_deliver,
            OP_NOACK: self._on_noack,
            OP_SCHEDULE: self._on_schedule,
            OP_ADVANCE: self._on_advance,
            OP_REMOVE: self._on_remove,
            OP_ACK_UNKNOWN: self._on_ack_unknown,
            OP_RELEASE: self._on_release,
            OP_CLAIM: self._on_claim,
            OP_DEL_CONSUMER: self._on_del_consumer,
            OP_RESTORE_GROUP: self._on_restore_group,
            OP_RESTORE_CONSUMER: self._on_restore_consumer,
            OP_RESTORE_PENDING: self._on_restore_pending,
        }

    def apply(self, op: tuple) -> None:
        self._apply[op[0]](*op[2:])

    # ------------------------------------------------------------------ applying ops

    def _on_seek(self, cursor: int, entries_read: int) -> None:
        self.cursor = cursor
        self.entries_read = entries_read

    def _on_config(self, config: GroupConfig) -> None:
        self.config = config
        self.rebuild_timers()  # max_deliveries decides which timer each entry sits in

    def _consumer(self, name: str, now: int) -> Consumer:
        consumer = self.consumers.get(name)
        if consumer is None:
            consumer = self.consumers[name] = Consumer(name, now)
        return consumer

    def _on_seen(self, name: str, now: int, active: bool) -> None:
        consumer = self._consumer(name, now)
        consumer.seen_ms = now
        if active:
            consumer.active_ms = now
        self.active_ms = now

    def _on_active(self, now: int) -> None:
        self.active_ms = now

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

    def _on_deliver(
        self, name: str, now: int, retry_ms: int | None, expire_ms: int | None, offsets: Sequence[int]
    ) -> None:
        consumer = self._consumer(name, now)
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

    def _on_noack(self, offsets: Iterable[int]) -> None:
        n = 0
        for offset in offsets:
            n += 1
            if offset in self.scheduled:
                self._unschedule(offset)
        self.counters["delivered"] += n

    def _on_schedule(self, pairs: Iterable[tuple[int, int]]) -> None:
        for offset, due in pairs:
            if offset not in self.scheduled:
                insort(self._sched_order, offset)
            self.scheduled[offset] = due
            heapq.heappush(self._sched_heap, (due, offset))

    def _unschedule(self, offset: int) -> None:
        del self.scheduled[offset]
        i = bisect_left(self._sched_order, offset)
        del self._sched_order[i]

    def _on_advance(self, cursor: int, caught_up: bool) -> None:
        self.entries_read += cursor - self.cursor
        self.cursor = cursor
        if caught_up:
            self.entries_read = cursor

    def _on_remove(self, reason: int, offsets: Iterable[int]) -> None:
        take, forget_idle = self.pending.pop, self._idle.pop
        removed: list[int] = []
        owners: dict[str | None, int] = {}  # consumer -> entries of its removed, counted once each
        unscheduled = 0
        for offset in offsets:
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
        self.counters[_REASON_COUNTER[reason]] += len(removed) + unscheduled
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

    def _on_ack_unknown(self, count: int) -> None:
        self.counters["ack_unknown"] = min(self.counters["ack_unknown"] + count, MAX_COUNT)

    def _on_release(self, due_ms: int, offsets: Iterable[int]) -> None:
        for offset in offsets:
            entry = self.pending.get(offset)
            if entry is not None:
                self._disown(entry)
                entry.retry_at = due_ms
                self._arm(entry)

    def _on_claim(self, name: str, now: int, offsets: Iterable[int]) -> None:
        consumer = self._consumer(name, now)
        for offset in offsets:
            entry = self.pending.get(offset)
            if entry is None:
                continue
            self._disown(entry)
            entry.count += 1
            self.counters["redelivered"] += 1
            self._own(entry, consumer, now)
            entry.retry_at = None if entry.retry_ms is None else now + entry.retry_ms
            self._arm(entry)

    def _on_del_consumer(self, name: str) -> None:
        consumer = self.consumers.pop(name, None)
        if consumer is not None and consumer.pending:
            for entry in self.pending.values():  # only after a release that missed some: keep counts exact
                if entry.consumer == name:
                    entry.consumer = None

    def _on_restore_group(self, active_ms: int, *counters: int) -> None:
        self.active_ms = active_ms
        self.counters = dict(zip(COUNTER_NAMES, counters, strict=True))

    def _on_restore_consumer(self, name: str, seen_ms: int, active_ms: int | None) -> None:
        consumer = self._consumer(name, seen_ms)
        consumer.seen_ms = seen_ms
        consumer.active_ms = active_ms

    def _on_restore_pending(self, rows: Sequence[tuple]) -> None:
        for offset, owner, count, delivered_ms, first_ms, retry_ms, retry_at, expire_at in rows:
            entry = Pending(offset, first_ms, expire_at)
            entry.count = count
            entry.retry_ms = retry_ms
            entry.retry_at = retry_at
            self.pending[offset] = entry
            if owner is None:
                entry.delivered_ms = delivered_ms
                self._idle[offset] = None
            else:
                self._own(entry, self._consumer(owner, delivered_ms), delivered_ms)
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
        self._emit((OP_SEEK, self.name, cursor, entries_read))

    def set_config(self, config: GroupConfig) -> None:
        self._emit((OP_CONFIG, self.name, config))

    def seen(self, consumer: str, now: int, active: bool) -> None:
        self._emit((OP_SEEN, self.name, consumer, now, active))

    def touch(self, now: int) -> None:
        self._emit((OP_ACTIVE, self.name, now))

    def deliver(
        self, consumer: str, now: int, retry_ms: int | None, expire_ms: int | None, offsets: Sequence[int]
    ) -> None:
        if offsets:
            self._emit((OP_DELIVER, self.name, consumer, now, retry_ms, expire_ms, offsets))

    def deliver_untracked(self, offsets: Sequence[int]) -> None:
        if offsets:
            self._emit((OP_NOACK, self.name, offsets))

    def schedule(self, pairs: Sequence[tuple[int, int]]) -> None:
        if pairs:
            self._emit((OP_SCHEDULE, self.name, tuple(pairs)))

    def advance(self, cursor: int, caught_up: bool) -> None:
        if cursor > self.cursor or (caught_up and self.entries_read != cursor):
            self._emit((OP_ADVANCE, self.name, max(cursor, self.cursor), caught_up))

    def remove(self, offsets: Sequence[int], reason: int) -> None:
        if offsets:
            self._emit((OP_REMOVE, self.name, reason, tuple(offsets)))

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
        self.remove(found, R_ACK)
        unknown = min(unknown, MAX_COUNT)
        if unknown:
            self._emit((OP_ACK_UNKNOWN, self.name, unknown))
        return AckResult(len(found), unknown)

    def nack(self, now: int, offsets: Sequence[int], delay_ms: int) -> NackResult:
        """Release pending entries for redelivery delay_ms from now (NATS NAK with delay, Redis XNACK)."""
        found = list(dict.fromkeys(o for o in offsets if o in self.pending))
        self.touch(now)
        if found:
            self._emit((OP_RELEASE, self.name, now + delay_ms, tuple(found)))
        return NackResult(len(found), len(offsets) - len(found))

    def claim(self, consumer: str, now: int, offsets: Sequence[int]) -> None:
        if offsets:
            self._emit((OP_CLAIM, self.name, consumer, now, tuple(offsets)))

    def delete_consumer(self, consumer: str, now: int) -> int:
        """Forget a consumer; its pending entries go back to the group, due at once. Returns how many."""
        if consumer not in self.consumers:
            return 0
        owned = self.owned_by(consumer)
        self.touch(now)
        if owned:
            self._emit((OP_RELEASE, self.name, now, tuple(owned)))
        self._emit((OP_DEL_CONSUMER, self.name, consumer))
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

    def snapshot_ops(self) -> list[tuple]:
        """Ops that rebuild this group from nothing (a snapshot is the journal compacted)."""
        name = self.name
        ops: list[tuple] = [
            (OP_CREATE, name, self.config, self.cursor, self.entries_read, self.created_ms),
            (OP_RESTORE_GROUP, name, self.active_ms, *(self.counters[k] for k in COUNTER_NAMES)),
        ]
        for consumer in self.consumers.values():
            ops.append((OP_RESTORE_CONSUMER, name, consumer.name, consumer.seen_ms, consumer.active_ms))
        if self.pending:
            rows = []
            for offset in self._idle:  # in delivery order, so claim-on-read order survives a restart
                e = self.pending[offset]
                rows.append(
                    (
                        offset,
                        e.consumer,
                        e.count,
                        e.delivered_ms,
                        e.first_ms,
                        e.retry_ms,
                        e.retry_at,
                        e.expire_at,
                    )
                )
            ops.append((OP_RESTORE_PENDING, name, tuple(rows)))
        if self.scheduled:
            ops.append((OP_SCHEDULE, name, tuple(sorted(self.scheduled.items()))))
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
        self.ops: list[tuple] = []

    def apply(self, op: tuple) -> None:
        code, name = op[0], op[1]
        if code == OP_CREATE:
            _, _, config, cursor, entries_read, now = op
            self.groups[name] = Group(name, config, cursor, entries_read, now, self._emit)
        elif code == OP_DROP:
            self.groups.pop(name, None)
        else:
            self.groups[name].apply(op)

    def _emit(self, op: tuple) -> None:
        self.apply(op)
        self.ops.append(op)

    def drain(self) -> list[tuple]:
        ops, self.ops = self.ops, []
        return ops

    def group(self, name: str) -> Group:
        group = self.groups.get(name)
        if group is None:
            raise GroupNotFoundError(f"consumer group {name!r} does not exist")
        return group

    def create(self, name: str, config: GroupConfig, cursor: int, entries_read: int, now: int) -> Group:
        self._emit((OP_CREATE, name, config, cursor, entries_read, now))
        return self.groups[name]

    def drop(self, name: str) -> None:
        self.group(name)
        self._emit((OP_DROP, name))

    def snapshot_ops(self) -> list[tuple]:
        ops: list[tuple] = []
        for name in sorted(self.groups):
            ops.extend(self.groups[name].snapshot_ops())
        return ops

    def dump(self) -> dict:
        return {name: self.groups[name].dump() for name in sorted(self.groups)}
