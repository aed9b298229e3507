"""Requests built from Python values, and replies turned into the typed results of clients.types.

Shared by the sync and the async client so both build exactly the same requests;
the unit tests (grpcio-testing's fake channel) check this layer through Client.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from streamlog.v1 import streamlog_pb2 as pb

from clients.errors import StreamlogError, from_status
from clients.types import (
    AppendData,
    AppendResult,
    Batch,
    ClaimResult,
    ClusterNode,
    ConsumerInfo,
    Entry,
    FsyncPolicy,
    Gap,
    GapReason,
    GroupConfig,
    GroupCounters,
    GroupInfo,
    PendingEntry,
    PendingInfo,
    ReadResult,
    Record,
    ReplicaProgress,
    RetentionHolder,
    Start,
    StreamConfig,
    StreamInfo,
    StreamPlacement,
)

_BYTES = bytes | bytearray | memoryview
# The requests that open a consumer's session with a group: a group-mode Subscribe, a Consume.
GroupSessionRequest = TypeVar("GroupSessionRequest", pb.SubscribeRequest, pb.ConsumeRequest)
_GAP_REASONS: dict[pb.GapReason, GapReason] = {
    pb.GAP_REASON_EVICTED: "evicted",
    pb.GAP_REASON_COMPACTED: "compacted",
    pb.GAP_REASON_CORRUPT: "corrupt",
}
_FSYNC_TO_PB: dict[FsyncPolicy | None, pb.FsyncPolicy] = {
    None: pb.FSYNC_POLICY_UNSPECIFIED,
    "always": pb.FSYNC_POLICY_ALWAYS,
    "everysec": pb.FSYNC_POLICY_EVERYSEC,
    "no": pb.FSYNC_POLICY_NO,
}
_FSYNC_FROM_PB = {value: key for key, value in _FSYNC_TO_PB.items()}
_STARTS = {"oldest": pb.START_POSITION_OLDEST, "latest": pb.START_POSITION_LATEST}


def start_fields(start: Start, timestamp_ms: int | None) -> dict[str, Any]:
    """SubscribeRequest/CreateGroupRequest fields for a start: an offset, "oldest", "latest", or a time."""
    if timestamp_ms is not None:
        return {"start": pb.START_POSITION_TIMESTAMP, "timestamp_ms": timestamp_ms}
    if isinstance(start, bool) or not isinstance(start, int | str):
        raise TypeError(f"start must be an offset or 'oldest'/'latest', not {start!r}")
    if isinstance(start, int):
        return {"start": pb.START_POSITION_OFFSET, "offset": start}
    if start not in _STARTS:
        raise ValueError(f"start must be an offset, 'oldest' or 'latest', not {start!r}")
    return {"start": _STARTS[start]}


# ------------------------------------------------------------------ append


def _as_items(data: Any) -> list[Any]:
    if isinstance(data, _BYTES | Record | Entry):
        return [data]
    if isinstance(data, str):
        raise TypeError("payloads are bytes: encode the str (e.g. text.encode())")
    return list(data)


def _pb_entry(item: Any) -> pb.Entry:
    if isinstance(item, _BYTES):
        return pb.Entry(payload=bytes(item))
    if isinstance(item, Record | Entry):
        return pb.Entry(
            payload=bytes(item.payload),
            tag=item.tag,
            headers=dict(item.headers) if item.headers else None,
            deliver_at_ms=item.deliver_at_ms,
        )
    raise TypeError(f"cannot append {type(item).__name__}: give bytes, a Record or an Entry")


def append_request(
    stream: str,
    data: bytes | Record | Entry | Iterable[bytes | Record | Entry],
    producer_id: str | None = None,
    producer_sequence: int | None = None,
    expected_next_offset: int | None = None,
) -> pb.AppendRequest:
    """An AppendRequest; payload-only batches use the `payloads` fast form."""
    request = _filled(pb.AppendRequest(stream=stream), data, producer_id, producer_sequence)
    if expected_next_offset is not None:
        request.expected_next_offset = expected_next_offset
    return request


def publish_request(
    stream: str,
    data: bytes | Record | Entry | Iterable[bytes | Record | Entry],
    producer_id: str | None,
    producer_sequence: int | None,
    request_id: int,
) -> pb.PublishRequest:
    """A message of a Publish session: an append, as append_request's, with its request id."""
    request = pb.PublishRequest(stream=stream, request_id=request_id)
    return _filled(request, data, producer_id, producer_sequence)


_Append = TypeVar("_Append", pb.AppendRequest, pb.PublishRequest)


def _filled(
    request: _Append,
    data: bytes | Record | Entry | Iterable[bytes | Record | Entry],
    producer_id: str | None,
    producer_sequence: int | None,
) -> _Append:
    items = _as_items(data)
    if not items:
        raise ValueError("append needs at least one entry")
    if all(isinstance(item, _BYTES) for item in items):
        # A repeated bytes field costs far less to encode (and decode) than messages.
        request.payloads.extend(bytes(item) if not isinstance(item, bytes) else item for item in items)
    else:
        request.entries.extend(_pb_entry(item) for item in items)
    if producer_id is not None:
        if producer_sequence is None:
            raise ValueError("producer_id needs a producer_sequence")
        request.producer_id = producer_id
        request.producer_sequence = producer_sequence
    elif producer_sequence is not None:
        raise ValueError("producer_sequence needs a producer_id")
    return request


def append_result(reply: pb.AppendResponse | pb.PublishResponse | pb.AppendManyResult) -> AppendResult:
    return AppendResult(reply.first_offset, reply.last_offset, reply.timestamp_ms, reply.duplicate)


def append_many_request(batches: Iterable[Batch | tuple[str, AppendData]]) -> pb.AppendManyRequest:
    """An AppendManyRequest: each batch as append_request makes it."""
    requests = []
    for batch in batches:
        if not isinstance(batch, Batch):
            batch = Batch(*batch)
        requests.append(
            append_request(
                batch.stream,
                batch.data,
                batch.producer_id,
                batch.producer_sequence,
                batch.expected_next_offset,
            )
        )
    return pb.AppendManyRequest(batches=requests)


def append_many_results(reply: pb.AppendManyResponse) -> list[AppendResult | StreamlogError]:
    """Each batch's AppendResult, or the error it was refused with, in request order."""
    return [
        from_status(r.error.code, r.error.message) if r.HasField("error") else append_result(r)
        for r in reply.results
    ]


# ------------------------------------------------------------------ entries and reads


def gap(message: pb.Gap) -> Gap:
    return Gap(message.start_offset, message.end_offset, _GAP_REASONS.get(message.reason, "unspecified"))


def entry(message: pb.Entry, delivery_count: int = 0) -> Entry:
    return Entry(
        offset=message.offset,
        timestamp_ms=message.timestamp_ms,
        payload=message.payload,
        tag=message.tag,
        headers=dict(message.headers) if message.headers else {},
        deliver_at_ms=message.deliver_at_ms,
        delivery_count=delivery_count,
    )


def entries(messages: Sequence[pb.Entry], delivery_counts: Sequence[int] = ()) -> list[Entry]:
    if delivery_counts:
        return [entry(m, c) for m, c in zip(messages, delivery_counts, strict=True)]
    return [entry(m) for m in messages]


def read_result(reply: pb.ReadResponse | pb.SubscribeResponse | pb.ConsumeResponse) -> ReadResult:
    """A Read reply, a Subscribe batch or a Consume batch.

    Read and Consume replies carry acknowledgement counts; a Consume batch has no
    next offset (0, as in a group Read's reply).
    """
    acknowledged = ack_unknown = 0
    if isinstance(reply, pb.ReadResponse | pb.ConsumeResponse):
        acknowledged, ack_unknown = reply.acknowledged, reply.ack_unknown
    return ReadResult(
        entries=entries(reply.entries, reply.delivery_counts),
        first_offset=reply.first_offset,
        next_offset=0 if isinstance(reply, pb.ConsumeResponse) else reply.next_offset,
        end_offset=reply.end_offset,
        gap=gap(reply.gap) if reply.HasField("gap") else None,
        acknowledged=acknowledged,
        ack_unknown=ack_unknown,
        pending_full=reply.pending_full,
    )


def span_bounds(span: tuple[int, int] | range) -> tuple[int, int]:
    """(start, end) of a half-open range given as a pair or a Python range (step 1)."""
    if isinstance(span, range):
        if span.step != 1:
            raise ValueError(f"ranges must have step 1, got {span!r}")
        return span.start, span.stop
    start, end = span
    return start, end


def offset_ranges(ranges: Iterable[tuple[int, int] | range]) -> list[pb.OffsetRange]:
    """Half-open ranges, given as (start, end) pairs or Python ranges (step 1)."""
    return [pb.OffsetRange(start_offset=start, end_offset=end) for start, end in map(span_bounds, ranges)]


# ------------------------------------------------------------------ streams


def stream_config_to_pb(config: StreamConfig) -> pb.StreamConfig:
    if config.fsync not in _FSYNC_TO_PB:
        raise ValueError(f"fsync must be one of always, everysec, no or None, not {config.fsync!r}")
    return pb.StreamConfig(
        max_entries=config.max_entries,
        max_age_ms=config.max_age_ms,
        max_bytes=config.max_bytes,
        compaction=config.compaction,
        tombstone_retention_ms=config.tombstone_retention_ms,
        fsync=_FSYNC_TO_PB[config.fsync],
    )


def _optional(message: Any, name: str) -> int | None:
    return getattr(message, name) if message.HasField(name) else None


def stream_config(message: pb.StreamConfig) -> StreamConfig:
    return StreamConfig(
        max_entries=_optional(message, "max_entries"),
        max_age_ms=_optional(message, "max_age_ms"),
        max_bytes=_optional(message, "max_bytes"),
        compaction=message.compaction,
        tombstone_retention_ms=_optional(message, "tombstone_retention_ms"),
        fsync=_FSYNC_FROM_PB.get(message.fsync),
    )


def stream_info(message: pb.StreamInfo) -> StreamInfo:
    holder = None
    if message.HasField("retention_holder"):
        holder = RetentionHolder(message.retention_holder.group, message.retention_holder.offset)
    return StreamInfo(
        name=message.name,
        first_offset=message.first_offset,
        next_offset=message.next_offset,
        entries_added=message.entries_added,
        entries=message.entries,
        bytes_on_disk=message.bytes_on_disk,
        segments=message.segments,
        nodes=message.nodes,
        compression_ratio=message.compression_ratio,
        last_timestamp_ms=message.last_timestamp_ms,
        config=stream_config(message.config),
        effective_fsync=_FSYNC_FROM_PB.get(message.effective_fsync),
        damaged=[gap(g) for g in message.damaged],
        groups=message.groups,
        retention_holder=holder,
        used_bytes=message.used_bytes,
        packed_segments=message.packed_segments,
    )


def cluster_node(message: pb.ClusterNode) -> ClusterNode:
    return ClusterNode(
        id=message.id,
        address=message.address,
        alive=message.alive,
        controller=message.controller,
        version=message.version,
        started_ms=message.started_ms,
    )


def stream_placement(message: pb.StreamPlacement) -> StreamPlacement:
    return StreamPlacement(
        name=message.name,
        leader=message.leader,
        replicas=list(message.replicas),
        in_sync_replicas=list(message.in_sync_replicas),
        leader_epoch=message.leader_epoch,
        replication_factor=message.replication_factor,
        acks=message.acks,
        high_watermark=_optional(message, "high_watermark"),
        progress=[ReplicaProgress(p.node, p.log_end_offset, p.lag_ms) for p in message.progress],
        target_replicas=list(message.target_replicas),
    )


def trim_request(
    stream: str, *, to_offset: int | None, keep_last: int | None, evict_up_to: int | None
) -> pb.TrimRequest:
    modes = {"trim_to_offset": to_offset, "keep_last": keep_last, "evict_up_to_offset": evict_up_to}
    given = {name: value for name, value in modes.items() if value is not None}
    if len(given) != 1:
        raise ValueError("trim needs exactly one of to_offset, keep_last, evict_up_to")
    return pb.TrimRequest(stream=stream, **given)


# ------------------------------------------------------------------ groups


def group_config_to_pb(config: GroupConfig) -> pb.GroupConfig:
    return pb.GroupConfig(
        retry_ms=config.retry_ms,
        expire_ms=config.expire_ms,
        max_deliveries=config.max_deliveries,
        max_pending=config.max_pending,
        dead_letter_stream=config.dead_letter_stream,
        delay_ms=config.delay_ms,
        retention_hold=config.retention_hold,
        idle_release_ms=config.idle_release_ms,
    )


def group_config(message: pb.GroupConfig) -> GroupConfig:
    return GroupConfig(
        retry_ms=_optional(message, "retry_ms"),
        expire_ms=_optional(message, "expire_ms"),
        max_deliveries=_optional(message, "max_deliveries"),
        max_pending=_optional(message, "max_pending"),
        dead_letter_stream=message.dead_letter_stream,
        delay_ms=message.delay_ms,
        retention_hold=message.retention_hold,
        idle_release_ms=_optional(message, "idle_release_ms"),
    )


def group_info(message: pb.GroupInfo) -> GroupInfo:
    counters = message.counters
    return GroupInfo(
        stream=message.stream,
        name=message.name,
        config=group_config(message.config),
        next_offset=message.next_offset,
        entries_read=message.entries_read,
        lag=_optional(message, "lag"),
        entries_added=message.entries_added,
        pending=message.pending,
        scheduled=message.scheduled,
        consumers=[
            ConsumerInfo(c.name, c.pending, c.seen_ms, _optional(c, "active_ms")) for c in message.consumers
        ],
        counters=GroupCounters(
            delivered=counters.delivered,
            redelivered=counters.redelivered,
            acked=counters.acked,
            ack_unknown=counters.ack_unknown,
            expired=counters.expired,
            dead_lettered=counters.dead_lettered,
            evicted=counters.evicted,
        ),
        created_ms=message.created_ms,
        active_ms=message.active_ms,
        hold_offset=message.hold_offset,
        holds_retention=message.holds_retention,
    )


def pending_info(reply: pb.GetPendingResponse) -> PendingInfo:
    return PendingInfo(
        count=reply.count,
        lowest_offset=_optional(reply, "lowest_offset"),
        highest_offset=_optional(reply, "highest_offset"),
        consumers={c.consumer: c.pending for c in reply.consumers},
        released=reply.released,
        entries=[
            PendingEntry(p.offset, p.consumer, p.idle_ms, p.delivery_count, _optional(p, "due_ms"))
            for p in reply.entries
        ],
    )


def claim_result(reply: pb.ClaimResponse | pb.AutoClaimResponse) -> ClaimResult:
    return ClaimResult(
        entries=entries(reply.entries, reply.delivery_counts),
        deleted_offsets=list(reply.deleted_offsets),
        next_cursor=reply.next_cursor if isinstance(reply, pb.AutoClaimResponse) else 0,
    )


def optional_fields(**values: int | None) -> dict[str, Any]:
    """Keyword arguments for the optional int64 fields that are set (proto3 `optional`)."""
    return {name: value for name, value in values.items() if value is not None}


# ------------------------------------------------------------------ requests with many options


def read_request(
    stream: str, offset: int, count: int, block_ms: int, reverse: bool, max_bytes: int
) -> pb.ReadRequest:
    return pb.ReadRequest(
        stream=stream, offset=offset, count=count, block_ms=block_ms, reverse=reverse, max_bytes=max_bytes
    )


def group_read_request(
    stream: str,
    group: str,
    consumer: str,
    *,
    count: int,
    block_ms: int,
    max_bytes: int,
    ack: Iterable[int],
    ack_ranges: Iterable[tuple[int, int] | range],
    retry_ms: int | None,
    expire_ms: int | None,
    noack: bool,
    claim_idle_ms: int | None,
) -> pb.ReadRequest:
    return pb.ReadRequest(
        stream=stream,
        group=group,
        consumer=consumer,
        count=count,
        block_ms=block_ms,
        max_bytes=max_bytes,
        ack_offsets=list(ack),
        ack_ranges=offset_ranges(ack_ranges),
        noack=noack,
        **optional_fields(retry_ms=retry_ms, expire_ms=expire_ms, claim_idle_ms=claim_idle_ms),
    )


def subscribe_request(
    stream: str, start: Start, timestamp_ms: int | None, count: int, max_bytes: int
) -> pb.SubscribeRequest:
    return pb.SubscribeRequest(
        stream=stream, count=count, max_bytes=max_bytes, **start_fields(start, timestamp_ms)
    )


def group_session_request(
    message: type[GroupSessionRequest],
    stream: str,
    group: str,
    consumer: str,
    *,
    count: int,
    max_bytes: int,
    retry_ms: int | None,
    expire_ms: int | None,
    noack: bool,
    claim_idle_ms: int | None,
) -> GroupSessionRequest:
    """A group-mode SubscribeRequest, or the fields that open a Consume session (its first
    request adds credit and acknowledgements)."""
    return message(
        stream=stream,
        group=group,
        consumer=consumer,
        count=count,
        max_bytes=max_bytes,
        noack=noack,
        **optional_fields(retry_ms=retry_ms, expire_ms=expire_ms, claim_idle_ms=claim_idle_ms),
    )


def ack_request(
    stream: str, group: str, offsets: Iterable[int], ranges: Iterable[tuple[int, int] | range]
) -> pb.AckRequest:
    return pb.AckRequest(stream=stream, group=group, offsets=list(offsets), ranges=offset_ranges(ranges))


def create_group_request(
    stream: str,
    group: str,
    start: Start,
    *,
    timestamp_ms: int | None,
    entries_read: int | None,
    config: GroupConfig | None,
    create_stream: bool,
) -> pb.CreateGroupRequest:
    return pb.CreateGroupRequest(
        stream=stream,
        group=group,
        config=group_config_to_pb(config) if config is not None else None,
        create_stream=create_stream,
        **start_fields(start, timestamp_ms),
        **optional_fields(entries_read=entries_read),
    )


def set_group_offset_request(
    stream: str, group: str, start: Start, *, timestamp_ms: int | None, entries_read: int | None
) -> pb.SetGroupOffsetRequest:
    return pb.SetGroupOffsetRequest(
        stream=stream,
        group=group,
        **start_fields(start, timestamp_ms),
        **optional_fields(entries_read=entries_read),
    )


def pending_request(
    stream: str,
    group: str,
    *,
    consumer: str,
    min_idle_ms: int,
    start_offset: int,
    end_offset: int | None,
    count: int,
) -> pb.GetPendingRequest:
    return pb.GetPendingRequest(
        stream=stream,
        group=group,
        consumer=consumer,
        min_idle_ms=min_idle_ms,
        start_offset=start_offset,
        count=count,
        **optional_fields(end_offset=end_offset),
    )
