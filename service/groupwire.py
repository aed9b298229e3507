"""Consumer groups between protobuf and the engine: configs, infos, pending lists, replies.

Replies that carry entries (group reads, claims) are built like Read's: the
engine's stored records are already the wire encoding of `repeated Entry
entries = 1`, so a reply is the records joined, followed by the other fields
serialized on their own (see streamwire.py).
"""

from __future__ import annotations

from typing import Any

from streamlog.v1 import streamlog_pb2 as pb

from service import validation
from storage import Gap, GapReason, GroupConfig, GroupInfo, GroupReadResult, PendingInfo, StreamBounds

_GAP_REASONS = {
    GapReason.EVICTED: pb.GAP_REASON_EVICTED,
    GapReason.COMPACTED: pb.GAP_REASON_COMPACTED,
    GapReason.CORRUPT: pb.GAP_REASON_CORRUPT,
}
# GroupConfig fields that are unset (None) when not limited, and must be > 0 when set.
_POSITIVE = ("max_deliveries", "max_pending")
# GroupConfig fields that are unset (None) when not used, and must be >= 0 when set.
_OPTIONAL_MS = ("retry_ms", "expire_ms", "idle_release_ms")
_COUNTERS = ("delivered", "redelivered", "acked", "ack_unknown", "expired", "dead_lettered", "evicted")


def gap_to_proto(gap: Gap) -> pb.Gap:
    return pb.Gap(start_offset=gap.start_offset, end_offset=gap.end_offset, reason=_GAP_REASONS[gap.reason])


def config_from_proto(message: pb.GroupConfig, field: str = "config") -> GroupConfig:
    values: dict[str, Any] = {"retention_hold": message.retention_hold}
    for name in _OPTIONAL_MS:
        if message.HasField(name):
            values[name] = validation.duration_ms(f"{field}.{name}", getattr(message, name))
    for name in _POSITIVE:
        if message.HasField(name):
            values[name] = validation.positive(f"{field}.{name}", getattr(message, name))
    values["delay_ms"] = validation.duration_ms(f"{field}.delay_ms", message.delay_ms)
    if message.dead_letter_stream:
        values["dead_letter_stream"] = validation.name(
            f"{field}.dead_letter_stream", message.dead_letter_stream
        )
    return GroupConfig(**values)


def config_to_proto(config: GroupConfig) -> pb.GroupConfig:
    message = pb.GroupConfig(
        delay_ms=config.delay_ms,
        retention_hold=config.retention_hold,
        dead_letter_stream=config.dead_letter_stream or "",
    )
    for name in (*_OPTIONAL_MS, *_POSITIVE):
        value = getattr(config, name)
        if value is not None:
            setattr(message, name, value)
    return message


def info_to_proto(info: GroupInfo) -> pb.GroupInfo:
    message = pb.GroupInfo(
        stream=info.stream,
        name=info.name,
        config=config_to_proto(info.config),
        next_offset=info.cursor,
        entries_read=info.entries_read,
        entries_added=info.entries_added,
        pending=info.pending,
        scheduled=info.scheduled,
        consumers=[
            pb.ConsumerInfo(name=c.name, pending=c.pending, seen_ms=c.seen_ms, active_ms=c.active_ms)
            for c in info.consumers
        ],
        counters=pb.GroupCounters(**{name: getattr(info.counters, name) for name in _COUNTERS}),
        created_ms=info.created_ms,
        active_ms=info.active_ms,
        hold_offset=info.hold_offset,
        holds_retention=info.holds_retention,
    )
    if info.lag is not None:
        message.lag = info.lag
    return message


def pending_to_proto(info: PendingInfo) -> pb.GetPendingResponse:
    return pb.GetPendingResponse(
        count=info.count,
        lowest_offset=info.lowest,
        highest_offset=info.highest,
        consumers=[
            pb.ConsumerPending(consumer=name, pending=count) for name, count in sorted(info.consumers.items())
        ],
        released=info.released,
        entries=[
            pb.PendingEntry(
                offset=row.offset,
                consumer=row.consumer or "",
                idle_ms=row.idle_ms,
                delivery_count=row.delivery_count,
                due_ms=row.due_ms,
            )
            for row in info.rows
        ],
    )


def read_reply(
    reply_type: type[pb.ReadResponse] | type[pb.SubscribeResponse] | type[pb.ConsumeResponse],
    result: GroupReadResult | None,
    bounds: StreamBounds,
    **extra: int,
) -> bytes:
    """A serialized Read, Subscribe or Consume reply for a group read (None: nothing came).

    `bounds` are the stream's first and end offsets; `extra`
    holds the acknowledgement counts of a Read that carried acks (and a Consume reply's
    batches).
    """
    fields: dict[str, Any] = {"first_offset": bounds.first_offset, "end_offset": bounds.end_offset}
    fields.update(extra)
    if result is None:
        return reply_type(**fields).SerializeToString()
    if result.gap is not None:
        fields["gap"] = gap_to_proto(result.gap)
    if result.pending_full:
        fields["pending_full"] = True
    tail = reply_type(delivery_counts=result.delivery_counts, **fields).SerializeToString()
    return b"".join(result.records) + tail if result.records else tail


def claim_reply(
    reply_type: type[pb.ClaimResponse] | type[pb.AutoClaimResponse], result: GroupReadResult, **extra: Any
) -> bytes:
    """A serialized ClaimResponse or AutoClaimResponse: the claimed records plus the other fields."""
    tail = reply_type(
        delivery_counts=result.delivery_counts, deleted_offsets=result.gone, **extra
    ).SerializeToString()
    return b"".join(result.records) + tail if result.records else tail
