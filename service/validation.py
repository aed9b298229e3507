"""Checks of request fields that the engine cannot make (or makes with less helpful messages).

Each check raises `ServiceError` naming the field, so a client sees which part of
its request is wrong. Limits coerce the way AIP-158 does for page sizes: 0 means
the server's default, larger than the maximum means the maximum, negative is an
error.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import grpc
from streamlog.v1 import streamlog_pb2 as pb

from service.errors import ServiceError, invalid_argument, limit_exceeded
from storage import MAX_DURATION_MS, Engine, InvalidNameError, validate_name


def name(field: str, value: str) -> str:
    """A stream, group or consumer name, by the engine's rule (1..255 bytes of UTF-8, no NUL)."""
    try:
        validate_name(value, field)
    except InvalidNameError as exc:
        raise invalid_argument(f"{field}: {exc.problem}") from None
    return value


# A stream name, checked: `name` without a call of its own (every append checks one).
stream = functools.partial(name, "stream")


def non_negative(field: str, value: int) -> int:
    if value < 0:
        raise invalid_argument(f"{field}: must not be negative, got {value}")
    return value


def positive(field: str, value: int) -> int:
    """A limit that is unset when not wanted, and must be above 0 when set."""
    if value <= 0:
        raise invalid_argument(f"{field}: must be positive when set, got {value}")
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


def ack_items(
    offsets: Sequence[int], ranges: Sequence[pb.OffsetRange], names: tuple[str, str], limit: int
) -> tuple[list[int], list[tuple[int, int]]]:
    """Offsets and [start, end) ranges to acknowledge: at most `limit` (max_ack_offsets) items,
    none negative, no range ending before it starts."""
    items = len(offsets) + len(ranges)
    if items > limit:
        raise limit_exceeded("max_ack_offsets", limit, f"{', '.join(names)}: {items} items in one call")
    if offsets and min(offsets) < 0:
        raise invalid_argument(f"{names[0]}: must not be negative")
    for index, span in enumerate(ranges):
        offset_range(f"{names[1]}[{index}]", span.start_offset, span.end_offset)
    return list(offsets), [(span.start_offset, span.end_offset) for span in ranges]


def offsets(values: Sequence[int], limit: int) -> list[int]:
    """The offsets of a Nack or Claim: at least one, none negative, at most `limit` (max_ack_offsets)."""
    if not values:
        raise invalid_argument("offsets: at least one offset is required")
    if len(values) > limit:
        raise limit_exceeded("max_ack_offsets", limit, f"offsets: {len(values)} offsets in one call")
    if min(values) < 0:
        raise invalid_argument("offsets: must not be negative")
    return list(values)


def offset_range(where: str, start: int, end: int | None) -> tuple[int, int | None]:
    """A range of offsets [start, end) (end None: to the stream's end): start not negative, end not
    before it. `where` names the range in its request, "" for the request's own fields."""
    non_negative(f"{where}.start_offset" if where else "start_offset", start)
    if end is not None and end < start:
        head = f"{where}: end_offset" if where else "end_offset:"
        raise invalid_argument(f"{head} {end} is before start_offset {start}")
    return start, end


def not_past_end(engine: Engine, stream: str, field: str, offset: int) -> int:
    """An offset `stream` has reached: at most its end. Past it is OUT_OF_RANGE, not INVALID_ARGUMENT:
    the stream may get there later, so the request is not malformed."""
    end = engine.bounds(stream).end_offset
    if offset > end:
        raise ServiceError(
            grpc.StatusCode.OUT_OF_RANGE,
            f"{field}: {offset} is past the end of stream {stream!r} (next_offset {end})",
        )
    return offset
