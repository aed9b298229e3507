"""The base of the service's server interceptors: wrap the handlers of StreamLogService.

grpc.aio interceptors see only the method name and metadata, not the request; auth
(which stream, which group), limits and metrics need the request and the outcome.
So each interceptor returns the method's handler with its behavior wrapped by a
function that receives the request and the context. Other services (health,
reflection) are passed through untouched: they stay open and uncounted.

A wrapped handler is built once per method and reused, so the per-call cost of an
interceptor is one `intercept_service` await and the wrapper itself. `admit` may
give a call another handler, decided from its metadata before its request is read
(auth refuses calls without credentials there).
"""

from __future__ import annotations

import abc
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from service.callcontext import CallContext, SessionBehavior, StreamBehavior, UnaryBehavior, aio_handler

# Unary RPCs whose calls may wait: a Read with block_ms.
WAITING_UNARY = frozenset({"Read"})
# Bidirectional RPCs whose every message stands alone (names its own stream, gets its own answer):
# a layer that checks requests checks each message, and passes a message it refuses on as a
# `Refused`, which the handler answers in its place, in order, without ending the call.
MESSAGE_SESSIONS = frozenset({"Publish"})


@dataclass(frozen=True, slots=True)
class Refused:
    """A message of a MESSAGE_SESSIONS call that a layer refused, with the status to answer it."""

    request: Any
    code: grpc.StatusCode
    message: str


def request_of(item: Any) -> Any:
    """The request a MESSAGE_SESSIONS message carries, refused or not."""
    return item.request if isinstance(item, Refused) else item


# A layer's check of one message: None to let it pass, else (code, message) to refuse it.
MessageCheck = Callable[[Any], tuple[grpc.StatusCode, str] | None]


async def checked(requests: AsyncIterator[Any], check: MessageCheck) -> AsyncIterator[Any]:
    """The messages of a MESSAGE_SESSIONS call, each one `check` refuses passed on as Refused
    (one refused by an outer layer is passed on as it is)."""
    async for item in requests:
        if not isinstance(item, Refused):
            refusal = check(item)
            if refusal is not None:
                item = Refused(item, *refusal)
        yield item


def waits(method: str, request: Any) -> bool:
    """Whether a unary call may wait for entries: it stays open until ended from outside or served
    (service/opencalls.py), and counts as a blocked read (service/limits.py)."""
    return method in WAITING_UNARY and request.block_ms > 0


class WrappingInterceptor(grpc.aio.ServerInterceptor):
    """Wraps the handlers of one service; subclasses define the wrappers."""

    def __init__(self, service_name: str) -> None:
        self._prefix = f"/{service_name}/"
        # method path -> (handler from the next layer, the wrapped handler built from it)
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        path = handler_call_details.method
        if handler is None or not path.startswith(self._prefix):
            return handler
        cached = self._wrapped.get(path)
        if cached is not None and cached[0] is handler:
            return self.admit(handler_call_details, cached[1])
        method = path[len(self._prefix) :]
        served = aio_handler(handler)
        wrapped: grpc.RpcMethodHandler
        if served.unary_unary is not None:
            wrapped = served._replace(unary_unary=self.wrap_unary(method, served.unary_unary))
        elif served.unary_stream is not None:
            wrapped = served._replace(unary_stream=self.wrap_stream(method, served.unary_stream))
        elif served.stream_stream is not None:
            wrapped = served._replace(stream_stream=self.wrap_session(method, served.stream_stream))
        else:
            # StreamLogService has no client-streaming-only RPC; one added later passes
            # unwrapped here, and auth refuses to start when an RPC has no access rule. Auth's
            # refusals of calls without credentials have this form, so they pass unread.
            return handler
        self._wrapped[path] = (handler, wrapped)
        return self.admit(handler_call_details, wrapped)

    def admit(
        self, handler_call_details: grpc.HandlerCallDetails, handler: grpc.RpcMethodHandler
    ) -> grpc.RpcMethodHandler:
        """The handler for this call, decided from its method and metadata alone (its request
        is not read yet): the wrapped `handler`, or another one (a refusal)."""
        return handler

    def wrap_session(self, method: str, behavior: SessionBehavior) -> SessionBehavior:
        """A bidirectional call, wrapped as a server-streaming one whose request is its first message.

        That message names the stream and group for the whole call (the servicer refuses
        later messages that set them), so what wrap_stream checks on it holds throughout.
        A layer that needs the later messages too (to relay them) overrides this.
        """

        async def session(requests: AsyncIterator[Any], context: CallContext) -> AsyncGenerator[Any, None]:
            opening = await anext(requests, None)
            if opening is None:
                return  # the client closed its side without a word

            def opened(request: Any, context: CallContext) -> AsyncIterator[Any]:
                return behavior(prepended(request, requests), context)

            async for reply in iterate(self.wrap_stream(method, opened), opening, context):
                yield reply

        return session

    @abc.abstractmethod
    def wrap_unary(self, method: str, behavior: UnaryBehavior) -> UnaryBehavior:
        """The handler of unary `method`, wrapped (or `behavior` itself to leave it alone)."""

    @abc.abstractmethod
    def wrap_stream(self, method: str, behavior: StreamBehavior) -> StreamBehavior:
        """The handler of server-streaming `method`, wrapped (or `behavior` itself)."""


async def iterate(behavior: StreamBehavior, request: Any, context: CallContext) -> AsyncGenerator[Any, None]:
    """The replies of a streaming behavior, whichever of the two forms it has.

    A behavior that writes with `context.write` (a coroutine) has sent its replies
    itself; it yields nothing here.
    """
    result = behavior(request, context)
    if hasattr(result, "__aiter__"):
        async for reply in result:
            yield reply
    else:
        await result


async def prepended(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """`first`, then the messages of `rest`: a session's requests after a layer read the first."""
    yield first
    async for request in rest:
        yield request
