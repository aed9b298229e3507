"""streamlog clients: the Python client library and the `streamlog` command.

    from clients import Client, AsyncClient, Producer, Consumer, Record

They talk to a server over gRPC only (the layering rule of docs: clients never
import `service`); the one exception is the CLI's offline `inspect`, which calls
the storage engine's inspector on segment files.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Names are loaded on first use, so that `streamlog --help` and `streamlog serve`
# (clients/cli.py) work without importing gRPC or the generated code.
_EXPORTS = {
    "AckResult": "clients.types",
    "AlreadyExistsError": "clients.errors",
    "AppendResult": "clients.types",
    "AsyncClient": "clients.aio",
    "AsyncConsumeSession": "clients.aio",
    "AsyncPublishSession": "clients.aio",
    "AsyncSubscription": "clients.aio",
    "Batch": "clients.types",
    "CancelledError": "clients.errors",
    "ClaimResult": "clients.types",
    "Client": "clients.client",
    "ClusterDescription": "clients.types",
    "ClusterNode": "clients.types",
    "ConsumeSession": "clients.client",
    "PublishSession": "clients.client",
    "Consumer": "clients.consumer",
    "ConsumerInfo": "clients.types",
    "DataLossError": "clients.errors",
    "DeadlineExceededError": "clients.errors",
    "Entry": "clients.types",
    "FailedPreconditionError": "clients.errors",
    "Gap": "clients.types",
    "GapError": "clients.errors",
    "GroupConfig": "clients.types",
    "GroupCounters": "clients.types",
    "GroupInfo": "clients.types",
    "InvalidArgumentError": "clients.errors",
    "Message": "clients.consumer",
    "NackResult": "clients.types",
    "NotFoundError": "clients.errors",
    "OffsetMismatchError": "clients.errors",
    "OutOfRangeError": "clients.errors",
    "PendingEntry": "clients.types",
    "PendingInfo": "clients.types",
    "PermissionDeniedError": "clients.errors",
    "Producer": "clients.producer",
    "ProducerClosedError": "clients.errors",
    "ReadResult": "clients.types",
    "Record": "clients.types",
    "ReplicaProgress": "clients.types",
    "ResourceExhaustedError": "clients.errors",
    "RetentionHolder": "clients.types",
    "StreamConfig": "clients.types",
    "StreamInfo": "clients.types",
    "StreamPlacement": "clients.types",
    "StreamlogError": "clients.errors",
    "Subscription": "clients.client",
    "TransientError": "clients.errors",
    "UnauthenticatedError": "clients.errors",
    "UnavailableError": "clients.errors",
}

__all__ = [
    "AckResult",
    "AlreadyExistsError",
    "AppendResult",
    "AsyncClient",
    "AsyncConsumeSession",
    "AsyncPublishSession",
    "AsyncSubscription",
    "Batch",
    "CancelledError",
    "ClaimResult",
    "Client",
    "ClusterDescription",
    "ClusterNode",
    "ConsumeSession",
    "Consumer",
    "ConsumerInfo",
    "DataLossError",
    "DeadlineExceededError",
    "Entry",
    "FailedPreconditionError",
    "Gap",
    "GapError",
    "GroupConfig",
    "GroupCounters",
    "GroupInfo",
    "InvalidArgumentError",
    "Message",
    "NackResult",
    "NotFoundError",
    "OffsetMismatchError",
    "OutOfRangeError",
    "PendingEntry",
    "PendingInfo",
    "PermissionDeniedError",
    "Producer",
    "ProducerClosedError",
    "PublishSession",
    "ReadResult",
    "Record",
    "ReplicaProgress",
    "ResourceExhaustedError",
    "RetentionHolder",
    "StreamConfig",
    "StreamInfo",
    "StreamPlacement",
    "StreamlogError",
    "Subscription",
    "TransientError",
    "UnauthenticatedError",
    "UnavailableError",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'clients' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from clients.aio import AsyncClient, AsyncConsumeSession, AsyncPublishSession, AsyncSubscription
    from clients.client import Client, ConsumeSession, PublishSession, Subscription
    from clients.consumer import Consumer, Message
    from clients.errors import (
        AlreadyExistsError,
        CancelledError,
        DataLossError,
        DeadlineExceededError,
        FailedPreconditionError,
        GapError,
        InvalidArgumentError,
        NotFoundError,
        OffsetMismatchError,
        OutOfRangeError,
        PermissionDeniedError,
        ProducerClosedError,
        ResourceExhaustedError,
        StreamlogError,
        TransientError,
        UnauthenticatedError,
        UnavailableError,
    )
    from clients.producer import Producer
    from clients.types import (
        AckResult,
        AppendResult,
        Batch,
        ClaimResult,
        ConsumerInfo,
        Entry,
        Gap,
        GroupConfig,
        GroupCounters,
        GroupInfo,
        NackResult,
        PendingEntry,
        PendingInfo,
        ReadResult,
        Record,
        RetentionHolder,
        StreamConfig,
        StreamInfo,
    )
