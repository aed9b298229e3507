"""Calls a clustered node serves as the leader of their stream (service/routing.py routes
them here): each answers once what it changed is replicated.

Append and each Publish reply wait until their entries are committed (acks=quorum; at once
for acks=leader); a group call that may change group state waits until every in-sync replica
applied the stream's group ops up to its own; DeleteStream deletes the placement record,
then the local copy; SetStreamConfig writes the stream's placement record first; CreateGroup
and SetGroupConfig place a new dead-letter stream beside the group's. Calls refused before
they change anything say so ("nothing was written"), the others that their outcome may not
be replicated. The module docstring of service/routing.py says the whole story.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any

import grpc
from streamlog.v1 import streamlog_pb2 as pb

from cluster.errors import ClusterError
from cluster.placement import StreamPlacement
from cluster.replication import copies
from cluster.replication.leader import NotEnoughReplicasError, NotLeadingError
from service import streamwire, validation
from service.callcontext import CallContext
from service.errors import ServiceError
from service.interceptors import UnaryBehavior
from service.opencalls import current_call
from service.resume import GROUP_RESUME
from storage import StreamNotFoundError

if TYPE_CHECKING:
    from service.clusternode import ClusterNode

_DEAD_LETTER_METHODS = frozenset({"CreateGroup", "SetGroupConfig"})
# Compare-and-swaps a SetStreamConfig tries while placement changes under it (the in-sync set).
_CONFIG_ATTEMPTS = 5
# Unary calls that may change group state (and a group Read): their reply waits for the group
# ops to be replicated.
_GROUP_CHANGES = frozenset(
    {
        "Ack",
        "Nack",
        "Claim",
        "AutoClaim",
        "CreateGroup",
        "DeleteGroup",
        "SetGroupOffset",
        "SetGroupConfig",
        "DeleteConsumer",
    }
)


class LeaderCalls:
    """The calls this node serves as their stream's leader (see the module docstring)."""

    def __init__(self, node: ClusterNode) -> None:
        self._node = node
        self._me = node.node_id
        self._placement = node.coordinator.placement

    def quorum(self, stream: str) -> bool:
        """Whether appends to `stream` wait for every in-sync replica (acks=quorum)."""
        record = self._placement.locate(stream)
        return record is None or record.config.get("acks", self._node.settings.default_acks) != "leader"

    async def _create(self, stream: str, context: CallContext, **where: Any) -> StreamPlacement:
        try:
            return await self._placement.create_if_absent(
                stream, followers_in_sync=self._node.followers_copy_leaders, **where
            )
        except ClusterError as exc:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"stream {stream!r} cannot be created in the cluster now: {exc}"
            )
            raise  # not reached: abort raises

    async def serve_unary(
        self, method: str, request: Any, context: CallContext, behavior: UnaryBehavior
    ) -> Any:
        if method == "DeleteStream":
            return await self._delete_stream(request, context, behavior)
        if method == "SetStreamConfig" and self._placement.locate(request.stream) is not None:
            return await self._set_stream_config(request, context, behavior)
        if method in _DEAD_LETTER_METHODS and request.config.dead_letter_stream:
            await self._place_dead_letters(request, context)
        if method == "Read" and request.block_ms > 0:
            # A blocking read waits here: it ends if this node stops leading the stream meanwhile.
            mark_read(request, relayed=False)
        if method == "Append" and self._placement.locate(request.stream) is not None:
            return await self._append(request, context, behavior)
        if (method in _GROUP_CHANGES or (method == "Read" and request.group)) and self._placement.locate(
            request.stream
        ) is not None:
            return await self._group_call(request, context, behavior)
        return await behavior(request, context)

    async def _group_call(self, request: Any, context: CallContext, behavior: UnaryBehavior) -> Any:
        """A group call served here: its reply once every in-sync replica applied the group ops up
        to its own."""
        return await self._replicated(
            request,
            context,
            behavior,
            self.group_barrier_of,
            refused="nothing was changed: retry",
            unsure="the change was made on this node but may not be replicated: retry",
        )

    def _group_seq(self, stream: str) -> int | None:
        """The stream's group op seq now (None: the stream was deleted meanwhile)."""
        engine = self._node.engine
        assert engine is not None  # set once the node started
        try:
            return engine.group_seq(stream)
        except StreamNotFoundError:
            return None

    def group_barrier_of(self, stream: str, _reply: Any) -> tuple[int, int | None]:
        """What a group read's reply waits for: the group ops made so far."""
        return 0, self._group_seq(stream)

    async def _append(self, request: Any, context: CallContext, behavior: UnaryBehavior) -> Any:
        """An Append served here: its reply once its entries are committed (acks=quorum: every
        in-sync replica holds them) or at once (acks=leader)."""
        engine = self._node.engine
        assert engine is not None  # set once the node started
        return await self._replicated(
            request,
            context,
            behavior,
            lambda stream, _reply: (engine.log_end(stream), None),
            refused="nothing was written: retry",
            unsure="the entries were written on this node but may not be replicated: retry (an "
            "idempotent producer's retry is not written twice)",
        )

    async def _replicated(
        self,
        request: Any,
        context: CallContext,
        behavior: UnaryBehavior,
        barrier_of: Callable[[str, Any], tuple[int, int | None]],
        *,
        refused: str,
        unsure: str,
    ) -> Any:
        """A unary call that changes `request.stream`, served once its change is replicated:
        refused (UNAVAILABLE, `refused`) before it changes anything when too few replicas are in
        sync for the stream's acks level; its reply once the replicas reached
        `barrier_of(stream, reply)`, (end, group seq), taken after the call. UNAVAILABLE
        (`unsure`: the outcome unknown) when this node stops leading or its lease lapses meanwhile."""
        stream, replication = request.stream, self._node.replication
        quorum = self.quorum(stream)
        try:
            replication.check_quorum(stream, quorum=quorum)
        except (NotEnoughReplicasError, NotLeadingError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{exc}; {refused}")
        reply = await behavior(request, context)
        end, group_seq = barrier_of(stream, reply)
        try:
            await replication.barrier(stream, end, quorum=quorum, group_seq=group_seq)
        except (NotEnoughReplicasError, NotLeadingError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{exc}; {unsure}")
        return reply

    async def committed(
        self,
        stream: str,
        replies: AsyncGenerator[Any, None],
        context: CallContext,
        barrier_of: Callable[[str, Any], tuple[int, int | None] | None],
    ) -> AsyncGenerator[Any, None]:
        """A streaming call's replies, each once what it changed is replicated, as a unary call's
        (acks=quorum; at once for acks=leader): `barrier_of(stream, reply)` says what it waits
        for, (end, group seq), or None. The call ends UNAVAILABLE when this node stops leading or
        its lease lapses: a Publish client resends what was not answered (an idempotent
        producer's resend is not written twice); a group reader resumes, and what it was not
        sent comes back to it or another consumer (at-least-once)."""
        replication = self._node.replication
        quorum = self.quorum(stream)
        async with contextlib.aclosing(replies):
            async for reply in replies:
                target = barrier_of(stream, reply)
                if target is not None:
                    try:
                        await replication.barrier(stream, target[0], quorum=quorum, group_seq=target[1])
                    except (NotEnoughReplicasError, NotLeadingError) as exc:
                        await context.abort(
                            grpc.StatusCode.UNAVAILABLE,
                            f"{exc}; what was not answered may not be replicated: resend it, or resume",
                        )
                yield reply

    # -- deletions and dead letters, served here as the leader

    async def _delete_stream(
        self, request: pb.DeleteStreamRequest, context: CallContext, behavior: UnaryBehavior
    ) -> Any:
        stream = request.stream
        record = self._placement.locate(stream)
        if record is None:  # not in the cluster: only a stray local copy can be deleted
            return await behavior(request, context)
        with self._node.replicas.deleting(stream):
            try:
                await self._placement.delete(record)
            except ClusterError as exc:
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"stream {stream!r} cannot be deleted from the cluster now: {exc}",
                )
            # The local copy goes as a single server deletes a stream (its readers told NOT_FOUND).
            if self._node.engine is not None and self._node.engine.exists(stream):
                return await behavior(request, context)
        return pb.DeleteStreamResponse()

    async def _set_stream_config(
        self, request: pb.SetStreamConfigRequest, context: CallContext, behavior: UnaryBehavior
    ) -> Any:
        """The settings go into the stream's placement record first (compare-and-swap on the record
        of this node's epoch: a deposed leader's write fails), so that every replica applies them
        and a new leader enforces them; then into this node's copy, which answers."""
        try:
            config = streamwire.config_from_proto(request.config)
        except ServiceError as exc:
            await context.abort(exc.code, exc.message)
        for _ in range(_CONFIG_ATTEMPTS):  # the in-sync set may change meanwhile: decide again
            record = self._placement.locate(request.stream)
            if record is None or record.leader != self._me:
                break
            try:
                outcome = await self._placement.cas(record, copies.with_settings(record, config))
            except ClusterError as exc:
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"stream {request.stream!r}: its config cannot be written to the cluster now: {exc}; "
                    "nothing was changed: retry",
                )
            if outcome.applied:
                return await behavior(request, context)
        await context.abort(
            grpc.StatusCode.UNAVAILABLE,
            f"stream {request.stream!r}: this node stopped leading it, or its placement kept changing; "
            "the config may not be set: retry",
        )

    async def _place_dead_letters(self, request: Any, context: CallContext) -> None:
        """The engine writes a group's dead letters into its own copy of the dead-letter stream,
        so this node must lead that stream too: placed beside the group's stream when new."""
        target = request.config.dead_letter_stream
        source = self._placement.locate(request.stream)
        if source is None or not valid_name(target):
            return  # no such stream, or a bad name: the servicer answers
        record = self._placement.locate(target) or await self._create(
            target, context, replicas=source.replicas
        )
        if record.leader != self._me:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"config.dead_letter_stream: stream {target!r} is led by node {record.leader or '(none)'}, "
                f"not by node {self._me}, which leads {request.stream!r}: in a cluster, a group's dead "
                "letters go to a stream led by the same node (a new name is created beside the group's "
                "stream)",
            )


def valid_name(stream: str) -> bool:
    try:
        validation.stream(stream)
    except ServiceError:
        return False
    return True


def publish_barrier_of(stream: str, reply: Any) -> tuple[int, int | None] | None:
    """What a Publish reply waits for: its entries committed (none for a refused message)."""
    return None if reply.error.code else (reply.last_offset + 1, None)


def mark_read(request: pb.ReadRequest, *, relayed: bool) -> None:
    """Mark the blocking Read this task serves (held open by service/opencalls.py)."""
    call = current_call()
    if call is None:  # not held open (another front door): nothing can end it
        return
    resume = GROUP_RESUME if request.group else f"read again from offset {request.offset}"
    call.relayed, call.resume = relayed, lambda: resume
