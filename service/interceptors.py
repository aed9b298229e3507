"""The service's interceptors: layers that wrap the handlers of StreamLogService.

grpc.aio interceptors see only the method name and metadata, not the request; auth
(which stream, which group), limits and metrics need the request and the outcome.
So each interceptor wraps a method's handler with a function that receives the
request and the context. Other services (health, reflection) are not wrapped:
they stay open and uncounted.

grpc.aio would run a chain of interceptors for every call (an `intercept_service`
await per interceptor, before the handler is found). `Interceptors` wraps each
method's handler by every interceptor once, at start-up, and the server serves
the wrapped handlers as its own: a call then costs what its wrappers do, nothing
more. Only `admit` runs per call before the request is read (auth refuses calls
without credentials there, from their metadata), in the one grpc.aio interceptor
the server keeps, and only when an interceptor has an `admit`.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

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


class WrappingInterceptor(abc.ABC):
    """One layer of the service's interceptors; subclasses define the wrappers."""

    def __init__(self, service_name: str) -> None:
        self._prefix = f"/{service_name}/"

    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """`handler` of `method` (its name in the service), its behavior wrapped by this layer."""
        served = aio_handler(handler)
        if served.unary_unary is not None:
            return served._replace(unary_unary=self.wrap_unary(method, served.unary_unary))
        if served.unary_stream is not None:
            return served._replace(unary_stream=self.wrap_stream(method, served.unary_stream))
        if served.stream_stream is not None:
            return served._replace(stream_stream=self.wrap_session(method, served.stream_stream))
        # StreamLogService has no client-streaming-only RPC; one added later is served
        # unwrapped, and auth refuses to start when an RPC has no access rule.
        return handler

    def admit(
        self, handler_call_details: grpc.HandlerCallDetails, handler: grpc.RpcMethodHandler
    ) -> grpc.RpcMethodHandler:
        """The handler for this call, decided from its method and metadata alone (its request
        is not read yet): the wrapped `handler`, or another one (a refusal, which the layers
        do not wrap). Layers that override this run it for every call (see `Interceptors`)."""
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


@dataclass(slots=True)
class CallDetails:
    """A call's method path and metadata, as grpc.aio hands them to interceptors (for calls that
    do not come through gRPC: grpc.HandlerCallDetails is only a protocol)."""

    method: str
    invocation_metadata: tuple[tuple[str, str | bytes], ...]


class Interceptors:
    """A service's interceptors (outermost first) applied to its method handlers, once.

    `handlers` are the wrapped handlers, by method name: the server serves them as its
    own. The interceptors with an `admit` run it for every call, innermost first, each on
    the handler the previous one chose; the first that chooses another handler (a
    refusal) decides, and that handler is served as it is.
    """

    def __init__(
        self,
        service_name: str,
        interceptors: Sequence[WrappingInterceptor],
        handlers: Mapping[str, grpc.RpcMethodHandler],
    ) -> None:
        self._prefix = f"/{service_name}/"
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}
        for method, handler in handlers.items():
            for interceptor in reversed(interceptors):
                handler = interceptor.wrap(method, handler)
            self.handlers[method] = handler
        self._by_path = {self._prefix + method: handler for method, handler in self.handlers.items()}
        self._admitting = tuple(
            i for i in reversed(interceptors) if type(i).admit is not WrappingInterceptor.admit
        )

    def admit(
        self, details: grpc.HandlerCallDetails, handler: grpc.RpcMethodHandler
    ) -> grpc.RpcMethodHandler:
        for interceptor in self._admitting:
            chosen = interceptor.admit(details, handler)
            if chosen is not handler:
                return chosen
        return handler

    def handler(self, method: str, metadata: tuple[tuple[str, str | bytes], ...]) -> grpc.RpcMethodHandler:
        """The handler of one call of `method` with `metadata`, admitted (for the HTTP gateway)."""
        return self.admit(CallDetails(self._prefix + method, metadata), self.handlers[method])

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """What grpc.aio must run per call: the admits, when there are any; else nothing."""
        return [_Admission(self._by_path, self.admit)] if self._admitting else []


class _Admission(grpc.aio.ServerInterceptor):
    """Runs the admits of a service's interceptors for each of its calls, in grpc.aio."""

    def __init__(
        self,
        by_path: Mapping[str, grpc.RpcMethodHandler],
        admit: Callable[[grpc.HandlerCallDetails, grpc.RpcMethodHandler], grpc.RpcMethodHandler],
    ) -> None:
        self._by_path = by_path
        self._admit = admit

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = self._by_path.get(handler_call_details.method)
        if handler is None:
            return await continuation(handler_call_details)  # another service's
        return self._admit(handler_call_details, handler)


def iterate(behavior: StreamBehavior, request: Any, context: CallContext) -> AsyncGenerator[Any, None]:
    """The replies of a streaming behavior, whichever of the two forms it has.

    An async generator's replies are its own (no generator added per layer and reply). A
    behavior that writes with `context.write` (a coroutine) has sent its replies itself;
    it yields nothing here.
    """
    result = behavior(request, context)
    if hasattr(result, "__aiter__"):
        return cast(AsyncGenerator[Any, None], result)
    return _written(cast(Awaitable[None], result))


async def _written(sent: Awaitable[None]) -> AsyncGenerator[Any, None]:
    await sent
    return
    yield  # an async generator that yields nothing


async def prepended(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """`first`, then the messages of `rest`: a session's requests after a layer read the first."""
    yield first
    async for request in rest:
        yield request
