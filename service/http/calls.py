"""Runs an RPC for an HTTP call through the handlers and interceptors of the gRPC server.

The gRPC server finds a method's handler by passing its name and metadata down the
chain of interceptors (each `intercept_service` wraps the handler of the next,
service/interceptors.py). `Dispatcher` does exactly that, with the server's own
interceptor objects and method handlers, then calls the wrapped behavior with an
HttpContext. So an HTTP call gets the same token check (before its request is
used), access rules, limits, metrics and servicer as a gRPC call, with no second
copy of any of them.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from google.protobuf import message_factory
from google.protobuf.message import Message

from service.callcontext import AioMethodHandler, aio_handler
from service.http.context import CallAborted, HttpContext, Metadata
from service.interceptors import iterate


@dataclass(slots=True)
class CallDetails:
    """What grpc.aio hands interceptors (grpc.HandlerCallDetails is only a protocol)."""

    method: str
    invocation_metadata: tuple[tuple[str, str | bytes], ...]


class Dispatcher:
    """The RPCs of one service, called the way the gRPC server calls them."""

    def __init__(
        self,
        service: Any,
        handlers: Mapping[str, grpc.RpcMethodHandler],
        interceptors: Iterable[grpc.aio.ServerInterceptor],
    ) -> None:
        """`service`: the service descriptor; `handlers`: the server's handler per method name (the
        same objects, so the interceptors' per-method caches serve both)."""
        self.service = service
        self._prefix = f"/{service.full_name}/"
        self._handlers = handlers
        self._interceptors = tuple(interceptors)

    def request_class(self, method: str) -> type[Message]:
        return message_factory.GetMessageClass(self.service.methods_by_name[method].input_type)

    def response_class(self, method: str) -> type[Message]:
        return message_factory.GetMessageClass(self.service.methods_by_name[method].output_type)

    async def _handler(self, method: str, metadata: Metadata) -> AioMethodHandler:
        base = self._handlers[method]
        interceptors = self._interceptors

        async def through(index: int, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
            if index == len(interceptors):
                return base
            return await interceptors[index].intercept_service(functools.partial(through, index + 1), details)

        handler = await through(0, CallDetails(self._prefix + method, metadata))
        if handler is None:  # an interceptor may decline a call (grpc.aio's contract; ours never do)
            raise CallAborted(grpc.StatusCode.UNIMPLEMENTED, f"no handler for {method}")
        return aio_handler(handler)

    async def unary(self, method: str, request: Message, context: HttpContext) -> Message:
        handler = await self._handler(method, context.invocation_metadata())
        if handler.unary_unary is None:
            await _refused(handler, context)
        reply = await handler.unary_unary(request, context)
        return self.as_message(method, reply)

    async def stream(self, method: str, request: Message, context: HttpContext) -> None:
        """A server-streaming call: each reply goes to `context.write`."""
        handler = await self._handler(method, context.invocation_metadata())
        if handler.unary_stream is None:
            await _refused(handler, context)
        # The outermost interceptor writes the replies itself; a bare behavior yields them.
        async for reply in iterate(handler.unary_stream, request, context):
            await context.write(reply)

    def as_message(self, method: str, reply: Any) -> Message:
        """The reply as a message: Read, Subscribe and the claims answer their serialized bytes."""
        if isinstance(reply, bytes):
            return self.response_class(method).FromString(reply)
        return reply


async def _nothing() -> AsyncIterator[Any]:
    return
    yield


async def _refused(handler: AioMethodHandler, context: HttpContext) -> NoReturn:
    """Auth's answer to a call without valid credentials: a handler that aborts without reading
    the request (service/auth.py, `admit`)."""
    if handler.stream_unary is not None:
        await handler.stream_unary(_nothing(), context)
    raise CallAborted(grpc.StatusCode.INTERNAL, "no handler answered the call")
