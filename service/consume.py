"""Consume: a consumer-group read loop steered by the client over one bidirectional call.

The client's side of the call carries acknowledgements and credit (batches wanted);
the server sends a batch only while it owes one, so entries are assigned to the
consumer when it asked for them, never buffered ahead of its pace (NATS's pull
consumers, Kafka's fetch sessions). One request and one reply per batch costs a
message each way on an open call: no per-call set-up, which is most of what a
unary gRPC call costs in Python.

Two tasks share a session. The handler's task waits for credit, reads (queueing
in the group's wait line, served in arrival order, while there is nothing) and
sends. A reader task takes the client's requests as they come, so that
acknowledgements apply at once, even while a read waits: the room they make in
a bounded pending list then wakes that read.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from streamlog.v1 import streamlog_pb2 as pb

from service import groupwire, validation
from service.callcontext import CallContext
from service.errors import invalid_argument, limit_exceeded, not_found, translate_errors, unavailable
from service.groupdelivery import GroupDelivery, group_options
from service.groupwaits import WaitResult, has_news
from service.serving import Serving
from service.waiters import Wake
from storage import GroupReadResult

# Fields that only the first request of a session may set: they name and shape it.
OPENING_FIELDS = ("stream", "group", "consumer", "count", "max_bytes", "noack")
OPENING_OPTIONAL_FIELDS = ("retry_ms", "expire_ms", "claim_idle_ms")
# The largest count a reply carries (int64): acknowledgements of huge ranges of unknown
# offsets, which the engine counts in full, saturate there rather than fail the reply.
_MAX_COUNT = 2**63 - 1


@dataclass(frozen=True, slots=True)
class SessionCalls:
    """What a session asks of the group delivery, bound to its stream, group and read options."""

    # A group read of up to `batches` batches' worth of entries that waits wait_s seconds (None:
    # until entries come), and no longer than the event stays unset, while it finds nothing.
    read_or_wait: Callable[[int, float | None, asyncio.Event | None], Awaitable[WaitResult]]
    # Acknowledge validated offsets and ranges; returns (acknowledged, unknown).
    ack: Callable[[list[int], list[tuple[int, int]]], Awaitable[tuple[int, int]]]
    # Check a request's acknowledgements (signs, max_ack_offsets): offsets and ranges.
    ack_items: Callable[[Sequence[int], Sequence[pb.OffsetRange]], tuple[list[int], list[tuple[int, int]]]]
    # A serialized ConsumeResponse for a read (None: no entries), the batches it fills, and
    # acknowledgement counts.
    reply: Callable[[GroupReadResult | None, int, int, int], bytes]
    # Whether the server is shutting down.
    draining: Callable[[], bool]
    stream: str
    count: int  # entries per batch
    max_batches: int


def has_opening_fields(request: pb.ConsumeRequest) -> bool:
    return any(getattr(request, name) for name in OPENING_FIELDS) or any(
        request.HasField(name) for name in OPENING_OPTIONAL_FIELDS
    )


class ConsumeSession:
    """One Consume call's state: batches owed, acknowledgements not yet reported, the client's side."""

    def __init__(self, calls: SessionCalls) -> None:
        self._calls = calls
        self._owed = 0
        self._acknowledged = 0
        self._unknown = 0
        # Set by the reader when credit arrives, and when the client's side ends or fails.
        self._credit = asyncio.Event()
        self._stopped = asyncio.Event()
        self._client_done = False
        self._failure: BaseException | None = None

    async def run(
        self, opening: pb.ConsumeRequest, requests: AsyncIterator[pb.ConsumeRequest]
    ) -> AsyncGenerator[bytes, None]:
        """The session's replies, after `opening` (validated by the caller) and then `requests`."""
        await self._take(opening)
        reader = asyncio.get_running_loop().create_task(self._read_requests(requests))
        try:
            while True:
                self._check()
                if self._client_done:
                    break
                if not self._owed:
                    self._credit.clear()
                    await self._credit.wait()
                    continue
                reply = await self._next_reply()
                if reply is None:
                    continue  # the wait ended for the client's side: look again
                yield reply
            if self._acknowledged or self._unknown:
                yield self._reply(None, 0)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    def wake(self) -> None:
        """Have the session look at the server's state now (it is shutting down), even if idle."""
        self._credit.set()

    def _check(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._calls.draining():
            raise unavailable("server is shutting down; open a new session")

    def _reply(self, result: GroupReadResult | None, filled: int) -> bytes:
        reply = self._calls.reply(result, filled, self._acknowledged, self._unknown)
        self._acknowledged = self._unknown = 0
        return reply

    async def _next_reply(self) -> bytes | None:
        """The next batch's reply, or None if the wait ended for the client's side. Built here so
        that the read's records are not held beside the reply while a slow client takes it."""
        result = await self._next_batch()
        if result is None:
            return None
        # Batches due at once travel in one reply: one message, one group read, not several.
        filled = max(1, -(-len(result.offsets) // self._calls.count))
        self._owed -= filled
        return self._reply(result, filled)

    async def _next_batch(self) -> GroupReadResult | None:
        """The next batch for this consumer, waiting for one; None if the client's side ended first."""
        # Up to every batch owed now (more credit while it waits does not change that).
        batches = self._owed
        found = await self._calls.read_or_wait(batches, 0, None)
        if not (isinstance(found, GroupReadResult) and has_news(found)):
            self._raise_for(found)
            # Nothing yet: queue in the group's line (more credit meanwhile keeps the place)
            # until entries come or the client's side ends or fails. A read under way for this
            # session then still delivers here: what it assigned to the consumer is sent.
            found = await self._calls.read_or_wait(batches, None, self._stopped)
        self._raise_for(found)
        return found if isinstance(found, GroupReadResult) and has_news(found) else None

    def _raise_for(self, found: WaitResult) -> None:
        if found is Wake.DELETED:
            raise not_found(f"stream {self._calls.stream!r} was deleted")
        if found is Wake.CLOSED:
            raise unavailable("server is shutting down; open a new session")

    async def _read_requests(self, requests: AsyncIterator[pb.ConsumeRequest]) -> None:
        try:
            async for request in requests:
                if has_opening_fields(request):
                    raise invalid_argument(
                        "stream, group, consumer and the read options are set by the first request only"
                    )
                await self._take(request)
            self._client_done = True
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the sender raises it: it becomes the call's status
            self._failure = exc
        self._stopped.set()
        self._credit.set()

    async def _take(self, request: pb.ConsumeRequest) -> None:
        """Apply one request: its acknowledgements first, then its credit."""
        owed = self._owed + validation.non_negative("batches", request.batches)
        if owed > self._calls.max_batches:
            limit = self._calls.max_batches
            raise limit_exceeded("max_consume_batches", limit, f"batches: {owed} would be owed")
        if request.ack_offsets or request.ack_ranges:
            offsets, ranges = self._calls.ack_items(request.ack_offsets, request.ack_ranges)
            acknowledged, unknown = await self._calls.ack(offsets, ranges)
            self._acknowledged += acknowledged
            self._unknown = min(self._unknown + unknown, _MAX_COUNT)
        if request.batches:
            # Not `owed`: a batch may have gone out while the acknowledgements were applied.
            self._owed += request.batches
            self._credit.set()


class ConsumeCalls:
    """The Consume RPC: one ConsumeSession per call, and the open sessions."""

    def __init__(self, serving: Serving, groups: GroupDelivery) -> None:
        self._serving = serving
        self._groups = groups
        # Open sessions, woken when the server starts draining (an idle one waits for credit).
        self._sessions: set[ConsumeSession] = set()

    def wake_all(self) -> None:
        """Have every open session look at the server's state now (it is shutting down)."""
        for session in self._sessions:
            session.wake()

    @translate_errors
    async def Consume(
        self, requests: AsyncIterator[pb.ConsumeRequest], context: CallContext
    ) -> AsyncIterator[bytes]:
        serving, groups = self._serving, self._groups
        engine = serving.ready()
        opening = await anext(requests, None)
        if opening is None:
            return  # the client closed its side without opening a session
        settings = serving.settings
        stream = validation.stream(opening.stream)
        group = validation.name("group", opening.group)
        count, max_bytes = serving.reply_limits(opening, settings.default_read_entries)
        options = group_options(opening, count, max_bytes)
        # NOT_FOUND now for a stream or group that does not exist, even if no batch is asked for yet
        # (an O(1) look, not a GroupInfo: its cost must not grow with the group's consumers).
        engine.consumer_count(stream, group, options.consumer)

        # Each batch is held from its read until its send completes, when the session asks for
        # the next one (the open calls' registry sends them one at a time, service/opencalls.py).
        charge = serving.replies.charge(context)

        async def ack(offsets: list[int], ranges: list[tuple[int, int]]) -> tuple[int, int]:
            result = await groups.ack(engine, stream, group, offsets, ranges)
            return result.acknowledged, result.unknown

        def reply(result: GroupReadResult | None, batches: int, acknowledged: int, unknown: int) -> bytes:
            counts = {"batches": batches, "acknowledged": acknowledged, "ack_unknown": unknown}
            return charge.hold(
                groupwire.read_reply(pb.ConsumeResponse, result, engine.bounds(stream), **counts)
            )

        # Read options for n batches at once: count x n entries (at most max_read_entries).
        options_for = functools.cache(
            lambda n: dataclasses.replace(options, count=min(count * n, settings.max_read_entries))
        )

        def read_or_wait(batches: int, wait_s: float | None, until: asyncio.Event | None) -> Any:
            return groups.read_or_wait(engine, stream, group, options_for(batches), wait_s, charge, until)

        calls = SessionCalls(
            read_or_wait=read_or_wait,
            ack=ack,
            ack_items=functools.partial(groups.ack_items, names=("ack_offsets", "ack_ranges")),
            reply=reply,
            draining=lambda: serving.draining,
            stream=stream,
            count=count,
            max_batches=settings.max_consume_batches,
        )
        session = ConsumeSession(calls)
        with serving.subscription():
            self._sessions.add(session)
            try:
                async with contextlib.aclosing(session.run(opening, requests)) as replies:
                    async for reply_bytes in replies:
                        yield reply_bytes
                        charge.settle(0)
            finally:
                self._sessions.discard(session)
