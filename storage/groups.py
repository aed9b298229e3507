"""What a group read does, without I/O: what it fetches from the stream, and what it delivers.

A group read (and a claim) is a *plan*: a generator that yields requests for
what it needs from the stream and, given what was fetched, finishes each step
against the group's state (storage.groupstate): which entries go into the
reply, in which order, and the ops that record it. The caller
(storage.groupdelivery) serves the requests and holds the group's lock
throughout:

    plan = read(group, options, count, now)
    request = next(plan)                     # e.g. ReadFrom(cursor, room, budget)
    request = plan.send(<what it asked for>) # ... until StopIteration carries the result

The order a read serves (RCP 11, Redis XREADGROUP, NATS redelivery):

1. Doomed entries leave first (`Retire`: expired, or delivered max_deliveries
   times; dropped or dead-lettered).
2. Redeliveries: pending entries whose retry time has passed, earliest first;
   then, with claim_idle_ms, entries idle that long (claim-on-read, least
   recently delivered first). The consumer becomes their owner.
3. New entries, unless max_pending entries are pending (`pending_full`):
   delayed entries now due (oldest offsets first), then entries from the
   group's cursor. An entry still inside the group's delay stops the cursor;
   one whose deliver_at_ms is ahead is scheduled and passed.
4. Delayed entries evicted before they fell due, and entries evicted ahead
   of the cursor, come back as one gap.

A reply holds each offset once, whatever the mix (a cursor moved back over
pending entries meets redeliveries again), and stays within max_bytes (at
least one entry): `Reply`. Runs of entries from the cursor that need no
judging (no delayed entry, past the delay, none in the reply yet, as the node
headers tell: the EntriesMeta of a `ReadFrom`) pass through as the stream returned them, with
no per-entry work.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Sequence
from typing import Any, NamedTuple, TypeVar

from storage.groupops import RemoveReason
from storage.grouppending import Doomed
from storage.groupstate import SCHEDULE, STOP, Group
from storage.grouptypes import GroupReadOptions, GroupReadResult
from storage.records import skim_records
from storage.results import Gap
from storage.types import GapReason

T = TypeVar("T")


# ---------------------------------------------------------------------- what a plan asks for


class FetchRecords(NamedTuple):
    """The records of these offsets that the stream still has: dict offset -> record."""

    offsets: Sequence[int]


class ReadFrom(NamedTuple):
    """A stream read from `start`, up to `limit` entries within `max_bytes` (0: any): a ReadResult,
    and what node headers say of the entries it returned (Engine.entries_meta; None: it returned none)."""

    start: int
    limit: int  # (not `count`: a tuple's method)
    max_bytes: int


class StreamStart(NamedTuple):
    """The stream's first offset: an int."""


class Retire(NamedTuple):
    """Take doomed entries out of the group, dropped or dead-lettered (storage.deadletters):
    the offsets found gone from the stream, in a list."""

    group: Group
    doomed: list[Doomed]
    now: int


Request = FetchRecords | ReadFrom | StreamStart | Retire
Plan = Generator[Request, Any, T]


# ---------------------------------------------------------------------- the reply


class Reply:
    """A reply as it is assembled: records in delivery order, a byte budget, the offsets it holds.

    Single offsets are kept in a set, the cursor's contiguous runs as ranges, so that holding
    each offset once costs nothing per entry on the hot path.
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

    def result(self, **extra: Any) -> GroupReadResult:
        return GroupReadResult(self.records, self.offsets, self.counts, **extra)


# ---------------------------------------------------------------------- the plans


def settle(group: Group, now: int) -> Plan[list[int]]:
    """Retire the entries whose time is up, before anything else looks at the group; returns the
    offsets found gone from the stream."""
    doomed = group.pending.take_doomed(now)
    if not doomed:
        return []
    gone: list[int] = yield Retire(group, doomed, now)
    return gone


def read(group: Group, options: GroupReadOptions, count: int, now: int) -> Plan[GroupReadResult]:
    """Up to `count` entries for `options.consumer`, each handed to no other consumer (module doc).

    `retry_ms` / `expire_ms` of the options override the group's for the entries this read
    delivers; `noack` reads take only new entries and do not track them. The result's
    `next_due_ms` is when a read with the same options could find something not deliverable
    now (a waiting reader arms one timer for it instead of polling).
    """
    consumer, noack, claim_idle_ms = options.consumer, options.noack, options.claim_idle_ms
    config = group.config
    retry_ms = options.retry_ms if options.retry_ms is not None else config.retry_ms
    expire_ms = options.expire_ms if options.expire_ms is not None else config.expire_ms
    reply = Reply(options.max_bytes)
    doomed = group.pending.take_doomed(now)  # settle, inline: this is the hot path
    gone: list[int] = (yield Retire(group, doomed, now)) if doomed else []
    if not noack and count:
        due = group.pending.take_due_retries(now, count)
        claims: list[int] = []
        if claim_idle_ms is not None and len(due) < count:
            claims, doomed = group.pending.select_idle(now, claim_idle_ms, count - len(due), set(due))
            if doomed:
                gone += yield Retire(group, doomed, now)
        if due or claims:
            lost, left = yield from _hand_over(
                group, consumer, now, due + claims, reply, retry_ms, claim=False
            )
            gone += lost
            due_set = set(due)
            group.pending.restore_retries(o for o in left if o in due_set)
    room = count - len(reply.offsets)
    full = False
    if not noack:
        free = group.room()
        if free is not None and free < room:
            full, room = True, free
    gap = None
    if group.scheduled.due:  # (the dict: no Python-level __len__ on every read)
        gap = _evict_scheduled(group, (yield StreamStart()))
    cursor_due = None
    if room > 0 and reply.budget() is not None:
        new = _NewEntries(group, consumer, now, retry_ms, expire_ms, noack, reply)
        if group.scheduled.due:
            room -= yield from new.scheduled(room)
        if room > 0 and reply.budget() is not None:
            cursor_due, cursor_gap = yield from new.scan(room)
            gap = _spanning(gap, cursor_gap)
    group.seen(consumer, now, active=bool(reply.offsets))
    free = group.room()
    next_due = group.next_due_ms(
        now,
        retries=not noack,
        new_entries=noack or free is None or free > 0,
        claim_idle_ms=None if noack else claim_idle_ms,
        cursor_due=cursor_due,
    )
    return reply.result(next_due_ms=next_due, pending_full=full, gap=gap, gone=gone)


def claim(
    group: Group, consumer: str, now: int, min_idle_ms: int, offsets: Iterable[int]
) -> Plan[GroupReadResult]:
    """Take over the named pending entries idle for at least min_idle_ms (Redis XCLAIM)."""
    gone = yield from settle(group, now)
    claims, doomed = group.pending.select_claims(now, min_idle_ms, offsets)
    if doomed:
        gone += yield Retire(group, doomed, now)
    return (yield from _claimed(group, consumer, now, claims, gone))


def autoclaim(
    group: Group, consumer: str, now: int, min_idle_ms: int, cursor: int, count: int
) -> Plan[tuple[int, GroupReadResult]]:
    """Claim up to `count` entries idle for min_idle_ms, scanning pending offsets from `cursor`
    (Redis XAUTOCLAIM); returns the cursor to continue from (0: the scan is complete) too."""
    gone = yield from settle(group, now)
    next_cursor, claims, doomed = group.pending.select_autoclaim(now, min_idle_ms, cursor, count)
    if doomed:
        gone += yield Retire(group, doomed, now)
    return next_cursor, (yield from _claimed(group, consumer, now, claims, gone))


def _claimed(
    group: Group, consumer: str, now: int, claims: list[int], gone: list[int]
) -> Plan[GroupReadResult]:
    reply = Reply(0)
    lost, _ = yield from _hand_over(group, consumer, now, claims, reply, None, claim=True)
    group.seen(consumer, now, active=bool(reply.offsets))
    return reply.result(gone=gone + lost)


def _hand_over(
    group: Group,
    consumer: str,
    now: int,
    offsets: list[int],
    reply: Reply,
    retry_ms: int | None,
    *,
    claim: bool,
) -> Plan[tuple[list[int], list[int]]]:
    """Redeliver pending entries to `consumer` (a retry, a claim-on-read, or a claim when `claim`).

    Returns (offsets the stream no longer has, offsets left out by the byte budget).
    """
    records: dict[int, bytes] = yield FetchRecords(offsets)
    gone = [o for o in offsets if o not in records]
    group.remove(gone, RemoveReason.EVICTED)
    start = len(reply.offsets)
    left = reply.take(offsets, records)
    taken = reply.offsets[start:]
    if claim:
        group.claim(consumer, now, taken)
    else:
        group.deliver(consumer, now, retry_ms, None, taken)
    reply.count_from(start, group.delivery_count)
    return gone, left


def _evict_scheduled(group: Group, first_offset: int) -> Gap | None:
    """Drop the delayed entries the stream evicted before they fell due, as a gap for the reader.

    The group never got them, so the read that finds them gone says so, as it does for entries
    evicted ahead of the cursor (a trim to an offset goes past retention holds).
    """
    evicted = group.scheduled.below(first_offset)
    if not evicted:
        return None
    group.remove(evicted, RemoveReason.EVICTED)
    return Gap(evicted[0], evicted[-1] + 1, GapReason.EVICTED)


def _spanning(a: Gap | None, b: Gap | None) -> Gap | None:
    """One gap covering two eviction gaps of a reply (every offset between them is evicted too)."""
    if a is None or b is None:
        return a or b
    return Gap(min(a.start_offset, b.start_offset), max(a.end_offset, b.end_offset), GapReason.EVICTED)


class _NewEntries:
    """Step 3 of a read: first deliveries (or untracked ones) into `reply`."""

    __slots__ = ("consumer", "expire_ms", "group", "noack", "now", "reply", "retry_ms")

    def __init__(
        self,
        group: Group,
        consumer: str,
        now: int,
        retry_ms: int | None,
        expire_ms: int | None,
        noack: bool,
        reply: Reply,
    ) -> None:
        self.group = group
        self.consumer = consumer
        self.now = now
        self.retry_ms = retry_ms
        self.expire_ms = expire_ms
        self.noack = noack
        self.reply = reply

    def scheduled(self, room: int) -> Plan[int]:
        """Delayed entries now due go first among new entries (their offsets are the oldest)."""
        group, reply = self.group, self.reply
        offsets = group.scheduled.take_due(self.now, room)
        if not offsets:
            return 0
        records: dict[int, bytes] = yield FetchRecords(offsets)
        group.remove([o for o in offsets if o not in records], RemoveReason.EVICTED)
        start = len(reply.offsets)
        group.scheduled.restore(reply.take(offsets, records))
        self._record(start)
        return len(reply.offsets) - start

    def scan(self, room: int) -> Plan[tuple[int | None, Gap | None]]:
        """New entries from the group's cursor. Returns (when the cursor's next entry is due, evicted gap).

        Contiguous runs with no delayed entry, past the group's delay and not in the reply yet go
        through as the stream returned them (one chunk per node). Otherwise each record is judged
        by `Group.admit`: delivered, scheduled for its deliver_at_ms (and passed), or the scan stops
        before it; an entry the reply holds already (a redelivery that a cursor moved back meets
        again) is passed.
        """
        group, reply, now = self.group, self.reply, self.now
        delay = group.config.delay_ms
        cursor = group.cursor
        start = len(reply.offsets)
        gap: Gap | None = None
        stop_due: int | None = None
        caught_up = False
        scheduled: list[tuple[int, int]] = []
        while room > 0:
            budget = reply.budget()
            if budget is None:
                break
            result, meta = yield ReadFrom(cursor, room, budget)
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
            if len(run) == result.count and not reply.holds_any(run):
                fast = (
                    not meta.delayed
                    and meta.max_timestamp_ms + delay <= now
                    and reply.fits(sum(map(len, result.records)))
                )
            if fast:
                reply.add_run(result.records, run)
                room -= result.count
                cursor = run.stop
            else:
                stopped = False
                for offset, timestamp, due, record in skim_records(result.records):
                    verdict = group.admit(now, timestamp, due)
                    if verdict == STOP:
                        stop_due = timestamp + delay
                        stopped = True
                        break
                    if verdict == SCHEDULE:
                        scheduled.append((offset, due))
                    elif reply.holds(offset):
                        pass
                    elif reply.fits(len(record)):
                        reply.add(record, offset)
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
        self._record(start)
        group.advance(cursor, caught_up)
        return stop_due, gap

    def _record(self, start: int) -> None:
        """Record the delivery of the entries added to the reply since `start`, and their counts."""
        group, reply = self.group, self.reply
        offsets = reply.offsets[start:]
        if not offsets:
            return
        first_delivery = group.all_new(offsets)
        if self.noack:
            group.deliver_untracked(offsets)
        else:
            group.deliver(self.consumer, self.now, self.retry_ms, self.expire_ms, offsets)
        if first_delivery:
            reply.counts.extend([1] * len(offsets))
        else:  # a cursor moved back over entries still pending: they count up (untracked: as they are)
            reply.count_from(start, group.delivery_count)
