"""Open streaming calls (Subscribe, Consume): a registry of them, and ending one from outside.

A subscription ends when its handler stops; something else may need to end it
first: the send timeout cutting off a subscriber whose client stopped reading, or
the auth layer ending the calls of a principal whose rights were revoked. Each
open call is served by `OpenCalls.serve`, which registers it; `OpenCall.end`
(or `OpenCalls.end_where`) interrupts its handler wherever it waits, closes its
replies at once (the subscription's reads, counts and waits end now), and
answers the status given.

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
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc

from service.errors import ServiceError


class OpenCall:
    """One open streaming call: what it asked for, and a way to end it."""

    __slots__ = ("_task", "context", "ending", "method", "request")

    def __init__(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> None:
        self.method = method
        self.request = request  # its first request (for Consume, the one that opened it)
        self.context = context
        self.ending: tuple[grpc.StatusCode, str] | None = None
        self._task = asyncio.current_task()

    def end(self, code: grpc.StatusCode, message: str) -> None:
        """End the call with this status (on the event loop; once: later calls change nothing)."""
        if self.ending is None and self._task is not None:
            self.ending = (code, message)
            self._task.cancel()


class OpenCalls:
    """The open streaming calls of one server. Event loop thread only."""

    def __init__(self) -> None:
        self._open: dict[OpenCall, None] = {}  # insertion-ordered, O(1) removal

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

    async def serve(
        self,
        method: str,
        request: Any,
        context: grpc.aio.ServicerContext,
        replies: AsyncIterator[Any],
        send: Callable[[OpenCall, Any], Awaitable[None]],
    ) -> None:
        """Send `replies` with `send` until they end or the call is ended.

        `send` may end the call itself by raising ServiceError (its code and message
        become the status).
        """
        call = OpenCall(method, request, context)
        self._open[call] = None
        try:
            await context.send_initial_metadata(())
            async for reply in replies:
                try:
                    await send(call, reply)
                except ServiceError as exc:
                    call.ending = (exc.code, exc.message)
                    break
        except asyncio.CancelledError:
            if call.ending is None:
                raise  # the client went away, or the server is stopping
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
        finally:
            del self._open[call]
            # Now rather than when collected: the subscription's cleanup (counts, waits) runs here.
            await replies.aclose()
        if call.ending is not None:
            await context.abort(*call.ending)
