"""DescribeCluster on a single server: one node, no cluster, no placement (clusters: tests/cluster)."""

from __future__ import annotations

import importlib.metadata

from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from tests.service.helpers import append


def test_a_single_server_describes_itself_as_one_node(stub: pb_grpc.StreamLogServiceStub) -> None:
    append(stub, "orders", b"x")
    reply = stub.DescribeCluster(pb.DescribeClusterRequest(), timeout=5)
    assert reply.cluster_name == "" and reply.node_id == ""
    assert list(reply.nodes) == [pb.ClusterNode(alive=True, version=importlib.metadata.version("streamlog"))]
    # No placement: a single server's streams are listed by ListStreams.
    assert list(reply.streams) == [] and reply.next_page_token == ""

