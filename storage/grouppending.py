"""The entries a consumer group has in flight: its pending list and its scheduled entries.

`PendingList` is Redis's PEL (stream.h `streamNACK`s) with RCP 11's retry and
expire times. A pending entry is *due* at `retry_at` (redelivered to the next
reader before new entries) and *doomed* at `expire_at`, or at `retry_at` once
it has been delivered `max_deliveries` times (it leaves the list, dropped or
dead-lettered, instead of being delivered again). Heaps keyed by those times
make "anything due?" O(1); entries re-armed since an item was pushed are
recognised by value (the entry's current time differs) and skipped.

`Scheduled` holds the offsets a group's cursor passed while their
`deliver_at_ms` was still ahead, each delivered as a new entry once due.

Both are pure data structures, changed only by storage.groupstate while it
applies ops.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from storage.groupops import PendingRecord
from storage.grouptypes import PendingRow


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
        # Derived by PendingList.arm: when it is redelivered (retry_at unless exhausted) and when it leaves.
        self.retry_due: int | None = None
        self.doom_at: int | None = None

    def record(self) -> PendingRecord:
        return PendingRecord(
            self.offset,
            self.consumer,
            self.count,
            self.delivered_ms,
            self.first_ms,
            self.retry_ms,
            self.retry_at,
            self.expire_at,
        )


@dataclass(frozen=True, slots=True)
class Doomed:
    """A pending entry that must leave the list now: expired, or delivered max_deliveries times."""

    offset: int
    delivery_count: int
    reason: str  # "expired" or "max_deliveries" (the x-reason header of a dead letter)


class PendingList:
    """A group's pending entries, ordered by offset, by last delivery and by their times.

    `order` (ascending offsets) serves summaries, ack ranges and autoclaim scans;
    `idle` (a dict keeps insertion order: least recently delivered first) serves
    claim-on-read; the heaps serve retries and retirement.
    """

    __slots__ = ("_doom_heap", "_retry_heap", "entries", "idle", "max_deliveries", "order")

    def __init__(self, max_deliveries: int | None) -> None:
        self.entries: dict[int, Pending] = {}
        self.order: list[int] = []
        self.idle: dict[int, None] = {}
        self.max_deliveries = max_deliveries  # the group's: decides which timer an entry sits in
        self._retry_heap: list[tuple[int, int]] = []  # (retry_due, offset)
        self._doom_heap: list[tuple[int, int]] = []  # (doom_at, offset)

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, offset: int) -> bool:
        return offset in self.entries

    def __iter__(self) -> Iterator[int]:
        return iter(self.entries)

    def get(self, offset: int) -> Pending | None:
        return self.entries.get(offset)

    def lowest(self) -> int | None:
        return self.order[0] if self.order else None

    def in_range(self, start: int, end: int | None) -> list[int]:
        """Pending offsets in [start, end), ascending (end None: to the last)."""
        order = self.order
        return order[bisect_left(order, start) : len(order) if end is None else bisect_left(order, end)]

    def all_after(self, offsets: Sequence[int]) -> bool:
        """Whether every offset is past the highest pending one (a batch of first deliveries)."""
        return not self.order or min(offsets) > self.order[-1]

    def records(self) -> tuple[PendingRecord, ...]:
        """The entries as a snapshot holds them: in delivery order, so that claim-on-read order
        survives a restart."""
        entries = self.entries
        return tuple(entries[offset].record() for offset in self.idle)

    def select(self, offsets: Iterable[int], ranges: Iterable[tuple[int, int]]) -> tuple[list[int], int]:
        """The pending entries named by offsets and half-open ranges [start, end), each once, and
        how many named offsets are not pending (an acknowledgement's unknown count)."""
        found: list[int] = []
        taken: set[int] = set()
        unknown = 0
        for offset in offsets:
            if offset in self.entries and offset not in taken:
                taken.add(offset)
                found.append(offset)
            else:
                unknown += 1
        for start, end in ranges:
            hits = self.in_range(start, end)
            if taken:
                hits = [o for o in hits if o not in taken]
            taken.update(hits)
            found.extend(hits)
            unknown += max(end - start, 0) - len(hits)
        return found, unknown

    def owned_by(self, consumer: str) -> list[int]:
        entries = self.entries
        return [o for o in self.order if entries[o].consumer == consumer]

    def rows(
        self, now: int, consumer: str | None, min_idle_ms: int, start: int, end: int | None, count: int
    ) -> tuple[PendingRow, ...]:
        """GetPending's detail: up to `count` entries in [start, end) of `consumer` (None: any)
        idle at least min_idle_ms, in offset order."""
        rows: list[PendingRow] = []
        for offset in self.in_range(start, end):
            if len(rows) >= count:
                break
            entry = self.entries[offset]
            if consumer is not None and entry.consumer != consumer:
                continue
            idle = now - entry.delivered_ms
            if idle >= min_idle_ms:
                rows.append(PendingRow(offset, entry.consumer, idle, entry.count, entry.retry_due))
        return tuple(rows)

    # ------------------------------------------------------------------ changes

    def add(self, entry: Pending) -> None:
        offset = entry.offset
        self.entries[offset] = entry
        order = self.order
        if not order or offset > order[-1]:
            order.append(offset)
        else:
            insort(order, offset)
        self.idle[offset] = None

    def add_new(self, offsets: Sequence[int], entries: list[Pending], *, timed: bool) -> None:
        """The entries of `offsets`, all past the highest pending one (see `all_after`), with no
        per-entry lookups; `timed`: they have a retry or expire time."""
        if timed:
            for entry in entries:
                self.arm(entry)
        self.entries.update(zip(offsets, entries, strict=True))
        self.order.extend(sorted(offsets))
        self.idle.update(dict.fromkeys(offsets))

    def delivered(self, entry: Pending, now: int) -> None:
        """The entry was (re)delivered now: it becomes the most recently delivered."""
        entry.delivered_ms = now
        idle = self.idle
        idle.pop(entry.offset, None)
        idle[entry.offset] = None

    def remove(self, offsets: Iterable[int]) -> tuple[dict[str, int], int, list[int]]:
        """Take the entries of `offsets` out, in one pass (a range ack takes many). Returns how many
        of them each consumer owned, how many were taken, and the offsets that were not pending."""
        take, forget_idle = self.entries.pop, self.idle.pop
        owners: dict[str, int] = {}
        gone: list[int] = []
        missing: list[int] = []
        for offset in offsets:
            entry = take(offset, None)
            if entry is None:
                missing.append(offset)
                continue
            forget_idle(offset, None)
            gone.append(offset)
            owner = entry.consumer
            if owner is not None:
                owners[owner] = owners.get(owner, 0) + 1
                entry.consumer = None
        order = self.order
        if len(gone) > 16:
            gone.sort()
            first = bisect_left(order, gone[0])
            if order[first : first + len(gone)] == gone:
                del order[first : first + len(gone)]  # a run of the list (a range ack): one cut
            else:
                drop = set(gone)
                self.order = [o for o in order if o not in drop]
        else:
            for offset in gone:
                del order[bisect_left(order, offset)]
        self._maybe_compact_heaps()
        return owners, len(gone), missing

    def restore(self, entry: Pending) -> None:
        """An entry of a snapshot, in delivery order (`order` is rebuilt by `restored`)."""
        self.entries[entry.offset] = entry
        self.idle[entry.offset] = None

    def restored(self) -> None:
        self.order = sorted(self.entries)

    # ------------------------------------------------------------------ timers

    def exhausted(self, entry: Pending) -> bool:
        limit = self.max_deliveries
        return limit is not None and entry.count >= limit

    def _set_times(self, entry: Pending) -> None:
        """Derive when the entry is redelivered (retry_due) and when it leaves the list (doom_at)."""
        if entry.retry_at is None and entry.expire_at is None:
            entry.retry_due = entry.doom_at = None
            return
        exhausted = self.exhausted(entry)
        entry.retry_due = None if exhausted else entry.retry_at
        doom = entry.expire_at
        if exhausted and entry.retry_at is not None:
            doom = entry.retry_at if doom is None else min(doom, entry.retry_at)
        entry.doom_at = doom

    def arm(self, entry: Pending) -> None:
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
        bound = 2 * len(self.entries) + 64
        if len(self._retry_heap) > bound or len(self._doom_heap) > bound:
            self.rebuild_timers()

    def rebuild_timers(self) -> None:
        """Rebuild the heaps from the entries (after a config change, or to undo takes that were not used)."""
        self._retry_heap, self._doom_heap = [], []
        for entry in self.entries.values():
            self._set_times(entry)
            if entry.retry_due is not None:
                self._retry_heap.append((entry.retry_due, entry.offset))
            if entry.doom_at is not None:
                self._doom_heap.append((entry.doom_at, entry.offset))
        heapq.heapify(self._retry_heap)
        heapq.heapify(self._doom_heap)

    def _valid_retry(self, item: tuple[int, int]) -> bool:
        entry = self.entries.get(item[1])
        return entry is not None and entry.retry_due == item[0]

    def _valid_doom(self, item: tuple[int, int]) -> bool:
        entry = self.entries.get(item[1])
        return entry is not None and entry.doom_at == item[0]

    def next_retry(self) -> int | None:
        return _top(self._retry_heap, self._valid_retry)

    def take_due_retries(self, now: int, limit: int) -> list[int]:
        """Pending entries whose retry time has passed, earliest first (then by offset), at most `limit`.

        They are taken off the retry heap: deliver them, or hand back the unused with `restore_retries`.
        """
        return _take(self._retry_heap, self._valid_retry, now, limit)

    def restore_retries(self, offsets: Iterable[int]) -> None:
        for offset in offsets:
            entry = self.entries.get(offset)
            if entry is not None and entry.retry_due is not None:
                heapq.heappush(self._retry_heap, (entry.retry_due, offset))

    def take_doomed(self, now: int) -> list[Doomed]:
        """Entries that must leave the pending list by now (expired, or exhausted and due), earliest first."""
        offsets = _take(self._doom_heap, self._valid_doom, now)
        return [self._doomed(self.entries[o], now) for o in offsets] if offsets else []

    def _doomed(self, entry: Pending, now: int) -> Doomed:
        expired = entry.expire_at is not None and entry.expire_at <= now
        return Doomed(entry.offset, entry.count, "expired" if expired else "max_deliveries")

    def defer_doom(self, offsets: Iterable[int], until_ms: int) -> None:
        """Retry retiring entries whose dead-lettering failed (in memory only: a restart retries at once)."""
        for offset in offsets:
            entry = self.entries.get(offset)
            if entry is not None:
                entry.doom_at = until_ms
                heapq.heappush(self._doom_heap, (until_ms, offset))

    # ------------------------------------------------------------------ claims

    def claimable(self, entry: Pending, now: int, min_idle_ms: int) -> bool:
        if now - entry.delivered_ms < min_idle_ms:
            return False
        # A released entry waits for its nack delay; automatic claims do not cut it short.
        return not (entry.consumer is None and entry.retry_at is not None and entry.retry_at > now)

    def _sort(self, offset: int, claims: list[int], doomed: list[Doomed]) -> None:
        """A claimable entry is claimed, unless it has been delivered max_deliveries times."""
        entry = self.entries[offset]
        if self.exhausted(entry):
            doomed.append(Doomed(offset, entry.count, "max_deliveries"))
        else:
            claims.append(offset)

    def select_idle(
        self, now: int, min_idle_ms: int, limit: int, exclude: set[int]
    ) -> tuple[list[int], list[Doomed]]:
        """Claim-on-read: entries idle for at least min_idle_ms, least recently delivered first."""
        claims: list[int] = []
        doomed: list[Doomed] = []
        for offset in self.idle:
            if len(claims) >= limit:
                break
            entry = self.entries[offset]
            if now - entry.delivered_ms < min_idle_ms:
                break  # ordered by delivery time: nothing after this one is idle enough
            if offset not in exclude and self.claimable(entry, now, min_idle_ms):
                self._sort(offset, claims, doomed)
        return claims, doomed

    def select_claims(
        self, now: int, min_idle_ms: int, offsets: Iterable[int]
    ) -> tuple[list[int], list[Doomed]]:
        """Explicit claim (Redis XCLAIM): the named pending entries idle for at least min_idle_ms."""
        claims: list[int] = []
        doomed: list[Doomed] = []
        seen: set[int] = set()
        for offset in offsets:
            entry = self.entries.get(offset)
            if entry is None or offset in seen or now - entry.delivered_ms < min_idle_ms:
                continue
            seen.add(offset)
            self._sort(offset, claims, doomed)
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
        order = self.order
        i = bisect_left(order, cursor)
        budget = max(limit, 1) * 10
        while i < len(order) and len(claims) < limit and budget > 0:
            offset = order[i]
            i += 1
            budget -= 1
            if self.claimable(self.entries[offset], now, min_idle_ms):
                self._sort(offset, claims, doomed)
        return (order[i] if i < len(order) else 0), claims, doomed

    def next_idle(self, now: int, claim_idle_ms: int) -> int | None:
        """When the least recently delivered entry becomes claimable on read (released entries
        waiting for their nack delay are on the retry heap already)."""
        for offset in self.idle:
            entry = self.entries[offset]
            if entry.consumer is None and entry.retry_at is not None and entry.retry_at > now:
                continue
            return entry.delivered_ms + claim_idle_ms
        return None


class Scheduled:
    """Offsets the cursor passed before their deliver_at_ms, with the time each falls due."""

    __slots__ = ("_heap", "due", "order")

    def __init__(self) -> None:
        self.due: dict[int, int] = {}  # offset -> due ms
        self.order: list[int] = []  # ascending (the retention hold)
        self._heap: list[tuple[int, int]] = []  # (due, offset)

    def __len__(self) -> int:
        return len(self.due)

    def __contains__(self, offset: int) -> bool:
        return offset in self.due

    def __iter__(self) -> Iterator[int]:
        return iter(self.due)

    def lowest(self) -> int | None:
        return self.order[0] if self.order else None

    def add(self, pairs: Iterable[tuple[int, int]]) -> None:
        for offset, due in pairs:
            if offset not in self.due:
                insort(self.order, offset)
            self.due[offset] = due
            heapq.heappush(self._heap, (due, offset))
        self._maybe_compact_heap()

    def discard(self, offset: int) -> bool:
        """Forget the offset if it is scheduled; returns whether it was."""
        if self.due.pop(offset, None) is None:
            return False
        del self.order[bisect_left(self.order, offset)]
        self._maybe_compact_heap()
        return True

    def pairs(self) -> tuple[tuple[int, int], ...]:
        """(offset, due ms), ascending."""
        return tuple(sorted(self.due.items()))

    def below(self, offset: int) -> list[int]:
        """Scheduled offsets below `offset`, ascending (below a stream's first offset: evicted)."""
        return self.order[: bisect_left(self.order, offset)]

    def _valid(self, item: tuple[int, int]) -> bool:
        return self.due.get(item[1]) == item[0]

    def next_due(self) -> int | None:
        return _top(self._heap, self._valid)

    def take_due(self, now: int, limit: int) -> list[int]:
        """Offsets now due, earliest first; `restore` hands back unused ones."""
        return _take(self._heap, self._valid, now, limit)

    def restore(self, offsets: Iterable[int]) -> None:
        for offset in offsets:
            due = self.due.get(offset)
            if due is not None:
                heapq.heappush(self._heap, (due, offset))

    def rebuild_timers(self) -> None:
        self._heap = [(due, offset) for offset, due in self.due.items()]
        heapq.heapify(self._heap)

    def _maybe_compact_heap(self) -> None:
        if len(self._heap) > 2 * len(self.due) + 64:
            self.rebuild_timers()


def _top(heap: list[tuple[int, int]], valid: Callable[[tuple[int, int]], bool]) -> int | None:
    """The earliest valid time on the heap (stale items are dropped on the way)."""
    while heap and not valid(heap[0]):
        heapq.heappop(heap)
    return heap[0][0] if heap else None


def _take(
    heap: list[tuple[int, int]], valid: Callable[[tuple[int, int]], bool], now: int, limit: int | None = None
) -> list[int]:
    """Pop the offsets of valid items due by `now`, earliest first, each once, at most `limit`."""
    if not heap or heap[0][0] > now:
        return []  # the common case, on every read: nothing due
    out: list[int] = []
    seen: set[int] = set()
    while heap and (limit is None or len(out) < limit) and heap[0][0] <= now:
        item = heapq.heappop(heap)
        if valid(item) and item[1] not in seen:
            seen.add(item[1])
            out.append(item[1])
    return out
