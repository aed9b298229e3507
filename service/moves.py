"""ReassignReplicas in a cluster: a stream's move written as its placement target.

Why here and not on the stream's leader: the call only writes etcd, which any node can, and
the controller carries the move out (cluster/reassign.py); so the node called answers it,
as it answers DescribeCluster, and a stream whose leader is down can still be given a
target (the move waits for a leader). The write is a compare-and-swap on the record's
revision, decided again from the fresh record on a conflict (a leader changing the in-sync
set meanwhile). A cancel (the request's `cancel`) is such a write too: the record back to the
replicas it had before the move (cluster/reassign.py's `cancelled`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import grpc
from streamlog.v1 import streamlog_pb2 as pb

from cluster.addresses import check_name
from cluster.errors import ClusterError, PlacementError
from cluster.placement import PlacementTable, StreamPlacement
from cluster.reassign import cancelled
from service import validation
from service.errors import ServiceError, invalid_argument

MAX_REPLICAS = 64


def check_target(replicas: list[str], live: Mapping[str, object]) -> tuple[str, ...]:
    """The target asked, checked: ServiceError unless it is 1 to 64 distinct live node ids."""
    if not replicas:
        raise invalid_argument("replicas: name at least one node")
    if len(replicas) > MAX_REPLICAS:
        raise invalid_argument(f"replicas: at most {MAX_REPLICAS} nodes, got {len(replicas)}")
    for node in replicas:
        try:
            check_name("a node id", node)
        except ValueError as exc:
            raise invalid_argument(f"replicas: {exc}") from None
    if len(set(replicas)) != len(replicas):
        raise invalid_argument(f"replicas: a node is listed twice in {replicas}")
    down = [node for node in replicas if node not in live]
    if down:
        raise ServiceError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"replicas: node(s) {', '.join(down)} not alive in the cluster now: a stream moves only "
            "to live nodes",
        )
    return tuple(replicas)


def _done(record: StreamPlacement, target: tuple[str, ...]) -> bool:
    """Whether the record already is, or is moving to, `target`."""
    if record.target:
        return record.target == target
    return record.replicas == target and record.leader == target[0]


async def reassign(
    placement: PlacementTable, live: Mapping[str, object], request: pb.ReassignReplicasRequest
) -> StreamPlacement:
    """Write the request's target into the stream's record, or undo its move if it asks to cancel
    (see the module docstring)."""
    stream = validation.stream(request.stream)
    if request.cancel:
        if request.replicas:
            raise invalid_argument("replicas: a cancel names none (it restores the replicas the stream had)")
        return await _written(placement, stream, _cancel_of)
    target = check_target(list(request.replicas), live)
    return await _written(placement, stream, lambda record: _move_to(record, target))


def _move_to(record: StreamPlacement, target: tuple[str, ...]) -> StreamPlacement | None:
    return None if _done(record, target) else dataclasses.replace(record, target=target)


def _cancel_of(record: StreamPlacement) -> StreamPlacement | None:
    try:
        return cancelled(record)
    except PlacementError as exc:
        raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None


async def _written(
    placement: PlacementTable,
    stream: str,
    change: Callable[[StreamPlacement], StreamPlacement | None],
) -> StreamPlacement:
    """The stream's record once `change` of it (None: nothing to change) is written, decided again
    from the fresh record whenever another write came first."""
    record = placement.locate(stream)
    while True:
        if record is None:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, f"stream {stream!r} is not in the cluster")
        updated = change(record)
        if updated is None:
            return record
        try:
            outcome = await placement.cas(record, updated)
        except ClusterError as exc:
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE, f"stream {stream!r}: the move cannot be written now: {exc}"
            ) from None
        if outcome.applied and outcome.record is not None:
            return outcome.record
        record = outcome.record
