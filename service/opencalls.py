"""Calls that stay open (Subscribe, Consume, Reads that wait): a registry of them, and ending one
from outside.

A call ends when its handler stops; something else may need to end it first: the
send timeout cutting off a subscriber whose client stopped reading
(service/limits.py), or the auth layer ending the calls a reload of the token and
ACL files no longer allows (service/auth.py). `OpenCallsInterceptor`, the
outermost interceptor, registers every such call: streaming calls are served by
`OpenCalls.serve`, Reads that wait by `OpenCalls.hold`. `OpenCall.end` (or
`OpenCalls.end_where`) interrupts its handler wherever it waits (reading, waiting
for entries or credit, sending a reply), closes its replies at once (the
subscription's reads, counts and waits end now), and answers the status given.
The layers inside see the call end with that status, not as cancelled.

In a cluster, the routing layer (service/routing.py) finds the OpenCall of the
call it routes with `current_call`, and marks it: relayed to another node or
served here (as the leader, or as an in-sync follower of one epoch), and where its
client resumes (service/resume.py). The cluster node then ends by stream
(`on_stream`) the calls served here on a stream it stops leading (or, as a
follower, stops following in sync), and on shutdown the calls it relays.

What ending cannot do: grpc.aio has no way for a server to reset one call (no
RST_STREAM from Python). A reply already handed to gRPC stays in its buffers,
and the status is sent after it, until the client takes them or the connection
closes (keepalive pings close the connections of peers that stopped reading
altogether). So that the status can always be queued behind such a reply,
`serve` sends the response headers first: a status batch that must also carry
the headers of a stuck first reply is refused by gRPC core
(GRPC_CALL_ERROR_TOO_MANY_OPERATIONS), and the call then stays open with no
status at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from typing import Any

import grpc

from service.callcontext import CallContext
from service.interceptors import (
    WAITING_UNARY,
    StreamBehavior,
    UnaryBehavior,
    WrappingInterceptor,
    iterate,
    waits,
)


class OpenCall:
    """One open call: what it asked for, and a way to end it."""

    __slots__ = (
        "_task",
        "context",
        "ending",
        "in_sync_epoch",
        "method",
        "relayed",
        "request",
        "resume",
        "send_timer",
        "sending_since",
    )

    def __init__(self, method: str, request: Any, context: CallContext) -> None:
        self.method = method
        self.request = request  # its first request (for Consume, the one that opened it)
        self.context = context
        self.ending: tuple[grpc.StatusCode, str] | None = None
        # Set by a cluster's routing: the call is relayed to the node that serves it, and where
        # its client resumes if it is ended to be made again (service/resume.py).
        self.relayed = False
        self.resume: Callable[[], str] | None = None
        # Set by a cluster's routing when the call is served here as an in-sync follower (a read
        # from a replica): the leader epoch it follows. None: served as the leader (or relayed).
        self.in_sync_epoch: int | None = None
        # The send timeout's (service/limits.py): when the reply being sent began (loop time; None
        # between sends), and the call's one timer that checks it.
        self.sending_since: float | None = None
        self.send_timer: asyncio.TimerHandle | None = None
        self._task = asyncio.current_task()

    def end(self, code: grpc.StatusCode, message: str) -> None:
        """End the call with this status (on the event loop; once: later calls change nothing)."""
        if self.ending is None and self._task is not None:
            self._end_with(code, message)
            self._task.cancel()

    def _end_with(self, code: grpc.StatusCode, message: str) -> None:
        self.ending = (code, message)
        # Set now, so that the layers inside (metrics) see the status, not a cancellation.
        self.context.set_code(code)

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """A block of the call's task that `end` may interrupt: the cancellation `end` caused
        ends the block quietly (the caller then answers `ending`); any other propagates."""
        try:
            yield
        except asyncio.CancelledError:
            if self.ending is None:
                raise  # the client went away, or the server is stopping
            asyncio.current_task().uncancel()  # type: ignore[union-attr]


# The open call the current task serves, for the layers inside `OpenCalls.hold` and `serve`.
_CURRENT: contextvars.ContextVar[OpenCall | None] = contextvars.ContextVar("open_call", default=None)


def current_call() -> OpenCall | None:
    """The OpenCall of the call this task serves; None outside `OpenCalls.hold` and `serve`."""
    return _CURRENT.get()


# How an open streaming call's replies are sent (the send timeout's, service/limits.py). It may
# end the call (OpenCall.end) while a send waits.
Send = Callable[[OpenCall, Any], Awaitable[None]]


class OpenCalls:
    """The open calls of one server. Event loop thread only."""

    def __init__(self) -> None:
        self._open: dict[OpenCall, None] = {}  # insertion-ordered, O(1) removal
        # The same calls by stream (every call that stays open names one), for `on_stream`.
        self._by_stream: dict[str, dict[OpenCall, None]] = {}
        # The loop the calls run on, for those who end calls from other threads (None until a
        # call has opened: until then there is nothing to end).
        self.loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        return len(self._open)

    def __iter__(self) -> Iterator[OpenCall]:
        return iter(list(self._open))  # a copy: ending a call removes it

    def end_where(self, predicate: Callable[[OpenCall], bool], code: grpc.StatusCode, message: str) -> int:
        """End every open call `predicate` selects; return how many."""
        chosen = [call for call in self if predicate(call)]
        for call in chosen:
            call.end(code, message)
        return len(chosen)

    def on_stream(self, stream: str) -> list[OpenCall]:
        """The open calls on `stream` (a copy: ending a call removes it)."""
        return list(self._by_stream.get(stream, ()))

    def _register(self, method: str, request: Any, context: CallContext) -> OpenCall:
        call = OpenCall(method, request, context)
        self._open[call] = None
        self._by_stream.setdefault(request.stream, {})[call] = None
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        return call

    def _unregister(self, call: OpenCall) -> None:
        if call.send_timer is not None:
            call.send_timer.cancel()
        del self._open[call]
        stream = call.request.stream
        same = self._by_stream[stream]
        del same[call]
        if not same:
            del self._by_stream[stream]

    async def hold(self, method: str, request: Any, context: CallContext, behavior: UnaryBehavior) -> Any:
        """The reply of unary `behavior`, unless the call is ended first."""
        call = self._register(method, request, context)
        token = _CURRENT.set(call)
        try:
            with call.interruptible():
                return await behavior(request, context)
        finally:
            _CURRENT.reset(token)
            self._unregister(call)
        await context.abort(*call.ending)

    async def serve(
        self,
        method: str,
        request: Any,
        context: CallContext,
        replies: AsyncGenerator[Any, None],
        send: Send,
    ) -> None:
        """Send `replies` with `send` until they end or the call is ended."""
        call = self._register(method, request, context)
        token = _CURRENT.set(call)
        try:
            with call.interruptible():
                await context.send_initial_metadata(())
                async for reply in replies:
                    await send(call, reply)
        finally:
            _CURRENT.reset(token)
            self._unregister(call)
            # Now rather than when collected: the subscription's cleanup (counts, waits) runs here.
            await replies.aclose()
        if call.ending is not None:
            await context.abort(*call.ending)


class OpenCallsInterceptor(WrappingInterceptor):
    """Registers every call that stays open in `calls`: streaming calls, whose replies it sends
    with `send` (so it must be installed first, outermost), and Reads that wait."""

    def __init__(self, service_name: str, calls: OpenCalls, send: Send) -> None:
        super().__init__(service_name)
        self._calls = calls
        self._send = send

    def wrap_unary(self, method: str, behavior: UnaryBehavior) -> UnaryBehavior:
        if method not in WAITING_UNARY:
            return behavior
        calls = self._calls

        async def held(request: Any, context: CallContext) -> Any:
            if not waits(method, request):
                return await behavior(request, context)
            return await calls.hold(method, request, context, behavior)

        return held

    def wrap_stream(self, method: str, behavior: StreamBehavior) -> StreamBehavior:
        calls, send = self._calls, self._send

        async def served(request: Any, context: CallContext) -> None:
            await calls.serve(method, request, context, iterate(behavior, request, context), send)

        return served
