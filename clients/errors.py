"""The exceptions the streamlog clients raise: one class per status code a caller may act on.

Every error that comes from a call is a `StreamlogError` carrying the status
`code` and the server's `details`; the original `grpc.RpcError` is kept as
`__cause__` (the clients `raise ... from` it), so nothing the server said is lost.
`TransientError` marks the two codes a retry may cure (UNAVAILABLE, DEADLINE_EXCEEDED).
"""

from __future__ import annotations

from typing import Any

import grpc

# Set by the server on a failed conditional append: the stream's actual next offset.
NEXT_OFFSET_TRAILER = "streamlog-next-offset"


class StreamlogError(Exception):
    """A streamlog call failed. `code` is the gRPC status (None for client-side errors)."""

    retryable = False

    def __init__(self, details: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(f"{code.name}: {details}" if code is not None else details)
        self.code = code
        self.details = details


class InvalidArgumentError(StreamlogError):
    """The request is malformed (bad name, negative number, conflicting fields)."""


class NotFoundError(StreamlogError):
    """The stream, group or consumer does not exist."""


class AlreadyExistsError(StreamlogError):
    """The thing to create exists already (e.g. a consumer group of that name)."""


class FailedPreconditionError(StreamlogError):
    """The stream's state does not allow the operation."""


class OffsetMismatchError(FailedPreconditionError):
    """A conditional append found the stream elsewhere than `expected_next_offset`.

    `next_offset` is where the stream actually is (from the server's trailer), so a
    caller can re-read from there, re-decide and try again.
    """

    def __init__(self, details: str, code: grpc.StatusCode | None, next_offset: int) -> None:
        super().__init__(details, code)
        self.next_offset = next_offset


class OutOfRangeError(StreamlogError):
    """An offset past the end of the stream (e.g. trimming beyond it)."""


class ResourceExhaustedError(StreamlogError):
    """A server limit (named in the details) or a full disk."""


class DataLossError(StreamlogError):
    """Stored bytes failed their checksum on the server."""


class UnauthenticatedError(StreamlogError):
    """The call carried no valid credentials."""


class PermissionDeniedError(StreamlogError):
    """The credentials do not allow this call."""


class CancelledError(StreamlogError):
    """The call was cancelled."""


class TransientError(StreamlogError):
    """A failure that retrying (with backoff) may cure."""

    retryable = True


class UnavailableError(TransientError):
    """The server is starting, draining or unreachable."""


class DeadlineExceededError(TransientError):
    """The call's timeout passed before the server answered."""


class GapError(StreamlogError):
    """Entries a reader was due to get no longer exist (evicted, compacted, corrupt).

    Raised by `Subscription.entries()` when no `on_gap` handler is given, so that
    missing entries are never skipped silently.
    """

    def __init__(self, gap: Any) -> None:
        super().__init__(
            f"offsets {gap.start_offset}..{gap.end_offset - 1} are missing ({gap.reason}); "
            "pass on_gap to continue past gaps"
        )
        self.gap = gap


class ProducerClosedError(StreamlogError):
    """`Producer.send` after `close()`."""


_BY_CODE: dict[grpc.StatusCode, type[StreamlogError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.OUT_OF_RANGE: OutOfRangeError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.DATA_LOSS: DataLossError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.CANCELLED: CancelledError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
}


def _trailer(error: Any, key: str) -> str | None:
    try:
        metadata = error.trailing_metadata() or ()
    except (AttributeError, TypeError, ValueError):
        return None
    # Sync calls give tuples of (key, value); grpc.aio gives a Metadata object that
    # iterates the same way.
    for item in metadata:
        name, value = item
        if name == key:
            return value.decode() if isinstance(value, bytes) else str(value)
    return None


def from_rpc_error(error: grpc.RpcError) -> StreamlogError:
    """The StreamlogError for a failed call, with the original as its `__cause__` (also when a
    session keeps it to raise later: a client reads the leader's address from its trailers)."""
    converted = _converted(error)
    converted.__cause__ = error
    return converted


def _converted(error: grpc.RpcError) -> StreamlogError:
    try:
        code = error.code()
        details = error.details() or ""
    except AttributeError:
        # An RpcError that is not a Call (raised by an interceptor, for instance).
        return StreamlogError(str(error) or type(error).__name__)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        next_offset = _trailer(error, NEXT_OFFSET_TRAILER)
        if next_offset is not None and next_offset.lstrip("-").isdigit():
            return OffsetMismatchError(details, code, int(next_offset))
    return _BY_CODE.get(code, StreamlogError)(details, code)


def from_status(code: int, details: str) -> StreamlogError:
    """The StreamlogError for a status given as its number (a Publish message's `error`)."""
    status = _BY_NUMBER.get(code)
    return _BY_CODE.get(status, StreamlogError)(details, status) if status else StreamlogError(details)


_BY_NUMBER = {status.value[0]: status for status in grpc.StatusCode}
