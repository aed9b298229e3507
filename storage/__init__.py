"""streamlog's storage engine: streams of entries in macro nodes inside segment files.

No gRPC, asyncio or protobuf here; usable from any script. See docs/FORMAT.md.
"""

from storage.config import EngineConfig, StreamConfig
from storage.engine import Engine
from storage.errors import (
    CorruptionError,
    DiskFullError,
    DurabilityError,
    GroupNotFoundError,
    InvalidArgumentError,
    LimitExceededError,
    OffsetMismatchError,
    PreconditionError,
    StorageError,
    StreamNotFoundError,
)
from storage.grouptypes import (
    MAX_DURATION_MS,
    AckResult,
    ConsumerInfo,
    GroupConfig,
    GroupCounters,
    GroupInfo,
    GroupReadOptions,
    GroupReadResult,
    NackResult,
    PendingInfo,
    PendingRow,
)
from storage.names import MAX_NAME_BYTES, InvalidNameError, validate_name
from storage.records import Entry
from storage.replica import ProducerMark, ReplicaChunk, ReplicaRun
from storage.results import AppendResult, EntriesMeta, Gap, ReadResult, StreamInfo
from storage.types import AppendBatch, FsyncPolicy, GapReason, StreamBounds

__all__ = [
    "MAX_DURATION_MS",
    "MAX_NAME_BYTES",
    "AckResult",
    "AppendBatch",
    "AppendResult",
    "ConsumerInfo",
    "CorruptionError",
    "DiskFullError",
    "DurabilityError",
    "Engine",
    "EngineConfig",
    "EntriesMeta",
    "Entry",
    "FsyncPolicy",
    "Gap",
    "GapReason",
    "GroupConfig",
    "GroupCounters",
    "GroupInfo",
    "GroupNotFoundError",
    "GroupReadOptions",
    "GroupReadResult",
    "InvalidArgumentError",
    "InvalidNameError",
    "LimitExceededError",
    "NackResult",
    "OffsetMismatchError",
    "PendingInfo",
    "PendingRow",
    "PreconditionError",
    "ProducerMark",
    "ReadResult",
    "ReplicaChunk",
    "ReplicaRun",
    "StorageError",
    "StreamBounds",
    "StreamConfig",
    "StreamInfo",
    "StreamNotFoundError",
    "validate_name",
]
