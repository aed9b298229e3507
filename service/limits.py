"""Limits on what clients can make a server hold, beyond those on a single request.

The servicer and the engine refuse oversized requests (message, batch, entry and
tag sizes, ack lists) and cap the total of subscriptions. This module adds the
limits that need to look across calls, as server interceptors:

- `max_streams`: a call that would create a stream (an Append to a new name,
  CreateGroup with create_stream, a new dead-letter stream) when the server holds
  that many already; in a Publish session, each message to a new name (that
  message is answered RESOURCE_EXHAUSTED, the session goes on); in an AppendMany,
  each batch to a new name (answered so in its result, the others are served).
- `max_groups_per_stream`, `max_consumers_per_group`: CreateGroup, and the first
  group read or claim by a new consumer name.
- `max_pending_per_group` (when set): a group's `max_pending` (its bounded pending
  list, which stops new deliveries when full); a group created or reconfigured
  without one gets this value, and asking for more is refused.
- `max_subscriptions_per_connection` (per client connection) and
  `max_blocked_reads` (Reads waiting with block_ms, server-wide).
- `subscriber_send_timeout_ms`: a subscriber whose client stops taking replies
  is cut off once a reply has waited that long to be sent: its subscription ends
  at once and RESOURCE_EXHAUSTED is queued behind the unsent reply (see
  service/opencalls.py for what gRPC keeps until the client takes it or leaves).
  Until then it holds one reply, counted in the reply budget
  (service/replybudget.py), which bounds what all such replies hold.

Every refusal is RESOURCE_EXHAUSTED with the limit's name and value in the message.
Connection-level limits are gRPC server options (`server_options`): concurrent
calls per connection, metadata size, keepalive pings that find dead peers, and the
keepalive enforcement that closes connections of clients pinging too often.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import grpc

from service import batchparts
from service.callcontext import CallContext
from service.config import Settings
from service.errors import ServiceError, limit_exceeded
from service.interceptors import (
    MESSAGE_SESSIONS,
    SessionBehavior,
    StreamBehavior,
    UnaryBehavior,
    WrappingInterceptor,
    checked,
    iterate,
    waits,
)
from service.opencalls import OpenCall
from storage import Engine, StorageError

log = logging.getLogger(__name__)

# The stream count is refreshed from the engine at most this often (listing costs O(streams)).
_STREAM_COUNT_TTL_S = 1.0
_CONSUMER_METHODS = frozenset({"Claim", "AutoClaim", "Consume"})
_GROUP_READ_METHODS = frozenset({"Read", "Subscribe"})
_FORGET_METHODS = frozenset({"DeleteConsumer", "DeleteGroup", "DeleteStream"})
_GROUP_CONFIG_METHODS = frozenset({"CreateGroup", "SetGroupConfig"})
# The methods `check` looks at (Append, AppendMany and Publish have wrappers of their own); the
# other unary calls are served unwrapped.
_CHECKED_METHODS = _CONSUMER_METHODS | _GROUP_READ_METHODS | _FORGET_METHODS | _GROUP_CONFIG_METHODS


def server_options(settings: Settings) -> list[tuple[str, Any]]:
    """gRPC server options enforcing the connection-level limits."""
    options: list[tuple[str, Any]] = [
        ("grpc.max_concurrent_streams", settings.max_concurrent_calls_per_connection),
        ("grpc.max_metadata_size", settings.max_metadata_bytes),
        # The server pings idle connections to find peers that vanished without a FIN
        # (a crashed host, a dropped NAT entry), which would otherwise hold calls forever.
        ("grpc.keepalive_time_ms", settings.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", settings.keepalive_timeout_ms),
        # Keepalive enforcement: a client pinging more often than this (without data) gets
        # strikes, then GOAWAY "too_many_pings". Clients may ping when they have no call.
        ("grpc.http2.min_ping_interval_without_data_ms", settings.min_client_ping_interval_ms),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.keepalive_permit_without_calls", 1),
        # Calls received but not yet taken by the event loop, which takes them one at a time.
        # Past gRPC's defaults (random refusals from 1,000 waiting, all from 3,000) a burst of
        # new calls, such as subscribers coming back after a restart, ends CANCELLED with
        # nothing logged. Up to max_subscriptions are let in, to meet the service's own limits
        # (RESOURCE_EXHAUSTED, with a message); gRPC still drops a call left waiting 30 s.
        ("grpc.server.max_pending_requests", settings.max_subscriptions),
        ("grpc.server.max_pending_requests_hard_limit", settings.max_subscriptions),
    ]
    if settings.max_connection_idle_ms:
        options.append(("grpc.max_connection_idle_ms", settings.max_connection_idle_ms))
    return options


class LimitError(Exception):
    def __init__(self, limit: str, value: int, message: str) -> None:
        super().__init__(limit_exceeded(limit, value, message).message)
        self.limit = limit


Observer = Callable[[str, str], None]


class LimitsInterceptor(WrappingInterceptor):
    """The cross-call limits. `engine()` is None until the server has recovered its data."""

    def __init__(
        self,
        service_name: str,
        settings: Settings,
        engine: Callable[[], Engine | None],
        observer: Observer | None = None,
    ) -> None:
        super().__init__(service_name)
        self._settings = settings
        self._engine = engine
        self._observer = observer
        self._subscriptions_by_peer: collections.Counter[str] = collections.Counter()
        self.blocked_reads = 0
        self._stream_count = 0
        self._stream_count_at = float("-inf")
        # Streams this interceptor let calls create since the count was refreshed, and those
        # calls still running (their stream may not be in the engine yet when the count is).
        self._created: set[str] = set()
        self._creating: set[str] = set()
        # (stream, group) -> consumer names known to exist, so reads by known consumers are free.
        self._consumers: dict[tuple[str, str], set[str]] = {}

    # -- checks

    def _count_streams(self, engine: Engine) -> int:
        now = time.monotonic()
        if now - self._stream_count_at > _STREAM_COUNT_TTL_S:
            self._stream_count, self._stream_count_at = engine.stream_count(), now
            # Names in the fresh count are no longer extra, nor need the calls that made them keep
            # them here (a Publish session, which may create a stream per message, runs on: the
            # set would grow with all it ever made, each refresh visiting them all). Those of
            # running calls not in the count yet still are extra.
            self._creating = {name for name in self._creating if not engine.exists(name)}
            self._created = set(self._creating)
        return self._stream_count + len(self._created)

    def _new_stream(self, engine: Engine, stream: str, what: str) -> str | None:
        """Count `stream` as created if it is new; return it if this call is creating it."""
        if not stream or engine.exists(stream) or stream in self._created:
            return None
        limit = self._settings.max_streams
        if self._count_streams(engine) >= limit:
            raise LimitError("max_streams", limit, f"{what}: the server holds {limit} streams")
        self._created.add(stream)
        return stream

    async def _new_consumer(self, engine: Engine, stream: str, group: str, consumer: str) -> None:
        if not (stream and group and consumer):
            return  # the servicer refuses what is missing
        known = self._consumers.get((stream, group))
        if known is not None and consumer in known:
            return
        try:
            # O(1), on the loop: one client naming new consumers must not slow everyone down.
            count, exists = engine.consumer_count(stream, group, consumer)
        except StorageError:
            return  # no such stream or group: the servicer answers that
        limit = self._settings.max_consumers_per_group
        if not exists and count >= limit:
            raise LimitError(
                "max_consumers_per_group",
                limit,
                f"consumer {consumer!r}: group {group!r} has {limit} consumers",
            )
        self._consumers.setdefault((stream, group), set()).add(consumer)

    async def _new_group(self, engine: Engine, request: Any) -> None:
        try:
            groups = await asyncio.to_thread(engine.list_groups, request.stream)
        except StorageError:
            return
        limit = self._settings.max_groups_per_stream
        if len(groups) >= limit and request.group not in {g.name for g in groups}:
            raise LimitError(
                "max_groups_per_stream", limit, f"group {request.group!r}: stream has {limit} groups"
            )

    def _pending_bound(self, request: Any) -> Any:
        """The request with its group config's max_pending set to at most max_pending_per_group."""
        limit = self._settings.max_pending_per_group
        config = request.config
        if not limit:
            return request
        if config.HasField("max_pending"):
            if config.max_pending > limit:
                raise LimitError(
                    "max_pending_per_group", limit, f"config.max_pending: {config.max_pending} asked"
                )
            return request
        bounded = type(request)()
        bounded.CopyFrom(request)
        bounded.config.max_pending = limit
        return bounded

    async def check(self, method: str, request: Any, engine: Engine) -> Any:
        """Raise LimitError for a call of one of _CHECKED_METHODS past a limit; return the request
        to serve (maybe bounded)."""
        if method in _GROUP_CONFIG_METHODS:
            if method == "CreateGroup":
                if request.create_stream:
                    self._track(self._new_stream(engine, request.stream, "create_stream"))
                await self._new_group(engine, request)
            self._new_stream(engine, request.config.dead_letter_stream, "config.dead_letter_stream")
            request = self._pending_bound(request)
        elif method in _CONSUMER_METHODS or (method in _GROUP_READ_METHODS and request.group):
            await self._new_consumer(engine, request.stream, request.group, request.consumer)
        elif method in _FORGET_METHODS:
            self._forget(request)
        return request

    def _track(self, stream: str | None) -> None:
        if stream is not None:
            self._creating.add(stream)

    def _done(self, method: str, request: Any) -> None:
        """A call that may have created a stream has finished."""
        if method == "CreateGroup":
            self._creating.discard(request.stream)

    def _forget(self, request: Any) -> None:
        # Stale names would only let a deleted consumer come back past the limit; drop them.
        if hasattr(request, "group"):
            self._consumers.pop((request.stream, request.group), None)
        else:
            for key in [k for k in self._consumers if k[0] == request.stream]:
                del self._consumers[key]

    async def _refuse(self, context: CallContext, method: str, request: Any, exc: LimitError) -> None:
        self._report(context, method, request, exc)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))

    def _report(self, context: CallContext, method: str, request: Any, exc: LimitError) -> None:
        log.info(
            "limit reached: %s",
            exc,
            extra={
                "method": method,
                "stream": getattr(request, "stream", ""),
                "group": getattr(request, "group", ""),
                "peer": context.peer(),
                "limit": exc.limit,
            },
        )
        if self._observer is not None:
            self._observer("limit", exc.limit)

    # -- wrappers

    def wrap_unary(self, method: str, behavior: UnaryBehavior) -> UnaryBehavior:
        if method in batchparts.BATCH_CALLS:
            return self._wrap_batches(method, behavior)
        if method == "Append":
            return self._wrap_append(behavior)
        if method not in _CHECKED_METHODS:
            return behavior  # no limit applies to it
        settings = self._settings

        async def limited(request: Any, context: CallContext) -> Any:
            engine = self._engine()
            if engine is not None:
                try:
                    request = await self.check(method, request, engine)
                except LimitError as exc:
                    await self._refuse(context, method, request, exc)
            if not waits(method, request):
                try:
                    return await behavior(request, context)
                finally:
                    self._done(method, request)
            if self.blocked_reads >= settings.max_blocked_reads:
                await self._refuse(
                    context,
                    method,
                    request,
                    LimitError(
                        "max_blocked_reads", settings.max_blocked_reads, "block_ms: too many blocked reads"
                    ),
                )
            self.blocked_reads += 1
            try:
                return await behavior(request, context)
            finally:
                self.blocked_reads -= 1

        return limited

    def _wrap_append(self, behavior: UnaryBehavior) -> UnaryBehavior:
        """max_streams: an Append that would create a stream past it is refused. The stream it
        creates counts as being created until the call ends (the engine may not list it yet)."""

        async def limited(request: Any, context: CallContext) -> Any:
            engine = self._engine()
            creating = None
            if engine is not None:
                try:
                    creating = self._new_stream(engine, request.stream, "stream")
                except LimitError as exc:
                    await self._refuse(context, "Append", request, exc)
            if creating is None:
                return await behavior(request, context)
            self._creating.add(creating)
            try:
                return await behavior(request, context)
            finally:
                self._creating.discard(creating)

        return limited

    def wrap_stream(self, method: str, behavior: StreamBehavior) -> StreamBehavior:
        limit = self._settings.max_subscriptions_per_connection

        async def limited(request: Any, context: CallContext) -> AsyncIterator[Any]:
            engine = self._engine()
            if engine is not None:
                try:
                    request = await self.check(method, request, engine)
                except LimitError as exc:
                    await self._refuse(context, method, request, exc)
            # The peer address names the client's connection (its address and port).
            peer = context.peer()
            by_peer = self._subscriptions_by_peer
            if by_peer[peer] >= limit:
                await self._refuse(
                    context,
                    method,
                    request,
                    LimitError(
                        "max_subscriptions_per_connection", limit, "too many subscriptions on this connection"
                    ),
                )
            by_peer[peer] += 1
            try:
                async for reply in iterate(behavior, request, context):
                    yield reply
            finally:
                by_peer[peer] -= 1
                if not by_peer[peer]:
                    del by_peer[peer]

        return limited

    def wrap_session(self, method: str, behavior: SessionBehavior) -> SessionBehavior:
        if method not in MESSAGE_SESSIONS:
            return super().wrap_session(method, behavior)

        async def limited(requests: AsyncIterator[Any], context: CallContext) -> AsyncGenerator[Any, None]:
            creating: set[str] = set()  # streams this session's messages may be creating
            check = self._creation_check(method, context, creating)
            try:
                async with contextlib.aclosing(behavior(checked(requests, check), context)) as replies:
                    async for reply in replies:
                        yield reply
            finally:
                self._creating -= creating

        return limited

    def _wrap_batches(self, method: str, behavior: UnaryBehavior) -> UnaryBehavior:
        """max_streams checked on each batch: one that would create a stream past it is answered
        RESOURCE_EXHAUSTED in its result, the others are served."""

        async def limited(request: Any, context: CallContext) -> Any:
            creating: set[str] = set()  # streams this call's batches may be creating
            try:
                refused, passed = batchparts.checked(
                    request, self._settings, self._creation_check(method, context, creating)
                )
            except ServiceError as exc:
                await context.abort(exc.code, exc.message)
            try:
                return await batchparts.passed_on(request, refused, passed, behavior, context)
            finally:
                self._creating -= creating

        return limited

    def _creation_check(
        self, method: str, context: CallContext, creating: set[str]
    ) -> Callable[[Any], tuple[grpc.StatusCode, str] | None]:
        """The max_streams check of each part of a call whose parts are answered one by one (a
        Publish message, an AppendMany batch); the streams they may create are added to `creating`
        (and counted as being created until the caller takes them out)."""

        def check(request: Any) -> tuple[grpc.StatusCode, str] | None:
            engine = self._engine()
            if engine is None:
                return None  # the servicer answers UNAVAILABLE
            try:
                stream = self._new_stream(engine, request.stream, "stream")
            except LimitError as exc:
                self._report(context, method, request, exc)
                return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
            if stream is not None:
                self._creating.add(stream)
                creating.add(stream)
            return None

        return check

    def subscriptions_on(self, peer: str) -> int:
        return self._subscriptions_by_peer.get(peer, 0)


class SendTimeout:
    """Sends the replies of open streaming calls (service/opencalls.py), and cuts off subscribers
    that stop taking them.

    One timer per call, not one per reply (an `asyncio.timeout` around each send cost a timer
    handle, its heap push and its cancellation on every Subscribe reply and Publish answer): a
    send notes when it began (`OpenCall.sending_since`) and arms the call's timer if none is
    armed. The timer, when it fires, ends the call if the send in progress began the timeout ago
    or more (`OpenCall.end`: the send is interrupted and the status answered), else arms itself
    for when that send would be due; with no send in progress it stays off until the next.
    """

    def __init__(self, timeout_ms: int, observer: Observer | None = None) -> None:
        self._timeout_s = timeout_ms / 1000
        self._timeout_ms = timeout_ms
        self._observer = observer
        self.cut_off = 0

    async def send(self, call: OpenCall, reply: Any) -> None:
        loop = asyncio.get_running_loop()
        # A send waits while the client's flow-control window is full.
        call.sending_since = since = loop.time()
        if call.send_timer is None:
            call.send_timer = loop.call_at(since + self._timeout_s, self._check, call, loop)
        try:
            await call.context.write(reply)
        except grpc.aio.InternalError:
            # gRPC's core refused the send (ExecuteBatchError): the client has gone (or
            # cancelled) and the call has not been told yet. A subscriber leaving is normal,
            # so the call ends as cancelled (gRPC logs that at debug), not as a servicer
            # failure (logged at ERROR with a traceback).
            raise asyncio.CancelledError from None
        finally:
            call.sending_since = None

    def _check(self, call: OpenCall, loop: asyncio.AbstractEventLoop) -> None:
        call.send_timer = None
        since = call.sending_since
        if since is None or call.ending is not None:
            return
        due = since + self._timeout_s
        if loop.time() < due:
            call.send_timer = loop.call_at(due, self._check, call, loop)
            return
        error = self._cut_off(call)
        call.end(error.code, error.message)

    def _cut_off(self, call: OpenCall) -> ServiceError:
        self.cut_off += 1
        error = limit_exceeded(
            "subscriber_send_timeout_ms",
            self._timeout_ms,
            f"subscriber too slow: a reply waited {self._timeout_ms} ms for the client to take it; "
            "resubscribe from the last next_offset received",
        )
        request = call.request
        log.warning(
            "subscriber cut off: %s",
            error.message,
            extra={
                "method": call.method,
                "stream": getattr(request, "stream", ""),
                "group": getattr(request, "group", ""),
                "peer": call.context.peer(),
                "limit": "subscriber_send_timeout_ms",
            },
        )
        if self._observer is not None:
            self._observer("limit", "subscriber_send_timeout_ms")
        return error
