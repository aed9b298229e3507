"""A node's cluster figures on /metrics and its readiness, on real `streamlog serve --cluster`
processes: replication lag of a paused follower, under-replicated streams, forwarded calls,
leader changes, a restarted node that is not ready until its copies have caught up; and the
Grafana dashboard (deploy/grafana), whose every query names metrics the nodes expose."""

from __future__ import annotations

import json
import re
import signal
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from bench.common import free_port
from service.server import SERVICE_NAME
from tests.cluster.etcd_server import EtcdCluster
from tests.cluster.nodes import ClusterNodes, eventually, leader_of
from tests.cluster.test_failover import Links
from tests.ops.helpers import ROOT
from tests.service.processes import ServerProcess

NODES = ("n1", "n2", "n3")
# Leases longer than the other cluster tests' (2 s): these tests read one leader's figures over
# several steps, and on a loaded machine a 2 s lease may lapse and move the leader meanwhile.
LEASE_TTL_MS = 6000
REPLICATED = {"default_replication_factor": "3", "replica_lag_ms": "1000", "lease_ttl_ms": str(LEASE_TTL_MS)}
# A paused node's lease expires within its TTL, then the controller elects; a loaded machine
# takes several times what an idle one does (see test_failover.py).
SETTLE_S = LEASE_TTL_MS / 1000 + 55
pytestmark = pytest.mark.timeout(300)

Stubs = Callable[[str], pb_grpc.StreamLogServiceStub]
DASHBOARD = ROOT / "deploy" / "grafana" / "streamlog.json"
METRIC = re.compile(r"\bstreamlog_[a-z0-9_]+")
# The sample names each type of family exposes, besides the name its TYPE line gives.
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class Nodes(ClusterNodes):
    """Nodes with a metrics port each, kept across restarts."""

    metrics_ports: dict[str, int]

    def spawn(self, name: str, node_id: str | None = None, **settings: str) -> ServerProcess:
        port = self.metrics_ports.setdefault(name, free_port())
        return super().spawn(name, node_id, metrics_port=str(port), **settings)


@pytest.fixture
def cluster_nodes(etcd: EtcdCluster, tmp_path: Path) -> Iterator[Nodes]:
    """n1, n2, n3 replicating every stream 3 times (conftest's `stubs` call them); all stopped at
    teardown."""
    started = Nodes(etcd.endpoints, tmp_path / "nodes", **REPLICATED)
    started.metrics_ports = {}
    try:
        started.start(*NODES)
        yield started
    finally:
        started.stop_all()
        started.print_logs()


def scrape(nodes: Nodes, name: str) -> Samples:
    """/metrics of node `name`: (sample name, sorted labels) -> value."""
    port = nodes.metrics_ports[name]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def health(nodes: Nodes, name: str, service: str) -> int:
    with grpc.insecure_channel(nodes.target(name)) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=10
        )
    return reply.status


def test_lag_under_replication_and_forwarding_per_node(cluster_nodes: Nodes, stubs: Stubs) -> None:
    nodes = cluster_nodes
    first = stubs("n1")
    first.Append(pb.AppendRequest(stream="m", payloads=[b"a"]), timeout=10)
    leader = leader_of(first, "m").leader
    follower, paused = sorted(set(NODES) - {leader})
    # Through a follower: relayed to the leader, and counted there as forwarded.
    stubs(follower).Append(pb.AppendRequest(stream="m", payloads=[b"b"]), timeout=10)
    assert (
        value(scrape(nodes, follower), "streamlog_cluster_forwarded_calls_total", method="Append") or 0
    ) >= 1
    assert value(scrape(nodes, leader), "streamlog_cluster_forwarded_calls_total", method="Append") is None

    def in_sync_on_leader() -> bool:
        samples = scrape(nodes, leader)
        return (
            value(samples, "streamlog_cluster_led_streams", replicas="3", in_sync="3") == 1
            and value(samples, "streamlog_cluster_under_replicated_streams") == 0
            and value(samples, "streamlog_cluster_replication_lag_entries", follower=paused) == 0
            and value(samples, "streamlog_cluster_replication_lag_entries", follower=follower) == 0
        )

    eventually(in_sync_on_leader, SETTLE_S)
    assert value(scrape(nodes, leader), "streamlog_cluster_live_nodes") == 3

    # A paused follower falls behind: entries and time, then out of the in-sync set.
    nodes.signal(paused, signal.SIGSTOP)
    # Acknowledged once the other follower holds it: retried (idempotent, written once) while a
    # loaded machine has that follower briefly out of the in-sync set too.
    request = pb.AppendRequest(stream="m", payloads=[b"c"] * 5, producer_id="lag", producer_sequence=0)

    def appended() -> bool:
        try:
            stubs(leader).Append(request, timeout=10)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            return False
        return True

    eventually(appended, SETTLE_S)

    def lagging() -> bool:
        samples = scrape(nodes, leader)
        return (
            value(samples, "streamlog_cluster_replication_lag_entries", follower=paused) == 5
            and (value(samples, "streamlog_cluster_replication_lag_seconds", follower=paused) or 0) > 0
            and value(samples, "streamlog_cluster_replication_lag_entries", follower=follower) == 0
            and value(samples, "streamlog_cluster_under_replicated_streams") == 1
            and value(samples, "streamlog_cluster_stream_in_sync_replicas", stream="m") == 2
            and value(samples, "streamlog_cluster_led_streams", replicas="3", in_sync="2") == 1
        )

    eventually(lagging, SETTLE_S)
    nodes.signal(paused, signal.SIGCONT)
    eventually(in_sync_on_leader, SETTLE_S)
    assert value(scrape(nodes, leader), "streamlog_cluster_stream_in_sync_replicas", stream="m") is None


def test_a_restarted_node_is_alive_but_not_ready_until_its_copies_catch_up(
    cluster_nodes: Nodes, stubs: Stubs
) -> None:
    nodes = cluster_nodes
    first = stubs("n1")
    first.Append(pb.AppendRequest(stream="r", payloads=[b"a"]), timeout=10)
    leader = leader_of(first, "r").leader
    other, restarted = sorted(set(NODES) - {leader})
    for name in NODES:
        assert health(nodes, name, SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING
    code, _ = nodes.stop(restarted)
    assert code == 0
    eventually(lambda: restarted not in leader_of(first, "r").in_sync_replicas, SETTLE_S)
    stubs(leader).Append(pb.AppendRequest(stream="r", payloads=[b"b"] * 3), timeout=10)
    # It comes back dialing the leader through a proxy that holds every byte: it joins, and
    # says so to liveness (""), but cannot catch up, so StreamLogService is not ready.
    links = Links({leader: nodes.ports[leader]})
    try:
        links.cut(leader)
        nodes.spawn(restarted, peer_addresses=links.peer_addresses()).wait_for(r"serving \d+ streams")
        assert health(nodes, restarted, "") == health_pb2.HealthCheckResponse.SERVING
        assert health(nodes, restarted, SERVICE_NAME) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert value(scrape(nodes, restarted), "streamlog_cluster_copies_behind") == 1
        links.heal(leader)
        nodes.processes[restarted].wait_for("caught up: every copy on this node is in sync; ready", SETTLE_S)
        assert health(nodes, restarted, SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING
        assert value(scrape(nodes, restarted), "streamlog_cluster_copies_behind") == 0
        assert restarted in leader_of(first, "r").in_sync_replicas
    finally:
        links.close()
    # The leader paused past its lease: a follower is elected (gained there), and the old leader,
    # back, finds the stream moved on (lost).
    nodes.signal(leader, signal.SIGSTOP)
    eventually(lambda: leader_of(stubs(other), "r").leader in (other, restarted), SETTLE_S)
    elected = leader_of(stubs(other), "r").leader
    assert (
        value(scrape(nodes, elected), "streamlog_cluster_leader_changes_total", change="gained") or 0
    ) >= 1
    nodes.signal(leader, signal.SIGCONT)
    eventually(
        lambda: (
            (value(scrape(nodes, leader), "streamlog_cluster_leader_changes_total", change="lost") or 0) >= 1
        ),
        SETTLE_S,
    )


def exposed_names(nodes: Nodes, name: str) -> set[str]:
    """Every sample name node `name`'s /metrics declares (with or without samples now)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{nodes.metrics_ports[name]}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(" ")
            names.update(family + suffix for suffix in ("", *SUFFIXES.get(kind, ())))
    return names


def test_every_metric_the_dashboard_queries_is_one_the_nodes_expose(
    cluster_nodes: Nodes, stubs: Stubs
) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    queries += [
        variable["definition"] for variable in dashboard["templating"]["list"] if "definition" in variable
    ]
    assert queries and all(METRIC.search(query) for query in queries)
    stubs("n1").Append(pb.AppendRequest(stream="d", payloads=[b"a"]), timeout=10)
    exposed = set().union(*(exposed_names(cluster_nodes, name) for name in NODES))
    queried = {name for query in queries for name in METRIC.findall(query)}
    assert queried - exposed == set()
    assert {"streamlog_cluster_replication_lag_entries", "streamlog_rpc_duration_seconds_bucket"} <= queried
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
