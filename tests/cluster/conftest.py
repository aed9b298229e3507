"""Fixtures for the cluster tests: real etcd processes and clustered servers, always stopped at teardown."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from bench.common import free_port
from tests.cluster.etcd_server import EtcdCluster
from tests.cluster.nodes import ClusterNodes
from tests.cluster.test_failover import NODES, Links


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[Callable[..., EtcdCluster]]:
    """Start etcd clusters (`size` members, 1 by default); all are stopped at teardown."""
    clusters: list[EtcdCluster] = []

    def start(size: int = 1) -> EtcdCluster:
        cluster = EtcdCluster(tmp_path / f"etcd{len(clusters)}", size)
        clusters.append(cluster)
        cluster.start()
        return cluster

    yield start
    for cluster in clusters:
        cluster.stop()


@pytest.fixture
def etcd(etcd_cluster: Callable[..., EtcdCluster]) -> EtcdCluster:
    """One etcd member."""
    return etcd_cluster()


@pytest.fixture
def cluster_nodes(etcd: EtcdCluster, tmp_path: Path) -> Iterator[ClusterNodes]:
    """`streamlog serve --cluster` processes on `etcd` (none started yet); all stopped at teardown."""
    nodes = ClusterNodes(etcd.endpoints, tmp_path / "nodes")
    yield nodes
    nodes.stop_all()
    nodes.print_logs()


@pytest.fixture(scope="module")
def three_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterNodes]:
    """etcd and nodes n1, n2, n3, shared by a module's tests (which must not kill them)."""
    directory = tmp_path_factory.mktemp("cluster")
    etcd = EtcdCluster(directory / "etcd")
    etcd.start()
    nodes = ClusterNodes(etcd.endpoints, directory / "nodes")
    try:
        nodes.start("n1", "n2", "n3")
        yield nodes
    finally:
        nodes.stop_all()
        nodes.print_logs()
        etcd.stop()


@pytest.fixture
def stubs(cluster_nodes: ClusterNodes) -> Iterator[Callable[[str], pb_grpc.StreamLogServiceStub]]:
    """A StreamLogService stub for node `name` of `cluster_nodes`; channels closed at teardown."""
    channels: list[grpc.Channel] = []
    yield lambda name: cluster_nodes.stub(name, channels)
    for channel in channels:
        channel.close()


@pytest.fixture
def links(cluster_nodes: ClusterNodes) -> Iterator[Links]:
    """A fault proxy in front of each of nodes n1, n2, n3 of `cluster_nodes` (their ports chosen
    now); start them with `peer_addresses=links.peer_addresses()` to dial one another through them."""
    for name in NODES:
        cluster_nodes.ports[name] = free_port()
    links = Links({name: cluster_nodes.ports[name] for name in NODES})
    yield links
    links.close()
