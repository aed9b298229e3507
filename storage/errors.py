"""Errors the engine raises. The service maps each class to one gRPC status."""

from __future__ import annotations


class StorageError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidArgumentError(StorageError):
    """The caller asked for something malformed: a bad name, size, count or offset."""


class StreamNotFoundError(StorageError):
    """The named stream does not exist."""


class GroupNotFoundError(StreamNotFoundError):
    """The named consumer group does not exist on the stream.

    A kind of StreamNotFoundError so that callers mapping "not found" (the
    service's NOT_FOUND) treat both alike.
    """


class LimitExceededError(StorageError):
    """A configured limit would be passed; the message names the limit and its value."""

    def __init__(self, limit: str, value: int, message: str) -> None:
        super().__init__(f"{message} (limit {limit}={value})")
        self.limit = limit
        self.value = value


class PreconditionError(StorageError):
    """The request is well formed but the stream's state does not allow it."""


class OffsetMismatchError(PreconditionError):
    """A conditional append expected the stream to be at another offset."""

    def __init__(self, expected: int, end_offset: int) -> None:
        # "next offset" in the message: the wire's name for the stream's end (expected_next_offset).
        super().__init__(f"the stream's next offset is {end_offset}, not the expected {expected}")
        self.expected = expected
        self.end_offset = end_offset


class DiskFullError(StorageError):
    """No space left to create or grow a file. Nothing was written."""


class DurabilityError(StorageError):
    """A sync failed: the engine stops accepting appends until it is restarted."""


class CorruptionError(StorageError):
    """Bytes on disk failed a check: bad magic, version, length or CRC."""
