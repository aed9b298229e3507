"""Consumer-group administration: create, delete, list, describe, reposition and configure groups,
remove consumers, list pending entries.

Calls that create or remove files (CreateGroup, DeleteGroup, SetGroupOffset,
SetGroupConfig, DeleteConsumer) always run in the thread pool; queries that may
retire expired entries, and so journal a change, follow the stream's fsync policy
(`Serving.may_block`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import grpc
from streamlog.v1 import streamlog_pb2 as pb

from service import groupwire, validation
from service.callcontext import CallContext
from service.errors import ServiceError, invalid_argument, translate_errors
from service.groupwaits import GroupWaits
from service.serving import Serving
from storage import Engine, GroupConfig, PreconditionError


def _group_start(
    engine: Engine, stream: str, request: pb.CreateGroupRequest | pb.SetGroupOffsetRequest
) -> Callable[[], str | int]:
    """Check a group's start fields now; the returned function resolves them (in the thread)."""
    start = request.start
    if start in (pb.START_POSITION_UNSPECIFIED, pb.START_POSITION_OFFSET):
        offset = validation.non_negative("offset", request.offset)
        return lambda: validation.not_past_end(engine, stream, "offset", offset)
    if start == pb.START_POSITION_TIMESTAMP:
        timestamp_ms = validation.non_negative("timestamp_ms", request.timestamp_ms)
        return lambda: engine.seek_time(stream, timestamp_ms)
    if start == pb.START_POSITION_OLDEST:
        return lambda: "oldest"
    if start == pb.START_POSITION_LATEST:
        return lambda: "newest"
    raise invalid_argument(f"start: unknown start position {start}")


def _entries_read(request: pb.CreateGroupRequest | pb.SetGroupOffsetRequest) -> int | None:
    if not request.HasField("entries_read"):
        return None
    return validation.non_negative("entries_read", request.entries_read)


def _config(stream: str, message: pb.GroupConfig) -> GroupConfig:
    config = groupwire.config_from_proto(message)
    if config.dead_letter_stream == stream:
        raise invalid_argument("config.dead_letter_stream: must not be the group's own stream")
    return config


class GroupAdmin:
    """The group RPCs that shape a group for all its consumers, or look at it."""

    def __init__(self, serving: Serving, waits: GroupWaits) -> None:
        self._serving = serving
        self._waits = waits

    @translate_errors
    async def CreateGroup(
        self, request: pb.CreateGroupRequest, context: CallContext
    ) -> pb.CreateGroupResponse:
        engine = self._serving.ready()
        stream = validation.stream(request.stream)
        group = validation.name("group", request.group)
        start = _group_start(engine, stream, request)
        entries_read = _entries_read(request)
        config = _config(stream, request.config)

        def create() -> pb.GroupInfo:
            if request.create_stream and not engine.exists(stream):
                engine.create_stream(stream)
            try:
                info = engine.create_group(
                    stream, group, start=start(), entries_read=entries_read, config=config
                )
            except PreconditionError as exc:  # the one precondition of create_group: the name is free
                raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, str(exc)) from None
            return groupwire.info_to_proto(info)

        return pb.CreateGroupResponse(group=await self._serving.in_thread(create))

    @translate_errors
    async def DeleteGroup(
        self, request: pb.DeleteGroupRequest, context: CallContext
    ) -> pb.DeleteGroupResponse:
        engine = self._serving.ready()
        stream = validation.stream(request.stream)
        group = validation.name("group", request.group)
        await self._serving.in_thread(engine.delete_group, stream, group)
        # Its blocked readers read again, find no group, and end with NOT_FOUND.
        self._waits.kick(stream, group)
        return pb.DeleteGroupResponse()

    @translate_errors
    async def ListGroups(self, request: pb.ListGroupsRequest, context: CallContext) -> pb.ListGroupsResponse:
        engine = self._serving.ready()
        stream = validation.stream(request.stream)
        infos = await self._serving.may_block(engine, stream, engine.list_groups, stream)
        return pb.ListGroupsResponse(groups=[groupwire.info_to_proto(info) for info in infos])

    @translate_errors
    async def GetGroupInfo(
        self, request: pb.GetGroupInfoRequest, context: CallContext
    ) -> pb.GetGroupInfoResponse:
        engine = self._serving.ready()
        stream = validation.stream(request.stream)
        group = validation.name("group", request.group)
        info = await self._serving.may_block(engine, stream, engine.group_info, stream, group)
        return pb.GetGroupInfoResponse(group=groupwire.info_to_proto(info))

    @translate_errors
    async def SetGroupOffset(
        self, request: pb.SetGroupOffsetRequest, context: CallContext
    ) -> pb.SetGroupOffsetResponse:
        engine = self._serving.ready()
        stream = validation.stream(request.stream)
        group = validation.name("group", request.group)
        start = _group_start(engine, stream, request)
        entries_read = _entries_read(request)

        def seek() -> pb.GroupInfo:
            return groupwire.info_to_proto(engine.set_group_offset(stream, group, start(), entries_read))

        return pb.SetGroupOffsetResponse(group=await self._serving.in_thread(seek))

    @translate_errors
    async def SetGroupConfig(
        self, request: pb.SetGroupConfigRequest, context: CallContext
    ) -> pb.SetGroupConfigResponse:
        engine = self._serving.ready()
        stream = validation.stream(request.stream)
        group = validation.name("group", request.group)
        config = _config(stream, request.config)
        info = await self._serving.in_thread(engine.set_group_config, stream, group, config)
        return pb.SetGroupConfigResponse(group=groupwire.info_to_proto(info))

    @translate_errors
    async def DeleteConsumer(
        self, request: pb.DeleteConsumerRequest, context: CallContext
    ) -> pb.DeleteConsumerResponse:
        engine = self._serving.ready()
        stream = validation.stream(request.stream)
        group = validation.name("group", request.group)
        consumer = validation.name("consumer", request.consumer)
        released = await self._serving.in_thread(engine.delete_consumer, stream, group, consumer)
        return pb.DeleteConsumerResponse(released=released)

    @translate_errors
    async def GetPending(self, request: pb.GetPendingRequest, context: CallContext) -> pb.GetPendingResponse:
        engine = self._serving.ready()
        settings = self._serving.settings
        stream = validation.stream(request.stream)
        group = validation.name("group", request.group)
        consumer = validation.name("consumer", request.consumer) if request.consumer else None
        min_idle_ms = validation.non_negative("min_idle_ms", request.min_idle_ms)
        start, end = validation.offset_range(
            "", request.start_offset, request.end_offset if request.HasField("end_offset") else None
        )
        count = validation.bounded(
            "count", request.count, settings.default_read_entries, settings.max_read_entries
        )
        query = functools.partial(
            engine.pending,
            stream,
            group,
            consumer=consumer,
            min_idle_ms=min_idle_ms,
            start=start,
            end=end,
            count=count,
        )
        return groupwire.pending_to_proto(await self._serving.may_block(engine, stream, query))
