"""The connector's calls to a streamlog server, made with the client library, and its errors.

Channels are the client library's (`clients._connection.open_channel`: plaintext,
TLS, mutual TLS, as `clients.Client` opens them) and every call carries the token
as Client's do. They are opened where the work happens (executor tasks, the
driver's planner process), never pickled, and kept per process and `Server`:
Spark reuses its Python workers, so later tasks skip the connection set-up and the
TLS handshake. The calls go through a `Client` on that channel, except Read,
whose replies stay bytes for pyspark_streamlog.wire to decode straight into Arrow.

Reads are retried on UNAVAILABLE (they change nothing). Appends are retried
only because every append the connector makes carries a producer id and
sequence, which makes a retry of a written batch a reported duplicate.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from streamlog.v1 import streamlog_pb2 as pb

from clients._connection import auth_metadata, open_channel
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


@dataclass(frozen=True, slots=True)
class _Link:
    """One process's channel to a server: a Client on it, and Read with replies left as bytes."""

    client: Client
    read: grpc.UnaryUnaryMultiCallable
    metadata: tuple[tuple[str, str], ...]


_lock = threading.Lock()
_links: dict[tuple[int, Server], _Link] = {}


def _link(server: Server) -> _Link:
    # Keyed by pid too: a forked worker must not use its parent's channel.
    key = (os.getpid(), server)
    with _lock:
        found = _links.get(key)
        if found is None:
            channel = open_channel(grpc, server.address, **server.tls_arguments())
            read = channel.unary_unary(
                _READ_METHOD, request_serializer=pb.ReadRequest.SerializeToString, response_deserializer=None
            )
            client = Client(server.address, channel=channel, token=server.token, timeout=None)
            found = _links[key] = _Link(client, read, auth_metadata(server.token))
        return found


class Connection:
    """The calls the connector makes, against one server, with a deadline per call."""

    def __init__(self, server: Server, timeout_s: float) -> None:
        self.server = server
        self.endpoint = server.address
        self.timeout_s = timeout_s
        link = _link(server)
        self._client = link.client
        self._read_raw = link.read
        self._metadata = link.metadata

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

    def _read_bytes(self, request: pb.ReadRequest) -> Any:
        try:
            return self._read_raw(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from exc

    def read(self, stream: str, offset: int, count: int, max_bytes: int) -> bytes:
        request = pb.ReadRequest(stream=stream, offset=offset, count=count, max_bytes=max_bytes)
        return self._call("Read", stream, lambda: self._read_bytes(request))

    def read_ahead(self, stream: str, offset: int, count: int, max_bytes: int) -> Callable[[], bytes]:
        """Start a Read now; the returned function waits for its reply.

        A task asks for its next reply before handing the current one to Spark,
        so the server prepares it meanwhile. A failed call is made again, with
        read()'s retries and error messages.
        """
        request = pb.ReadRequest(stream=stream, offset=offset, count=count, max_bytes=max_bytes)
        future = self._read_raw.future(request, timeout=self.timeout_s, metadata=self._metadata)

        def result() -> bytes:
            try:
                return future.result()
            except grpc.RpcError:
                return self.read(stream, offset, count, max_bytes)

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
