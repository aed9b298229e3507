"""StreamLogService: each RPC translated between protobuf and the storage engine.

Hot paths move batches, not entries. Append takes `payloads` (a list of bytes) in
one C call, or turns `entries` into the engine's columns with C-level `map`s (a
single one for payload-only batches: see wire.py). Read and Subscribe send the
engine's stored records as they are: a stored record is exactly the wire encoding of one `Entry` in field 1 of
ReadResponse/SubscribeResponse, so a reply is the records joined, followed by the
serialized scalar fields (protobuf allows fields in any order). Those two methods
therefore return `bytes`, and the server registers them with a pass-through
serializer (see server.py).

Handlers run on the event loop. Reads call the engine directly (a read is an
in-memory slice under a per-stream lock). Appends to "always"-fsync streams, and
admin calls that create, rename or delete files, run in a small thread pool so a
disk sync never stalls the loop; concurrent "always" appends then share one
fdatasync inside the engine (group commit).

Consumer groups follow the same rule. A group call journals its change and, on
an "always" stream, waits for the journal's sync: such calls (group reads,
acks, nacks, claims, queries that may retire expired entries) run in the thread
pool for "always" streams and on the loop otherwise; group admin calls that
create or remove files (CreateGroup, DeleteGroup, ...) always run in the pool.
Blocked group readers queue per group and are served in arrival order
(service/groupwaits.py).
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import contextlib
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Executor
from operator import attrgetter
from typing import Any, TypeVar

import grpc
from streamlog.v1 import streamlog_pb2 as pb

from service import groupwire, validation
from service.config import MAX_STREAM_NAME_BYTES, Settings
from service.consume import ConsumeSession, SessionCalls
from service.errors import (
    ServiceError,
    invalid_argument,
    limit_exceeded,
    not_found,
    translate_errors,
    unavailable,
)
from service.groupwaits import GroupWaits, WaitResult, has_news
from service.replybudget import ReplyBudget, ReplyCharge
from service.waiters import Waiters, Wake
from service.wire import entries_hold_only_payloads
from storage import (
    AppendBatch,
    CorruptionError,
    Engine,
    GroupReadOptions,
    GroupReadResult,
    PreconditionError,
    ReadResult,
    StreamConfig,
    StreamNotFoundError,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

_FSYNC_TO_PROTO = {
    None: pb.FSYNC_POLICY_UNSPECIFIED,
    "always": pb.FSYNC_POLICY_ALWAYS,
    "everysec": pb.FSYNC_POLICY_EVERYSEC,
    "no": pb.FSYNC_POLICY_NO,
}
_FSYNC_FROM_PROTO = {value: key for key, value in _FSYNC_TO_PROTO.items()}
_RETENTION_LIMITS = ("max_entries", "max_age_ms", "max_bytes")
_TRIM_MODES = ("evict_up_to_offset", "keep_last", "trim_to_offset")
_PAGE_TOKEN_PREFIX = b"streamlog.v1/streams\x00"
# Bigger than any offset: engine.count clamps the end of a range to the stream's end.
_END_OF_STREAM = 2**63 - 1
# A blocking call answers this long before its deadline, so that the empty reply
# reaches the client before the deadline does (else it sees DEADLINE_EXCEEDED):
# a tenth of the time left, within bounds that cover a busy machine's delays.
_DEADLINE_MARGIN_MIN_S = 0.005
_DEADLINE_MARGIN_MAX_S = 0.2

# Group-mode fields of ReadRequest/SubscribeRequest that are unset (None) when not given.
_GROUP_OPTIONAL_MS = ("retry_ms", "expire_ms", "claim_idle_ms")

_payload = attrgetter("payload")
_tag = attrgetter("tag")
_headers = attrgetter("headers")
_deliver_at = attrgetter("deliver_at_ms")


_gap = groupwire.gap_to_proto


def _has_news(result: ReadResult, offset: int) -> bool:
    """Whether a forward read at `offset` has something to tell: entries, or a gap that moves it on.

    A gap that does not move past `offset` would make a follower loop without waiting.
    """
    return bool(result.count) or (result.gap is not None and result.gap.end_offset > offset)


def _read_reply(result: ReadResult, next_offset: int) -> bytes:
    """A serialized ReadResponse: the stored records (field 1) plus the other fields."""
    tail = pb.ReadResponse(
        first_offset=result.first_offset,
        next_offset=next_offset,
        gap=_gap(result.gap),
        end_offset=result.end_offset,
    ).SerializeToString()
    return b"".join(result.records) + tail if result.records else tail


def _subscribe_reply(result: ReadResult | None, next_offset: int) -> bytes:
    """A serialized SubscribeResponse, as _read_reply; `result` None means no stream yet."""
    if result is None:
        return pb.SubscribeResponse(next_offset=next_offset).SerializeToString()
    tail = pb.SubscribeResponse(
        first_offset=result.first_offset,
        next_offset=next_offset,
        gap=_gap(result.gap),
        end_offset=result.end_offset,
    ).SerializeToString()
    return b"".join(result.records) + tail if result.records else tail


def _held(charge: ReplyCharge, reply: bytes) -> bytes:
    """`reply`, now counted in the reply budget at its size (in place of the room reserved for it)."""
    charge.settle(len(reply))
    return reply


def _optional_columns(entries: Sequence[pb.Entry]) -> dict[str, list | None]:
    """The engine's optional columns (tags, headers, deliver_at_ms); None for one no entry uses."""
    tags = list(map(_tag, entries))
    deliver_at = list(map(_deliver_at, entries))
    headers = None
    if any(map(len, map(_headers, entries))):
        headers = [dict(h) if h else None for h in map(_headers, entries)]
    if any(deliver_at) and min(deliver_at) < 0:
        raise invalid_argument("entries.deliver_at_ms: must not be negative")
    return {
        "tags": tags if any(tags) else None,
        "headers": headers,
        "deliver_at_ms": deliver_at if any(deliver_at) else None,
    }


def _config_to_proto(config: StreamConfig) -> pb.StreamConfig:
    return pb.StreamConfig(
        max_entries=config.max_entries,
        max_age_ms=config.max_age_ms,
        max_bytes=config.max_bytes,
        compaction=config.compaction,
        tombstone_retention_ms=config.tombstone_retention_ms,
        fsync=_FSYNC_TO_PROTO[config.fsync],
    )


def _config_from_proto(message: pb.StreamConfig) -> StreamConfig:
    values: dict[str, Any] = {"compaction": message.compaction}
    for field in _RETENTION_LIMITS:
        if message.HasField(field):
            value = getattr(message, field)
            if value <= 0:
                raise invalid_argument(f"config.{field}: must be positive when set, got {value}")
            values[field] = value
    if message.HasField("tombstone_retention_ms"):
        values["tombstone_retention_ms"] = validation.non_negative(
            "config.tombstone_retention_ms", message.tombstone_retention_ms
        )
    if message.fsync not in _FSYNC_FROM_PROTO:
        raise invalid_argument(f"config.fsync: unknown policy {message.fsync}")
    values["fsync"] = _FSYNC_FROM_PROTO[message.fsync]
    return StreamConfig(**values)


def _page_token(name: str) -> str:
    return base64.urlsafe_b64encode(_PAGE_TOKEN_PREFIX + name.encode()).decode()


def _after_token(token: str) -> str:
    """The last name of the previous page, from a token this server issued."""
    try:
        raw = base64.urlsafe_b64decode(token.encode())
        if not raw.startswith(_PAGE_TOKEN_PREFIX):
            raise ValueError(token)
        return raw[len(_PAGE_TOKEN_PREFIX) :].decode()
    except (ValueError, UnicodeError):
        raise invalid_argument("page_token: not a token this server issued") from None


def _has_group_fields(request: pb.ReadRequest | pb.SubscribeRequest) -> bool:
    """Whether a plain (non-group) read or subscription sets a field that needs `group`."""
    return bool(
        request.consumer
        or request.noack
        or request.HasField("retry_ms")
        or request.HasField("expire_ms")
        or request.HasField("claim_idle_ms")
    )


def _group_options(
    request: pb.ReadRequest | pb.SubscribeRequest | pb.ConsumeRequest, count: int, max_bytes: int
) -> GroupReadOptions:
    consumer = validation.name("consumer", request.consumer)
    optional = {
        name: validation.duration_ms(name, getattr(request, name)) if request.HasField(name) else None
        for name in _GROUP_OPTIONAL_MS
    }
    return GroupReadOptions(consumer, count, max_bytes, noack=request.noack, **optional)


class StreamLogServicer:
    """The StreamLogService handlers. Every method runs on the server's event loop."""

    def __init__(self, settings: Settings, waiters: Waiters, executor: Executor) -> None:
        self._settings = settings
        self._waiters = waiters
        self._executor = executor
        self._engine: Engine | None = None
        self._draining = False
        self.subscriptions = 0
        # Open Consume sessions, woken when the server starts draining (an idle one waits for credit).
        self._sessions: set[ConsumeSession] = set()
        # Bytes of replies not yet sent, per connection and in total: every read reserves room
        # for its reply before it reads (service/replybudget.py).
        self.replies = ReplyBudget.from_settings(settings)
        # Blocked group readers, served in arrival order; the dispatcher reads through _read_group.
        self.group_waits = GroupWaits(self._dispatch_read)

    def attach_engine(self, engine: Engine) -> None:
        """Start serving from `engine` (opened and recovered); until then calls get UNAVAILABLE."""
        self._engine = engine

    def listen_to(self, engine: Engine) -> None:
        """Register the wake-ups of blocked group readers with the engine (once per engine)."""
        engine.add_append_listener(self.group_waits.on_append)
        engine.add_group_listener(self.group_waits.on_group_change)

    def start_draining(self) -> None:
        """From now on, new calls get UNAVAILABLE and subscriptions end at their next step."""
        self._draining = True
        for session in self._sessions:
            session.wake()

    def _ready(self) -> Engine:
        if self._draining:
            raise unavailable("server is shutting down; retry on another server or after restart")
        if self._engine is None:
            raise unavailable("server is starting: recovering its data; retry shortly")
        return self._engine

    async def _in_thread(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(function, *args, **kwargs))

    async def _group_call(self, engine: Engine, stream: str, function: Callable[..., T], *args: Any) -> T:
        """A group call that may wait for a journal sync: in a thread on "always" streams, else here."""
        if engine.fsync_policy(stream).blocks:
            return await self._in_thread(function, *args)
        return function(*args)

    async def _read_group(
        self, engine: Engine, stream: str, group: str, options: GroupReadOptions, charge: ReplyCharge
    ) -> GroupReadResult:
        """A group read, with room reserved in `charge` for the reply it may fill (kept only if it
        found something: the caller then settles it to the reply's size)."""
        await charge.reserve(options.max_bytes)
        result = await self._group_call(engine, stream, engine.read_group, stream, group, options)
        if not has_news(result):
            charge.settle(0)
        return result

    async def _dispatch_read(
        self, stream: str, group: str, options: GroupReadOptions, charge: ReplyCharge
    ) -> GroupReadResult:
        return await self._read_group(self._ready(), stream, group, options, charge)

    async def _group_read_or_wait(
        self,
        engine: Engine,
        stream: str,
        group: str,
        options: GroupReadOptions,
        wait_s: float | None,
        charge: ReplyCharge,
        until: asyncio.Event | None = None,
    ) -> WaitResult:
        """A group read that waits (wait_s seconds, None: forever; `until` set: no longer) while it
        finds nothing.

        Returns the read's result (with entries, or empty at once when wait_s is 0), or
        why the wait ended without one (TIMEOUT, DELETED, CLOSED).
        """
        waits = self.group_waits
        if not waits.busy(stream, group):
            # Nobody queued ahead: read now.
            in_thread = engine.fsync_policy(stream).blocks
            result = await self._read_group(engine, stream, group, options, charge)
            if has_news(result) or wait_s == 0:
                return result
            if not in_thread:
                # Read on the loop with no await since, so no append or ack went unseen: queue up
                # without reading again, and be woken when the read said something falls due.
                return await waits.wait(
                    stream,
                    group,
                    options,
                    wait_s,
                    charge,
                    due_ms=result.next_due_ms,
                    read_first=False,
                    until=until,
                )
        # Readers are queued ahead (they are served first), or the read above ran in a thread:
        # queue up, and the group's dispatcher reads for the queue in arrival order.
        return await waits.wait(stream, group, options, wait_s, charge, until=until)

    def _ack_items(
        self, offsets: Sequence[int], ranges: Sequence[pb.OffsetRange], names: tuple[str, str]
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Offsets and [start, end) ranges to acknowledge, checked against max_ack_offsets and signs."""
        items = len(offsets) + len(ranges)
        limit = self._settings.max_ack_offsets
        if items > limit:
            raise limit_exceeded("max_ack_offsets", limit, f"{', '.join(names)}: {items} items in one call")
        if offsets and min(offsets) < 0:
            raise invalid_argument(f"{names[0]}: must not be negative")
        spans = []
        for index, span in enumerate(ranges):
            validation.non_negative(f"{names[1]}[{index}].start_offset", span.start_offset)
            if span.end_offset < span.start_offset:
                raise invalid_argument(
                    f"{names[1]}[{index}]: end_offset {span.end_offset} is before "
                    f"start_offset {span.start_offset}"
                )
            spans.append((span.start_offset, span.end_offset))
        return list(offsets), spans

    def _offsets(self, offsets: Sequence[int]) -> list[int]:
        """The offsets of a Nack or Claim: at least one, none negative, at most max_ack_offsets."""
        if not offsets:
            raise invalid_argument("offsets: at least one offset is required")
        limit = self._settings.max_ack_offsets
        if len(offsets) > limit:
            raise limit_exceeded("max_ack_offsets", limit, f"offsets: {len(offsets)} offsets in one call")
        if min(offsets) < 0:
            raise invalid_argument("offsets: must not be negative")
        return list(offsets)

    def _reply_limits(self, request: Any, default_count: int) -> tuple[int, int]:
        """A read's count and max_bytes (0: the defaults), lowered to the server's maximums."""
        settings = self._settings
        count = validation.bounded("count", request.count, default_count, settings.max_read_entries)
        max_bytes = validation.bounded(
            "max_bytes", request.max_bytes, settings.default_read_bytes, settings.max_read_bytes
        )
        return count, max_bytes

    def _wait_limit_s(self, context: grpc.aio.ServicerContext, block_ms: int) -> float:
        """How long a blocking call may wait: block_ms, or less if the deadline comes first."""
        wait_s = block_ms / 1000
        remaining = context.time_remaining()
        if remaining is not None:
            margin = min(max(remaining * 0.1, _DEADLINE_MARGIN_MIN_S), _DEADLINE_MARGIN_MAX_S)
            wait_s = min(wait_s, remaining - margin)
        return max(wait_s, 0.0)

    # ------------------------------------------------------------------ data

    @translate_errors
    async def Append(self, request: pb.AppendRequest, context: grpc.aio.ServicerContext) -> pb.AppendResponse:
        engine = self._ready()
        stream = validation.stream(request.stream)
        entries = request.entries
        if entries and request.payloads:
            raise invalid_argument("entries, payloads: set one of them, not both")
        count = len(entries) or len(request.payloads)
        if not count:
            raise invalid_argument("entries: at least one entry is required")
        limit = self._settings.max_batch_entries
        if count > limit:
            # Refuse before building columns for a batch that cannot be taken.
            raise limit_exceeded("max_batch_entries", limit, f"entries: the batch has {count} entries")
        if request.payloads:
            # The fast form: a repeated bytes field converts to a list in one C call.
            batch = AppendBatch(list(request.payloads))
        else:
            # The engine takes columns. The common batch has payloads only: one pass
            # gets them, and a size comparison done in C proves there is nothing else.
            payloads = list(map(_payload, entries))
            only_payloads = entries_hold_only_payloads(request, stream, payloads)
            batch = AppendBatch(payloads, **({} if only_payloads else _optional_columns(entries)))
        options: dict[str, Any] = {}
        if request.producer_id:
            sequence = validation.non_negative("producer_sequence", request.producer_sequence)
            options["producer"] = (request.producer_id, sequence)
        if request.HasField("expected_next_offset"):
            options["expected_end"] = validation.non_negative(
                "expected_next_offset", request.expected_next_offset
            )
        if engine.fsync_policy(stream).blocks:
            result = await self._in_thread(engine.append, stream, batch, **options)
        else:
            result = engine.append(stream, batch, **options)
        return pb.AppendResponse(
            first_offset=result.first_offset,
            last_offset=result.last_offset,
            timestamp_ms=result.timestamp_ms,
            duplicate=result.duplicate,
        )

    @translate_errors
    async def Read(self, request: pb.ReadRequest, context: grpc.aio.ServicerContext) -> bytes:
        engine = self._ready()
        settings = self._settings
        stream = validation.stream(request.stream)
        offset = validation.non_negative("offset", request.offset)
        count, max_bytes = self._reply_limits(request, settings.default_read_entries)
        block_ms = validation.at_most("block_ms", request.block_ms, "max_block_ms", settings.max_block_ms)
        # Held from the read until the call ends: grpc.aio ends it once the reply is sent.
        charge = self.replies.charge(context)
        if request.group:
            return await self._group_read(
                engine, stream, request, count, max_bytes, block_ms, context, charge
            )
        if _has_group_fields(request) or request.ack_offsets or request.ack_ranges:
            raise invalid_argument(
                "group: consumer, retry_ms, expire_ms, noack, claim_idle_ms and acks need a group"
            )
        await charge.reserve(max_bytes)
        if request.reverse:
            result = engine.read(stream, offset, count, max_bytes=max_bytes, reverse=True)
            return _held(charge, _read_reply(result, result.next_offset))
        if not block_ms:
            result = engine.read(stream, offset, count, max_bytes=max_bytes)
            return _held(charge, _read_reply(result, result.next_offset))

        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._wait_limit_s(context, block_ms)
        seen = False
        while True:
            await charge.reserve(max_bytes)
            try:
                result = engine.read(stream, offset, count, max_bytes=max_bytes)
            except StreamNotFoundError:
                # RCP 11's BLOCK waits on a stream that does not exist yet; one that
                # existed during this call and is gone now was deleted.
                if seen:
                    raise not_found(f"stream {stream!r} was deleted") from None
                result = None
            else:
                seen = True
                if _has_news(result, offset):
                    return _held(charge, _read_reply(result, result.next_offset))
            # Nothing yet: wait, holding no room, with no await between the read above and this call.
            charge.settle(0)
            wake = await self._waiters.wait(stream, offset, deadline - loop.time())
            if wake is Wake.DELETED:
                raise not_found(f"stream {stream!r} was deleted")
            if wake is not Wake.APPENDED:
                # Timed out, or the server is draining: an empty reply, like BLOCK's timeout.
                if result is None:
                    return pb.ReadResponse(next_offset=offset).SerializeToString()
                return _read_reply(result, offset)

    async def _group_read(
        self,
        engine: Engine,
        stream: str,
        request: pb.ReadRequest,
        count: int,
        max_bytes: int,
        block_ms: int,
        context: grpc.aio.ServicerContext,
        charge: ReplyCharge,
    ) -> bytes:
        """Read in group mode: acknowledge what the request carries, then read (and wait) as a consumer."""
        group = validation.name("group", request.group)
        options = _group_options(request, count, max_bytes)
        if request.reverse:
            raise invalid_argument("reverse: group reads go forward only")
        offsets, ranges = self._ack_items(
            request.ack_offsets, request.ack_ranges, ("ack_offsets", "ack_ranges")
        )
        acks: dict[str, int] = {}
        if offsets or ranges:
            # First, so that the room it makes in a bounded pending list serves this very read.
            acked = await self._group_call(engine, stream, engine.ack, stream, group, offsets, ranges)
            acks = {"acknowledged": acked.acknowledged, "ack_unknown": acked.unknown}
        if block_ms:
            waited = await self._group_read_or_wait(
                engine, stream, group, options, self._wait_limit_s(context, block_ms), charge
            )
            if waited is Wake.DELETED:
                raise not_found(f"stream {stream!r} was deleted")
            # TIMEOUT, or CLOSED (draining): an empty reply, as a plain blocking read's timeout.
            result = waited if isinstance(waited, GroupReadResult) else None
        else:
            result = await self._read_group(engine, stream, group, options, charge)
        return _held(charge, groupwire.read_reply(pb.ReadResponse, result, engine.bounds(stream), **acks))

    @translate_errors
    async def Subscribe(
        self, request: pb.SubscribeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        engine = self._ready()
        settings = self._settings
        stream = validation.stream(request.stream)
        count, max_bytes = self._reply_limits(request, settings.subscribe_batch_entries)
        # Each reply is held from its read until its send completes: the code after each
        # `yield` runs once it has (service/limits.py sends them one at a time).
        charge = self.replies.charge(context)
        if request.group:
            # aclosing: when the client goes away, the inner generator's cleanup runs now, not at GC.
            async with contextlib.aclosing(
                self._group_subscribe(engine, stream, request, count, max_bytes, charge)
            ) as replies:
                async for reply in replies:
                    yield reply
            return
        if _has_group_fields(request):
            raise invalid_argument(
                "group: consumer, retry_ms, expire_ms, noack and claim_idle_ms need a group"
            )
        offset = self._start_offset(engine, stream, request)
        self._take_subscription()
        try:
            first = True
            seen = False
            while True:
                if self._draining:
                    raise unavailable(f"server is shutting down; resubscribe from offset {offset}")
                await charge.reserve(max_bytes)
                try:
                    result = engine.read(stream, offset, count, max_bytes=max_bytes)
                except StreamNotFoundError:
                    if seen:
                        raise not_found(f"stream {stream!r} was deleted") from None
                    result = None
                else:
                    seen = True
                    if _has_news(result, offset):
                        offset = result.next_offset
                        first = False
                        reply = _held(charge, _subscribe_reply(result, offset))
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
                    yield _subscribe_reply(result, offset)
                    continue
                charge.settle(0)
                wake = await self._waiters.wait(stream, offset, None)
                if wake is Wake.DELETED:
                    raise not_found(f"stream {stream!r} was deleted")
                if wake is Wake.CLOSED:
                    raise unavailable(f"server is shutting down; resubscribe from offset {offset}")
        finally:
            self.subscriptions -= 1

    def _take_subscription(self) -> None:
        limit = self._settings.max_subscriptions
        if self.subscriptions >= limit:
            raise limit_exceeded("max_subscriptions", limit, "too many subscriptions on this server")
        self.subscriptions += 1

    async def _group_subscribe(
        self,
        engine: Engine,
        stream: str,
        request: pb.SubscribeRequest,
        count: int,
        max_bytes: int,
        charge: ReplyCharge,
    ) -> AsyncIterator[bytes]:
        """Subscribe in group mode: batches of the entries the group hands this consumer, as they come."""
        group = validation.name("group", request.group)
        options = _group_options(request, count, max_bytes)
        if request.start or request.offset or request.timestamp_ms:
            raise invalid_argument(
                "start, offset, timestamp_ms: not used in group mode (the group keeps its position)"
            )
        self._take_subscription()
        try:
            # The first reply goes out at once, even empty: the subscriber then knows it is
            # registered (and a fresh consumer exists in the group).
            wait_s: float | None = 0
            while True:
                if self._draining:
                    raise unavailable("server is shutting down; subscribe again")
                waited = await self._group_read_or_wait(engine, stream, group, options, wait_s, charge)
                if waited is Wake.DELETED:
                    raise not_found(f"stream {stream!r} was deleted")
                if waited is Wake.CLOSED:
                    raise unavailable("server is shutting down; subscribe again")
                if isinstance(waited, GroupReadResult) and (wait_s == 0 or has_news(waited)):
                    reply = groupwire.read_reply(pb.SubscribeResponse, waited, engine.bounds(stream))
                    del waited  # its records are in the reply (see Subscribe)
                    yield _held(charge, reply)
                    charge.settle(0)
                wait_s = None
        finally:
            self.subscriptions -= 1

    @translate_errors
    async def Consume(
        self, requests: AsyncIterator[pb.ConsumeRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        engine = self._ready()
        opening = await anext(requests, None)
        if opening is None:
            return  # the client closed its side without opening a session
        settings = self._settings
        stream = validation.stream(opening.stream)
        group = validation.name("group", opening.group)
        count, max_bytes = self._reply_limits(opening, settings.default_read_entries)
        options = _group_options(opening, count, max_bytes)
        # NOT_FOUND now for a stream or group that does not exist, even if no batch is asked for yet
        # (an O(1) look, not a GroupInfo: its cost must not grow with the group's consumers).
        engine.consumer_count(stream, group, options.consumer)

        # Each batch is held from its read until its send completes, when the session asks for
        # the next one (service/limits.py sends them one at a time).
        charge = self.replies.charge(context)

        async def ack(offsets: list[int], ranges: list[tuple[int, int]]) -> tuple[int, int]:
            result = await self._group_call(engine, stream, engine.ack, stream, group, offsets, ranges)
            return result.acknowledged, result.unknown

        def reply(result: GroupReadResult | None, batches: int, acknowledged: int, unknown: int) -> bytes:
            counts = {"batches": batches, "acknowledged": acknowledged, "ack_unknown": unknown}
            reply = groupwire.read_reply(pb.ConsumeResponse, result, engine.bounds(stream), **counts)
            return _held(charge, reply)

        # Read options for n batches at once: count x n entries (at most max_read_entries).
        options_for = functools.cache(
            lambda n: dataclasses.replace(options, count=min(count * n, settings.max_read_entries))
        )

        def read_or_wait(batches: int, wait_s: float | None, until: asyncio.Event | None) -> Any:
            return self._group_read_or_wait(
                engine, stream, group, options_for(batches), wait_s, charge, until
            )

        calls = SessionCalls(
            read_or_wait=read_or_wait,
            ack=ack,
            ack_items=functools.partial(self._ack_items, names=("ack_offsets", "ack_ranges")),
            reply=reply,
            draining=lambda: self._draining,
            stream=stream,
            count=count,
            max_batches=settings.max_consume_batches,
        )
        session = ConsumeSession(calls)
        self._take_subscription()
        self._sessions.add(session)
        try:
            async with contextlib.aclosing(session.run(opening, requests)) as replies:
                async for reply_bytes in replies:
                    yield reply_bytes
                    charge.settle(0)
        finally:
            self._sessions.discard(session)
            self.subscriptions -= 1

    def _start_offset(self, engine: Engine, stream: str, request: pb.SubscribeRequest) -> int:
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
            # A read of no entries costs nothing and reports the stream's bounds.
            bounds = engine.bounds(stream)
        except StreamNotFoundError:
            return 0  # the stream's first append will have offset 0
        return bounds.first_offset if start == pb.START_POSITION_OLDEST else bounds.end_offset

    @translate_errors
    async def Ack(self, request: pb.AckRequest, context: grpc.aio.ServicerContext) -> pb.AckResponse:
        engine = self._ready()
        stream = validation.stream(request.stream)
        group = validation.name("group", request.group)
        if not request.offsets and not request.ranges:
            raise invalid_argument("offsets, ranges: nothing to acknowledge")
        offsets, ranges = self._ack_items(request.offsets, request.ranges, ("offsets", "ranges"))
        result = await self._group_call(engine, stream, engine.ack, stream, group, offsets, ranges)
        return pb.AckResponse(acknowledged=result.acknowledged, unknown=result.unknown)

    @translate_errors
    async def Nack(self, request: pb.NackRequest, context: grpc.aio.ServicerContext) -> pb.NackResponse:
        engine = self._ready()
        stream = validation.stream(request.stream)
        group = validation.name("group", request.group)
        offsets = self._offsets(request.offsets)
        delay_ms = validation.duration_ms("delay_ms", request.delay_ms)
        result = await self._group_call(engine, stream, engine.nack, stream, group, offsets, delay_ms)
        return pb.NackResponse(released=result.released, unknown=result.unknown)

    @translate_errors
    async def Claim(self, request: pb.ClaimRequest, context: grpc.aio.ServicerContext) -> bytes:
        engine = self._ready()
        stream = validation.stream(request.stream)
        group = validation.name("group", request.group)
        consumer = validation.name("consumer", request.consumer)
        min_idle_ms = validation.non_negative("min_idle_ms", request.min_idle_ms)
        offsets = self._offsets(request.offsets)
        # The claimed entries' size is known only once claimed: room for the largest read.
        charge = self.replies.charge(context)
        await charge.reserve(self._settings.max_read_bytes)
        result = await self._group_call(
            engine, stream, engine.claim, stream, group, consumer, min_idle_ms, offsets
        )
        return _held(charge, groupwire.claim_reply(pb.ClaimResponse, result))

    @translate_errors
    async def AutoClaim(self, request: pb.AutoClaimRequest, context: grpc.aio.ServicerContext) -> bytes:
        engine = self._ready()
        settings = self._settings
        stream = validation.stream(request.stream)
        group = validation.name("group", request.group)
        consumer = validation.name("consumer", request.consumer)
        min_idle_ms = validation.non_negative("min_idle_ms", request.min_idle_ms)
        cursor = validation.non_negative("cursor", request.cursor)
        count = validation.bounded(
            "count", request.count, settings.default_read_entries, settings.max_read_entries
        )
        charge = self.replies.charge(context)  # as Claim
        await charge.reserve(settings.max_read_bytes)
        next_cursor, result = await self._group_call(
            engine, stream, engine.autoclaim, stream, group, consumer, min_idle_ms, cursor, count
        )
        return _held(charge, groupwire.claim_reply(pb.AutoClaimResponse, result, next_cursor=next_cursor))

    # ------------------------------------------------------------------ group admin

    def _group_start(
        self, engine: Engine, stream: str, request: pb.CreateGroupRequest | pb.SetGroupOffsetRequest
    ) -> Callable[[], str | int]:
        """Check a group's start fields now; the returned function resolves them (in the thread)."""
        start = request.start
        if start in (pb.START_POSITION_UNSPECIFIED, pb.START_POSITION_OFFSET):
            offset = validation.non_negative("offset", request.offset)

            def at_offset() -> int:
                end = engine.bounds(stream).end_offset
                if offset > end:
                    # As Trim: the stream may get there later, so the request is not malformed.
                    raise ServiceError(
                        grpc.StatusCode.OUT_OF_RANGE,
                        f"offset: {offset} is past the end of stream {stream!r} (next_offset {end})",
                    )
                return offset

            return at_offset
        if start == pb.START_POSITION_TIMESTAMP:
            timestamp_ms = validation.non_negative("timestamp_ms", request.timestamp_ms)
            return lambda: engine.seek_time(stream, timestamp_ms)
        if start == pb.START_POSITION_OLDEST:
            return lambda: "oldest"
        if start == pb.START_POSITION_LATEST:
            return lambda: "newest"
        raise invalid_argument(f"start: unknown start position {start}")

    @translate_errors
    async def CreateGroup(
        self, request: pb.CreateGroupRequest, context: grpc.aio.ServicerContext
    ) -> pb.CreateGroupResponse:
        engine = self._ready()
        stream = validation.stream(request.stream)
        group = validation.name("group", request.group)
        start = self._group_start(engine, stream, request)
        entries_read = (
            validation.non_negative("entries_read", request.entries_read)
            if request.HasField("entries_read")
            else None
        )
        config = groupwire.config_from_proto(request.config)
        if config.dead_letter_stream == stream:
            raise invalid_argument("config.dead_letter_stream: must not be the group's own stream")

        def create() -> pb.GroupInfo:
            if request.create_stream and not engine.exists(stream):
                engine.create_stream(stream)
            try:
                info = engine.create_group(
                    stream, group, start=start(), entries_read=entries_read, config=config
                )
            except PreconditionError as exc:  # the one precondition of create_group: the name is free
                raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, str(exc)) from None
            return groupwire.info_to_proto(info)

        return pb.CreateGroupResponse(group=await self._in_thread(create))

    @translate_errors
    async def DeleteGroup(
        self, request: pb.DeleteGroupRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteGroupResponse:
        engine = self._ready()
        stream = validation.stream(request.stream)
        group = validation.name("group", request.group)
        await self._in_thread(engine.delete_group, stream, group)
        # Its blocked readers read again, find no group, and end with NOT_FOUND.
        self.group_waits.kick(stream, group)
        return pb.DeleteGroupResponse()

    @translate_errors
    async def ListGroups(
        self, request: pb.ListGroupsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListGroupsResponse:
        engine = self._ready()
        stream = validation.stream(request.stream)
        infos = await self._group_call(engine, stream, engine.list_groups, stream)
        return pb.ListGroupsResponse(groups=[groupwire.info_to_proto(info) for info in infos])

    @translate_errors
    async def GetGroupInfo(
        self, request: pb.GetGroupInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetGroupInfoResponse:
        engine = self._ready()
        stream = validation.stream(request.stream)
        group = validation.name("group", request.group)
        info = await self._group_call(engine, stream, engine.group_info, stream, group)
        return pb.GetGroupInfoResponse(group=groupwire.info_to_proto(info))

    @translate_errors
    async def SetGroupOffset(
        self, request: pb.SetGroupOffsetRequest, context: grpc.aio.ServicerContext
    ) -> pb.SetGroupOffsetResponse:
        engine = self._ready()
        stream = validation.stream(request.stream)
        group = validation.name("group", request.group)
        start = self._group_start(engine, stream, request)
        entries_read = (
            validation.non_negative("entries_read", request.entries_read)
            if request.HasField("entries_read")
            else None
        )

        def seek() -> pb.GroupInfo:
            return groupwire.info_to_proto(engine.set_group_offset(stream, group, start(), entries_read))

        return pb.SetGroupOffsetResponse(group=await self._in_thread(seek))

    @translate_errors
    async def SetGroupConfig(
        self, request: pb.SetGroupConfigRequest, context: grpc.aio.ServicerContext
    ) -> pb.SetGroupConfigResponse:
        engine = self._ready()
        stream = validation.stream(request.stream)
        group = validation.name("group", request.group)
        config = groupwire.config_from_proto(request.config)
        if config.dead_letter_stream == stream:
            raise invalid_argument("config.dead_letter_stream: must not be the group's own stream")
        info = await self._in_thread(engine.set_group_config, stream, group, config)
        return pb.SetGroupConfigResponse(group=groupwire.info_to_proto(info))

    @translate_errors
    async def DeleteConsumer(
        self, request: pb.DeleteConsumerRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteConsumerResponse:
        engine = self._ready()
        stream = validation.stream(request.stream)
        group = validation.name("group", request.group)
        consumer = validation.name("consumer", request.consumer)
        released = await self._in_thread(engine.delete_consumer, stream, group, consumer)
        return pb.DeleteConsumerResponse(released=released)

    @translate_errors
    async def GetPending(
        self, request: pb.GetPendingRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetPendingResponse:
        engine = self._ready()
        settings = self._settings
        stream = validation.stream(request.stream)
        group = validation.name("group", request.group)
        consumer = validation.name("consumer", request.consumer) if request.consumer else None
        min_idle_ms = validation.non_negative("min_idle_ms", request.min_idle_ms)
        start = validation.non_negative("start_offset", request.start_offset)
        end = None
        if request.HasField("end_offset"):
            end = request.end_offset
            if end < start:
                raise invalid_argument(f"end_offset: {end} is before start_offset {start}")
        count = validation.bounded(
            "count", request.count, settings.default_read_entries, settings.max_read_entries
        )
        query = functools.partial(
            engine.pending,
            stream,
            group,
            consumer=consumer,
            min_idle_ms=min_idle_ms,
            start=start,
            end=end,
            count=count,
        )
        return groupwire.pending_to_proto(await self._group_call(engine, stream, query))

    # ------------------------------------------------------------------ admin

    @translate_errors
    async def ListStreams(
        self, request: pb.ListStreamsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListStreamsResponse:
        engine = self._ready()
        settings = self._settings
        prefix = request.prefix
        if len(prefix.encode()) > MAX_STREAM_NAME_BYTES:
            raise invalid_argument(
                f"prefix: longer than a stream name can be ({MAX_STREAM_NAME_BYTES} bytes)"
            )
        page_size = validation.bounded(
            "page_size", request.page_size, settings.default_page_size, settings.max_page_size
        )
        # Sorted by code point, which is the byte order of the UTF-8 encoding.
        names = engine.list_streams()
        start = bisect.bisect_left(names, prefix)
        if request.page_token:
            start = max(start, bisect.bisect_right(names, _after_token(request.page_token)))
        page: list[str] = []
        for name in names[start : start + page_size + 1]:
            if not name.startswith(prefix):
                break
            page.append(name)
        more = len(page) > page_size
        del page[page_size:]
        return pb.ListStreamsResponse(streams=page, next_page_token=_page_token(page[-1]) if more else "")

    @translate_errors
    async def GetStreamInfo(
        self, request: pb.GetStreamInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetStreamInfoResponse:
        engine = self._ready()
        stream = validation.stream(request.stream)
        info = engine.info(stream)
        groups: int | None = None
        try:
            groups = len(await self._group_call(engine, stream, engine.list_groups, stream))
        except CorruptionError as exc:
            # Unreadable group state must not hide the stream's own description: leave `groups` unset.
            log.warning("stream %r: consumer groups not counted: %s", stream, exc)
        holder = engine.retention_holder(stream)
        return pb.GetStreamInfoResponse(
            info=pb.StreamInfo(
                name=info.name,
                first_offset=info.first_offset,
                next_offset=info.end_offset,
                entries_added=info.entries_added,
                entries=info.entries,
                bytes_on_disk=info.bytes_on_disk,
                segments=info.segments,
                nodes=info.nodes,
                compression_ratio=info.compression_ratio,
                used_bytes=info.used_bytes,
                packed_segments=info.packed_segments,
                last_timestamp_ms=info.last_timestamp_ms,
                config=_config_to_proto(info.config),
                effective_fsync=_FSYNC_TO_PROTO[engine.fsync_policy(stream)],
                damaged=[_gap(gap) for gap in info.damaged],
                groups=groups,
                retention_holder=None
                if holder is None
                else pb.RetentionHolder(group=holder[0], offset=holder[1]),
            )
        )

    @translate_errors
    async def DeleteStream(
        self, request: pb.DeleteStreamRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteStreamResponse:
        engine = self._ready()
        stream = validation.stream(request.stream)
        await self._in_thread(engine.delete_stream, stream)
        self._waiters.on_delete(stream)
        self.group_waits.on_delete(stream)
        return pb.DeleteStreamResponse()

    @translate_errors
    async def Trim(self, request: pb.TrimRequest, context: grpc.aio.ServicerContext) -> pb.TrimResponse:
        engine = self._ready()
        stream = validation.stream(request.stream)
        mode = request.WhichOneof("mode")
        if mode is None:
            raise invalid_argument(f"mode: set one of {', '.join(_TRIM_MODES)}")
        value = validation.non_negative(mode, getattr(request, mode))
        if mode == "trim_to_offset":
            end = engine.bounds(stream).end_offset
            if value > end:
                raise ServiceError(
                    grpc.StatusCode.OUT_OF_RANGE,
                    f"trim_to_offset: {value} is past the end of stream {stream!r} (next_offset {end})",
                )
            first = await self._in_thread(engine.trim, stream, value)
        elif mode == "keep_last":
            first = await self._in_thread(engine.keep_last, stream, value)
        else:
            first = await self._in_thread(engine.evict, stream, value)
        return pb.TrimResponse(first_offset=first)

    @translate_errors
    async def SetStreamConfig(
        self, request: pb.SetStreamConfigRequest, context: grpc.aio.ServicerContext
    ) -> pb.SetStreamConfigResponse:
        engine = self._ready()
        stream = validation.stream(request.stream)
        config = _config_from_proto(request.config)
        await self._in_thread(engine.set_stream_config, stream, config)
        return pb.SetStreamConfigResponse(config=_config_to_proto(engine.stream_config(stream)))

    @translate_errors
    async def SeekTime(
        self, request: pb.SeekTimeRequest, context: grpc.aio.ServicerContext
    ) -> pb.SeekTimeResponse:
        engine = self._ready()
        stream = validation.stream(request.stream)
        timestamp_ms = validation.non_negative("timestamp_ms", request.timestamp_ms)
        return pb.SeekTimeResponse(offset=engine.seek_time(stream, timestamp_ms))

    @translate_errors
    async def CountRange(
        self, request: pb.CountRangeRequest, context: grpc.aio.ServicerContext
    ) -> pb.CountRangeResponse:
        engine = self._ready()
        stream = validation.stream(request.stream)
        start = validation.non_negative("start_offset", request.start_offset)
        end = _END_OF_STREAM
        if request.HasField("end_offset"):
            end = request.end_offset
            if end < start:
                raise invalid_argument(f"end_offset: {end} is before start_offset {start}")
        return pb.CountRangeResponse(count=engine.count(stream, start, end))
