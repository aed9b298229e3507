"""The Spark connector on a 3-node cluster (real `streamlog serve --cluster` processes, real etcd):
a batch read spreads its partitions over the streams' in-sync replicas (readFrom=replica, the
default), each node serving some, and returns exactly what a read from the leaders returns; a
streaming query from one replicated stream into another through the exactly-once sink, its
partitions read from the replicas, the streams' leader (one of those replicas) killed (`kill -9`)
in the middle. Nothing is lost, nothing written twice, no data loss reported. The nodes' own
metrics (`streamlog_read_requests`, counted where a Read is served) show where reads went.
"""

from __future__ import annotations

from collections import Counter

import grpc
import pytest
from streamlog.v1 import streamlog_pb2 as pb

from clients import Client, StreamlogError
from pyspark_streamlog.options import Server
from pyspark_streamlog.reading import StreamRange, read_range
from tests.cluster.helpers import TEST_TTL_MS
from tests.cluster.nodes import ClusterNodes, eventually, leader_of
from tests.cluster.test_client_routing import metric, start
from tests.cluster.test_replica_reads import REPLICA

NODES = ("n1", "n2", "n3")
REPLICATED = {"default_replication_factor": "3", "replica_lag_ms": "1000"}
# Elections take the lease TTL and a few seconds; a loaded machine may take several times that.
SETTLE_S = TEST_TTL_MS / 1000 + 55
pytestmark = pytest.mark.timeout(420)


def payloads(first: int, count: int) -> list[bytes]:
    return [b"ride-%06d" % i for i in range(first, first + count)]


def reads_served(metrics_port: int, stream: str) -> float:
    """Plain Reads of `stream` the node has served (answered from its own copy)."""
    return metric(metrics_port, "streamlog_read_requests", "_total", stream=stream, mode="plain")


def serves_last(stub, stream: str, entries: list[bytes]) -> bool:
    """Whether the node serves the last of `entries` as an in-sync replica of `stream`."""
    request = pb.ReadRequest(stream=stream, offset=len(entries) - 1, count=1)
    try:
        reply = stub.Read(request, metadata=REPLICA, timeout=30)
    except grpc.RpcError as exc:  # not in sync, or it has not learned the high watermark yet
        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
        return False
    return [entry.payload for entry in reply.entries] == entries[-1:]


def all_served(metrics: dict[str, int], streams: tuple[str, ...]) -> dict[str, float]:
    return {name: sum(reads_served(port, stream) for stream in streams) for name, port in metrics.items()}


def start_nodes(cluster_nodes: ClusterNodes, stubs, **settings: str) -> dict[str, int]:
    """Start n1, n2, n3 with metrics ports (returned by node), once each sees all three live (new
    streams are then placed on all three)."""
    metrics = start(cluster_nodes, **settings)

    def all_live(name: str) -> bool:
        reply = stubs(name).DescribeCluster(pb.DescribeClusterRequest(), timeout=30)
        return {node.id for node in reply.nodes if node.alive} == set(NODES)

    for name in NODES:
        eventually(lambda n=name: all_live(n), SETTLE_S)
    return metrics


def test_a_batch_read_from_replicas_spreads_over_them_and_matches_a_read_from_leaders(
    spark, cluster_nodes: ClusterNodes, stubs
) -> None:
    # A lag far longer than the test: every replica stays in sync however loaded the machine.
    metrics = start_nodes(cluster_nodes, stubs, default_replication_factor="3", replica_lag_ms="60000")
    seeds = ",".join(cluster_nodes.target(name) for name in NODES)
    stub = {name: stubs(name) for name in NODES}
    streams = {"rides": payloads(0, 3000), "refunds": payloads(0, 500)}
    with Client(seeds, timeout=30) as client:
        for stream, entries in streams.items():
            eventually(lambda s=stream, e=entries: _appended(client, s, e), timeout_s=SETTLE_S)
    leaders = set()
    for stream, entries in streams.items():
        leaders.add(leader_of(stub["n1"], stream).leader)
        eventually(lambda s=stream: len(leader_of(stub["n1"], s).in_sync_replicas) == 3, SETTLE_S)
        for name in NODES:  # each replica serves them all (it has learned the high watermark)
            eventually(lambda n=name, s=stream, e=entries: serves_last(stub[n], s, e), SETTLE_S)

    def read(read_from: str) -> list[tuple[str, int, bytes]]:
        frame = (
            spark.read.format("streamlog")
            .option("endpoint", seeds)
            .option("streams", ",".join(streams))
            .option("minPartitions", 6)  # rides in 5 partitions, refunds in 1: two per node
            .option("readFrom", read_from)
            .load()
        )
        return sorted((row.stream, row.offset, bytes(row.payload)) for row in frame.collect())

    expected = sorted((s, offset, p) for s, entries in streams.items() for offset, p in enumerate(entries))
    before = all_served(metrics, tuple(streams))
    assert read("replica") == expected
    between = all_served(metrics, tuple(streams))
    assert read("leader") == expected
    after = all_served(metrics, tuple(streams))
    # From the replicas: every node served reads. From the leaders: only they did.
    assert all(between[name] > before[name] for name in NODES), (before, between)
    assert {name for name in NODES if after[name] > between[name]} == leaders, (between, after, leaders)

    # A task whose replica is dead (kill -9, still in the in-sync set as far as the layout says)
    # reads its whole range from another replica.
    follower = next(name for name in NODES if name not in leaders)
    cluster_nodes.kill(follower)
    task = StreamRange(Server(seeds), "rides", 0, 3000, True, False, True, 30.0, replica=follower)
    offsets = [offset for batch in read_range(task) for offset in batch.column("offset").to_pylist()]
    assert offsets == list(range(3000))


def _appended(client: Client, stream: str, entries: list[bytes]) -> bool:
    """Append `entries` once (idempotent: retried through a slow start, written once)."""
    try:
        client.append(stream, entries, producer_id=f"load-{stream}", producer_sequence=0)
    except (StreamlogError, grpc.RpcError):
        return False
    return True


def test_a_streaming_query_through_the_sink_survives_its_leaders_kill(
    spark, cluster_nodes: ClusterNodes, stubs, tmp_path
) -> None:
    metrics = start_nodes(cluster_nodes, stubs, **REPLICATED)
    seeds = ",".join(cluster_nodes.target(name) for name in NODES)
    # Created through n1, both streams are led by n1: its kill fails the source and the sink over.
    with Client(cluster_nodes.target("n1"), timeout=10) as n1:
        n1.append("rides", payloads(0, 2000), producer_id="api", producer_sequence=0)
        n1.create_group("copies", "audit", "oldest", create_stream=True)
    for stream in ("rides", "copies"):
        placement = leader_of(stubs("n1"), stream)
        assert placement.leader == "n1" and set(placement.in_sync_replicas) == set(NODES)

    query = (
        spark.readStream.format("streamlog")
        .option("endpoint", seeds)
        .option("streams", "rides")
        .option("startingOffsets", "earliest")
        .option("maxEntriesPerTrigger", 200)
        .option("timeoutMs", 60_000)
        .load()
        .select("payload")
        .writeStream.format("streamlog")
        .option("endpoint", seeds)
        .option("stream", "copies")
        .option("timeoutMs", 60_000)
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .start()
    )
    try:
        with Client(seeds, timeout=10) as client:

            def copied() -> int:
                try:
                    return client.info("copies").next_offset
                except StreamlogError:  # failing over: ask again
                    return 0

            # The micro-batches (one partition each) are read from the replicas in turn: the
            # followers serve some before the kill.
            followers = {name: metrics[name] for name in ("n2", "n3")}
            eventually(
                lambda: copied() >= 400 and sum(all_served(followers, ("rides",)).values()) > 0, SETTLE_S
            )
            cluster_nodes.kill("n1")  # kill -9, mid-query: no lease revoked (it is one of the replicas read)
            # More rides after the kill: appended through the new leader, read by the query from it.
            client.append(
                "rides", payloads(2000, 1000), producer_id="api", producer_sequence=1, timeout=SETTLE_S
            )
            eventually(lambda: copied() >= 3000 or query.exception() is not None, timeout_s=SETTLE_S * 2)
            assert query.exception() is None, query.exception()
            query.processAllAvailable()
            assert leader_of(stubs("n2"), "rides").leader in ("n2", "n3")
            written = [entry.payload for entry in client.read("copies", 0, count=10_000).entries]
    finally:
        query.stop()
    copies = Counter(written)
    assert sorted(copies) == payloads(0, 3000)  # no ride lost
    assert max(copies.values()) == 1  # none written twice
    assert len(written) == 3000
