"""ReplicaService: what a leader serves its followers (protos/streamlog/internal/v1/replication.proto).

Served by every node of a cluster, on the port of the public service. Nothing a peer
sends can crash the server: every request is checked for shape (INVALID_ARGUMENT), a
request this node cannot serve (it does not lead the stream, or not at that epoch or
incarnation) gets FAILED_PRECONDITION with the epoch it knows in the
`streamlog-leader-epoch` trailer, and when the cluster has a peer secret, a call
without it gets UNAUTHENTICATED.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from streamlog.internal.v1 import replication_pb2 as rpb
from streamlog.internal.v1 import replication_pb2_grpc as rpb_grpc

from cluster.addresses import check_name
from cluster.replication.leader import FetchRefusedError, StreamLeader
from storage import InvalidNameError, StorageError, validate_name

PEER_SECRET = "streamlog-peer-secret"
REPLICATE = "/streamlog.internal.v1.ReplicaService/Replicate"
REPLICA_STATE = "/streamlog.internal.v1.ReplicaService/ReplicaState"
LEADER_EPOCH = "streamlog-leader-epoch"
MAX_FETCH_BYTES = 4 << 20
DEFAULT_FETCH_BYTES = 1 << 20


def problem(request: rpb.FetchRequest) -> str | None:
    """What is wrong with a request's fields, if anything."""
    try:
        validate_name(request.stream)
    except InvalidNameError as exc:
        return f"stream: {exc}"
    try:
        check_name("follower_id", request.follower_id)
    except ValueError as exc:
        return str(exc)
    if request.incarnation < 1 or request.leader_epoch < 1:
        return "incarnation and leader_epoch must be positive"
    if request.log_end < 0 or request.last_epoch < -1 or request.group_seq < 0:
        return "log_end and group_seq must not be negative, last_epoch not below -1"
    if not 0 <= request.max_bytes <= MAX_FETCH_BYTES:
        return f"max_bytes must be 0 (the default) to {MAX_FETCH_BYTES}"
    return None


class ReplicaServicer(rpb_grpc.ReplicaServiceServicer):
    """`leader(stream)`: this node's leader role for the stream, if it leads it and is ready
    (ReplicaManager.leader; None before replication starts)."""

    def __init__(
        self,
        node_id: str,
        leader: Callable[[str], StreamLeader | None],
        state: Callable[[str, int], tuple[int, int] | None],
        secret: bytes | None = None,
    ) -> None:
        self._node_id = node_id
        self._leader = leader
        self._state = state
        self._secret = secret

    async def _authenticate(self, context: grpc.aio.ServicerContext) -> None:
        if self._secret is not None:
            sent = dict(context.invocation_metadata() or ()).get(PEER_SECRET, "")
            if not hmac.compare_digest(str(sent).encode(), self._secret):
                await context.abort(
                    grpc.StatusCode.UNAUTHENTICATED, "internal calls need the cluster's peer secret"
                )

    async def ReplicaState(
        self, request: rpb.ReplicaStateRequest, context: grpc.aio.ServicerContext
    ) -> rpb.ReplicaStateResponse:
        await self._authenticate(context)
        try:
            validate_name(request.stream)
        except InvalidNameError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"stream: {exc}")
        if request.incarnation < 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "incarnation must be positive")
        state = self._state(request.stream, request.incarnation)
        if state is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this node ({self._node_id}) holds no copy of that incarnation of stream {request.stream!r}",
            )
            raise AssertionError("not reached: abort raises")
        last_epoch, log_end = state
        return rpb.ReplicaStateResponse(last_epoch=last_epoch, log_end=log_end)

    async def Replicate(
        self, request_iterator: AsyncIterator[rpb.FetchRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rpb.FetchResponse]:
        await self._authenticate(context)
        requests = aiter(request_iterator)
        first = await anext(requests, None)
        if first is None:
            return
        wrong = problem(first)
        if wrong is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, wrong)
        leader = self._leader(first.stream)
        if leader is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this node ({self._node_id}) does not lead stream {first.stream!r} now",
            )
            return
        try:
            async for response in leader.serve(_checked(first, requests)):
                yield response
        except _BadRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except FetchRefusedError as exc:
            context.set_trailing_metadata(((LEADER_EPOCH, str(exc.epoch)),))
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except StorageError as exc:  # the log moved under the request (a truncation, retention)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"stream {first.stream!r}: {exc}")


class _BadRequestError(Exception):
    pass


async def _checked(
    first: rpb.FetchRequest, requests: AsyncIterator[rpb.FetchRequest]
) -> AsyncIterator[rpb.FetchRequest]:
    """The session's requests, each checked; the first names the session."""
    opening = (first.stream, first.incarnation, first.leader_epoch, first.follower_id)
    request: rpb.FetchRequest | None = first
    while request is not None:
        wrong = problem(request)
        if (
            wrong is None
            and (request.stream, request.incarnation, request.leader_epoch, request.follower_id) != opening
        ):
            wrong = "a fetch session's requests must keep its stream, incarnation, epoch and follower"
        if wrong is not None:
            raise _BadRequestError(wrong)
        if request.max_bytes == 0:
            request.max_bytes = DEFAULT_FETCH_BYTES
        yield request
        request = await anext(requests, None)


def add_to_server(servicer: ReplicaServicer, server: Any) -> None:
    """`server`: a grpc.aio.Server, or what takes its handlers in its place (service/server.py)."""
    rpb_grpc.add_ReplicaServiceServicer_to_server(servicer, server)
