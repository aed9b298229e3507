"""The Python client on a real three-node cluster (`streamlog serve --cluster` processes): calls go
straight to each stream's leader (the nodes' call metrics show no forwarding), a Producer keeps
producing through a leader's kill -9 with nothing lost or doubled, and a Consumer keeps consuming
through one with every entry seen at least once."""

from __future__ import annotations

import threading
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from streamlog.v1 import streamlog_pb2 as pb

from bench.common import free_port
from clients import Client, Consumer, Producer
from clients.consumer import Message
from clients.errors import NotFoundError
from tests.cluster.helpers import TEST_TTL_MS
from tests.cluster.nodes import ClusterNodes

NODES = ("n1", "n2", "n3")
REPLICATED = {"default_replication_factor": "3", "replica_lag_ms": "1000"}
# A killed leader's lease expires within its TTL, then an election; a loaded machine takes far
# longer (see test_failover.py): the clients below are given this long to ride it out.
SETTLE_S = TEST_TTL_MS / 1000 + 55
pytestmark = pytest.mark.timeout(300)


def start(cluster_nodes: ClusterNodes, **settings: str) -> dict[str, int]:
    """Start the three nodes, each with a metrics port; the ports by node."""
    metrics = {name: free_port() for name in NODES}
    for name in NODES:
        cluster_nodes.spawn(name, metrics_port=str(metrics[name]), **settings)
    for name in NODES:
        cluster_nodes.processes[name].wait_for(r"serving \d+ streams")
    return metrics


def metric(metrics_port: int, family_name: str, suffix: str, **labels: str) -> float:
    """The sum of the node's samples `<family_name><suffix>` that carry these labels, from its
    Prometheus metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == family_name
        for sample in family.samples
        if sample.name == family_name + suffix and labels.items() <= sample.labels.items()
    )


def calls(metrics_port: int, method: str) -> float:
    """Calls of `method` the node has handled (any status)."""
    return metric(metrics_port, "streamlog_rpc_duration_seconds", "_count", method=method)


def seeds(cluster_nodes: ClusterNodes) -> list[str]:
    return [cluster_nodes.target(name) for name in NODES]


def test_calls_go_straight_to_each_streams_leader(cluster_nodes: ClusterNodes) -> None:
    metrics = start(cluster_nodes)
    streams = ["s1", "s2", "s3"]
    by_address = {cluster_nodes.target(name): name for name in NODES}
    with Client(cluster_nodes.target("n1"), timeout=30) as client:  # one seed: it learns the rest
        for stream in streams:
            client.append(stream, b"created")
        leaders = {stream: by_address[client.route(stream)] for stream in streams}
        assert set(leaders.values()) == set(NODES)  # new streams spread: one led by each node
        before = {name: (calls(metrics[name], "Append"), calls(metrics[name], "Read")) for name in NODES}
        redirects = client._routes.redirects  # the first appends were redirected: the layout grew
        for stream in streams:
            for i in range(10):
                client.append(stream, b"entry %d" % i)
            assert len(client.read(stream, 0, count=100).entries) == 11
        after = {name: (calls(metrics[name], "Append"), calls(metrics[name], "Read")) for name in NODES}
        assert client._routes.redirects == redirects  # the layout was right: no call refused
    for name in NODES:
        led = sum(1 for leader in leaders.values() if leader == name)
        # Each node saw the calls on the stream it leads, and none of the others' (a forwarded
        # call is counted at the node it entered and again at the leader).
        assert (after[name][0] - before[name][0], after[name][1] - before[name][1]) == (10 * led, led)

    # The evidence would show forwarding: a call sent to a node that does not lead the stream.
    stream = next(s for s, leader in leaders.items() if leader != "n1")
    entered = calls(metrics["n1"], "Append")
    with grpc.insecure_channel(cluster_nodes.target("n1")) as channel:
        stub = cluster_nodes.stub("n1", [channel])
        stub.Append(pb.AppendRequest(stream=stream, payloads=[b"forwarded"]), timeout=30)
    assert calls(metrics["n1"], "Append") == entered + 1


def test_a_stale_layout_gets_a_redirect_that_the_client_follows(cluster_nodes: ClusterNodes) -> None:
    cluster_nodes.start(*NODES)
    with Client(seeds(cluster_nodes), timeout=30) as client:
        client.append("orders", b"first")
        leader = client.route("orders")
        wrong = next(cluster_nodes.target(n) for n in NODES if cluster_nodes.target(n) != leader)
        client._routes._leaders["orders"] = wrong  # as if the stream had moved since
        redirects = client._routes.redirects
        client.append("orders", b"second")  # a plain append: a redirect means it was not written
        assert client._routes.redirects == redirects + 1 and client.route("orders") == leader
        assert [e.payload for e in client.read("orders", 0).entries] == [b"first", b"second"]
        with pytest.raises(NotFoundError):  # an answer, not a routing failure: the layout stays
            client.group_info("orders", "no-such-group")
        assert client._routes.leader("orders") == leader


def kill_leader(cluster_nodes: ClusterNodes, client: Client, stream: str) -> str:
    """Kill -9 the node leading `stream`; its name."""
    address = client.route(stream)
    name = next(n for n in NODES if cluster_nodes.target(n) == address)
    cluster_nodes.kill(name)
    return name


def test_a_producer_rides_out_a_leader_kill_with_nothing_lost_or_written_twice(
    cluster_nodes: ClusterNodes,
) -> None:
    cluster_nodes.start(*NODES, **REPLICATED)
    sent = [b"order %04d" % i for i in range(2000)]
    with Client(seeds(cluster_nodes), timeout=30) as client:
        client.append("orders", b"created")  # placed, replicated three ways
        with Producer(
            client, "orders", linger_ms=2, max_batch_entries=50, delivery_timeout_s=SETTLE_S
        ) as producer:
            futures = [producer.send(payload) for payload in sent[:1000]]
            futures[-1].result(timeout=60)  # some written before the kill
            killed = kill_leader(cluster_nodes, client, "orders")
            futures += [producer.send(payload) for payload in sent[1000:]]
            producer.flush(timeout=SETTLE_S + 30)
        offsets = [future.result() for future in futures]  # no error surfaced
        assert producer.retries >= 1  # the kill was felt, and ridden out
        assert client.route("orders") != cluster_nodes.target(killed)
        entries = client.read("orders", 1, count=5000).entries
    assert [entry.payload for entry in entries] == sent  # none lost, none twice, in order
    assert offsets == [entry.offset for entry in entries]


def test_a_consumer_rides_out_a_leader_kill_and_sees_every_entry(
    cluster_nodes: ClusterNodes,
) -> None:
    cluster_nodes.start(*NODES, **REPLICATED)
    total = 600
    seen: set[int] = set()
    halfway, killed = threading.Event(), threading.Event()
    with Client(seeds(cluster_nodes), timeout=30) as client:
        for start_at in range(0, total // 2, 100):
            client.append("jobs", [b"job %d" % i for i in range(start_at, start_at + 100)])

        def handle(message: Message) -> None:
            seen.add(message.offset)
            if len(seen) == 100:
                halfway.set()
                assert killed.wait(60)  # the leader dies while this consumer holds a message
            if len(seen) >= total and seen == set(range(total)):
                consumer.stop()

        with Consumer(
            client, "jobs", "workers", create=True, batch_size=20, give_up_after_s=SETTLE_S
        ) as consumer:
            runner = threading.Thread(target=consumer.run, args=(handle,))
            runner.start()
            assert halfway.wait(60)
            kill_leader(cluster_nodes, client, "jobs")
            killed.set()
            # More entries through the failover, appended idempotently (retried until acknowledged).
            for start_at in range(total // 2, total, 100):
                batch = [b"job %d" % i for i in range(start_at, start_at + 100)]
                client.append("jobs", batch, producer_id="test", producer_sequence=start_at, timeout=SETTLE_S)
            runner.join(SETTLE_S + 30)
            assert not runner.is_alive(), f"the consumer saw {len(seen)} of {total} entries"
    assert seen == set(range(total))  # every entry, at least once


def test_a_subscription_reopens_on_the_new_leader_from_where_it_was(cluster_nodes: ClusterNodes) -> None:
    cluster_nodes.start(*NODES, **REPLICATED)
    sent = [b"event %d" % i for i in range(400)]
    received: list[tuple[int, bytes]] = []
    with Client(seeds(cluster_nodes), timeout=30) as client:
        client.append("events", sent[:200])
        client.route("events")  # known: the subscription opens on the leader
        killed = False
        with client.subscribe("events", "oldest", count=50) as subscription:
            for batch in subscription:
                received += [(entry.offset, entry.payload) for entry in batch]
                if not killed and len(received) >= 100:
                    killed = True
                    kill_leader(cluster_nodes, client, "events")
                    client.append(
                        "events", sent[200:], producer_id="test", producer_sequence=1, timeout=SETTLE_S
                    )
                if len(received) >= len(sent):
                    break
    assert received == list(enumerate(sent))  # from where it was: none lost, none twice
