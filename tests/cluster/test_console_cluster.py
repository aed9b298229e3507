"""The console's cluster page on a real replicated cluster (three `streamlog serve --cluster`
processes on etcd), in a real browser: it shows who leads, who is in sync, and how far behind a
paused follower is (its replication lag), as the leader's DescribeCluster reports them."""

from __future__ import annotations

import signal
from typing import Any

import grpc
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from bench.common import free_port
from tests import browsers
from tests.cluster.nodes import ClusterNodes, eventually, leader_of

REPLICATED = {"default_replication_factor": "3", "replica_lag_ms": "1000"}
browser_context = browsers.browser_context  # the fixture (tests/browsers.py)


def test_the_cluster_page_shows_leaders_in_sync_sets_and_a_paused_followers_lag(
    cluster_nodes: ClusterNodes, browser_context: Any
) -> None:
    http_port = free_port()
    cluster_nodes.start("n1", http_port=str(http_port), **REPLICATED)
    cluster_nodes.start("n2", "n3", **REPLICATED)
    with grpc.insecure_channel(cluster_nodes.target("n1")) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        stub.Append(pb.AppendRequest(stream="orders", payloads=[b"%d" % i for i in range(10)]), timeout=30)
        # The first stream of a fresh cluster goes to n1 (fewest streams, then the lowest id).
        assert leader_of(stub, "orders").leader == "n1"
        eventually(lambda: leader_of(stub, "orders").high_watermark == 10, timeout_s=60)
        cluster_nodes.signal("n3", signal.SIGSTOP)
        try:
            # Committed once n3 leaves the in-sync set (after replica_lag_ms): n1 and n2 hold them.
            stub.Append(pb.AppendRequest(stream="orders", payloads=[b"late"] * 5), timeout=60)
            placement = leader_of(stub, "orders")
            assert (placement.high_watermark, set(placement.in_sync_replicas)) == (15, {"n1", "n2"})

            page = browser_context.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            try:
                page.goto(f"http://127.0.0.1:{http_port}/#/cluster")
                page.wait_for_selector("main[aria-busy=false]", timeout=15_000)
                row = page.locator("tr", has_text="orders").first.inner_text()
                rows = page.locator("tr").all_inner_texts()
            finally:
                page.close()
        finally:
            cluster_nodes.signal("n3", signal.SIGCONT)
    assert errors == []
    # Every node has its row (n3's lease may have expired meanwhile: then it shows as down).
    assert {"n1", "n2", "n3"} <= {text.split("\t")[0] for text in rows}
    # The stream's row: its leader, its in-sync set without n3, its high watermark, and each
    # follower's progress: n2 at the end, n3 behind by the five entries it missed.
    assert "n1" in row and "high_watermark" not in row  # a table cell, not a key dump
    assert "15" in row
    assert "node: n2; log_end_offset: 15" in row
    assert "node: n3; log_end_offset: 10" in row
    in_sync = next(cell for cell in row.split("\t") if cell.replace(" ", "") in ("n1,n2", "n2,n1"))
    assert in_sync
