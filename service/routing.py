"""Routing in a cluster: every stream-scoped call is served by its stream's leader.

An interceptor (service/interceptors.py), installed only on a clustered server, inside
auth (a forwarded call is authorized at the node it entered, and again at the leader,
which checks the caller's token from the forwarded metadata as it checks any call)
and outside the limits (the leader applies them). For each call it reads the stream
from the request and asks placement (cluster/placement.py, no call to etcd):

- this node leads the stream: served here (while its etcd lease is valid);
- another node leads it: the call is forwarded there and its answer relayed
  (service/forwarding.py), unless the caller sent `streamlog-route: redirect`, which
  gets UNAVAILABLE with trailers `streamlog-leader-id`, `streamlog-leader-address`
  and `streamlog-leader-epoch` instead (so a client can call the leader directly).
  A call identified by its client certificate (mutual TLS with access rules) gets
  that answer too: the certificate cannot be passed on. A call that was already
  forwarded (`streamlog-forwarded-by`) is never forwarded again: the nodes' views
  differ for a moment, and it gets UNAVAILABLE;
- nobody leads it (an election is under way, or no in-sync replica is alive):
  UNAVAILABLE, without leader trailers;
- the stream is not in placement: a call that creates streams (Append, Publish, CreateGroup
  with create_stream) creates its placement record first, then is routed by it;
  any other call is answered here (NOT_FOUND, or a blocking read that waits for the
  stream; such a wait ends with "leader changed" if the stream is then created on
  another node).

An AppendMany is routed per batch: the streams of its batches are located (placed when
new, a few at a time), the batches of streams this node leads are served here (each
stream's refused before writing when too few replicas are in sync, answered once
committed, as an Append), the others are forwarded in one call per leader, all at once;
a batch that cannot be routed (no leader, redirect mode, already forwarded) gets its
refusal in its result, and a leader's call that fails gives its status to each of its
batches (service/batchparts.py puts the results back in order).

A Publish session is routed on its first message: it carries that stream only (a later
message naming another is answered FAILED_PRECONDITION; one session per stream in a
cluster keeps routing per session, not per message).

Subscribe, Consume, Publish and blocking Reads are open calls (service/opencalls.py), marked
here as relayed or served here, with where their client resumes (service/resume.py):
those served here end when this node stops leading their stream, those relayed when
it drains for shutdown (service/clusternode.py). DeleteStream deletes the placement
record, then the leader's copy. CreateGroup and
SetGroupConfig with a dead-letter stream place that stream beside the group's (the
engine writes dead letters into its local copy), and refuse one led elsewhere.
ListStreams lists placement (the cluster's catalog) and DescribeCluster describes the
cluster, from this node's copy of etcd; ReassignReplicas writes a stream's move into
placement (service/moves.py), all three answered by the node called.

Reads from in-sync replicas: a plain Read (blocking or not) or Subscribe whose caller sent
`streamlog-read-from: replica` is served by a follower that is in the stream's in-sync set,
follows its leader at the epoch placement names and has learned the high watermark from it
(its copy shows committed entries only: storage's commit cap, at the HW the leader sent), while
its lease is valid. Such a call is marked with that epoch (`OpenCall.in_sync_epoch`): it ends
when the epoch changes or the node leaves the in-sync set (service/clusternode.py). Any other
node routes it to the leader as above; group calls, appends and admin calls always go there.

Served here, a call that changes a stream answers once the change is replicated (the
barrier, cluster/replication/leader.py; acks=quorum streams, at once for acks=leader):
Append and each Publish answer once their entries are committed; a group call that may
change group state (Ack, Nack, Claim, AutoClaim, group and consumer admin, and each
reply of a group Read, Subscribe or Consume) once every in-sync replica applied the
stream's group ops up to its own, so a failover never takes back a delivery or an ack
(a read that changed nothing finds them applied already, and does not wait).
SetStreamConfig writes the stream's settings into its placement record first
(cluster/replication/copies.py), so that every replica has them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any, NamedTuple

import grpc
from streamlog.v1 import streamlog_pb2 as pb

from cluster.errors import ClusterError
from cluster.replication.leader import NotEnoughReplicasError, NotLeadingError
from service import batchparts
from service.appendmany import check_request, error_result
from service.callcontext import CallContext
from service.clustercatalog import ClusterCatalogCalls
from service.errors import ServiceError
from service.forwarding import FORWARDED_BY
from service.interceptors import (
    MESSAGE_SESSIONS,
    SessionBehavior,
    StreamBehavior,
    UnaryBehavior,
    WrappingInterceptor,
    checked,
    iterate,
    prepended,
    request_of,
)
from service.leadercalls import LeaderCalls, mark_read, publish_barrier_of, valid_name
from service.opencalls import current_call
from service.resume import GROUP_RESUME, PUBLISH_RESUME, SubscribePosition

if TYPE_CHECKING:
    from service.clusternode import ClusterNode

ROUTE = "streamlog-route"
REDIRECT = "redirect"
READ_FROM = "streamlog-read-from"
REPLICA = "replica"
LEADER_ID = "streamlog-leader-id"
LEADER_ADDRESS = "streamlog-leader-address"
LEADER_EPOCH = "streamlog-leader-epoch"

# Streams of one AppendMany located (and placed, when new) at once.
_PLACING = 64
# How long a call waits for this node to take over a stream placement says it now leads.
_READY_WAIT_S = 2.0


class _Refusal(NamedTuple):
    """How a call (or an AppendMany batch) routing cannot serve is answered."""

    code: grpc.StatusCode
    message: str
    trailers: tuple[tuple[str, str], ...] = ()


def _creates_stream(method: str, request: Any) -> bool:
    return method in ("Append", "Publish") or (method == "CreateGroup" and request.create_stream)


def _no_leader(stream: str) -> str:
    return f"stream {stream!r} has no leader: an election is under way or its in-sync replicas are down"


class RoutingInterceptor(WrappingInterceptor):
    """Routes the calls of a clustered server (see the module docstring)."""

    def __init__(self, service_name: str, node: ClusterNode) -> None:
        super().__init__(service_name)
        self._node = node
        self._me = node.node_id
        self._placement = node.coordinator.placement
        settings = node.settings
        # Under mutual TLS with access rules, a call without a token is identified by its
        # client certificate, which a forwarded call cannot carry.
        self._certificates_identify = bool(settings.acl_file and settings.tls_client_ca_file)
        self._leader = LeaderCalls(node)
        self._catalog_calls = ClusterCatalogCalls(node)

    # -- wrappers

    def wrap_unary(self, method: str, behavior: UnaryBehavior) -> UnaryBehavior:
        if method == "ListStreams":
            return self._catalog_calls.list_streams
        if method == "DescribeCluster":
            return self._catalog_calls.describe_cluster
        if method == "ReassignReplicas":
            return self._catalog_calls.reassign_replicas
        if method in batchparts.BATCH_CALLS:
            return self._wrap_batches(method, behavior)
        node = self._node

        async def routed(request: Any, context: CallContext) -> Any:
            leader = await self._route(method, request, context)
            if leader is None:
                return await self._leader.serve_unary(method, request, context, behavior)
            if method == "Read" and request.block_ms > 0:
                mark_read(request, relayed=True)
            return await node.forwarder.unary(method, request, context, *leader)

        return routed

    def _wrap_batches(self, method: str, behavior: UnaryBehavior) -> UnaryBehavior:
        """An AppendMany: its batches served here for the streams this node leads, forwarded in one
        call per leader for the others (all at once), each refused batch answered in its result."""
        node = self._node

        async def routed(request: Any, context: CallContext) -> Any:
            refusal = self._not_serving()
            if refusal is not None:
                await context.abort(refusal.code, refusal.message)
            try:
                check_request(request, node.settings)
            except ServiceError as exc:
                await context.abort(exc.code, exc.message)
            forwarded_by, redirect, _replica = self._routing_metadata(context)
            streams = list(dict.fromkeys(batch.stream for batch in request.batches))
            placing = asyncio.Semaphore(_PLACING)

            async def place(stream: str) -> tuple[str, str] | _Refusal | None:
                async with placing:  # new streams each create a record in etcd: a few at a time
                    return await self._where(stream, True, forwarded_by, redirect)

            places = await asyncio.gather(*map(place, streams))
            where = dict(zip(streams, places, strict=True))
            refused: dict[int, batchparts.Refusal] = {}
            here: list[int] = []
            by_leader: dict[tuple[str, str], list[int]] = {}
            for i, batch in enumerate(request.batches):
                target = where[batch.stream]
                if isinstance(target, _Refusal):
                    refused[i] = (target.code, target.message)
                elif target is None:
                    here.append(i)
                else:
                    by_leader.setdefault(target, []).append(i)
            parts: list[tuple[list[int], batchparts.Serve]] = []
            if here:
                parts.append((here, lambda part: self._append_many_here(part, context, behavior)))
            for (leader, address), indices in by_leader.items():
                parts.append(
                    (indices, functools.partial(self._forward_part, method, context, leader, address))
                )
            return await batchparts.answered(request, refused, parts)

        return routed

    async def _forward_part(
        self, method: str, context: CallContext, leader: str, address: str, part: pb.AppendManyRequest
    ) -> pb.AppendManyResponse:
        try:
            return await self._node.forwarder.unary_part(method, part, context, leader, address)
        except grpc.aio.AioRpcError as exc:
            # The leader's call failed as a whole: each of its batches gets that status.
            failed = error_result(exc.code(), exc.details() or "")
            return pb.AppendManyResponse(results=[failed] * len(part.batches))

    async def _append_many_here(
        self, request: pb.AppendManyRequest, context: CallContext, behavior: UnaryBehavior
    ) -> pb.AppendManyResponse:
        """The batches of streams this node leads, as `_append` serves an Append: a stream with too
        few replicas in sync for its acks level has its batches refused before anything is written,
        the others are answered once committed (acks=quorum) or at once (acks=leader)."""
        replication = self._node.replication
        # The streams in placement (a batch of another, such as a bad name, is the servicer's).
        placed = {b.stream for b in request.batches if self._placement.locate(b.stream) is not None}
        quorum = {stream: self._leader.quorum(stream) for stream in placed}

        def in_sync(batch: pb.AppendRequest) -> batchparts.Refusal | None:
            if batch.stream not in quorum:
                return None
            try:
                replication.check_quorum(batch.stream, quorum=quorum[batch.stream])
            except (NotEnoughReplicasError, NotLeadingError) as exc:
                return grpc.StatusCode.UNAVAILABLE, f"{exc}; nothing was written: retry"
            return None

        refused, passed = batchparts.checked(request, self._node.settings, in_sync)
        reply = await batchparts.passed_on(request, refused, passed, behavior, context)
        ends: dict[str, int] = {}
        for batch, result in zip(request.batches, reply.results, strict=True):
            if not result.HasField("error") and batch.stream in quorum:
                ends[batch.stream] = max(ends.get(batch.stream, 0), result.last_offset + 1)
        failed = await asyncio.gather(
            *(replication.barrier(stream, end, quorum=quorum[stream]) for stream, end in ends.items()),
            return_exceptions=True,
        )
        lost = {stream: exc for stream, exc in zip(ends, failed, strict=True) if exc is not None}
        for batch, result in zip(request.batches, reply.results, strict=True):
            exc = lost.get(batch.stream)
            if exc is not None and not result.HasField("error"):
                if not isinstance(exc, NotEnoughReplicasError | NotLeadingError):
                    raise exc
                result.CopyFrom(
                    error_result(
                        grpc.StatusCode.UNAVAILABLE,
                        f"{exc}; the entries were written on this node but may not be replicated: retry "
                        "(an idempotent producer's retry is not written twice)",
                    )
                )
        return reply

    def wrap_stream(self, method: str, behavior: StreamBehavior) -> StreamBehavior:
        node = self._node

        async def routed(request: Any, context: CallContext) -> AsyncIterator[Any]:
            leader = await self._route(method, request, context)
            if leader is not None:
                relayed = node.forwarder.stream(method, request, context, *leader)
                replies = _marked(method, request, relayed, relayed=True)
            else:
                served = iterate(behavior, request, context)
                if method == "Subscribe" and request.group:
                    served = self._leader.committed(
                        request.stream, served, context, self._leader.group_barrier_of
                    )
                replies = _marked(method, request, served, relayed=False)
            async with contextlib.aclosing(replies):
                async for reply in replies:
                    yield reply

        return routed

    def wrap_session(self, method: str, behavior: SessionBehavior) -> SessionBehavior:
        # Routed on the opening message, which names the stream for the whole session (a Publish
        # session too: its later messages naming another stream are refused, one by one); a
        # forwarded session relays the later messages as they come.
        node = self._node
        messages = method in MESSAGE_SESSIONS

        async def routed(requests: AsyncIterator[Any], context: CallContext) -> AsyncGenerator[Any, None]:
            opening = await anext(requests, None)
            if opening is None:
                return  # the client closed its side without a word
            stream = request_of(opening).stream
            call = current_call()
            if call is not None:
                # Not served here while it is routed: the placement a Publish makes for a new
                # stream must not end it as a call served here on a stream another node leads.
                call.relayed = True
            leader = await self._route(method, request_of(opening), context)
            if leader is not None:
                # Refused messages go on as they came: the leader checks every message again.
                sent = _unrefused(prepended(opening, requests)) if messages else prepended(opening, requests)
                relayed = node.forwarder.session(method, await anext(sent), sent, context, *leader)
                replies = _marked(method, request_of(opening), relayed, relayed=True)
            else:
                served_requests = prepended(opening, requests)
                if messages:
                    served_requests = checked(served_requests, functools.partial(_same_stream, stream))
                served = behavior(served_requests, context)
                if method == "Publish":
                    served = self._leader.committed(stream, served, context, publish_barrier_of)
                elif method == "Consume":
                    served = self._leader.committed(stream, served, context, self._leader.group_barrier_of)
                replies = _marked(method, request_of(opening), served, relayed=False)
            async with contextlib.aclosing(replies):
                async for reply in replies:
                    yield reply

        return routed

    # -- where a call goes

    async def _route(self, method: str, request: Any, context: CallContext) -> tuple[str, str] | None:
        """(leader id, its advertised address) to forward the call to; None to serve it here.
        Refusals abort the call."""
        where: tuple[str, str] | _Refusal | None = self._not_serving()
        if where is None:
            forwarded_by, redirect, replica = self._routing_metadata(context)
            if replica and _reads_entries(method, request) and self._serves_in_sync(request.stream):
                return None
            creates = _creates_stream(method, request)
            where = await self._where(request.stream, creates, forwarded_by, redirect)
        if isinstance(where, _Refusal):
            await context.abort(where.code, where.message, where.trailers)
        return where

    def _not_serving(self) -> _Refusal | None:
        """The refusal of every call while this node is starting or draining."""
        node = self._node
        if not node.started:
            return _Refusal(
                grpc.StatusCode.UNAVAILABLE, "server is starting: joining the cluster; retry shortly"
            )
        if node.draining:
            return _Refusal(
                grpc.StatusCode.UNAVAILABLE,
                "server is shutting down; retry on another server or after restart",
            )
        return None

    async def _where(
        self, stream: str, creates: bool, forwarded_by: str | None, redirect: bool
    ) -> tuple[str, str] | _Refusal | None:
        """Where a call on `stream` is served: (leader id, address) to forward it to, None here,
        or the refusal to answer it with (see the module docstring)."""
        node = self._node
        record = self._placement.locate(stream)
        if record is None:
            if creates and valid_name(stream):
                try:
                    record = await self._placement.create_if_absent(
                        stream, followers_in_sync=node.followers_copy_leaders
                    )
                except ClusterError as exc:
                    return _Refusal(
                        grpc.StatusCode.UNAVAILABLE,
                        f"stream {stream!r} cannot be created in the cluster now: {exc}",
                    )
            elif forwarded_by is not None:
                # The node that forwarded it knows the stream: this node has not heard of it yet.
                return _Refusal(
                    grpc.StatusCode.UNAVAILABLE,
                    f"stream {stream!r}: this node ({self._me}) has not heard of it yet (the node that "
                    "forwarded the call sees the cluster a moment ahead); retry",
                )
            else:
                return None  # not in the cluster: answered here (NOT_FOUND, bad names, waits)
        leader = record.leader
        if leader == self._me:
            if not node.coordinator.membership.lease_valid():
                return _Refusal(
                    grpc.StatusCode.UNAVAILABLE,
                    f"stream {stream!r} is led by this node ({self._me}), which cannot confirm its cluster "
                    "lease now (is etcd reachable?); retry shortly",
                )
            if node.replicas.is_deleting(stream):
                return _Refusal(
                    grpc.StatusCode.UNAVAILABLE, f"stream {stream!r} is being deleted; retry shortly"
                )
            if not await node.replication.wait_ready(stream, _READY_WAIT_S):
                return _Refusal(
                    grpc.StatusCode.UNAVAILABLE,
                    f"stream {stream!r} is led by this node ({self._me}), which is not ready to serve it "
                    "yet (taking over its copy); retry shortly",
                )
            return None
        info = node.coordinator.nodes.live().get(leader) if leader else None
        if info is None:
            return _Refusal(grpc.StatusCode.UNAVAILABLE, _no_leader(stream))
        if forwarded_by is not None:
            return _Refusal(
                grpc.StatusCode.UNAVAILABLE,
                f"stream {stream!r} is led by node {leader!r}, not by this node ({self._me}), and the "
                f"call was already forwarded here by node {forwarded_by!r}: calls are forwarded once; "
                "retry (the nodes' views of the cluster differ for a moment)",
            )
        if redirect:
            return _Refusal(
                grpc.StatusCode.UNAVAILABLE,
                f"stream {stream!r} is led by node {leader!r} at {info.address} (epoch {record.epoch}): "
                "call it there",
                ((LEADER_ID, leader), (LEADER_ADDRESS, info.address), (LEADER_EPOCH, str(record.epoch))),
            )
        return leader, info.address

    def _serves_in_sync(self, stream: str) -> bool:
        """Whether this node serves a read of `stream` as an in-sync follower now (see the module
        docstring); if so, the call it serves is marked with the epoch it follows."""
        record = self._placement.locate(stream)
        node = self._node
        if (
            record is None
            or record.leader in ("", self._me)
            or self._me not in record.isr
            or not node.replication.serves_reads(stream, record.epoch)
            or not node.coordinator.membership.lease_valid()
        ):
            return False
        call = current_call()
        if call is not None:  # a long call: it ends when this node stops serving it so
            call.in_sync_epoch = record.epoch
        return True

    def _routing_metadata(self, context: CallContext) -> tuple[str | None, bool, bool]:
        """(the node that forwarded the call, if any; whether to answer with the leader's address;
        whether the caller asked for a read from an in-sync replica)."""
        forwarded_by, redirect, token, replica = None, False, False, False
        for key, value in context.invocation_metadata() or ():
            if key == FORWARDED_BY and isinstance(value, str):
                forwarded_by = value
            elif key == ROUTE:
                redirect = value == REDIRECT
            elif key == "authorization":
                token = True
            elif key == READ_FROM:
                replica = value == REPLICA
        return forwarded_by, redirect or (self._certificates_identify and not token), replica


def _reads_entries(method: str, request: Any) -> bool:
    """Whether the call only reads entries (a plain Read or Subscribe, not a group's)."""
    return method in ("Read", "Subscribe") and not request.group


def _same_stream(stream: str, request: Any) -> tuple[grpc.StatusCode, str] | None:
    if request.stream == stream:
        return None
    return (
        grpc.StatusCode.FAILED_PRECONDITION,
        f"stream {request.stream!r}: in a cluster, a Publish session carries the stream of its first "
        f"message ({stream!r}); open one session per stream",
    )


async def _unrefused(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for item in requests:
        yield request_of(item)


# -- long calls, served here or relayed: marked on their open call (service/opencalls.py)


async def _marked(
    method: str, request: Any, replies: AsyncGenerator[Any, None], *, relayed: bool
) -> AsyncGenerator[Any, None]:
    """The replies of the streaming call this task serves, served here or relayed, with its open
    call marked so; a plain subscription's resume position follows the replies sent."""
    call = current_call()
    position = None
    if call is not None:  # else not held open (another front door): nothing can end it
        call.relayed = relayed
        if method == "Subscribe" and not request.group:
            start = request.start in (pb.START_POSITION_UNSPECIFIED, pb.START_POSITION_OFFSET)
            position = SubscribePosition(request.offset if start else None)
            call.resume = position.resume
        elif method == "Publish":
            call.resume = lambda: PUBLISH_RESUME
        else:
            call.resume = lambda: GROUP_RESUME
    async with contextlib.aclosing(replies):
        async for reply in replies:
            yield reply
            if position is not None:
                position.sent(reply)  # it was sent: resume after it
