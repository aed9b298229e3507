"""Engine-wide and per-stream settings, validated when they are built."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from storage.errors import InvalidArgumentError
from storage.format import NODE_PREFIX_SIZE, SLOTTED_HEADER_SIZE
from storage.types import FsyncPolicy


def _fsync_policy(value: str) -> FsyncPolicy:
    try:
        return FsyncPolicy(value)
    except ValueError:
        choices = ", ".join(FsyncPolicy)
        raise InvalidArgumentError(f"fsync must be one of {choices}, not {value!r}") from None


def min_segment_bytes(node_entries: int, max_batch_entries: int, max_batch_bytes: int) -> int:
    """The smallest segment that holds the largest batch in one fresh node.

    Batches are atomic, so a batch never spans two segments: a fresh segment must take
    its header, a node prefix, an offset-table slot per entry and the batch's bytes.
    """
    return SLOTTED_HEADER_SIZE + NODE_PREFIX_SIZE + 4 * max(node_entries, max_batch_entries) + max_batch_bytes


SMALL_STREAMS = ("off", "slots")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    segment_bytes: int = 64 << 20
    node_entries: int = 1000
    max_entry_bytes: int = 1 << 20
    max_batch_entries: int = 10_000
    max_batch_bytes: int = 8 << 20
    max_tag_bytes: int = 1024
    fsync: FsyncPolicy = FsyncPolicy.EVERYSEC  # a string naming one is taken too
    compression: bool = True
    compression_level: int = 3
    cache_nodes: int = 256
    # Streams kept open (files and mappings); the least recently used close past it (storage/openstreams.py).
    max_open_streams: int = 1024
    background: bool = True  # a maintenance thread: everysec syncs, packing, retention, compaction
    maintenance_interval_ms: int = 1000
    compaction_interval_ms: int = 60_000
    # Idempotent appends: per stream, the last batches of each producer, for this long.
    dedup_window_ms: int = 600_000
    dedup_batches_per_producer: int = 32
    dedup_max_producers: int = 10_000
    # Consumer groups start passive (a cluster node's: they serve calls only where it leads,
    # storage/groupstore.py); False: active (a single server).
    groups_passive: bool = False
    # Streams start with retention and compaction passive (a cluster node's: a follower's copy
    # changes only as its leader's log does, storage/replicaapi.py); False: maintenance runs them.
    retention_passive: bool = False
    # "slots" (the default): a new small stream lives in a 4 KiB slot of a shared pack file, not a
    # directory of its own (storage/slothome.py); "off": every new stream is a directory, as
    # before docs/design/small-streams.md (streams already in slots stay readable).
    small_streams: str = "slots"

    def __post_init__(self) -> None:
        object.__setattr__(self, "fsync", _fsync_policy(self.fsync))
        if self.small_streams not in SMALL_STREAMS:
            raise InvalidArgumentError(
                f"small_streams must be one of {', '.join(SMALL_STREAMS)}, not {self.small_streams!r}"
            )
        for name in (
            "node_entries",
            "max_entry_bytes",
            "max_batch_entries",
            "max_batch_bytes",
            "cache_nodes",
            "max_open_streams",
        ):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name} must be at least 1")
        if not -7 <= self.compression_level <= 22:
            raise InvalidArgumentError("compression_level must be between -7 and 22")
        needed = min_segment_bytes(self.node_entries, self.max_batch_entries, self.max_batch_bytes)
        if self.segment_bytes < needed:
            raise InvalidArgumentError(
                f"segment_bytes={self.segment_bytes} cannot hold one full batch (batches are never split "
                f"across segments): with max_batch_bytes={self.max_batch_bytes} and max_batch_entries="
                f"{self.max_batch_entries} it must be at least {needed}; raise segment_bytes, or lower "
                f"max_batch_bytes to at most {self.segment_bytes - (needed - self.max_batch_bytes)}"
            )
        if self.max_entry_bytes > self.max_batch_bytes:
            raise InvalidArgumentError("max_entry_bytes cannot exceed max_batch_bytes")


@dataclass(frozen=True, kw_only=True)
class StreamConfig:
    """Per-stream policy. None means no limit (retention) or the engine default (fsync)."""

    max_entries: int | None = None  # keep at least this many, evicting whole nodes (RCP BACKLOG)
    max_age_ms: int | None = None
    max_bytes: int | None = None  # bytes on disk, evicting whole nodes
    compaction: bool = False  # keep only the latest entry per tag in sealed segments
    tombstone_retention_ms: int = 86_400_000
    fsync: FsyncPolicy | None = None

    def __post_init__(self) -> None:
        for name in ("max_entries", "max_age_ms", "max_bytes"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise InvalidArgumentError(f"{name} must not be negative")
        if self.tombstone_retention_ms < 0:
            raise InvalidArgumentError("tombstone_retention_ms must not be negative")
        if self.fsync is not None:
            object.__setattr__(self, "fsync", _fsync_policy(self.fsync))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> StreamConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


DEFAULT_STREAM_CONFIG = StreamConfig()  # a new stream's (frozen: one instance serves every stream)
