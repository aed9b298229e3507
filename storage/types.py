"""The engine's small shared vocabulary: policies, reasons, bounds and the append batch.

These are what callers above storage (the service, groups, replication) name
when they talk to the engine, so they live apart from any one module's code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum


class FsyncPolicy(StrEnum):
    """When an append is made durable (Redis `appendfsync`)."""

    ALWAYS = "always"  # before the append returns; concurrent appends share one sync
    EVERYSEC = "everysec"  # by the maintenance thread, about once a second
    NO = "no"  # when the operating system decides

    # Whether a call that waits for this stream's sync may block (the service then runs it in a
    # thread): an attribute of each member, not a property (every Append reads it).
    blocks: bool

    def __init__(self, value: str) -> None:
        self.blocks = value == "always"


class GapReason(StrEnum):
    """Why a range of offsets has no entries."""

    EVICTED = "evicted"  # retention or a trim removed them
    COMPACTED = "compacted"  # compaction kept a newer entry of the same tag
    CORRUPT = "corrupt"  # their stored bytes failed their checks


@dataclass(frozen=True, slots=True)
class StreamBounds:
    """A stream's retained range: entries first_offset..end_offset-1 (minus holes)."""

    first_offset: int
    end_offset: int  # the offset the next append will take


@dataclass(slots=True)
class AppendBatch:
    """The entries of one append, as parallel columns; an optional column is None when unused.

    Not frozen, though nothing changes one once made: every append builds one, and a frozen
    dataclass sets each field through object.__setattr__ (three times the instructions)."""

    payloads: Sequence[bytes]
    tags: Sequence[str] | None = None
    headers: Sequence[Mapping[str, bytes] | None] | None = None
    deliver_at_ms: Sequence[int] | None = None

    def __len__(self) -> int:
        return len(self.payloads)
