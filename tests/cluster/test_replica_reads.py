"""Reads from in-sync replicas (`streamlog-read-from: replica`) on real `streamlog serve --cluster`
processes: a follower serves committed entries only and wakes its readers when the high watermark
moves; its subscriptions end at a leader change (the client resumes them) and when it leaves the
in-sync set, after which it serves no more; the client's `read_from="replica"` spreads its streams'
reads over the in-sync replicas (the nodes' call metrics show where each read was served).

The raw calls here ask for a redirect too: a node that would not serve a read itself answers
UNAVAILABLE naming the leader instead of forwarding it, so a reply is proof it served the read."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from clients import Client
from tests.cluster.nodes import ClusterNodes, eventually, leader_of
from tests.cluster.test_client_routing import calls, seeds, start
from tests.cluster.test_failover import NODES, SETTLE_S, Links, Stubs

REPLICA = (("streamlog-read-from", "replica"), ("streamlog-route", "redirect"))
REDIRECT = (("streamlog-route", "redirect"),)
# acks=leader: the leader acknowledges what its followers have not all copied. A lag far longer
# than a test keeps a paused follower in the in-sync set, holding the HW back.
HELD_BACK = {"default_replication_factor": "3", "replica_lag_ms": "60000", "default_acks": "leader"}
pytestmark = pytest.mark.timeout(300)


def read(
    stub: pb_grpc.StreamLogServiceStub, offset: int = 0, stream: str = "s", **fields: object
) -> pb.ReadResponse:
    return stub.Read(pb.ReadRequest(stream=stream, offset=offset, **fields), metadata=REPLICA, timeout=30)


def served(stub: pb_grpc.StreamLogServiceStub, stream: str = "s") -> list[bytes] | None:
    """What the node serves of `stream` from offset 0 as an in-sync replica; None while it does not
    serve it so (not in sync, or it has not yet learned the HW from its leader)."""
    try:
        return payloads(read(stub, stream=stream))
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
        return None


def payloads(reply: pb.ReadResponse | pb.SubscribeResponse) -> list[bytes]:
    return [entry.payload for entry in reply.entries]


def subscribe(stub: pb_grpc.StreamLogServiceStub, offset: int = 0) -> Iterator[pb.SubscribeResponse]:
    request = pb.SubscribeRequest(stream="s", start=pb.START_POSITION_OFFSET, offset=offset)
    return stub.Subscribe(request, metadata=REPLICA, timeout=SETTLE_S * 2)


def take(subscription: Iterator[pb.SubscribeResponse], count: int) -> list[bytes]:
    """The payloads of the subscription's next replies, until `count` entries came."""
    got: list[bytes] = []
    while len(got) < count:
        got += payloads(next(subscription))
    return got


def refused_for(leader_address: str, call: object) -> None:
    """`call()` is answered with a redirect to the leader: this node did not serve it."""
    with pytest.raises(grpc.RpcError) as caught:
        call()  # type: ignore[operator]
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value
    assert dict(caught.value.trailing_metadata())["streamlog-leader-address"] == leader_address


def test_a_follower_serves_committed_entries_only_and_wakes_its_readers_as_the_watermark_moves(
    cluster_nodes: ClusterNodes, stubs: Stubs
) -> None:
    cluster_nodes.start(*NODES, **HELD_BACK)
    stub = {name: stubs(name) for name in NODES}
    committed, uncommitted = [b"committed %d" % i for i in range(5)], [b"not yet %d" % i for i in range(3)]
    stub["n1"].Append(pb.AppendRequest(stream="s", payloads=committed), timeout=30)
    leader = leader_of(stub["n1"], "s").leader
    reader, paused = (name for name in NODES if name != leader)
    eventually(lambda: leader_of(stub[leader], "s").high_watermark == 5, SETTLE_S)
    eventually(lambda: served(stub[reader]) == committed, SETTLE_S)  # it learned the HW

    cluster_nodes.signal(paused, signal.SIGSTOP)
    try:
        stub[leader].Append(pb.AppendRequest(stream="s", payloads=uncommitted), timeout=30)

        def reader_holds_them() -> bool:
            progress = leader_of(stub[leader], "s").progress
            return any(p.node == reader and p.log_end_offset == 8 for p in progress)

        eventually(reader_holds_them, SETTLE_S)
        assert leader_of(stub[leader], "s").high_watermark == 5  # the paused follower lacks them
        reply = read(stub[reader])
        assert (payloads(reply), reply.next_offset) == (committed, 5)
        # Only plain reads with the header are served there: the rest go to the leader.
        to_leader = cluster_nodes.target(leader)
        plain = pb.ReadRequest(stream="s")
        refused_for(to_leader, lambda: stub[reader].Read(plain, metadata=REDIRECT, timeout=30))
        group = pb.ReadRequest(stream="s", group="g", consumer="c")
        refused_for(to_leader, lambda: stub[reader].Read(group, metadata=REPLICA, timeout=30))
        append = pb.AppendRequest(stream="s", payloads=[b"x"])
        refused_for(to_leader, lambda: stub[reader].Append(append, metadata=REPLICA, timeout=30))
        info = pb.GetStreamInfoRequest(stream="s")
        refused_for(to_leader, lambda: stub[reader].GetStreamInfo(info, metadata=REPLICA, timeout=30))

        # A blocking read and a subscription there wait for the commit, not for the append.
        with ThreadPoolExecutor(1) as pool:
            blocked = pool.submit(read, stub[reader], 5, block_ms=int(SETTLE_S * 1000))
            subscription = subscribe(stub[reader])
            try:
                assert take(subscription, 5) == committed
                assert not blocked.done()
                cluster_nodes.signal(paused, signal.SIGCONT)
                assert payloads(blocked.result(timeout=SETTLE_S)) == uncommitted
                assert take(subscription, 3) == uncommitted
            finally:
                subscription.cancel()  # type: ignore[attr-defined]
    finally:
        cluster_nodes.signal(paused, signal.SIGCONT)


def test_a_restarted_follower_serves_nothing_past_the_watermark_it_learns(
    cluster_nodes: ClusterNodes, stubs: Stubs
) -> None:
    # Nothing committed (a paused follower in the in-sync set), while a follower holds entries:
    # restarted, its copy opens with them, and the HW its leader sends (0) raises no cap.
    cluster_nodes.start(*NODES, **HELD_BACK)
    stub = {name: stubs(name) for name in NODES}
    stub["n1"].CreateGroup(pb.CreateGroupRequest(stream="s", group="g", create_stream=True), timeout=30)
    leader = leader_of(stub["n1"], "s").leader
    restarted, paused = (name for name in NODES if name != leader)
    eventually(lambda: served(stub[restarted]) == [], SETTLE_S)
    cluster_nodes.signal(paused, signal.SIGSTOP)
    try:
        stub[leader].Append(pb.AppendRequest(stream="s", payloads=[b"not yet"] * 3), timeout=30)

        def held_by(name: str) -> bool:
            return any(
                p.node == name and p.log_end_offset == 3 for p in leader_of(stub[leader], "s").progress
            )

        eventually(lambda: held_by(restarted), SETTLE_S)
        cluster_nodes.stop(restarted)
        cluster_nodes.start(restarted, **HELD_BACK)
        stub[restarted] = stubs(restarted)
        eventually(lambda: served(stub[restarted]) is not None, SETTLE_S)
        assert held_by(restarted) and leader_of(stub[leader], "s").high_watermark == 0
        assert served(stub[restarted]) == []
    finally:
        cluster_nodes.signal(paused, signal.SIGCONT)
    eventually(lambda: served(stub[restarted]) == [b"not yet"] * 3, SETTLE_S)


def test_a_followers_subscription_ends_at_a_leader_change_and_the_client_resumes_it(
    cluster_nodes: ClusterNodes, stubs: Stubs
) -> None:
    cluster_nodes.start(*NODES, default_replication_factor="3", replica_lag_ms="1000")
    stub = {name: stubs(name) for name in NODES}
    stub["n1"].Append(pb.AppendRequest(stream="s", payloads=[b"first %d" % i for i in range(10)]), timeout=30)
    leader = leader_of(stub["n1"], "s").leader
    follower = next(name for name in NODES if name != leader)
    eventually(lambda: len(served(stub[follower]) or ()) == 10, SETTLE_S)
    subscription = subscribe(stub[follower])
    expected = [b"first %d" % i for i in range(10)] + [b"second %d" % i for i in range(5)]
    seen: list[bytes] = []
    done = threading.Event()
    with Client(seeds(cluster_nodes), timeout=30, read_from="replica") as client:
        # The client's subscription, wherever its replica is, rides out the leader change.
        def follow() -> None:
            with client.subscribe("s", 0) as tail:  # (closing the client ends it)
                for entry in tail.entries():
                    seen.append(entry.payload)
                    if len(seen) == len(expected) + 5:
                        done.set()
                        return

        with ThreadPoolExecutor(1) as pool:
            following = pool.submit(follow)
            try:
                assert take(subscription, 10) == expected[:10]
                # New committed entries reach the follower's subscribers (woken, no polling).
                client.append("s", expected[10:])
                assert take(subscription, 5) == expected[10:]
                cluster_nodes.stop(leader)  # its lease revoked: another replica is elected at once
                with pytest.raises(grpc.RpcError) as caught:
                    take(subscription, 1)
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
                assert caught.value.details() == "leader changed; resubscribe from offset 15"
                client.append("s", [b"third %d" % i for i in range(5)])
                assert done.wait(SETTLE_S)
                following.result(timeout=SETTLE_S)
            finally:
                if not done.is_set():
                    client.close()
    assert seen == expected + [b"third %d" % i for i in range(5)]  # each once, in order


def test_a_follower_out_of_the_in_sync_set_serves_no_reads(
    cluster_nodes: ClusterNodes, stubs: Stubs, links: Links
) -> None:
    settings = {"default_replication_factor": "3", "replica_lag_ms": "1000", "default_acks": "leader"}
    cluster_nodes.start(*NODES, **settings, peer_addresses=links.peer_addresses())
    stub = {name: stubs(name) for name in NODES}
    stub["n1"].Append(pb.AppendRequest(stream="s", payloads=[b"a", b"b"]), timeout=30)
    leader = leader_of(stub["n1"], "s").leader
    follower = next(name for name in NODES if name != leader)
    eventually(lambda: served(stub[follower]) == [b"a", b"b"], SETTLE_S)
    subscription = subscribe(stub[follower])
    try:
        assert take(subscription, 2) == [b"a", b"b"]
        # Its followers cut off from it, the leader takes in an entry they cannot fetch: they
        # lag, and leave the in-sync set.
        links.cut(leader)
        stub[leader].Append(pb.AppendRequest(stream="s", payloads=[b"c"]), timeout=30)
        with pytest.raises(grpc.RpcError) as caught:
            take(subscription, 1)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert caught.value.details() == "this replica left the in-sync set; resubscribe from offset 2"
    finally:
        subscription.cancel()  # type: ignore[attr-defined]
    eventually(lambda: list(leader_of(stub[follower], "s").in_sync_replicas) == [leader], SETTLE_S)
    refused_for(cluster_nodes.target(leader), lambda: read(stub[follower]))
    # A client reading from replicas reads from the leader, the only one in sync.
    with Client(cluster_nodes.target(follower), timeout=30, read_from="replica") as client:
        assert [e.payload for e in client.read("s", 0).entries] == [b"a", b"b", b"c"]
        assert client._routes.replica("s") == cluster_nodes.target(leader)
    links.heal(leader)
    eventually(lambda: len(leader_of(stub[follower], "s").in_sync_replicas) == 3, SETTLE_S)
    eventually(lambda: served(stub[follower]) == [b"a", b"b", b"c"], SETTLE_S)


def test_a_client_reading_from_replicas_spreads_its_streams_over_the_in_sync_replicas(
    cluster_nodes: ClusterNodes,
) -> None:
    metrics = start(cluster_nodes, default_replication_factor="3", replica_lag_ms="30000")
    by_address = {cluster_nodes.target(name): name for name in NODES}
    streams = ["s1", "s2", "s3"]
    with grpc.insecure_channel(cluster_nodes.target("n1")) as channel:
        n1 = pb_grpc.StreamLogServiceStub(channel)

        def n1_sees_all() -> bool:  # the client's first appends go to n1, which places the streams
            reply = n1.DescribeCluster(pb.DescribeClusterRequest(), timeout=30)
            return {node.id for node in reply.nodes if node.alive} == set(NODES)

        eventually(n1_sees_all, SETTLE_S)
    with Client(seeds(cluster_nodes), timeout=30, read_from="replica") as client:
        for stream in streams:
            client.append(stream, [b"x"] * 5)
        # Placed on all three nodes (the fewest streams, then the lowest id): n1 leads them all.
        assert {by_address[client.route(stream)] for stream in streams} == {"n1"}
        for name in NODES:  # every replica is in sync and has learned the HW: it serves all five
            with grpc.insecure_channel(cluster_nodes.target(name)) as channel:
                node = pb_grpc.StreamLogServiceStub(channel)
                for stream in streams:
                    eventually(lambda n=node, s=stream: served(n, s) == [b"x"] * 5, SETTLE_S)
        for stream in streams:  # each stream's first read chooses its replica, in turn
            assert len(client.read(stream, 0).entries) == 5
        chosen = {stream: by_address[client._routes.replica(stream)] for stream in streams}
        assert set(chosen.values()) == set(NODES)  # spread: each node serves one stream's reads
        before = {name: calls(metrics[name], "Read") for name in NODES}
        for stream in streams:
            for _ in range(10):
                assert len(client.read(stream, 0).entries) == 5
        after = {name: calls(metrics[name], "Read") for name in NODES}
        # Each read was served where it was sent, none forwarded (a forwarded call counts twice).
        assert {name: after[name] - before[name] for name in NODES} == {name: 10 for name in NODES}
        # A read may name its replica: served there, whatever the stream's replica in turn is.
        assert client.in_sync_replicas("s1") == list(NODES)
        for name in NODES:
            before = calls(metrics[name], "Read")
            assert len(client.read("s1", 0, replica=name).entries) == 5
            assert calls(metrics[name], "Read") == before + 1
        # Killed (still in the in-sync set, its lease not expired): a read that prefers it fails
        # there once and is served by another replica, and the next ones do not try it again.
        cluster_nodes.kill("n3")
        lookups = client._routes.lookups
        before = {name: calls(metrics[name], "Read") for name in ("n1", "n2")}
        for _ in range(3):
            assert len(client.read("s1", 0, replica="n3").entries) == 5
        after = {name: calls(metrics[name], "Read") for name in ("n1", "n2")}
        assert sum(after.values()) - sum(before.values()) == 3
        assert client._routes.lookups == lookups + 1  # once, after the failure
