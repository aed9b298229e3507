"""The servicer context of an HTTP call: what the service and its interceptors ask of a gRPC one.

Each HTTP call runs through the same wrapped method handlers as a gRPC call
(service/http/calls.py), so it meets the same auth, limits, metrics and servicer.
Those call, on their context, exactly these: `invocation_metadata` (the bearer
token), `peer` (logs, per-connection limits), `auth_context` (the client
certificate's common name under mutual TLS), `abort` (every refusal), `code`
(metrics), `set_code` (a call ended from outside, service/opencalls.py),
`time_remaining` (blocking reads), `write` (each reply of a streaming call, sent
by the outermost interceptor), `send_initial_metadata` (open calls),
`add_done_callback` (the reply budget gives its bytes back when the call ends:
the gateway calls `done`). Nothing else is implemented: service/callcontext.py's
CallContext lists what the service may use, and mypy checks this class against it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NoReturn

import grpc
from aiohttp import web

Metadata = tuple[tuple[str, str], ...]
# What a call answers besides its reply: binary (-bin) values are bytes, as in gRPC.
Trailers = tuple[tuple[str, str | bytes], ...]


class CallAborted(grpc.aio.AbortError):
    """`abort` on the HTTP side: ends the call's handlers as grpc.aio's AbortError does (the
    service's error translation lets it through), and carries the status to answer."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: Trailers = ()) -> None:
        super().__init__(details)
        self.code, self.details, self.trailing_metadata = code, details, trailing_metadata


def metadata_of(request: web.Request) -> Metadata:
    """The request's headers as gRPC metadata: lower-case keys, every value (a repeated header
    stays repeated, so auth refuses two `authorization` headers as it does on gRPC)."""
    return tuple((key.lower(), value) for key, value in request.headers.items())


def peer_of(request: web.Request) -> str:
    """The client's connection, named as gRPC names peers (`ipv4:127.0.0.1:53012`)."""
    address = request.transport.get_extra_info("peername") if request.transport else None
    if not address:
        return "unknown"
    host, port = address[0], address[1]
    return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"


def auth_context_of(request: web.Request) -> dict[str, list[bytes]]:
    """gRPC's auth context for the connection: under TLS, the verified client certificate's
    common names (only a certificate the client CA signed gets this far)."""
    transport = request.transport
    if transport is None or transport.get_extra_info("sslcontext") is None:
        return {}
    found: dict[str, list[bytes]] = {"transport_security_type": [b"ssl"]}
    certificate = transport.get_extra_info("peercert") or {}
    names = [value for rdn in certificate.get("subject", ()) for key, value in rdn if key == "commonName"]
    if names:
        found["x509_common_name"] = [name.encode() for name in names]
    return found


Sink = Callable[[Any], Awaitable[None]]


class HttpContext:
    """One HTTP call's stand-in for CallContext (see the module's docstring)."""

    def __init__(self, request: web.Request, sink: Sink | None = None) -> None:
        """`sink` receives each reply a streaming call writes."""
        self._request = request
        self._sink = sink
        self._metadata = metadata_of(request)
        self._code: grpc.StatusCode | None = None
        self._done: list[Callable[[Any], None]] = []
        self.trailing_metadata: Trailers = ()

    def invocation_metadata(self) -> Metadata:
        return self._metadata

    def peer(self) -> str:
        return peer_of(self._request)

    def auth_context(self) -> dict[str, list[bytes]]:
        return auth_context_of(self._request)

    async def abort(
        self,
        code: grpc.StatusCode,
        details: str = "",
        trailing_metadata: Sequence[tuple[str, str | bytes]] = (),
    ) -> NoReturn:
        self._code = code
        raise CallAborted(code, details, tuple(trailing_metadata))

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def time_remaining(self) -> float | None:
        return None  # HTTP has no deadline; a blocking read waits its block_ms

    async def send_initial_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        """Nothing to do: an HTTP response's headers go with its first event (or its refusal).
        (On gRPC, early headers let a status queue behind a stuck reply; service/opencalls.py.)"""

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str | bytes]]) -> None:
        """Kept for the reply's headers (a unary call's; a stream's headers went with its first event)."""
        self.trailing_metadata = tuple(metadata)

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        self._done.append(callback)

    def done(self) -> None:
        """The call has ended: run the done callbacks (the reply budget's release), once."""
        callbacks, self._done = self._done, []
        for callback in callbacks:
            callback(self)

    async def write(self, message: Any) -> None:
        if self._sink is None:
            raise RuntimeError("write on a unary call")
        await self._sink(message)
