"""Typed values the clients take and return, instead of raw protobuf messages.

Plain frozen dataclasses: they print well, compare by value and hold no reference
to gRPC objects. Offsets and times are ints (times in ms since the Unix epoch,
server clock), as on the wire.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

GapReason = Literal["evicted", "compacted", "corrupt", "unspecified"]
FsyncPolicy = Literal["always", "everysec", "no"]
# Where a subscription or a consumer group starts: an offset, or one of these words.
Start = int | Literal["oldest", "latest"]


@dataclass(frozen=True, slots=True)
class Record:
    """An entry to append when it carries more than a payload (a tag, headers, a delivery time)."""

    payload: bytes
    tag: str = ""
    headers: Mapping[str, bytes] | None = None
    # Consumer groups do not deliver the entry before this time (0: at once).
    deliver_at_ms: int = 0


@dataclass(frozen=True, slots=True)
class Entry:
    """An entry read from a stream."""

    offset: int
    timestamp_ms: int
    payload: bytes
    tag: str = ""
    headers: Mapping[str, bytes] = field(default_factory=dict)
    deliver_at_ms: int = 0
    # Group reads and claims: how many times the group has delivered it (1 the first
    # time). 0 for plain reads and subscriptions.
    delivery_count: int = 0


@dataclass(frozen=True, slots=True)
class Gap:
    """A half-open range of offsets whose entries will never be returned, and why."""

    start_offset: int
    end_offset: int
    reason: GapReason

    @property
    def count(self) -> int:
        return self.end_offset - self.start_offset


@dataclass(frozen=True, slots=True)
class AppendResult:
    """Where a batch was written. `duplicate`: a retried idempotent batch, written before."""

    first_offset: int
    last_offset: int
    timestamp_ms: int
    duplicate: bool = False

    @property
    def count(self) -> int:
        return self.last_offset - self.first_offset + 1

    @property
    def offsets(self) -> range:
        return range(self.first_offset, self.last_offset + 1)


@dataclass(frozen=True, slots=True)
class ReadResult:
    """One Read reply, one Subscribe batch or one Consume batch.

    `next_offset` is where to continue (forward reads and subscriptions), `end_offset`
    the stream's end when the batch was read, `gap` the missing range the batch starts
    after, if any. Group reads and Consume batches also report the acknowledgements
    applied (since the previous reply, for a session) and whether the group's pending
    list is full.
    """

    entries: list[Entry]
    first_offset: int
    next_offset: int
    end_offset: int
    gap: Gap | None = None
    acknowledged: int = 0
    ack_unknown: int = 0
    pending_full: bool = False

    @property
    def lag(self) -> int:
        """How many entries the reader is behind the end of the stream, after this batch."""
        return max(self.end_offset - self.next_offset, 0)

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries)


@dataclass(frozen=True, slots=True)
class StreamConfig:
    """A stream's settings. None means "no limit" (retention) or "the server's" (fsync)."""

    max_entries: int | None = None
    max_age_ms: int | None = None
    max_bytes: int | None = None
    compaction: bool = False
    tombstone_retention_ms: int | None = None
    fsync: FsyncPolicy | None = None


@dataclass(frozen=True, slots=True)
class RetentionHolder:
    """The consumer group keeping retention from evicting entries at or after `offset`."""

    group: str
    offset: int


@dataclass(frozen=True, slots=True)
class StreamInfo:
    """A snapshot of one stream's state."""

    name: str
    first_offset: int
    next_offset: int
    entries_added: int
    entries: int
    bytes_on_disk: int
    segments: int
    nodes: int
    compression_ratio: float
    last_timestamp_ms: int
    config: StreamConfig
    effective_fsync: FsyncPolicy | None
    damaged: list[Gap] = field(default_factory=list)
    groups: int = 0
    retention_holder: RetentionHolder | None = None
    # Bytes of bytes_on_disk holding entries (the rest is preallocated), and how many
    # segments are packed (compression_ratio covers those; none yet while 0).
    used_bytes: int = 0
    packed_segments: int = 0


@dataclass(frozen=True, slots=True)
class AckResult:
    """Entries now acknowledged, and offsets named that were not pending."""

    acknowledged: int
    unknown: int = 0


@dataclass(frozen=True, slots=True)
class NackResult:
    """Entries released for redelivery, and offsets named that were not pending."""

    released: int
    unknown: int = 0


@dataclass(frozen=True, slots=True)
class GroupConfig:
    """A consumer group's policy. None means "no limit" / "not used"."""

    retry_ms: int | None = None
    expire_ms: int | None = None
    max_deliveries: int | None = None
    max_pending: int | None = None
    dead_letter_stream: str = ""
    delay_ms: int = 0
    retention_hold: bool = False
    idle_release_ms: int | None = None


@dataclass(frozen=True, slots=True)
class ConsumerInfo:
    name: str
    pending: int
    seen_ms: int
    active_ms: int | None = None


@dataclass(frozen=True, slots=True)
class GroupCounters:
    delivered: int = 0
    redelivered: int = 0
    acked: int = 0
    ack_unknown: int = 0
    expired: int = 0
    dead_lettered: int = 0
    evicted: int = 0


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """A snapshot of one consumer group. `lag` is None when it cannot be known (as in Redis)."""

    stream: str
    name: str
    config: GroupConfig
    next_offset: int
    entries_read: int
    lag: int | None
    entries_added: int
    pending: int
    scheduled: int = 0
    consumers: list[ConsumerInfo] = field(default_factory=list)
    counters: GroupCounters = field(default_factory=GroupCounters)
    created_ms: int = 0
    active_ms: int = 0
    hold_offset: int = 0
    holds_retention: bool = False


@dataclass(frozen=True, slots=True)
class PendingEntry:
    """One pending entry: its owner ("" when released), idle time and delivery count."""

    offset: int
    consumer: str
    idle_ms: int
    delivery_count: int
    due_ms: int | None = None


@dataclass(frozen=True, slots=True)
class PendingInfo:
    """A group's pending list: a summary, and the detail rows asked for."""

    count: int
    lowest_offset: int | None
    highest_offset: int | None
    consumers: dict[str, int]
    released: int
    entries: list[PendingEntry]


@dataclass(frozen=True, slots=True)
class ClaimResult:
    """Entries a claim took over (with their delivery counts), and offsets that left for good.

    `next_cursor` continues an auto-claim scan; 0 when it is over (and for Claim).
    """

    entries: list[Entry]
    deleted_offsets: list[int] = field(default_factory=list)
    next_cursor: int = 0


@dataclass(frozen=True, slots=True)
class ClusterNode:
    """A server of the cluster. `address`, `version` and `started_ms` are empty (0) when not alive."""

    id: str
    address: str
    alive: bool
    controller: bool = False
    version: str = ""
    started_ms: int = 0


@dataclass(frozen=True, slots=True)
class ReplicaProgress:
    """How far one replica of a stream has come: its log end, and its lag behind the leader."""

    node: str
    log_end_offset: int
    lag_ms: int


@dataclass(frozen=True, slots=True)
class StreamPlacement:
    """Where a stream lives. `leader` is "" while it has none; `high_watermark` and `progress`
    are None and empty until the servers report them (replication); `target_replicas` is
    empty unless the stream is being moved."""

    name: str
    leader: str
    replicas: list[str]
    in_sync_replicas: list[str]
    leader_epoch: int
    replication_factor: int
    acks: str
    high_watermark: int | None = None
    progress: list[ReplicaProgress] = field(default_factory=list)
    # While a move is under way (reassign_replicas): the replicas it moves the stream to.
    target_replicas: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ClusterDescription:
    """The cluster as one node sees it. A single server: one node, `cluster_name` "", no streams."""

    cluster_name: str
    node_id: str
    nodes: list[ClusterNode]
    streams: list[StreamPlacement]


# What append() takes: one payload, Record or Entry, or an iterable of them (a batch).
AppendData = bytes | Record | Entry | Iterable[bytes | Record | Entry]


@dataclass(frozen=True, slots=True)
class Batch:
    """One stream's batch of an append_many() call, with an append()'s options."""

    stream: str
    data: AppendData
    producer_id: str | None = None
    producer_sequence: int | None = None
    expected_next_offset: int | None = None


# Acknowledgement ranges: half-open (start, end) pairs or Python ranges.
Ranges = Iterable[tuple[int, int] | range]
