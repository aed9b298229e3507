"""gRPC calls to a streamlog server, with errors turned into the connector's own.

Channels are opened where the work happens (executor tasks, the driver's
planner process), never pickled, and kept per process and endpoint: Spark
reuses its Python workers, so later tasks skip the connection set-up.

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
from typing import TypeVar

import grpc
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from pyspark_streamlog.errors import EndpointError, ServerError, StreamNotFoundError

T = TypeVar("T")

# A full Read reply is up to the server's max_read_bytes (8 MiB by default, up
# to max_message_bytes) plus framing: accept anything the server may send.
_MESSAGE_LIMIT = 64 << 20
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", _MESSAGE_LIMIT),
    ("grpc.max_send_message_length", _MESSAGE_LIMIT),
]
_READ_METHOD = "/streamlog.v1.StreamLogService/Read"
# UNAVAILABLE covers a server that is starting, draining or briefly unreachable.
_ATTEMPTS = 5
_FIRST_BACKOFF_S = 0.2

_lock = threading.Lock()
_channels: dict[tuple[int, str], grpc.Channel] = {}


def _channel(endpoint: str) -> grpc.Channel:
    # Keyed by pid too: a forked worker must not use its parent's channel.
    key = (os.getpid(), endpoint)
    with _lock:
        found = _channels.get(key)
        if found is None:
            found = _channels[key] = grpc.insecure_channel(endpoint, options=_CHANNEL_OPTIONS)
        return found


@dataclass(frozen=True, slots=True)
class StreamState:
    first_offset: int
    next_offset: int


class Connection:
    """The calls the connector makes, against one endpoint, with a deadline per call."""

    def __init__(self, endpoint: str, timeout_s: float) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        channel = _channel(endpoint)
        self._stub = pb_grpc.StreamLogServiceStub(channel)
        # Read replies stay bytes: pyspark_streamlog.wire decodes them into columns.
        self._read_raw = channel.unary_unary(
            _READ_METHOD, request_serializer=pb.ReadRequest.SerializeToString, response_deserializer=None
        )

    def _call(self, what: str, stream: str | None, function: Callable[[], T], retry: bool = True) -> T:
        delay = _FIRST_BACKOFF_S
        for attempt in range(_ATTEMPTS):
            try:
                return function()
            except grpc.RpcError as exc:
                code = exc.code()
                if retry and code == grpc.StatusCode.UNAVAILABLE and attempt + 1 < _ATTEMPTS:
                    time.sleep(delay)
                    delay *= 2
                    continue
                raise self._translate(exc, what, stream) from None
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _translate(self, exc: grpc.RpcError, what: str, stream: str | None) -> Exception:
        code, details = exc.code(), exc.details()
        if code == grpc.StatusCode.NOT_FOUND and stream is not None:
            return StreamNotFoundError(
                f"stream {stream!r} does not exist on the streamlog server at {self.endpoint} "
                "(a stream is created by its first append)"
            )
        if code == grpc.StatusCode.UNAVAILABLE:
            return EndpointError(
                f"cannot reach the streamlog server at {self.endpoint} ({what}: UNAVAILABLE: {details}); "
                "check the endpoint option or the STREAMLOG_ADDRESS environment variable"
            )
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return EndpointError(
                f"the streamlog server at {self.endpoint} did not answer {what} within {self.timeout_s:g} s "
                "(raise the timeoutMs option if it is busy)"
            )
        return ServerError(
            f"{what} failed on the streamlog server at {self.endpoint}: {code.name}: {details}"
        )

    def _refused(self, stream: str, details: str) -> ServerError:
        hint = ""
        if any(limit in details for limit in ("max_batch", "max_message_bytes")):
            hint = " (lower entriesPerAppend or bytesPerAppend to fit the server's limits)"
        return ServerError(
            f"the streamlog server at {self.endpoint} refused an append to {stream!r}: {details}{hint}"
        )

    def stream_state(self, stream: str) -> StreamState:
        reply = self._call(
            "GetStreamInfo",
            stream,
            lambda: self._stub.GetStreamInfo(pb.GetStreamInfoRequest(stream=stream), timeout=self.timeout_s),
        )
        return StreamState(reply.info.first_offset, reply.info.next_offset)

    def seek_time(self, stream: str, timestamp_ms: int) -> int:
        request = pb.SeekTimeRequest(stream=stream, timestamp_ms=timestamp_ms)
        reply = self._call("SeekTime", stream, lambda: self._stub.SeekTime(request, timeout=self.timeout_s))
        return reply.offset

    def read(self, stream: str, offset: int, count: int, max_bytes: int) -> bytes:
        request = pb.ReadRequest(stream=stream, offset=offset, count=count, max_bytes=max_bytes)
        return self._call("Read", stream, lambda: self._read_raw(request, timeout=self.timeout_s))

    def read_ahead(self, stream: str, offset: int, count: int, max_bytes: int) -> Callable[[], bytes]:
        """Start a Read now; the returned function waits for its reply.

        A task asks for its next reply before handing the current one to Spark,
        so the server prepares it meanwhile. A failed call is made again, with
        read()'s retries and error messages.
        """
        request = pb.ReadRequest(stream=stream, offset=offset, count=count, max_bytes=max_bytes)
        future = self._read_raw.future(request, timeout=self.timeout_s)

        def result() -> bytes:
            try:
                return future.result()
            except grpc.RpcError:
                return self.read(stream, offset, count, max_bytes)

        return result

    def append(
        self,
        stream: str,
        producer_id: str,
        sequence: int,
        payloads: Sequence[bytes] | None = None,
        entries: Sequence[pb.Entry] | None = None,
    ) -> pb.AppendResponse | None:
        """An idempotent append; None when the server no longer remembers the sequence.

        The server refuses a sequence older than every one it remembers for the
        producer (FAILED_PRECONDITION). The connector sends a producer's
        sequences in order, each only after the one before was acknowledged, so
        a newer one being remembered proves this one was written by an earlier
        attempt of the same task.
        """
        request = pb.AppendRequest(
            stream=stream,
            payloads=payloads or (),
            entries=entries or (),
            producer_id=producer_id,
            producer_sequence=sequence,
        )
        delay = _FIRST_BACKOFF_S
        for attempt in range(_ATTEMPTS):
            try:
                return self._stub.Append(request, timeout=self.timeout_s)
            except grpc.RpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.FAILED_PRECONDITION and "deduplication window" in (
                    exc.details() or ""
                ):
                    return None
                if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and (
                    attempt + 1 < _ATTEMPTS
                ):
                    time.sleep(delay)
                    delay *= 2
                    continue
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise self._refused(stream, exc.details() or "") from None
                raise self._translate(exc, "Append", None) from None
        raise AssertionError("unreachable: the last attempt returns or raises")
