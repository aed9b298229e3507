"""Clustered `streamlog serve` processes that die, pause, or find their id taken.

Streams have one replica here (default_replication_factor 1; tests/cluster/test_failover.py
has replicated ones): a stream whose leader dies has no replica to take over, so it has
no leader (UNAVAILABLE, without leader trailers) until that node comes back, and then
it serves its data again. A leader
paused past its lease finds it was deposed when it resumes: the long calls it served
end with "leader changed", and it is elected again (it is the only in-sync replica).
"""

from __future__ import annotations

import base64
import json
import signal
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from tests.cluster.etcd_server import EtcdCluster
from tests.cluster.helpers import TEST_TTL_MS
from tests.cluster.nodes import ClusterNodes, eventually, leader_of
from tests.service.test_consume import Session

NODES = ("n1", "n2", "n3")
LEADER_TRAILERS = {"streamlog-leader-id", "streamlog-leader-address", "streamlog-leader-epoch"}
# A dead or paused node's lease expires within its TTL, plus etcd's expiry check and the election.
EXPIRY_S = TEST_TTL_MS / 1000 + 5


def test_a_killed_leaders_streams_have_no_leader_until_it_comes_back(
    cluster_nodes: ClusterNodes, stubs
) -> None:
    cluster_nodes.start(*NODES)
    stubs("n1").Append(pb.AppendRequest(stream="kept", payloads=[b"a", b"b", b"c"]), timeout=10)
    leader = leader_of(stubs("n1"), "kept").leader
    other, third = (stubs(node) for node in NODES if node != leader)

    cluster_nodes.kill(leader)
    eventually(lambda: leader_of(other, "kept").leader == leader_of(third, "kept").leader == "")
    for call, request, metadata in [
        (other.Append, pb.AppendRequest(stream="kept", payloads=[b"d"]), ()),
        (third.Read, pb.ReadRequest(stream="kept"), ()),
        (other.Read, pb.ReadRequest(stream="kept"), (("streamlog-route", "redirect"),)),
    ]:
        with pytest.raises(grpc.RpcError) as caught:
            call(request, metadata=metadata, timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert caught.value.details() == (
            "stream 'kept' has no leader: an election is under way or its in-sync replicas are down"
        )
        assert not LEADER_TRAILERS & {key for key, _ in caught.value.trailing_metadata()}
    described = other.DescribeCluster(pb.DescribeClusterRequest(), timeout=10)
    assert [(n.id, n.alive, n.address) for n in described.nodes if n.id == leader] == [(leader, False, "")]
    assert sum(n.alive for n in described.nodes) == 2
    # New streams go to the live nodes.
    other.Append(pb.AppendRequest(stream="fresh", payloads=[b"x"]), timeout=10)
    assert leader_of(other, "fresh").leader != leader

    cluster_nodes.start(leader)  # same port and data directory
    everyone = (other, third, stubs(leader))
    eventually(lambda: all(leader_of(stub, "kept").leader == leader for stub in everyone))
    assert leader_of(other, "kept").leader_epoch == 3  # deposed (2), then elected again (3)
    read = third.Read(pb.ReadRequest(stream="kept"), timeout=10)
    assert [e.payload for e in read.entries] == [b"a", b"b", b"c"]
    assert other.Append(pb.AppendRequest(stream="kept", payloads=[b"d"]), timeout=10).first_offset == 3


def test_a_leader_deposed_while_paused_ends_the_long_calls_it_served(
    cluster_nodes: ClusterNodes, stubs
) -> None:
    cluster_nodes.start(*NODES)
    entry = stubs("n1")
    entry.CreateGroup(
        pb.CreateGroupRequest(stream="paused", group="g", create_stream=True, start=pb.START_POSITION_OLDEST),
        timeout=10,
    )
    entry.Append(pb.AppendRequest(stream="paused", payloads=[b"a", b"b", b"c"]), timeout=10)
    leader_name = leader_of(entry, "paused").leader
    leader = stubs(leader_name)
    other = stubs(next(node for node in NODES if node != leader_name))
    assert leader_of(other, "paused").leader == leader_name  # it knows where to forward

    def caught_up(subscription) -> None:
        for reply in subscription:
            if reply.next_offset == 3:
                return

    direct = leader.Subscribe(pb.SubscribeRequest(stream="paused"), timeout=60)
    caught_up(direct)
    forwarded = other.Subscribe(pb.SubscribeRequest(stream="paused", offset=1), timeout=60)
    caught_up(forwarded)
    blocked = leader.Read.future(pb.ReadRequest(stream="paused", offset=3, block_ms=60_000), timeout=60)
    session = Session(leader, timeout=60, stream="paused", group="g", consumer="c", count=10, batches=2)
    assert len(session.next().entries) == 3  # the second batch waits for entries

    cluster_nodes.signal(leader_name, signal.SIGSTOP)
    try:
        # Its lease expires; nobody else holds the stream, so it is left without a leader.
        eventually(lambda: leader_of(other, "paused").leader == "")
    finally:
        cluster_nodes.signal(leader_name, signal.SIGCONT)
    ended = []
    for subscription in (direct, forwarded):
        with pytest.raises(grpc.RpcError) as caught:
            next(subscription)
        ended.append((caught.value.code(), caught.value.details()))
    with pytest.raises(grpc.RpcError) as caught:
        blocked.result()
    ended.append((caught.value.code(), caught.value.details()))
    ended.append(session.fails(timeout_s=10))
    assert ended == [
        (grpc.StatusCode.UNAVAILABLE, "leader changed; resubscribe from offset 3"),
        (grpc.StatusCode.UNAVAILABLE, "leader changed; resubscribe from offset 3"),
        (grpc.StatusCode.UNAVAILABLE, "leader changed; read again from offset 3"),
        (grpc.StatusCode.UNAVAILABLE, "leader changed; call again (the group keeps its position)"),
    ]
    # Back with a new lease, it is the only in-sync replica and leads again: resubscribe.
    eventually(lambda: leader_of(other, "paused").leader == leader_of(leader, "paused").leader == leader_name)
    again = other.Subscribe(pb.SubscribeRequest(stream="paused", offset=3), timeout=30)
    assert next(again).next_offset == 3
    other.Append(pb.AppendRequest(stream="paused", payloads=[b"d"]), timeout=10)
    assert [e.payload for e in next(again).entries] == [b"d"]
    again.cancel()


def test_a_node_whose_id_is_live_elsewhere_does_not_start_and_is_not_ready_meanwhile(
    cluster_nodes: ClusterNodes,
) -> None:
    cluster_nodes.start("n1")
    twin = cluster_nodes.spawn("twin", node_id="n1")
    twin.wait_for("listening on")
    # The port answers, but the node has not joined: not ready, and calls are refused.
    with grpc.insecure_channel(cluster_nodes.target("twin")) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as caught:
            pb_grpc.StreamLogServiceStub(channel).Read(pb.ReadRequest(stream="s"), timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    code, log = twin.finish(timeout_s=EXPIRY_S + 10)
    assert code == 1
    assert "cannot run the server: cannot join the cluster: node id 'n1' is registered by a live node" in log


def test_a_node_whose_id_was_taken_while_it_was_paused_shuts_down(cluster_nodes: ClusterNodes, stubs) -> None:
    cluster_nodes.start("n1", "n2")
    observer = stubs("n1")

    def live() -> list[str]:
        return [
            n.id for n in observer.DescribeCluster(pb.DescribeClusterRequest(), timeout=10).nodes if n.alive
        ]

    cluster_nodes.signal("n2", signal.SIGSTOP)
    try:
        eventually(lambda: live() == ["n1"])
        cluster_nodes.start("twin", node_id="n2")  # another process takes the id meanwhile
    finally:
        cluster_nodes.signal("n2", signal.SIGCONT)
    code, log = cluster_nodes.processes["n2"].finish(timeout_s=EXPIRY_S + 10)
    assert code == 1
    assert "cannot run the server: left the cluster: node id 'n2' is registered by a live node" in log
    assert "stopped" in log  # it drained and closed its engine before it exited
    assert live() == ["n1", "n2"]
    assert cluster_nodes.processes["twin"].process.poll() is None


def test_a_node_that_stops_ends_the_calls_it_relays_and_forwards_no_more(
    cluster_nodes: ClusterNodes, stubs
) -> None:
    cluster_nodes.start("n1", "n2")
    leader, entry = stubs("n1"), stubs("n2")
    leader.CreateGroup(
        pb.CreateGroupRequest(
            stream="relayed", group="g", create_stream=True, start=pb.START_POSITION_OLDEST
        ),
        timeout=10,
    )
    leader.Append(pb.AppendRequest(stream="relayed", payloads=[b"a", b"b"]), timeout=10)
    assert leader_of(entry, "relayed").leader == "n1"  # the first stream of a fresh cluster
    subscription = entry.Subscribe(pb.SubscribeRequest(stream="relayed"), timeout=60)
    assert next(subscription).next_offset == 2
    session = Session(entry, timeout=60, stream="relayed", group="g", consumer="c", count=10, batches=2)
    assert len(session.next().entries) == 2  # the second batch waits for entries

    cluster_nodes.signal("n2", signal.SIGTERM)
    with pytest.raises(grpc.RpcError) as caught:
        next(subscription)
    assert (caught.value.code(), caught.value.details()) == (
        grpc.StatusCode.UNAVAILABLE,
        "server is shutting down; resubscribe from offset 2",
    )
    assert session.fails(timeout_s=10) == (
        grpc.StatusCode.UNAVAILABLE,
        "server is shutting down; call again (the group keeps its position)",
    )
    code, log = cluster_nodes.processes["n2"].finish()
    assert code == 0, log
    # The leader served them to the end: nothing was left pending but the delivered batch.
    assert leader.GetPending(pb.GetPendingRequest(stream="relayed", group="g"), timeout=10).count == 2


def test_a_node_that_stops_revokes_its_lease_so_its_streams_move_at_once(
    cluster_nodes: ClusterNodes, etcd: EtcdCluster, stubs
) -> None:
    cluster_nodes.start("n1", "n2")
    stubs("n1").Append(pb.AppendRequest(stream="left", payloads=[b"x"]), timeout=10)
    assert leader_of(stubs("n2"), "left").leader == "n1"
    code, log = cluster_nodes.stop("n1")
    assert code == 0, log
    # Gone as it exited, not a lease TTL later (its last keep-alive left it more than a second).
    request = urllib.request.Request(
        f"http://127.0.0.1:{etcd.endpoints[0][1]}/v3/kv/range",
        data=json.dumps({"key": base64.b64encode(b"/streamlog/nodes/n1").decode()}).encode(),
    )
    with urllib.request.urlopen(request, timeout=5) as reply:
        assert "kvs" not in json.load(reply)
    eventually(lambda: leader_of(stubs("n2"), "left").leader == "")
