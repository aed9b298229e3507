"""Forwarding a call to the node that leads its stream, and relaying its answer unchanged.

The entry node calls the leader with the caller's request, metadata (its token
included: the leader checks it as it checks any call; not the transport's headers)
and remaining deadline, plus `streamlog-forwarded-by: <this node>`. Replies come back as the leader sent them:
messages (bytes, for the RPCs that send stored records as they are, see server.py),
the final status with its message and trailers. Streams are relayed one message at a
time in each direction, a reply taken from the leader only once the caller took the
previous one, so a forwarded Subscribe holds one reply here at most (gRPC's buffers
aside) and a slow caller slows the leader's sends as a direct one would.

A failure to reach the leader is answered with the status gRPC gives it (UNAVAILABLE
when the leader cannot be reached): the call did not happen there, or its outcome is
unknown, exactly as for a caller whose own connection broke.
"""

from __future__ import annotations

import collections
import re
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from typing import Any

import grpc
from streamlog.v1 import streamlog_pb2 as pb

from service.callcontext import CallContext
from service.interceptors import prepended
from service.peers import PeerChannels

FORWARDED_BY = "streamlog-forwarded-by"
# Headers of the transport, not of the call: those gRPC sets on every call itself (the
# forwarded call gets its own), and HTTP/1.1's, for calls that came in over the HTTP API.
_TRANSPORT_KEYS = frozenset(
    {
        "user-agent",
        "te",
        "content-type",
        "content-length",
        "host",
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "upgrade",
        "accept-encoding",
    }
)
# What gRPC accepts as metadata (other HTTP headers cannot be sent, and mean nothing to it).
_KEY = re.compile(r"[0-9a-z_.-]+")
_TEXT_VALUE = re.compile(r"[\x20-\x7e]*")

_KINDS = {(False, False): "unary_unary", (False, True): "unary_stream", (True, True): "stream_stream"}


def _pass_through(data: bytes) -> bytes:
    return data


class Forwarder:
    """Relays StreamLogService calls from this node to their stream's leader."""

    def __init__(
        self, node_id: str, peers: PeerChannels, service: Any, raw_reply_methods: Iterable[str]
    ) -> None:
        self._node_id = node_id
        self._peers = peers
        # Calls relayed to a leader, per method (read by /metrics, service/metrics.py).
        self.forwarded: collections.Counter[str] = collections.Counter()
        raw = frozenset(raw_reply_methods)
        # method name -> (path, channel method, serializers): requests are the parsed messages
        # the server read; replies stay bytes for the RPCs whose handlers return bytes.
        self._methods: dict[str, tuple[str, str, dict[str, Any]]] = {}
        for method in service.methods:
            kind = _KINDS.get((method.client_streaming, method.server_streaming))
            if kind is None:
                continue  # no client-streaming-only RPC exists; one added later is served locally
            response = getattr(pb, method.output_type.name)
            serializers = {
                "request_serializer": getattr(pb, method.input_type.name).SerializeToString,
                "response_deserializer": _pass_through if method.name in raw else response.FromString,
            }
            self._methods[method.name] = (f"/{service.full_name}/{method.name}", kind, serializers)

    def _call(self, method: str, leader: str, address: str) -> Any:
        path, kind, serializers = self._methods[method]
        self.forwarded[method] += 1
        return self._peers.method(leader, address, path, kind, **serializers)

    def _metadata(self, context: CallContext) -> tuple[tuple[str, Any], ...]:
        passed = tuple(
            (key, value) for key, value in context.invocation_metadata() or () if _passed(key, value)
        )
        return (*passed, (FORWARDED_BY, self._node_id))

    def _unary_call(self, method: str, request: Any, context: CallContext, leader: str, address: str) -> Any:
        return self._call(method, leader, address)(
            request, metadata=self._metadata(context), timeout=context.time_remaining()
        )

    async def unary(self, method: str, request: Any, context: CallContext, leader: str, address: str) -> Any:
        call = self._unary_call(method, request, context, leader, address)
        try:
            reply = await call
        except grpc.aio.AioRpcError as exc:
            await _relay_status(context, exc)
        await _relay_trailers(context, call)
        return reply

    async def unary_part(
        self, method: str, request: Any, context: CallContext, leader: str, address: str
    ) -> Any:
        """The leader's reply to a part of a call (some batches of an AppendMany), or its failure
        raised as grpc.aio.AioRpcError: the caller answers it in that part's place, the call goes
        on (its trailers are not relayed)."""
        return await self._unary_call(method, request, context, leader, address)

    async def stream(
        self, method: str, request: Any, context: CallContext, leader: str, address: str
    ) -> AsyncGenerator[Any, None]:
        call = self._call(method, leader, address)(
            request, metadata=self._metadata(context), timeout=context.time_remaining()
        )
        async for reply in _relayed(call, context):
            yield reply

    async def session(
        self,
        method: str,
        opening: Any,
        requests: AsyncIterator[Any],
        context: CallContext,
        leader: str,
        address: str,
    ) -> AsyncGenerator[Any, None]:
        """A bidirectional call: the caller's messages (its first already read) to the leader,
        the leader's to the caller, as each comes."""
        call = self._call(method, leader, address)(
            prepended(opening, requests), metadata=self._metadata(context), timeout=context.time_remaining()
        )
        async for reply in _relayed(call, context):
            yield reply


def _passed(key: str, value: Any) -> bool:
    if key in _TRANSPORT_KEYS or key.startswith("grpc-") or not _KEY.fullmatch(key):
        return False
    return key.endswith("-bin") or (isinstance(value, str) and _TEXT_VALUE.fullmatch(value) is not None)


async def _relayed(call: Any, context: CallContext) -> AsyncGenerator[Any, None]:
    """The replies of a streaming call to a peer, then its status and trailers on `context`."""
    try:
        async for reply in call:
            yield reply
    except grpc.aio.AioRpcError as exc:
        await _relay_status(context, exc)
    finally:
        call.cancel()  # the caller went away or the relay failed: end the leader's side too
    await _relay_trailers(context, call)


async def _relay_status(context: CallContext, error: grpc.aio.AioRpcError) -> None:
    await context.abort(error.code(), error.details() or "", tuple(error.trailing_metadata() or ()))


async def _relay_trailers(context: CallContext, call: Any) -> None:
    trailers = await call.trailing_metadata()
    if trailers:
        context.set_trailing_metadata(tuple(trailers))
