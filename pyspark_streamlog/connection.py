"""The connector's calls to streamlog servers, made with the client library, and its errors.

The endpoint is one server or a cluster's seed nodes. Every call goes through a
`clients.Client` on those seeds, which learns the cluster layout (DescribeCluster) and
sends each call on a stream to the stream's leader, following redirects and failovers
(clients/_routing.py); against a single server it calls that server. The exception is
Read, whose replies stay bytes for pyspark_streamlog.wire to decode straight into Arrow:
it is sent here, on a channel per node, to the address the Client routes the stream to
(its leader, or with a `replica` node id the in-sync replica the Client's replica reads
would choose with that preference), and retried the Client's way (a redirect followed at
once, a failed replica passed over, a failover waited out within the call's deadline).

Channels (the client library's `clients._connection.open_channel`: plaintext, TLS,
mutual TLS, as `clients.Client` opens them) carry the token on every call. They are
opened where the work happens (executor tasks, the driver's planner process), never
pickled, and kept per process and `Server`: Spark reuses its Python workers, so later
tasks skip the connection set-up, the TLS handshake and the layout lookup.

Reads are retried on UNAVAILABLE (they change nothing). Appends are retried
only because every append the connector makes carries a producer id and
sequence, which makes a retry of a written batch a reported duplicate.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
from streamlog.v1 import streamlog_pb2 as pb

from clients._connection import auth_metadata, open_channel
from clients._routing import READ_FROM_METADATA, ROUTE_METADATA, Attempts, redirect_address, retryable
from clients.client import Client
from clients.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    StreamlogError,
    UnauthenticatedError,
    UnavailableError,
    from_rpc_error,
)
from clients.types import AppendResult, Record, StreamInfo
from pyspark_streamlog.errors import EndpointError, ServerError, StreamNotFoundError
from pyspark_streamlog.options import ENV_ENDPOINT, ENV_TOKEN, Server

T = TypeVar("T")

_READ_METHOD = "/streamlog.v1.StreamLogService/Read"
# UNAVAILABLE covers a server that is starting, draining or briefly unreachable.
_ATTEMPTS = 5
_FIRST_BACKOFF_S = 0.2


class _Link:
    """One process's connections to a server or cluster: a routing Client on its seeds, and
    Read with replies left as bytes, per node address (opened when first used)."""

    def __init__(self, server: Server) -> None:
        self.client = Client(server.address, token=server.token, timeout=None, **server.tls_arguments())
        self.metadata = (*auth_metadata(server.token), ROUTE_METADATA)
        self.replica_metadata = (*self.metadata, READ_FROM_METADATA)
        self._tls = server.tls_arguments()
        self._reads: dict[str, grpc.UnaryUnaryMultiCallable] = {}
        self._lock = threading.Lock()

    def read(self, address: str) -> grpc.UnaryUnaryMultiCallable:
        with self._lock:
            found = self._reads.get(address)
            if found is None:
                found = self._reads[address] = open_channel(grpc, address, **self._tls).unary_unary(
                    _READ_METHOD,
                    request_serializer=pb.ReadRequest.SerializeToString,
                    response_deserializer=None,
                )
            return found


_lock = threading.Lock()
_links: dict[tuple[int, Server], _Link] = {}


def _link(server: Server) -> _Link:
    # Keyed by pid too: a forked worker must not use its parent's channels.
    key = (os.getpid(), server)
    with _lock:
        found = _links.get(key)
        if found is None:
            found = _links[key] = _Link(server)
        return found


class Connection:
    """The calls the connector makes, against one server or cluster, with a deadline per call."""

    def __init__(self, server: Server, timeout_s: float) -> None:
        self.server = server
        self.endpoint = server.address
        self.timeout_s = timeout_s
        self._link = _link(server)
        self._client = self._link.client

    def _call(self, what: str, stream: str | None, function: Callable[[], T]) -> T:
        delay = _FIRST_BACKOFF_S
        for attempt in range(_ATTEMPTS):
            try:
                return function()
            except StreamlogError as exc:
                if isinstance(exc, UnavailableError) and attempt + 1 < _ATTEMPTS:
                    time.sleep(delay)
                    delay *= 2
                    continue
                raise self._translate(exc, what, stream) from None
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _translate(self, exc: StreamlogError, what: str, stream: str | None) -> Exception:
        code = exc.code.name if exc.code is not None else "error"
        if isinstance(exc, NotFoundError) and stream is not None:
            return StreamNotFoundError(
                f"stream {stream!r} does not exist on the streamlog server at {self.endpoint} "
                "(a stream is created by its first append)"
            )
        if isinstance(exc, UnavailableError):
            return EndpointError(
                f"cannot reach the streamlog server at {self.endpoint} ({what}: {code}: {exc.details}); "
                f"check the endpoint option or the {ENV_ENDPOINT} environment variable, and for a "
                "server with TLS the tls, tlsCa, tlsCert and tlsKey options"
            )
        if isinstance(exc, DeadlineExceededError):
            return EndpointError(
                f"the streamlog server at {self.endpoint} did not answer {what} within {self.timeout_s:g} s "
                "(raise the timeoutMs option if it is busy)"
            )
        if isinstance(exc, UnauthenticatedError | PermissionDeniedError):
            given = "with no token" if self.server.token is None else "with the token given"
            return EndpointError(
                f"the streamlog server at {self.endpoint} refused {what} {given} ({code}: {exc.details}); "
                f"set the token option or the {ENV_TOKEN} environment variable to a token allowed to {what}"
            )
        return ServerError(f"{what} failed on the streamlog server at {self.endpoint}: {code}: {exc.details}")

    def _refused(self, stream: str, details: str) -> ServerError:
        hint = ""
        if any(limit in details for limit in ("max_batch", "max_message_bytes")):
            hint = " (lower entriesPerAppend or bytesPerAppend to fit the server's limits)"
        return ServerError(
            f"the streamlog server at {self.endpoint} refused an append to {stream!r}: {details}{hint}"
        )

    def stream_state(self, stream: str) -> StreamInfo:
        return self._call("GetStreamInfo", stream, lambda: self._client.info(stream, timeout=self.timeout_s))

    def seek_time(self, stream: str, timestamp_ms: int) -> int:
        return self._call(
            "SeekTime", stream, lambda: self._client.seek(stream, timestamp_ms, timeout=self.timeout_s)
        )

    def in_sync_replicas(self, stream: str) -> list[str]:
        """The node ids of the stream's live in-sync replicas now; [] on a single server."""
        return self._call("DescribeCluster", stream, lambda: self._client.in_sync_replicas(stream))

    def _route(
        self, stream: str, replica: str | None, failure: StreamlogError | None = None, at: str = ""
    ) -> str:
        """Where a Read of `stream` goes: its leader (`replica` None), else node `replica` while it
        is a live in-sync replica of the stream, else another one. `failure`: how a Read sent to
        address `at` just failed (a redirect is learned, a failed replica passed over)."""
        if replica is None:
            return self._client.route(stream, failure)
        return self._client.replica_route(stream, failure, failed_at=at or None, replica=replica)

    def _read_bytes(self, request: pb.ReadRequest, replica: str | None) -> Any:
        """One Read, sent where _route() says, again after a redirect or a failover until answered
        or the deadline passes (as the Client's calls)."""
        attempts = Attempts(self.timeout_s)
        metadata = self._link.metadata if replica is None else self._link.replica_metadata
        failure: StreamlogError | None = None
        address = ""
        while True:
            address = self._route(request.stream, replica, failure, address)
            try:
                return self._link.read(address)(request, timeout=attempts.remaining(), metadata=metadata)
            except grpc.RpcError as exc:
                failure = from_rpc_error(exc)
                if not retryable("Read", request, exc):
                    raise failure from exc
                pause = attempts.pause(redirected=redirect_address(failure) is not None)
                if pause is None:
                    self._route(request.stream, replica, failure, address)  # the next call knows
                    raise failure from exc
            time.sleep(pause)

    def read(
        self,
        stream: str,
        offset: int,
        count: int,
        max_bytes: int,
        block_ms: int = 0,
        replica: str | None = None,
    ) -> bytes:
        """Entries of `stream` from `offset` as Read's reply bytes, from its leader, or with
        `replica` (a node id) from that in-sync replica (or another: Connection._route)."""
        request = pb.ReadRequest(
            stream=stream, offset=offset, count=count, max_bytes=max_bytes, block_ms=block_ms
        )
        try:
            return self._read_bytes(request, replica)  # retried within the deadline already
        except StreamlogError as exc:
            raise self._translate(exc, "Read", stream) from None

    def read_ahead(
        self, stream: str, offset: int, count: int, max_bytes: int, replica: str | None = None
    ) -> Callable[[], bytes]:
        """Start a Read now; the returned function waits for its reply.

        A task asks for its next reply before handing the current one to Spark,
        so the server prepares it meanwhile. A failed call is made again, with
        read()'s routing, retries and error messages.
        """
        request = pb.ReadRequest(stream=stream, offset=offset, count=count, max_bytes=max_bytes)
        address = self._route(stream, replica)
        metadata = self._link.metadata if replica is None else self._link.replica_metadata
        future = self._link.read(address).future(request, timeout=self.timeout_s, metadata=metadata)

        def result() -> bytes:
            try:
                return future.result()
            except grpc.RpcError as exc:
                self._route(stream, replica, from_rpc_error(exc), address)
                return self.read(stream, offset, count, max_bytes, replica=replica)

        return result

    def append(
        self, stream: str, producer_id: str, sequence: int, batch: Sequence[bytes] | Sequence[Record]
    ) -> AppendResult | None:
        """An idempotent append of payloads or Records; None when the server no longer remembers the sequence.

        The server refuses a sequence older than every one it remembers for the
        producer (FAILED_PRECONDITION). The connector sends a producer's
        sequences in order, each only after the one before was acknowledged, so
        a newer one being remembered proves this one was written by an earlier
        attempt of the same task.
        """
        delay = _FIRST_BACKOFF_S
        for attempt in range(_ATTEMPTS):
            try:
                return self._client.append(
                    stream, batch, producer_id=producer_id, producer_sequence=sequence, timeout=self.timeout_s
                )
            except StreamlogError as exc:
                if isinstance(exc, FailedPreconditionError) and "deduplication window" in exc.details:
                    return None
                if exc.retryable and attempt + 1 < _ATTEMPTS:
                    time.sleep(delay)
                    delay *= 2
                    continue
                if isinstance(exc, ResourceExhaustedError):
                    raise self._refused(stream, exc.details) from None
                raise self._translate(exc, "Append", None) from None
        raise AssertionError("unreachable: the last attempt returns or raises")
