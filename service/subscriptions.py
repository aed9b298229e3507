"""Subscribe: a stream's entries as they come, from a start position (plain), or the entries a
consumer group hands one consumer (group mode).

A subscription reads, sends what it found, and waits for the next append (plain:
service/waiters.py) or in its group's queue (group mode: service/groupwaits.py);
there is no polling. Each reply is held in the reply budget from its read until
its send completes (service/replybudget.py): the code after each `yield` runs once
it has (the open calls' registry sends them one at a time, service/opencalls.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator

from streamlog.v1 import streamlog_pb2 as pb

from service import groupwire, streamwire, validation
from service.callcontext import CallContext
from service.errors import invalid_argument, not_found, translate_errors, unavailable
from service.groupdelivery import GroupDelivery, group_options, has_group_fields
from service.groupwaits import has_news
from service.replybudget import ReplyCharge
from service.serving import Serving
from service.streams import read_waiting
from service.waiters import Wake
from storage import Engine, GroupReadResult, StreamNotFoundError


def _start_offset(engine: Engine, stream: str, request: pb.SubscribeRequest) -> int:
    start = request.start
    if start in (pb.START_POSITION_UNSPECIFIED, pb.START_POSITION_OFFSET):
        return validation.non_negative("offset", request.offset)
    if start == pb.START_POSITION_TIMESTAMP:
        timestamp_ms = validation.non_negative("timestamp_ms", request.timestamp_ms)
    elif start not in (pb.START_POSITION_OLDEST, pb.START_POSITION_LATEST):
        raise invalid_argument(f"start: unknown start position {start}")
    try:
        if start == pb.START_POSITION_TIMESTAMP:
            return engine.seek_time(stream, timestamp_ms)
        bounds = engine.bounds(stream)
    except StreamNotFoundError:
        return 0  # the stream's first append will have offset 0
    return bounds.first_offset if start == pb.START_POSITION_OLDEST else bounds.end_offset


class Subscriptions:
    """The Subscribe RPC, in both modes."""

    def __init__(self, serving: Serving, groups: GroupDelivery) -> None:
        self._serving = serving
        self._groups = groups

    @translate_errors
    async def Subscribe(self, request: pb.SubscribeRequest, context: CallContext) -> AsyncIterator[bytes]:
        serving = self._serving
        engine = serving.ready()
        stream = validation.stream(request.stream)
        count, max_bytes = serving.reply_limits(request, serving.settings.subscribe_batch_entries)
        charge = serving.replies.charge(context)
        if request.group:
            # aclosing: when the client goes away, the inner generator's cleanup runs now, not at GC.
            async with contextlib.aclosing(
                self._group_subscribe(engine, stream, request, count, max_bytes, charge)
            ) as replies:
                async for reply in replies:
                    yield reply
            return
        if has_group_fields(request):
            raise invalid_argument(
                "group: consumer, retry_ms, expire_ms, noack and claim_idle_ms need a group"
            )
        offset = _start_offset(engine, stream, request)
        with serving.subscription():
            first = True
            seen = False
            while True:
                if serving.draining:
                    raise unavailable(f"server is shutting down; resubscribe from offset {offset}")
                await charge.reserve(max_bytes)
                result = read_waiting(engine, stream, offset, count, max_bytes, seen)
                if result is not None:
                    seen = True
                    if streamwire.has_news(result, offset):
                        offset = result.next_offset
                        first = False
                        reply = charge.hold(streamwire.records_reply(pb.SubscribeResponse, result, offset))
                        # The records are in the reply: `result` must not hold a second copy
                        # while a slow client keeps this generator at its yield.
                        del result
                        yield reply
                        charge.settle(0)
                        continue
                if first:
                    # Tell the client where it starts, then read again: entries may
                    # have arrived while this reply was being sent.
                    first = False
                    charge.settle(0)
                    yield streamwire.records_reply(pb.SubscribeResponse, result, offset)
                    continue
                charge.settle(0)
                wake = await serving.waiters.wait(stream, offset, None)
                if wake is Wake.DELETED:
                    raise not_found(f"stream {stream!r} was deleted")
                if wake is Wake.CLOSED:
                    raise unavailable(f"server is shutting down; resubscribe from offset {offset}")

    async def _group_subscribe(
        self,
        engine: Engine,
        stream: str,
        request: pb.SubscribeRequest,
        count: int,
        max_bytes: int,
        charge: ReplyCharge,
    ) -> AsyncGenerator[bytes, None]:
        """Subscribe in group mode: batches of the entries the group hands this consumer, as they come."""
        serving = self._serving
        group = validation.name("group", request.group)
        options = group_options(request, count, max_bytes)
        if request.start or request.offset or request.timestamp_ms:
            raise invalid_argument(
                "start, offset, timestamp_ms: not used in group mode (the group keeps its position)"
            )
        with serving.subscription():
            # The first reply goes out at once, even empty: the subscriber then knows it is
            # registered (and a fresh consumer exists in the group).
            wait_s: float | None = 0
            while True:
                if serving.draining:
                    raise unavailable("server is shutting down; subscribe again")
                waited = await self._groups.read_or_wait(engine, stream, group, options, wait_s, charge)
                if waited is Wake.DELETED:
                    raise not_found(f"stream {stream!r} was deleted")
                if waited is Wake.CLOSED:
                    raise unavailable("server is shutting down; subscribe again")
                if isinstance(waited, GroupReadResult) and (wait_s == 0 or has_news(waited)):
                    reply = groupwire.read_reply(pb.SubscribeResponse, waited, engine.bounds(stream))
                    del waited  # its records are in the reply (see Subscribe)
                    yield charge.hold(reply)
                    charge.settle(0)
                wait_s = None
