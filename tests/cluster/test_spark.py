"""The Spark connector on a 3-node cluster (real `streamlog serve --cluster` processes, real etcd): a
streaming query from one replicated stream into another through the exactly-once sink, the streams'
leader killed (`kill -9`) in the middle. Nothing is lost, nothing written twice, no data loss reported.
"""

from __future__ import annotations

from collections import Counter

import pytest

from clients import Client, StreamlogError
from tests.cluster.helpers import TEST_TTL_MS
from tests.cluster.nodes import ClusterNodes, eventually, leader_of

NODES = ("n1", "n2", "n3")
REPLICATED = {"default_replication_factor": "3", "replica_lag_ms": "1000"}
# Elections take the lease TTL and a few seconds; a loaded machine may take several times that.
SETTLE_S = TEST_TTL_MS / 1000 + 55
pytestmark = pytest.mark.timeout(420)


def payloads(first: int, count: int) -> list[bytes]:
    return [b"ride-%06d" % i for i in range(first, first + count)]


def test_a_streaming_query_through_the_sink_survives_its_leaders_kill(
    spark, cluster_nodes: ClusterNodes, stubs, tmp_path
) -> None:
    cluster_nodes.start(*NODES, **REPLICATED)
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

            eventually(lambda: copied() >= 400, timeout_s=SETTLE_S)
            cluster_nodes.kill("n1")  # kill -9, mid-query: no lease revoked
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
