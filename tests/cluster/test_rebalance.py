"""Growing, shrinking and moving, on real `streamlog serve --cluster` processes: a fourth node and
`streamlog cluster rebalance` under a running Producer and Consumer, `streamlog cluster drain`, a
killed node's replicas re-created elsewhere, and a rebalance finished by the next controller."""

from __future__ import annotations

import collections
import io
import os
import threading
import time
from typing import Any

import grpc
import pytest
from streamlog.v1 import streamlog_pb2 as pb

from bench.replicalogs import read_replica
from clients import Client, Consumer, Producer
from clients.cli import main
from clients.consumer import Message
from storage.layout import stream_directory
from tests.cluster.nodes import ClusterNodes, eventually, leader_of

# 6 s leases: 2 s ones lapsed at load 20, moving leaders in the middle of the tests' set-up.
REPLICATED = {"default_replication_factor": "3", "replica_lag_ms": "1000", "lease_ttl_ms": "6000"}
# Moves copy, then wait for an in-sync set change and a controller step; a loaded machine takes
# far longer than an idle one (see test_failover.py): these tests check outcomes, not speed.
SETTLE_S = 90
pytestmark = pytest.mark.timeout(400)


def seeds(cluster_nodes: ClusterNodes, last: str = "") -> list[str]:
    """Every node's address, node `last` the last (a client asks its first seed for the layout)."""
    names = sorted(cluster_nodes.processes, key=lambda name: name == last)
    return [cluster_nodes.target(name) for name in names]


def cli(cluster_nodes: ClusterNodes, *args: str, last: str = "") -> tuple[int, str]:
    """`streamlog cluster ARGS` with every node as a seed; its exit code and output."""
    out = io.StringIO()
    addresses = ",".join(seeds(cluster_nodes, last))
    code = main(["cluster", *args, "--address", addresses, "--max-wait", str(SETTLE_S)], out)
    return code, out.getvalue()


def fill(client: Client, streams: list[str]) -> dict[str, Any]:
    """Entries in each stream and a group with entries pending; what each should keep."""
    kept = {}
    for stream in streams:
        entries = [b"%s entry %d" % (stream.encode(), i) for i in range(300)]
        client.append(
            stream, entries, producer_id=f"fill-{stream}", producer_sequence=0
        )  # retried if need be
        client.create_group(stream, "g", "oldest")
        read = client.read_group(stream, "g", "c1", count=20)
        client.ack(stream, "g", [entry.offset for entry in read.entries[:5]])
        kept[stream] = state(client, stream)
    return kept


def state(client: Client, stream: str) -> tuple[Any, ...]:
    """A stream's entries, its group's position and its pending list (owners, delivery counts)."""
    entries = [(e.offset, e.timestamp_ms, e.payload) for e in client.read(stream, 0, count=10_000).entries]
    info = client.group_info(stream, "g")
    pending = client.pending(stream, "g", count=1000)
    rows = [(p.offset, p.consumer, p.delivery_count) for p in pending.entries]
    return entries, info.next_offset, info.entries_read, rows


def layout(client: Client) -> dict[str, Any]:
    return {s.name: s for s in client.describe_cluster().streams}


def replica_counts(client: Client, nodes: list[str]) -> dict[str, int]:
    counts = collections.Counter(node for s in layout(client).values() for node in s.replicas)
    return {node: counts[node] for node in nodes}


def test_a_move_asked_wrongly_is_refused_with_the_right_status(
    cluster_nodes: ClusterNodes, stubs: Any
) -> None:
    cluster_nodes.start("n1", "n2")
    stub = stubs("n1")
    stub.Append(pb.AppendRequest(stream="s", payloads=[b"x"]), timeout=30)
    cases = [
        (pb.ReassignReplicasRequest(stream="s"), grpc.StatusCode.INVALID_ARGUMENT, "at least one"),
        (
            pb.ReassignReplicasRequest(stream="s", replicas=["n1", "n1"]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "twice",
        ),
        (
            pb.ReassignReplicasRequest(stream="s", replicas=["bad/id"]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "node id",
        ),
        (
            pb.ReassignReplicasRequest(stream="s", replicas=["n1"] * 65),
            grpc.StatusCode.INVALID_ARGUMENT,
            "64",
        ),
        (pb.ReassignReplicasRequest(stream="", replicas=["n1"]), grpc.StatusCode.INVALID_ARGUMENT, "stream"),
        (pb.ReassignReplicasRequest(stream="none", replicas=["n1"]), grpc.StatusCode.NOT_FOUND, "'none'"),
        (pb.ReassignReplicasRequest(stream="s", replicas=["n9"]), grpc.StatusCode.FAILED_PRECONDITION, "n9"),
        (
            pb.ReassignReplicasRequest(stream="s", replicas=["n1"], cancel=True),
            grpc.StatusCode.INVALID_ARGUMENT,
            "cancel",
        ),
        (pb.ReassignReplicasRequest(stream="none", cancel=True), grpc.StatusCode.NOT_FOUND, "'none'"),
    ]
    for request, code, text in cases:
        with pytest.raises(grpc.RpcError) as refused:
            stub.ReassignReplicas(request, timeout=30)
        assert (refused.value.code(), text in refused.value.details()) == (code, True), refused.value
    assert not leader_of(stub, "s").target_replicas  # nothing was written
    # A move to where the stream already is changes nothing; a real one is carried out.
    here = list(leader_of(stub, "s").replicas)
    assert not stub.ReassignReplicas(
        pb.ReassignReplicasRequest(stream="s", replicas=here), timeout=30
    ).placement.target_replicas
    there = ["n2"] if here == ["n1"] else ["n1"]
    assert (
        stub.ReassignReplicas(
            pb.ReassignReplicasRequest(stream="s", replicas=there), timeout=30
        ).placement.target_replicas
        == there
    )
    eventually(
        lambda: list(leader_of(stub, "s").replicas) == there and not leader_of(stub, "s").target_replicas, 60
    )
    assert [e.payload for e in stub.Read(pb.ReadRequest(stream="s"), timeout=30).entries] == [b"x"]
    # A target of another size is the stream's replica count from then on, as in Kafka.
    both = [*there, *here]
    stub.ReassignReplicas(pb.ReassignReplicasRequest(stream="s", replicas=both), timeout=30)
    eventually(lambda: not leader_of(stub, "s").target_replicas, 60)  # the move done
    assert (list(leader_of(stub, "s").replicas), leader_of(stub, "s").replication_factor) == (both, 2)


def test_a_rebalance_onto_a_new_node_moves_replicas_live(cluster_nodes: ClusterNodes) -> None:
    cluster_nodes.start("n1", "n2", "n3", **REPLICATED)
    streams = [f"s{i}" for i in range(6)]
    sent = [b"order %04d" % i for i in range(3000)]
    seen: set[int] = set()
    with Client(seeds(cluster_nodes), timeout=30) as client:
        kept = fill(client, streams)
        client.append("orders", b"created")
        cluster_nodes.start("n4", **REPLICATED)
        client.append("fresh", b"new")  # a new stream spreads onto the new node at once
        assert "n4" in layout(client)["fresh"].replicas

        def handle(message: Message) -> None:
            seen.add(message.offset)
            if seen >= set(range(len(sent) + 1)):
                consumer.stop()

        with (
            Producer(
                client, "orders", linger_ms=2, max_batch_entries=20, delivery_timeout_s=SETTLE_S
            ) as producer,
            # retry_ms: a batch whose reply a leader change cut off is pending for this consumer,
            # and comes back after it (docs/API.md#consume), as at-least-once asks.
            Consumer(
                client,
                "orders",
                "workers",
                create=True,
                batch_size=20,
                retry_ms=3000,
                give_up_after_s=SETTLE_S,
            ) as consumer,
        ):
            runner = threading.Thread(target=consumer.run, args=(handle,))
            runner.start()
            futures = [producer.send(payload) for payload in sent[:1000]]

            def produce_rest() -> None:
                for payload in sent[1000:]:
                    futures.append(producer.send(payload))
                    time.sleep(0.001)

            feeder = threading.Thread(target=produce_rest)
            feeder.start()
            code, output = cli(cluster_nodes, "rebalance")  # while the Producer and Consumer run
            feeder.join(SETTLE_S)
            producer.flush(timeout=SETTLE_S)
            runner.join(SETTLE_S)
            assert not runner.is_alive(), f"the consumer saw {len(seen)} of {len(sent)} entries"
        assert code == 0, output
        offsets = [future.result() for future in futures]
        entries = client.read("orders", 1, count=10_000).entries
        assert [e.payload for e in entries] == sent  # none lost, none twice, in order
        assert offsets == [e.offset for e in entries]
        assert seen == set(range(len(sent) + 1))  # the consumer saw every entry
        counts = replica_counts(client, ["n1", "n2", "n3", "n4"])
        assert min(counts.values()) >= 1 and max(counts.values()) - min(counts.values()) <= 1, counts
        placed = layout(client)
        assert all(not s.target_replicas and len(s.replicas) == 3 for s in placed.values())
        assert all(set(s.in_sync_replicas) == set(s.replicas) for s in placed.values())
        for stream in streams:
            assert state(client, stream) == kept[stream]  # entries, group position, pending list
        assert "n4" in output and "done" in output


def test_a_drained_node_holds_no_replica_and_the_streams_stay_readable(cluster_nodes: ClusterNodes) -> None:
    cluster_nodes.start("n1", "n2", "n3", "n4", **REPLICATED)
    streams = [f"s{i}" for i in range(4)]
    with Client(seeds(cluster_nodes), timeout=30) as client:
        kept = fill(client, streams)
        assert replica_counts(client, ["n2"])["n2"] == 3
        code, output = cli(cluster_nodes, "drain", "n2", "--dry-run")  # the plan only
        assert code == 0 and "3 stream(s) to move" in output, output
        assert replica_counts(client, ["n2"])["n2"] == 3 and not any(
            s.target_replicas for s in layout(client).values()
        )
        assert cli(cluster_nodes, "drain", "n9")[0] == 2  # no such node: a usage error
        code, output = cli(cluster_nodes, "drain", "n2")
        assert code == 0, output
        placed = layout(client)
        for stream in streams:
            assert "n2" not in placed[stream].replicas and len(placed[stream].replicas) == 3
            assert set(placed[stream].in_sync_replicas) == set(placed[stream].replicas)
            assert state(client, stream) == kept[stream]
    # Its copies went too: read offline, its data directory holds none of the streams.
    cluster_nodes.stop("n2")
    replica, problems = read_replica(cluster_nodes.directory / "n2", "n2")
    assert problems == [] and not set(replica) & set(streams)


def test_a_dead_nodes_replicas_are_re_created_elsewhere_after_the_delay(cluster_nodes: ClusterNodes) -> None:
    settings = {**REPLICATED, "replica_replace_after_ms": "3000"}
    cluster_nodes.start("n1", "n2", "n3", "n4", **settings)
    streams = [f"s{i}" for i in range(4)]
    with Client(seeds(cluster_nodes)[:3], timeout=30) as client:
        kept = fill(client, streams)
        on_n4 = [name for name, s in layout(client).items() if "n4" in s.replicas]
        assert len(on_n4) == 3
        cluster_nodes.kill("n4")
        killed_at = time.monotonic()

        def replaced() -> bool:
            placed = layout(client)
            return all(
                "n4" not in s.replicas and len(s.replicas) == 3 and set(s.in_sync_replicas) == set(s.replicas)
                for s in placed.values()
            )

        eventually(replaced, timeout_s=SETTLE_S)
        assert time.monotonic() - killed_at >= 3  # not before the delay
        for stream in streams:
            assert state(client, stream)[0] == kept[stream][0]


def test_a_rebalance_whose_controller_dies_midway_finishes_under_the_next(
    cluster_nodes: ClusterNodes,
) -> None:
    settings = {**REPLICATED, "max_concurrent_moves": "1"}
    cluster_nodes.start("n1", "n2", "n3", **settings)
    streams = [f"s{i}" for i in range(8)]
    with Client(seeds(cluster_nodes), timeout=30) as client:
        controller = next(n.id for n in client.describe_cluster().nodes if n.controller)
    with Client(seeds(cluster_nodes, last=controller), timeout=30) as client:
        for stream in streams:
            for start in range(0, 20_000, 5000):
                entries = [b"%s %06d" % (stream.encode(), i) + b"." * 100 for i in range(start, start + 5000)]
                client.append(stream, entries, producer_id=f"fill-{stream}", producer_sequence=start)
        kept = {stream: client.count(stream, 0) for stream in streams}
        cluster_nodes.start("n4", **settings)
        result: list[tuple[int, str]] = []
        rebalance = threading.Thread(
            target=lambda: result.append(cli(cluster_nodes, "rebalance", last=controller))
        )
        rebalance.start()

        def midway() -> bool:
            moving = [s for s in layout(client).values() if s.target_replicas]
            done = sum(1 for s in layout(client).values() if "n4" in s.replicas and not s.target_replicas)
            return bool(moving) and done >= 1

        eventually(midway, timeout_s=SETTLE_S)
        cluster_nodes.kill(controller)  # kill -9: the moves under way stop with it
        eventually(
            lambda: any(n.controller and n.id != controller for n in client.describe_cluster().nodes),
            timeout_s=SETTLE_S,
        )
        cluster_nodes.start(controller, **settings)  # back, as a plain node: a target may name it
        rebalance.join(SETTLE_S * 2)
        assert result and result[0][0] == 0, result
        counts = replica_counts(client, ["n1", "n2", "n3", "n4"])
        assert max(counts.values()) - min(counts.values()) <= 1, counts
        for stream in streams:
            assert client.count(stream, 0) == kept[stream]


# A throttled move: streams of random (incompressible) entries, so that the bytes copied are
# about the payload's; the copy then takes about size / rate.
THROTTLED = {"default_replication_factor": "1", "lease_ttl_ms": "6000"}
BIG_ENTRIES = 10_000


def fill_random(stub: Any, stream: str) -> None:
    for _ in range(BIG_ENTRIES // 1000):
        stub.Append(
            pb.AppendRequest(stream=stream, payloads=[os.urandom(100) for _ in range(1000)]), timeout=30
        )


def copy_of(cluster_nodes: ClusterNodes, node: str, stream: str) -> bool:
    """Whether node's data directory holds a copy of the stream (read from outside, while it runs)."""
    return stream_directory(cluster_nodes.directory / node, stream).is_dir()


def test_a_throttled_move_copies_at_about_the_rate_set(cluster_nodes: ClusterNodes, stubs: Any) -> None:
    rate = 100_000  # bytes/s: about 10 s for the stream's 1 MB
    cluster_nodes.start("n1", "n2", move_bytes_per_s=str(rate), **THROTTLED)
    stub = stubs("n1")
    fill_random(stub, "big")
    [source] = leader_of(stub, "big").replicas
    [destination] = {"n1", "n2"} - {source}
    size = stubs(source).GetStreamInfo(pb.GetStreamInfoRequest(stream="big"), timeout=30).info.bytes_on_disk
    assert size >= BIG_ENTRIES * 100
    started = time.monotonic()
    stub.ReassignReplicas(pb.ReassignReplicasRequest(stream="big", replicas=[destination]), timeout=30)
    eventually(lambda: list(leader_of(stub, "big").replicas) == [destination], SETTLE_S)
    took = time.monotonic() - started
    # At least the payload's bytes at the rate (unthrottled, this copy takes well under a second);
    # at most twice the stream's size at the rate, plus the controller's steps on a loaded machine.
    assert BIG_ENTRIES * 100 / rate * 0.9 <= took <= 2 * size / rate + 20, (took, size)
    reply = stubs(destination).Read(pb.ReadRequest(stream="big", offset=BIG_ENTRIES - 1), timeout=30)
    assert [e.offset for e in reply.entries] == [BIG_ENTRIES - 1]


def test_a_move_cancelled_midway_drops_the_new_replica_and_keeps_the_old(
    cluster_nodes: ClusterNodes, stubs: Any
) -> None:
    # Throttled so that the copy takes about 20 s: the cancel comes in the middle of it.
    cluster_nodes.start("n1", "n2", move_bytes_per_s="50000", **THROTTLED)
    stub = stubs("n1")
    fill_random(stub, "big")
    before = leader_of(stub, "big")
    [source] = before.replicas
    [added] = {"n1", "n2"} - {source}
    stub.ReassignReplicas(pb.ReassignReplicasRequest(stream="big", replicas=[source, added]), timeout=30)

    def copying() -> bool:
        placement = (
            stubs(source).DescribeCluster(pb.DescribeClusterRequest(prefix="big"), timeout=10).streams[0]
        )
        ends = {p.node: p.log_end_offset for p in placement.progress}
        return list(placement.replicas) == [source, added] and 0 < ends.get(added, 0) < BIG_ENTRIES

    eventually(copying, SETTLE_S)
    assert copy_of(cluster_nodes, added, "big")
    out = io.StringIO()
    code = main(["cluster", "cancel-moves", "--address", cluster_nodes.target("n1")], out)
    text = out.getvalue()
    assert code == 0 and "big: move cancelled, back on" in text and "1 move(s) cancelled" in text, text
    after = leader_of(stub, "big")
    assert (list(after.replicas), list(after.in_sync_replicas), after.leader, after.leader_epoch) == (
        [source],
        [source],
        source,
        before.leader_epoch,
    )
    assert not after.target_replicas and after.replication_factor == before.replication_factor
    eventually(lambda: not copy_of(cluster_nodes, added, "big"), SETTLE_S)  # its copy deleted
    reply = stub.Read(pb.ReadRequest(stream="big", offset=BIG_ENTRIES - 1), timeout=30)
    assert [e.offset for e in reply.entries] == [BIG_ENTRIES - 1]
    # Nothing left to cancel: the stream stays as it is.
    out = io.StringIO()
    assert main(["cluster", "cancel-moves", "big", "--address", cluster_nodes.target("n1")], out) == 0
    assert "big: no move in progress" in out.getvalue() and list(leader_of(stub, "big").replicas) == [source]
