"""What an append must pass before anything is written.

The engine checks every batch against its limits (entries, bytes, tag and
header sizes) and the shape of its columns, and an idempotent append's
producer id and sequence, so that nothing a caller sends can reach the
encoder half-valid: a refused batch changes nothing.
"""

from __future__ import annotations

from storage.config import EngineConfig
from storage.errors import InvalidArgumentError, LimitExceededError
from storage.types import AppendBatch

MAX_PRODUCER_ID_BYTES = 255


def check_expected_end(expected_end: int | None) -> None:
    if expected_end is not None and (not isinstance(expected_end, int) or expected_end < 0):
        raise InvalidArgumentError("expected_end must be a non-negative integer")


def check_producer(producer: tuple[str, int] | None) -> tuple[str, int] | None:
    """The (producer id, sequence) of an idempotent append, checked; None for a plain one."""
    if producer is None:
        return None
    producer_id, sequence = producer
    if not producer_id or not isinstance(producer_id, str) or sequence is None:
        raise InvalidArgumentError("an idempotent append needs both a producer id and a sequence")
    try:
        size = len(producer_id.encode())
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError("producer id is not valid UTF-8") from exc
    if size > MAX_PRODUCER_ID_BYTES:
        raise InvalidArgumentError(f"producer id is {size} bytes; the limit is {MAX_PRODUCER_ID_BYTES}")
    if not isinstance(sequence, int) or sequence < 0:
        raise InvalidArgumentError("producer sequence must be a non-negative integer")
    return producer_id, sequence


def check_batch(cfg: EngineConfig, batch: AppendBatch) -> None:
    """A batch within the engine's limits, its columns as long as its payloads and of the right types."""
    payloads, tags, headers, deliver_at_ms = (
        batch.payloads,
        batch.tags,
        batch.headers,
        batch.deliver_at_ms,
    )
    n = len(payloads)
    if n == 0:
        raise InvalidArgumentError("a batch needs at least one entry")
    if n > cfg.max_batch_entries:
        raise LimitExceededError("max_batch_entries", cfg.max_batch_entries, f"batch has {n} entries")
    try:
        if n == 1:  # one entry (most unary Appends): no map, no sum
            biggest = total = len(payloads[0])
        else:
            total = sum(map(len, payloads))
            biggest = max(map(len, payloads))
    except TypeError as exc:
        raise InvalidArgumentError("payloads must be bytes") from exc
    if biggest > cfg.max_entry_bytes:
        raise LimitExceededError("max_entry_bytes", cfg.max_entry_bytes, f"an entry has {biggest} bytes")
    if total > cfg.max_batch_bytes:
        raise LimitExceededError("max_batch_bytes", cfg.max_batch_bytes, f"batch has {total} payload bytes")
    if tags is None and headers is None and deliver_at_ms is None:
        return  # payloads only (most appends): no column to check
    for column, label in ((tags, "tags"), (headers, "headers"), (deliver_at_ms, "deliver_at_ms")):
        if column is not None and len(column) != n:
            raise InvalidArgumentError(f"{label} has {len(column)} items for {n} payloads")
    if tags is not None:
        for tag in tags:
            if not isinstance(tag, str):
                raise InvalidArgumentError("tags must be strings")
            try:
                size = len(tag.encode())
            except UnicodeEncodeError as exc:
                raise InvalidArgumentError("a tag is not valid UTF-8") from exc
            if size > cfg.max_tag_bytes:
                raise LimitExceededError("max_tag_bytes", cfg.max_tag_bytes, f"a tag has {size} bytes")
    if headers is not None:
        for entry_headers in headers:
            if not entry_headers:
                continue
            size = 0
            for key, value in entry_headers.items():
                if not isinstance(key, str) or not isinstance(value, (bytes, bytearray, memoryview)):
                    raise InvalidArgumentError("headers map strings to bytes")
                try:
                    size += len(key.encode()) + len(value)
                except UnicodeEncodeError as exc:
                    raise InvalidArgumentError("a header name is not valid UTF-8") from exc
            if size > cfg.max_entry_bytes:
                raise LimitExceededError("max_entry_bytes", cfg.max_entry_bytes, f"headers take {size} bytes")
    if deliver_at_ms is not None and any(not isinstance(d, int) or d < 0 for d in deliver_at_ms):
        raise InvalidArgumentError("deliver_at_ms must be non-negative integers")
