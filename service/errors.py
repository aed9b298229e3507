"""Errors -> gRPC status codes, in one place.

Handlers raise: `ServiceError` for requests the service refuses itself, or let the
engine's `StorageError`s through. The `translate_errors` decorator turns either into
`context.abort(code, message)`, so every RPC answers the same code for the same
cause, and a bug becomes INTERNAL (logged with its traceback) instead of leaking a
Python exception text to clients.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn

import grpc

from storage.errors import (
    CorruptionError,
    DiskFullError,
    DurabilityError,
    InvalidArgumentError,
    LimitExceededError,
    OffsetMismatchError,
    PreconditionError,
    StorageError,
    StreamNotFoundError,
)

log = logging.getLogger(__name__)

# Most specific first: the first class an error is an instance of decides its code.
_STORAGE_CODES: tuple[tuple[type[StorageError], grpc.StatusCode], ...] = (
    (InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
    (StreamNotFoundError, grpc.StatusCode.NOT_FOUND),
    (LimitExceededError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DiskFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (PreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    # Appends are refused after a failed fsync until restart; reads still work, and
    # another replica may take the write: UNAVAILABLE is the retryable answer.
    (DurabilityError, grpc.StatusCode.UNAVAILABLE),
    (CorruptionError, grpc.StatusCode.DATA_LOSS),
)


class ServiceError(Exception):
    """A request refused by the service itself, with the status code to answer."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid_argument(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)


def not_found(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.NOT_FOUND, message)


def limit_exceeded(limit: str, value: int, message: str) -> ServiceError:
    """A request past a configured limit; the message names the limit the way the engine does."""
    return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{message} (limit {limit}={value})")


def unavailable(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.UNAVAILABLE, message)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message to answer for an exception raised by a handler."""
    if isinstance(exc, ServiceError):
        return exc.code, exc.message
    if isinstance(exc, StorageError):
        for cls, code in _STORAGE_CODES:
            if isinstance(exc, cls):
                return code, str(exc)
        return grpc.StatusCode.INTERNAL, f"storage error: {exc}"
    return grpc.StatusCode.INTERNAL, "internal error; the server log has the details"


NEXT_OFFSET_TRAILER = "streamlog-next-offset"


def trailers_for(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """Machine-readable details for clients: a failed conditional append says where the stream is."""
    if isinstance(exc, OffsetMismatchError):
        return ((NEXT_OFFSET_TRAILER, str(exc.end_offset)),)
    return ()


def _log_unexpected(method: str, exc: BaseException) -> None:
    if not isinstance(exc, ServiceError | StorageError):
        log.error("%s failed unexpectedly", method, exc_info=exc)


async def abort_for(context: Any, method: str, exc: Exception) -> NoReturn:
    """End the call of `method` with the status for `exc`, raised by its handler (an abort the
    handler made goes on as it is): what translate_errors does, for a handler that catches its
    own errors (Append: one coroutine layer less on the hottest call)."""
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    _log_unexpected(method, exc)
    await context.abort(*status_for(exc), trailing_metadata=trailers_for(exc))
    raise AssertionError("context.abort returned")  # it raises AbortError


def translate_errors(handler: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a servicer method (coroutine or async generator) so errors become statuses."""
    name = handler.__name__

    if inspect.isasyncgenfunction(handler):

        @functools.wraps(handler)
        async def stream_wrapper(self: Any, request: Any, context: Any) -> AsyncIterator[Any]:
            try:
                async for response in handler(self, request, context):
                    yield response
            except Exception as exc:
                await abort_for(context, name, exc)

        return stream_wrapper

    @functools.wraps(handler)
    async def unary_wrapper(self: Any, request: Any, context: Any) -> Any:
        try:
            return await handler(self, request, context)
        except Exception as exc:
            await abort_for(context, name, exc)

    return unary_wrapper
