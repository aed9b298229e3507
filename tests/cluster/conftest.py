"""Fixtures for the cluster tests: real etcd processes, always stopped at teardown."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.cluster.etcd_server import EtcdCluster


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
