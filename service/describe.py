"""DescribeCluster's answer: a single server's, or a cluster node's from its copy of etcd.

Why the two live together: both fill the same reply, and a client must not tell them
apart by anything but `cluster_name` being empty. The cluster's answer reads the
records the node already holds (cluster/placement.py, cluster/nodes.py) and costs no
call to etcd; a single server never loads the cluster layer (types only, below).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from streamlog.v1 import streamlog_pb2 as pb

from service.config import Settings
from service.paging import page_of_names

if TYPE_CHECKING:
    from cluster.nodes import NodeInfo
    from cluster.placement import StreamPlacement

VERSION = importlib.metadata.version("streamlog")
# A led stream's high watermark and its replicas' (node, log end, lag in ms).
Progress = tuple[int, list[tuple[str, int, int]]]


def single_server(request: pb.DescribeClusterRequest, settings: Settings) -> pb.DescribeClusterResponse:
    """A server that is not in a cluster: one node, no cluster name, no placement."""
    page_of_names(request, (), settings)  # the request is checked as in a cluster
    return pb.DescribeClusterResponse(nodes=[pb.ClusterNode(alive=True, version=VERSION)])


def cluster_view(
    *,
    cluster_name: str,
    node_id: str,
    live: Mapping[str, NodeInfo],
    controller: str | None,
    streams: Mapping[str, StreamPlacement],
    page: Sequence[str],
    next_page_token: str,
    progress: Callable[[str], Progress | None] = lambda _name: None,
) -> pb.DescribeClusterResponse:
    """A cluster node's answer: the `live` nodes, and the placement `streams` named in `page`, with
    the high watermark and replicas' progress of those this node leads (`progress`)."""
    nodes = [
        pb.ClusterNode(
            id=info.node_id,
            address=info.address,
            alive=True,
            controller=info.node_id == controller,
            version=info.version,
            started_ms=info.started_ms,
        )
        for info in live.values()
    ]
    # Nodes that hold streams but have no lease now (stopped, dead, cut off from etcd).
    absent = {node for record in streams.values() for node in record.replicas} - live.keys()
    nodes += [pb.ClusterNode(id=node, alive=False) for node in absent]
    nodes.sort(key=lambda node: node.id)
    return pb.DescribeClusterResponse(
        cluster_name=cluster_name,
        node_id=node_id,
        nodes=nodes,
        streams=[placement_to_proto(streams[name], progress(name)) for name in page],
        next_page_token=next_page_token,
    )


def placement_to_proto(record: StreamPlacement, progress: Progress | None = None) -> pb.StreamPlacement:
    config = record.config
    placement = pb.StreamPlacement(
        name=record.name,
        leader=record.leader,
        replicas=record.replicas,
        in_sync_replicas=record.isr,
        leader_epoch=record.epoch,
        replication_factor=int(config.get("replication_factor", len(record.replicas))),
        acks=str(config.get("acks", "")),
        target_replicas=record.target,
    )
    if progress is not None:
        hw, replicas = progress
        placement.high_watermark = hw
        placement.progress.extend(
            pb.ReplicaProgress(node=node, log_end_offset=end, lag_ms=lag) for node, end, lag in replicas
        )
    return placement
