"""The calls any node of a cluster answers itself, from its copy of etcd: ListStreams
(placement is the cluster's catalog), DescribeCluster, and ReassignReplicas (which writes
a stream's move into placement, service/moves.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import grpc
from streamlog.v1 import streamlog_pb2 as pb

from service import describe, moves
from service.callcontext import CallContext
from service.errors import ServiceError
from service.paging import page_of_names

if TYPE_CHECKING:
    from service.clusternode import ClusterNode


class ClusterCatalogCalls:
    def __init__(self, node: ClusterNode) -> None:
        self._node = node
        self._me = node.node_id
        self._placement = node.coordinator.placement

    async def list_streams(self, request: pb.ListStreamsRequest, context: CallContext) -> Any:
        names, next_page_token = await self._names(context, request)
        return pb.ListStreamsResponse(streams=names, next_page_token=next_page_token)

    async def describe_cluster(self, request: pb.DescribeClusterRequest, context: CallContext) -> Any:
        page, next_page_token = await self._names(context, request)
        coordinator = self._node.coordinator
        return describe.cluster_view(
            cluster_name=self._node.settings.cluster_name,
            node_id=self._me,
            live=coordinator.nodes.live(),
            controller=coordinator.election.controller_id,
            streams=self._placement.streams(),
            page=page,
            next_page_token=next_page_token,
            progress=self._node.replication_progress,
        )

    async def reassign_replicas(self, request: pb.ReassignReplicasRequest, context: CallContext) -> Any:
        if not self._node.started:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "server is starting: joining the cluster; retry shortly"
            )
        try:
            record = await moves.reassign(self._placement, self._node.coordinator.nodes.live(), request)
        except ServiceError as exc:
            await context.abort(exc.code, exc.message)
        return pb.ReassignReplicasResponse(placement=describe.placement_to_proto(record))

    async def _names(self, context: CallContext, request: Any) -> tuple[list[str], str]:
        if not self._node.started:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "server is starting: joining the cluster; retry shortly"
            )
        try:
            return page_of_names(request, self._node.stream_names(), self._node.settings)
        except ServiceError as exc:
            await context.abort(exc.code, exc.message)
            raise  # not reached: abort raises
