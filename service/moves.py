"""ReassignReplicas in a cluster: a stream's move written as its placement target.

Why here and not on the stream's leader: the call only writes etcd, which any node can, and
the controller carries the move out (cluster/reassign.py); so the node called answers it,
as it answers DescribeCluster, and a stream whose leader is down can still be given a
target (the move waits for a leader). The write is a compare-and-swap on the record's
revision, decided again from the fresh record on a conflict (a leader changing the in-sync
set meanwhile).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import grpc
from streamlog.v1 import streamlog_pb2 as pb

from cluster.addresses import check_name
from cluster.errors import ClusterError
from cluster.placement import PlacementTable, StreamPlacement
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
    """Write the request's target into the stream's record (see the module docstring)."""
    stream = validation.stream(request.stream)
    target = check_target(list(request.replicas), live)
    record = placement.locate(stream)
    while True:
        if record is None:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, f"stream {stream!r} is not in the cluster")
        if _done(record, target):
            return record
        try:
            outcome = await placement.cas(record, dataclasses.replace(record, target=target))
        except ClusterError as exc:
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE, f"stream {stream!r}: the move cannot be written now: {exc}"
            ) from None
        if outcome.applied and outcome.record is not None:
            return outcome.record
        record = outcome.record
