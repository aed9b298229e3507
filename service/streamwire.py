"""Streams between protobuf and the engine: append batches, read replies, configs, infos.

Hot paths move batches, not entries. An append takes `payloads` (a list of bytes)
in one C call, or turns `entries` into the engine's columns with C-level `map`s
(a single one for payload-only batches: see wire.py). Read and Subscribe replies
carry the engine's stored records as they are: a stored record is exactly the
wire encoding of one `Entry` in field 1 of ReadResponse/SubscribeResponse, so a
reply is the serialized scalar fields followed by the records joined (protobuf
allows fields in any order; scalars first, so that a Subscribe reply's next_offset
is found without parsing the records: service/resume.py). Those replies are
therefore `bytes`, which the server sends with a pass-through serializer (see
server.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import Any

from streamlog.v1 import streamlog_pb2 as pb

from service import validation
from service.errors import invalid_argument, limit_exceeded
from service.groupwire import gap_to_proto
from service.wire import entries_hold_only_payloads
from storage import AppendBatch, AppendResult, FsyncPolicy, ReadResult, StreamConfig, StreamInfo

FSYNC_TO_PROTO = {
    None: pb.FSYNC_POLICY_UNSPECIFIED,
    FsyncPolicy.ALWAYS: pb.FSYNC_POLICY_ALWAYS,
    FsyncPolicy.EVERYSEC: pb.FSYNC_POLICY_EVERYSEC,
    FsyncPolicy.NO: pb.FSYNC_POLICY_NO,
}
_FSYNC_FROM_PROTO = {value: key for key, value in FSYNC_TO_PROTO.items()}
_RETENTION_LIMITS = ("max_entries", "max_age_ms", "max_bytes")
# An idempotent append's (producer id, sequence).
Producer = tuple[str, int] | None

_payload = attrgetter("payload")
_tag = attrgetter("tag")
_headers = attrgetter("headers")
_deliver_at = attrgetter("deliver_at_ms")


def checked_append(request: Any, max_entries: int, what: str) -> tuple[str, AppendBatch, Producer]:
    """The stream, engine batch and (producer id, sequence) of an append (an Append's request, a
    Publish message, an AppendMany batch: `what` names it in errors), checked as every one is."""
    stream = validation.stream(request.stream)
    # Each read of a repeated field makes a container object: read each once.
    entries, payloads = request.entries, request.payloads
    if entries and payloads:
        raise invalid_argument("entries, payloads: set one of them, not both")
    count = len(entries) or len(payloads)
    if not count:
        raise invalid_argument("entries: at least one entry is required")
    if count > max_entries:
        # Refuse before building columns for a batch that cannot be taken.
        raise limit_exceeded("max_batch_entries", max_entries, f"entries: the {what} has {count} entries")
    if payloads:
        # The fast form: one payload (most Appends) by index, several in one C call (a list()
        # of a repeated field costs several times an index).
        batch = AppendBatch([payloads[0]] if count == 1 else list(payloads))
    else:
        batch = entries_batch(request, stream, entries)
    producer = None
    if request.producer_id:
        producer = (
            request.producer_id,
            validation.non_negative("producer_sequence", request.producer_sequence),
        )
    return stream, batch, producer


def appended(result: AppendResult) -> dict[str, Any]:
    """The fields every answer to an append carries (a Publish answer, an AppendMany result)."""
    return {
        "first_offset": result.first_offset,
        "last_offset": result.last_offset,
        "timestamp_ms": result.timestamp_ms,
        "duplicate": result.duplicate,
    }


def entries_batch(request: pb.AppendRequest, stream: str, entries: Sequence[pb.Entry]) -> AppendBatch:
    """The engine's batch for an AppendRequest whose `entries` are set (its payloads are not)."""
    # The engine takes columns. The common batch has payloads only: one pass gets
    # them, and a size comparison done in C proves there is nothing else.
    columns = list(map(_payload, entries))
    if entries_hold_only_payloads(request, stream, columns):
        return AppendBatch(columns)
    return AppendBatch(columns, **_optional_columns(entries))


def _optional_columns(entries: Sequence[pb.Entry]) -> dict[str, list | None]:
    """The engine's optional columns (tags, headers, deliver_at_ms); None for one no entry uses."""
    tags = list(map(_tag, entries))
    deliver_at = list(map(_deliver_at, entries))
    headers = None
    if any(map(len, map(_headers, entries))):
        headers = [dict(h) if h else None for h in map(_headers, entries)]
    if any(deliver_at):
        validation.non_negative("entries.deliver_at_ms", min(deliver_at))
    return {
        "tags": tags if any(tags) else None,
        "headers": headers,
        "deliver_at_ms": deliver_at if any(deliver_at) else None,
    }


def has_news(result: ReadResult, offset: int) -> bool:
    """Whether a forward read at `offset` has something to tell: entries, or a gap that moves it on.

    A gap that does not move past `offset` would make a follower loop without waiting.
    """
    return bool(result.count) or (result.gap is not None and result.gap.end_offset > offset)


def records_reply(
    reply_type: type[pb.ReadResponse] | type[pb.SubscribeResponse],
    result: ReadResult | None,
    next_offset: int,
) -> bytes:
    """A serialized ReadResponse or SubscribeResponse: the scalar fields, then the stored records
    (field 1); `result` None means no stream yet."""
    if result is None:
        return reply_type(next_offset=next_offset).SerializeToString()
    head = reply_type(
        first_offset=result.first_offset,
        next_offset=next_offset,
        gap=gap_to_proto(result.gap) if result.gap is not None else None,
        end_offset=result.end_offset,
    ).SerializeToString()
    return b"".join((head, *result.records)) if result.records else head


def config_to_proto(config: StreamConfig) -> pb.StreamConfig:
    return pb.StreamConfig(
        max_entries=config.max_entries,
        max_age_ms=config.max_age_ms,
        max_bytes=config.max_bytes,
        compaction=config.compaction,
        tombstone_retention_ms=config.tombstone_retention_ms,
        fsync=FSYNC_TO_PROTO[config.fsync],
    )


def config_from_proto(message: pb.StreamConfig) -> StreamConfig:
    values: dict[str, Any] = {"compaction": message.compaction}
    for field in _RETENTION_LIMITS:
        if message.HasField(field):
            values[field] = validation.positive(f"config.{field}", getattr(message, field))
    if message.HasField("tombstone_retention_ms"):
        values["tombstone_retention_ms"] = validation.non_negative(
            "config.tombstone_retention_ms", message.tombstone_retention_ms
        )
    if message.fsync not in _FSYNC_FROM_PROTO:
        raise invalid_argument(f"config.fsync: unknown policy {message.fsync}")
    values["fsync"] = _FSYNC_FROM_PROTO[message.fsync]
    return StreamConfig(**values)


def info_to_proto(
    info: StreamInfo,
    effective_fsync: FsyncPolicy,
    groups: int | None,
    retention_holder: tuple[str, int] | None,
) -> pb.StreamInfo:
    return pb.StreamInfo(
        name=info.name,
        first_offset=info.first_offset,
        next_offset=info.end_offset,
        entries_added=info.entries_added,
        entries=info.entries,
        bytes_on_disk=info.bytes_on_disk,
        segments=info.segments,
        nodes=info.nodes,
        compression_ratio=info.compression_ratio,
        used_bytes=info.used_bytes,
        packed_segments=info.packed_segments,
        last_timestamp_ms=info.last_timestamp_ms,
        config=config_to_proto(info.config),
        effective_fsync=FSYNC_TO_PROTO[effective_fsync],
        damaged=[gap_to_proto(gap) for gap in info.damaged],
        groups=groups,
        retention_holder=None
        if retention_holder is None
        else pb.RetentionHolder(group=retention_holder[0], offset=retention_holder[1]),
    )
