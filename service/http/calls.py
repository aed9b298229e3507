"""Runs an RPC for an HTTP call through the handlers and interceptors of the gRPC server.

The gRPC server serves the servicer's handlers wrapped by the interceptors, and
runs their `admit` for each call before its request is read
(service/interceptors.py). `Dispatcher` does exactly that, with the server's own
wrapped handlers, then calls the wrapped behavior with an HttpContext. So an HTTP
call gets the same token check (before its request is used), access rules,
limits, metrics and servicer as a gRPC call, with no second copy of any of them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, NoReturn

import grpc
from google.protobuf import message_factory
from google.protobuf.message import Message

from service.callcontext import AioMethodHandler, aio_handler
from service.http.context import CallAborted, HttpContext, Metadata
from service.interceptors import Interceptors, iterate


class Dispatcher:
    """The RPCs of one service, called the way the gRPC server calls them."""

    def __init__(self, service: Any, interceptors: Interceptors) -> None:
        """`service`: the service descriptor; `interceptors`: the gRPC server's (the same wrapped
        handlers serve both)."""
        self.service = service
        self._interceptors = interceptors

    def request_class(self, method: str) -> type[Message]:
        return message_factory.GetMessageClass(self.service.methods_by_name[method].input_type)

    def response_class(self, method: str) -> type[Message]:
        return message_factory.GetMessageClass(self.service.methods_by_name[method].output_type)

    def _handler(self, method: str, metadata: Metadata) -> AioMethodHandler:
        return aio_handler(self._interceptors.handler(method, metadata))

    async def unary(self, method: str, request: Message, context: HttpContext) -> Message:
        handler = self._handler(method, context.invocation_metadata())
        if handler.unary_unary is None:
            await _refused(handler, context)
        reply = await handler.unary_unary(request, context)
        return self.as_message(method, reply)

    async def stream(self, method: str, request: Message, context: HttpContext) -> None:
        """A server-streaming call: each reply goes to `context.write`."""
        handler = self._handler(method, context.invocation_metadata())
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
