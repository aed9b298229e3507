"""The Node.js client against a real three-node cluster (clients/node/test/cluster.test.js): calls
go to the stream's leader, a stale route is redirected, and a loop of appends and reads and a
subscription survive a kill -9 of the leader: nothing acknowledged lost, every entry delivered once."""

from __future__ import annotations

import json

import pytest

from tests.clients.nodejs import needs_node, run_node_tests
from tests.cluster.nodes import ClusterNodes


@needs_node
@pytest.mark.timeout(300)
def test_node_client_follows_the_leader_and_survives_its_kill(cluster_nodes: ClusterNodes) -> None:
    cluster_nodes.start("n1", "n2", "n3", default_replication_factor="3", default_acks="quorum")
    nodes = [
        {"id": name, "address": cluster_nodes.target(name), "pid": cluster_nodes.processes[name].process.pid}
        for name in ("n1", "n2", "n3")
    ]
    report = run_node_tests("test/cluster.test.js", {"STREAMLOG_CLUSTER_NODES": json.dumps(nodes)}, 240)
    assert "# pass 2" in report, report  # both tests ran
