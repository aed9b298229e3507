"""Delivery: group reads, claims, acks and nacks, each run against the stream.

`storage.groups` says what a read or a claim does (an I/O-free plan); this
module checks a call's arguments, runs the plan inside the stream's group
store (`GroupStores.writing`: the lock, the journal, the fsync policy) and
serves what the plan asks of the stream through the engine's public calls
(storage.groupstreams). Doomed entries go to storage.deadletters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from storage import groups
from storage.deadletters import DeadLetters
from storage.errors import InvalidArgumentError
from storage.groups import FetchRecords, ReadFrom, Retire, StreamStart
from storage.groupstate import Group
from storage.groupstore import GroupStores
from storage.groupstreams import GroupStreams, fetch_records
from storage.grouptypes import (
    AckResult,
    GroupReadOptions,
    GroupReadResult,
    NackResult,
    PendingInfo,
    check_duration,
    check_non_negative,
    validate_label,
)
from storage.results import EntriesMeta, ReadResult

T = TypeVar("T")


def _check_offsets(offsets: Iterable[int]) -> list[int]:
    out = list(offsets)
    for offset in out:
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise InvalidArgumentError("offsets must be non-negative integers")
    return out


class GroupDelivery:
    """Reads, claims, acks, nacks and the pending list of every stream's groups."""

    def __init__(
        self, stores: GroupStores, streams: GroupStreams, dead_letters: DeadLetters, now: Callable[[], int]
    ) -> None:
        self._stores = stores
        self._streams = streams
        self._dead_letters = dead_letters
        self._now = now
        self._serve: dict[type, Callable[[str, Any], Any]] = {
            ReadFrom: self._read_from,
            FetchRecords: self._fetch_records,
            StreamStart: self._stream_start,
            Retire: self._retire,
        }

    # ------------------------------------------------------------------ serving plans

    def _drive(self, stream: str, plan: groups.Plan[T]) -> T:
        """Run a group plan (storage.groups), serving what it asks of the stream."""
        serve = self._serve
        try:
            request = next(plan)
            while True:
                request = plan.send(serve[type(request)](stream, request))
        except StopIteration as done:
            return done.value

    def _read_from(self, stream: str, request: ReadFrom) -> tuple[ReadResult, EntriesMeta | None]:
        streams = self._streams
        result = streams.read(stream, request.start, request.limit, max_bytes=request.max_bytes)
        last = result.last_offset
        if last is None:  # no entries
            return result, None
        return result, streams.entries_meta(stream, max(request.start, result.first_offset), last + 1)

    def _fetch_records(self, stream: str, request: FetchRecords) -> dict[int, bytes]:
        return fetch_records(self._streams, stream, request.offsets)

    def _stream_start(self, stream: str, request: StreamStart) -> int:
        return self._streams.bounds(stream).first_offset

    def _retire(self, stream: str, request: Retire) -> list[int]:
        return self._dead_letters.retire(stream, request.group, request.doomed, request.now)

    def settle(self, stream: str, group: Group, now: int) -> list[int]:
        """Retire the entries whose time is up before anything else looks at the group; returns the
        offsets found gone from the stream. Call inside `GroupStores.writing`.

        `storage.groups.settle` without the plan's machinery: this runs before every ack and nack."""
        doomed = group.pending.take_doomed(now)
        return self._dead_letters.retire(stream, group, doomed, now) if doomed else []

    # ------------------------------------------------------------------ calls

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
        count = min(options.count, self._streams.config.max_batch_entries)
        with self._stores.writing(stream, group=group) as store:
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
        with self._stores.writing(stream, group=group) as store:
            found = store.state.group(group)
            now = self._now()
            self.settle(stream, found, now)
            return found.ack(now, offsets, spans)

    def nack(self, stream: str, group: str, offsets: Iterable[int], delay_ms: int = 0) -> NackResult:
        offsets = _check_offsets(offsets)
        check_duration("delay_ms", delay_ms, optional=False)
        with self._stores.writing(stream, group=group) as store:
            found = store.state.group(group)
            now = self._now()
            self.settle(stream, found, now)
            return found.nack(now, offsets, delay_ms)

    def claim(
        self, stream: str, group: str, consumer: str, min_idle_ms: int, offsets: Iterable[int]
    ) -> GroupReadResult:
        """Take over pending entries idle for at least min_idle_ms (Redis XCLAIM); returns them."""
        validate_label("consumer", consumer)
        check_non_negative("min_idle_ms", min_idle_ms)
        offsets = _check_offsets(offsets)
        with self._stores.writing(stream, group=group) as store:
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
        count = min(count, self._streams.config.max_batch_entries)
        with self._stores.writing(stream, group=group) as store:
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
        with self._stores.writing(stream, group=group) as store:
            found = store.state.group(group)
            now = self._now()
            self.settle(stream, found, now)
            return found.pending_info(
                now, consumer=consumer, min_idle_ms=min_idle_ms, start=start, end=end, count=count
            )
