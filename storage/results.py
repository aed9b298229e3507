"""What the engine's calls return."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from storage.config import StreamConfig
from storage.records import Entry, decode_records
from storage.types import GapReason


class AppendResult(NamedTuple):
    """Where an append's entries went. A named tuple: one is built per append, and a frozen
    dataclass's construction costs twice the instructions (object.__setattr__ per field)."""

    first_offset: int
    last_offset: int
    timestamp_ms: int
    duplicate: bool = False  # an idempotent retry: these are the offsets of the first attempt


@dataclass(frozen=True, slots=True)
class Gap:
    """Offsets start_offset..end_offset-1 that a read asked for and that no longer exist."""

    start_offset: int
    end_offset: int
    reason: GapReason


class EntriesMeta(NamedTuple):  # a tuple: made on every group read
    """What the node headers say of a range of entries, without reading a record.

    Both are over the whole nodes that overlap the range, so they bound it: no
    entry in the range is newer than `max_timestamp_ms`, and none carries
    `deliver_at_ms` unless `delayed`.
    """

    delayed: bool
    max_timestamp_ms: int


@dataclass(slots=True)
class ReadResult:
    """Entries as encoded records (see storage.records), plus the stream's bounds.

    `records` concatenated are the wire bytes of `repeated Entry entries = 1`.
    `next_offset` is where the reader continues: forward, after the last entry
    returned (or after the gap, or where it asked when there is nothing); in
    reverse, before the last entry returned, or -1 when nothing older remains.
    """

    records: list[bytes]
    count: int
    first_offset: int
    end_offset: int  # the stream's end: the offset the next append will take
    next_offset: int
    gap: Gap | None = None
    last_offset: int | None = None

    def data(self) -> bytes:
        return b"".join(self.records)

    def entries(self) -> list[Entry]:
        return decode_records(self.data())


@dataclass(frozen=True, slots=True)
class StreamInfo:
    name: str
    first_offset: int
    end_offset: int
    entries_added: int
    entries: int
    bytes_on_disk: int  # file sizes, the space growing segments reserved ahead included
    used_bytes: int  # bytes holding headers and nodes
    segments: int
    packed_segments: int  # full segments rewritten packed; compression_ratio covers these
    nodes: int
    compression_ratio: float
    last_timestamp_ms: int
    config: StreamConfig = field(default_factory=StreamConfig)
    damaged: tuple[Gap, ...] = ()
