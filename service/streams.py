"""The stream RPCs: Append, Read, and the stream's administration (list, describe, delete, trim,
configure, seek by time, count), and DescribeCluster and ReassignReplicas as a single server answers them.

Append and Read are the hot paths: batches in, batches out (service/streamwire.py).
An append to a stream whose fsync policy blocks runs in the thread pool, else on
the loop (`Serving.may_block`); a read is an in-memory slice, on the loop. A Read
that names a group is a group read (service/groupdelivery.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
from streamlog.v1 import streamlog_pb2 as pb

from service import describe, paging, streamwire, validation
from service.callcontext import CallContext
from service.errors import ServiceError, abort_for, invalid_argument, not_found, translate_errors
from service.groupdelivery import GroupDelivery, has_group_fields
from service.serving import Serving
from service.waiters import Wake
from storage import CorruptionError, Engine, ReadResult, StreamNotFoundError

log = logging.getLogger(__name__)

_TRIM_MODES = ("evict_up_to_offset", "keep_last", "trim_to_offset")
# Bigger than any offset: engine.count clamps the end of a range to the stream's end.
_END_OF_STREAM = 2**63 - 1


def read_waiting(
    engine: Engine, stream: str, offset: int, count: int, max_bytes: int, seen: bool
) -> ReadResult | None:
    """A forward read by a caller that waits for entries: None while the stream does not exist
    (RCP 11's BLOCK waits on a stream that does not exist yet); NOT_FOUND if it existed during
    the call (`seen`) and is gone now: it was deleted."""
    try:
        return engine.read(stream, offset, count, max_bytes=max_bytes)
    except StreamNotFoundError:
        if seen:
            raise not_found(f"stream {stream!r} was deleted") from None
        return None


class StreamCalls:
    """Appends, reads and the administration of streams."""

    def __init__(self, serving: Serving, groups: GroupDelivery) -> None:
        self._serving = serving
        self._groups = groups

    # ------------------------------------------------------------------ data

    async def Append(self, request: pb.AppendRequest, context: CallContext) -> pb.AppendResponse:
        # translate_errors's work done here (abort_for): a coroutine layer less on every Append.
        try:
            serving = self._serving
            engine = serving.ready()
            stream, batch, producer = streamwire.checked_append(
                request, serving.settings.max_batch_entries, "batch"
            )
            options: dict[str, Any] = {}
            if producer is not None:
                options["producer"] = producer
            if request.HasField("expected_next_offset"):
                options["expected_end"] = validation.non_negative(
                    "expected_next_offset", request.expected_next_offset
                )
            # As Serving.may_block, without its extra await on the hot path.
            if engine.fsync_policy(stream).blocks:
                result = await serving.in_thread(engine.append, stream, batch, **options)
            else:
                result = engine.append(stream, batch, **options)
            return pb.AppendResponse(
                first_offset=result.first_offset,
                last_offset=result.last_offset,
                timestamp_ms=result.timestamp_ms,
                duplicate=result.duplicate,
            )
        except Exception as exc:
            await abort_for(context, "Append", exc)

    @translate_errors
    async def Read(self, request: pb.ReadRequest, context: CallContext) -> bytes:
        serving = self._serving
        engine = serving.ready()
        settings = serving.settings
        stream = validation.stream(request.stream)
        offset = validation.non_negative("offset", request.offset)
        count, max_bytes = serving.reply_limits(request, settings.default_read_entries)
        block_ms = validation.at_most("block_ms", request.block_ms, "max_block_ms", settings.max_block_ms)
        # Held from the read until the call ends: grpc.aio ends it once the reply is sent.
        charge = serving.replies.charge(context)
        if request.group:
            return await self._groups.read_request(
                engine, stream, request, (count, max_bytes), block_ms, context, charge
            )
        if has_group_fields(request) or request.ack_offsets or request.ack_ranges:
            raise invalid_argument(
                "group: consumer, retry_ms, expire_ms, noack, claim_idle_ms and acks need a group"
            )
        await charge.reserve(max_bytes)
        if request.reverse:
            result = engine.read(stream, offset, count, max_bytes=max_bytes, reverse=True)
            return charge.hold(streamwire.records_reply(pb.ReadResponse, result, result.next_offset))
        if not block_ms:
            result = engine.read(stream, offset, count, max_bytes=max_bytes)
            return charge.hold(streamwire.records_reply(pb.ReadResponse, result, result.next_offset))

        loop = asyncio.get_running_loop()
        deadline = loop.time() + serving.wait_limit_s(context, block_ms)
        seen = False
        while True:
            await charge.reserve(max_bytes)
            found = read_waiting(engine, stream, offset, count, max_bytes, seen)
            if found is not None:
                seen = True
                if streamwire.has_news(found, offset):
                    return charge.hold(streamwire.records_reply(pb.ReadResponse, found, found.next_offset))
            # Nothing yet: wait, holding no room, with no await between the read above and this call.
            charge.settle(0)
            wake = await serving.waiters.wait(stream, offset, deadline - loop.time())
            if wake is Wake.DELETED:
                raise not_found(f"stream {stream!r} was deleted")
            if wake is not Wake.APPENDED:
                # Timed out, or the server is draining: an empty reply, like BLOCK's timeout.
                return streamwire.records_reply(pb.ReadResponse, found, offset)

    # ------------------------------------------------------------------ admin

    @translate_errors
    async def ListStreams(
        self, request: pb.ListStreamsRequest, context: CallContext
    ) -> pb.ListStreamsResponse:
        # In a cluster, the routing layer lists the cluster's catalog instead (service/routing.py).
        engine = self._serving.ready()
        names, next_page_token = paging.page_of_names(request, engine.stream_names(), self._serving.settings)
        return pb.ListStreamsResponse(streams=names, next_page_token=next_page_token)

    @translate_errors
    async def DescribeCluster(
        self, request: pb.DescribeClusterRequest, context: CallContext
    ) -> pb.DescribeClusterResponse:
        # A single server; in a cluster, the routing layer answers instead (service/routing.py).
        self._serving.ready()
        return describe.single_server(request, self._serving.settings)

    @translate_errors
    async def ReassignReplicas(
        self, request: pb.ReassignReplicasRequest, context: CallContext
    ) -> pb.ReassignReplicasResponse:
        # A single server; in a cluster, the routing layer answers instead (service/routing.py).
        self._serving.ready()
        raise ServiceError(
            grpc.StatusCode.FAILED_PRECONDITION, "this server is not in a cluster: it has no replicas to move"
        )

    @translate_errors
    async def GetStreamInfo(
        self, request: pb.GetStreamInfoRequest, context: CallContext
    ) -> pb.GetStreamInfoResponse:
        engine = self._serving.ready()
        stream = validation.stream(request.stream)
        info = engine.info(stream)
        groups: int | None = None
        try:
            groups = len(await self._serving.may_block(engine, stream, engine.list_groups, stream))
        except CorruptionError as exc:
            # Unreadable group state must not hide the stream's own description: leave `groups` unset.
            log.warning("stream %r: consumer groups not counted: %s", stream, exc)
        holder = engine.retention_holder(stream)
        fsync = engine.fsync_policy(stream)
        return pb.GetStreamInfoResponse(info=streamwire.info_to_proto(info, fsync, groups, holder))

    @translate_errors
    async def DeleteStream(
        self, request: pb.DeleteStreamRequest, context: CallContext
    ) -> pb.DeleteStreamResponse:
        engine = self._serving.ready()
        stream = validation.stream(request.stream)
        await self._serving.in_thread(engine.delete_stream, stream)
        self._serving.waiters.on_delete(stream)
        self._groups.waits.on_delete(stream)
        return pb.DeleteStreamResponse()

    @translate_errors
    async def Trim(self, request: pb.TrimRequest, context: CallContext) -> pb.TrimResponse:
        engine = self._serving.ready()
        stream = validation.stream(request.stream)
        mode = request.WhichOneof("mode")
        if mode is None:
            raise invalid_argument(f"mode: set one of {', '.join(_TRIM_MODES)}")
        value = validation.non_negative(mode, getattr(request, mode))
        if mode == "trim_to_offset":
            validation.not_past_end(engine, stream, mode, value)
            first = await self._serving.in_thread(engine.trim, stream, value)
        elif mode == "keep_last":
            first = await self._serving.in_thread(engine.keep_last, stream, value)
        else:
            first = await self._serving.in_thread(engine.evict, stream, value)
        return pb.TrimResponse(first_offset=first)

    @translate_errors
    async def SetStreamConfig(
        self, request: pb.SetStreamConfigRequest, context: CallContext
    ) -> pb.SetStreamConfigResponse:
        engine = self._serving.ready()
        stream = validation.stream(request.stream)
        config = streamwire.config_from_proto(request.config)
        await self._serving.in_thread(engine.set_stream_config, stream, config)
        return pb.SetStreamConfigResponse(config=streamwire.config_to_proto(engine.stream_config(stream)))

    @translate_errors
    async def SeekTime(self, request: pb.SeekTimeRequest, context: CallContext) -> pb.SeekTimeResponse:
        engine = self._serving.ready()
        stream = validation.stream(request.stream)
        timestamp_ms = validation.non_negative("timestamp_ms", request.timestamp_ms)
        return pb.SeekTimeResponse(offset=engine.seek_time(stream, timestamp_ms))

    @translate_errors
    async def CountRange(self, request: pb.CountRangeRequest, context: CallContext) -> pb.CountRangeResponse:
        engine = self._serving.ready()
        stream = validation.stream(request.stream)
        start, end = validation.offset_range(
            "", request.start_offset, request.end_offset if request.HasField("end_offset") else None
        )
        return pb.CountRangeResponse(
            count=engine.count(stream, start, _END_OF_STREAM if end is None else end)
        )
