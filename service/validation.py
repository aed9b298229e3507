"""Checks of request fields that the engine cannot make (or makes with less helpful messages).

Each check raises `ServiceError` naming the field, so a client sees which part of
its request is wrong. Limits coerce the way AIP-158 does for page sizes: 0 means
the server's default, larger than the maximum means the maximum, negative is an
error.
"""

from __future__ import annotations

from service.config import MAX_STREAM_NAME_BYTES
from service.errors import invalid_argument
from storage import MAX_DURATION_MS


def name(field: str, value: str) -> str:
    """A stream or group name: 1..255 bytes of UTF-8, no NUL."""
    if not value:
        raise invalid_argument(f"{field}: must not be empty")
    size = len(value.encode())
    if size > MAX_STREAM_NAME_BYTES:
        raise invalid_argument(f"{field}: {size} bytes long; the limit is {MAX_STREAM_NAME_BYTES} bytes")
    if "\x00" in value:
        raise invalid_argument(f"{field}: must not contain NUL")
    return value


def stream(value: str) -> str:
    return name("stream", value)


def non_negative(field: str, value: int) -> int:
    if value < 0:
        raise invalid_argument(f"{field}: must not be negative, got {value}")
    return value


def bounded(field: str, value: int, default: int, maximum: int) -> int:
    """0 -> default; above maximum -> maximum; negative -> INVALID_ARGUMENT."""
    non_negative(field, value)
    if value == 0:
        return default
    return min(value, maximum)


def at_most(field: str, value: int, limit_name: str, limit: int) -> int:
    """A non-negative value that must not pass a configured limit (an error, not coerced)."""
    non_negative(field, value)
    if value > limit:
        raise invalid_argument(f"{field}: {value} passes the limit {limit_name}={limit}")
    return value


def duration_ms(field: str, value: int) -> int:
    """A duration the server adds to its clock (a retry, an expiry, a delay): 0..MAX_DURATION_MS.

    The sum is a due time, sent back as int64 and used to arm timers; past the bound it could
    overflow, and a value accepted now must not make later calls (GetPending) fail.
    """
    non_negative(field, value)
    if value > MAX_DURATION_MS:
        raise invalid_argument(
            f"{field}: {value} ms is past the limit of {MAX_DURATION_MS} ms (about 31,700 years)"
        )
    return value
