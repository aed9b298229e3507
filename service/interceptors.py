"""The base of the service's server interceptors: wrap the handlers of StreamLogService.

grpc.aio interceptors see only the method name and metadata, not the request; auth
(which stream, which group), limits and metrics need the request and the outcome.
So each interceptor returns the method's handler with its behavior wrapped by a
function that receives the request and the context. Other services (health,
reflection) are passed through untouched: they stay open and uncounted.

A wrapped handler is built once per method and reused, so the per-call cost of an
interceptor is one `intercept_service` await and the wrapper itself.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

UnaryBehavior = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
# A server-streaming behavior: an async generator function, or a coroutine function that
# sends with `context.write` (grpc.aio accepts both).
StreamBehavior = Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any] | Awaitable[None]]


class WrappingInterceptor(grpc.aio.ServerInterceptor):
    """Wraps the unary-request handlers of one service; subclasses define the wrappers."""

    def __init__(self, service_name: str) -> None:
        self._prefix = f"/{service_name}/"
        # method path -> (handler from the next layer, the wrapped handler built from it)
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        path = handler_call_details.method
        if handler is None or not path.startswith(self._prefix):
            return handler
        cached = self._wrapped.get(path)
        if cached is not None and cached[0] is handler:
            return cached[1]
        method = path[len(self._prefix) :]
        if handler.unary_unary is not None:
            wrapped = handler._replace(unary_unary=self.wrap_unary(method, handler.unary_unary))
        elif handler.unary_stream is not None:
            wrapped = handler._replace(unary_stream=self.wrap_stream(method, handler.unary_stream))
        else:
            # StreamLogService has no client-streaming RPC; one added later passes unwrapped
            # here, and the subclasses refuse to start when they must see every call (auth).
            return handler
        self._wrapped[path] = (handler, wrapped)
        return wrapped

    @abc.abstractmethod
    def wrap_unary(self, method: str, behavior: UnaryBehavior) -> UnaryBehavior:
        """The handler of unary `method`, wrapped (or `behavior` itself to leave it alone)."""

    @abc.abstractmethod
    def wrap_stream(self, method: str, behavior: StreamBehavior) -> StreamBehavior:
        """The handler of server-streaming `method`, wrapped (or `behavior` itself)."""


async def iterate(
    behavior: StreamBehavior, request: Any, context: grpc.aio.ServicerContext
) -> AsyncIterator[Any]:
    """The replies of a streaming behavior, whichever of the two forms it has.

    A behavior that writes with `context.write` (a coroutine) has sent its replies
    itself; it yields nothing here.
    """
    result = behavior(request, context)
    if hasattr(result, "__aiter__"):
        async for reply in result:  # type: ignore[union-attr]
            yield reply
    else:
        await result  # type: ignore[misc]
