"""What the service asks of a call's context, and the method handlers as grpc.aio serves them.

The servicer and the interceptors run for gRPC calls (a CallContext)
and for the HTTP gateway's calls (service/http/context.py's HttpContext, which
implements only what the service uses). `CallContext` names exactly that, so a
new use of the context that HTTP calls lack is a type error, not an
AttributeError at run time.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Never, Protocol, cast

import grpc


class CallContext(Protocol):
    """A call's context, as the service uses it (both a grpc.aio.ServicerContext and an HttpContext)."""

    def invocation_metadata(self) -> Iterable[tuple[str, str | bytes]] | None: ...

    def peer(self) -> str: ...

    def auth_context(self) -> Mapping[str, Iterable[bytes]]: ...

    async def abort(
        self,
        code: grpc.StatusCode,
        details: str = "",
        trailing_metadata: Sequence[tuple[str, str | bytes]] = (),
    ) -> Never: ...

    def code(self) -> grpc.StatusCode | None: ...

    def set_code(self, code: grpc.StatusCode, /) -> None: ...

    def time_remaining(self) -> float | None: ...

    async def send_initial_metadata(self, metadata: Sequence[tuple[str, str]], /) -> None: ...

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str | bytes]], /) -> None: ...

    async def write(self, message: Any, /) -> None: ...


UnaryBehavior = Callable[[Any, CallContext], Awaitable[Any]]
# A server-streaming behavior: an async generator function, or a coroutine function that
# sends with `context.write` (grpc.aio accepts both).
StreamBehavior = Callable[[Any, CallContext], AsyncIterator[Any] | Awaitable[None]]
# A bidirectional behavior: the requests in, the replies out.
SessionBehavior = Callable[[AsyncIterator[Any], CallContext], AsyncGenerator[Any, None]]


class AioMethodHandler(Protocol):
    """A method handler as grpc.aio serves it: its behaviors are coroutine or async generator
    functions. (grpc's type stubs describe the sync server's: plain functions of a
    grpc.ServicerContext.) At run time it is the namedtuple grpc builds."""

    @property
    def unary_unary(self) -> UnaryBehavior | None: ...

    @property
    def unary_stream(self) -> StreamBehavior | None: ...

    @property
    def stream_unary(self) -> Callable[[AsyncIterator[Any], CallContext], Awaitable[Any]] | None: ...

    @property
    def stream_stream(self) -> SessionBehavior | None: ...

    def _replace(self, **behaviors: Any) -> grpc.RpcMethodHandler:
        """The same handler with some behaviors replaced (the namedtuple's own method)."""
        ...


def aio_handler(handler: grpc.RpcMethodHandler) -> AioMethodHandler:
    """`handler` typed as grpc.aio serves it (see AioMethodHandler)."""
    # A cast, not a check: the stubs have no type for grpc.aio's handlers, and every handler
    # the server holds was made for grpc.aio (the generated add_...Servicer_to_server).
    return cast(AioMethodHandler, handler)
