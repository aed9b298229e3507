"""A cluster of three `streamlog serve` processes: every call works on any node.

The nodes forward each call to its stream's leader and relay the answer, for unary
calls, Subscribe and Consume alike; redirect mode answers with the leader's address;
DescribeCluster, ListStreams and `streamlog cluster` show the cluster's catalog. One
cluster serves the whole module; each test uses streams of its own and finds their
leaders in DescribeCluster (the least loaded node gets each new stream).
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import grpc
import pytest
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from clients.cli import main as cli_main
from service.errors import NEXT_OFFSET_TRAILER
from tests.cluster.nodes import ClusterNodes, eventually, leader_of
from tests.service.test_consume import Session

NODES = ("n1", "n2", "n3")
Stubs = dict[str, pb_grpc.StreamLogServiceStub]
REDIRECT = (("streamlog-route", "redirect"),)


@pytest.fixture(scope="module")
def stubs(three_nodes: ClusterNodes) -> Iterator[Stubs]:
    channels: list[grpc.Channel] = []
    yield {node: three_nodes.stub(node, channels) for node in NODES}
    for channel in channels:
        channel.close()


def placed(stubs: Stubs, stream: str) -> tuple[str, list[str]]:
    """The stream's leader and the two other nodes, once every node knows the stream (a node
    learns of one created through another from its watch, a moment later)."""
    leaders = {leader_of(stubs[node], stream).leader for node in NODES}
    assert len(leaders) == 1, leaders
    leader = leaders.pop()
    return leader, [node for node in NODES if node != leader]


def create(stubs: Stubs, stream: str, *payloads: bytes) -> tuple[str, list[str]]:
    """Create `stream` (through n1) with `payloads`; return its leader and the two other nodes."""
    stubs["n1"].Append(pb.AppendRequest(stream=stream, payloads=payloads or [b"first"]), timeout=10)
    return placed(stubs, stream)


def failure(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call(*args, timeout=10, **kwargs)
    return caught.value


def test_appends_and_reads_work_through_every_node(stubs: Stubs) -> None:
    for index, node in enumerate(NODES):
        reply = stubs[node].Append(
            pb.AppendRequest(stream="everywhere", payloads=[node.encode()]), timeout=10
        )
        assert (reply.first_offset, reply.last_offset) == (index, index)
    for node in NODES:
        read = stubs[node].Read(pb.ReadRequest(stream="everywhere", count=10), timeout=10)
        assert [e.payload for e in read.entries] == [b"n1", b"n2", b"n3"]
        info = stubs[node].GetStreamInfo(pb.GetStreamInfoRequest(stream="everywhere"), timeout=10).info
        assert (info.name, info.next_offset) == ("everywhere", 3)
    # A blocking read through one node that does not lead is woken by an append through the other.
    _leader, (first, second) = create(stubs, "woken")
    waiting = stubs[first].Read.future(pb.ReadRequest(stream="woken", offset=1, block_ms=10_000), timeout=20)
    stubs[second].Append(pb.AppendRequest(stream="woken", payloads=[b"late"]), timeout=10)
    assert [(e.offset, e.payload) for e in waiting.result().entries] == [(1, b"late")]


def test_a_subscription_through_a_node_that_does_not_lead(stubs: Stubs) -> None:
    _leader, (first, second) = create(stubs, "followed", b"e0")
    subscription = stubs[first].Subscribe(pb.SubscribeRequest(stream="followed"), timeout=30)
    received = []
    for reply in subscription:
        received += [e.payload for e in reply.entries]
        if reply.next_offset == 1:
            # Caught up: the next entries come as they are appended, through the other node.
            stubs[second].Append(pb.AppendRequest(stream="followed", payloads=[b"e1", b"e2"]), timeout=10)
        if reply.next_offset == 3:
            break
    subscription.cancel()
    assert received == [b"e0", b"e1", b"e2"]


def test_groups_and_a_consume_session_through_nodes_that_do_not_lead(stubs: Stubs) -> None:
    # The stream is created by CreateGroup (create_stream), through a node that will not lead it
    # only by chance: find the leader after.
    stubs["n2"].CreateGroup(
        pb.CreateGroupRequest(
            stream="consumed", group="g", create_stream=True, start=pb.START_POSITION_OLDEST
        ),
        timeout=10,
    )
    _leader, (first, second) = placed(stubs, "consumed")
    stubs[second].Append(pb.AppendRequest(stream="consumed", payloads=[b"a", b"b", b"c"]), timeout=10)

    session = Session(stubs[first], stream="consumed", group="g", consumer="c1", count=2, batches=1)
    try:
        batch = session.next()
        assert [(e.offset, e.payload) for e in batch.entries] == [(0, b"a"), (1, b"b")]
        session.send(ack_offsets=[0, 1], batches=1)
        batch = session.next()
        assert [e.payload for e in batch.entries] == [b"c"] and batch.acknowledged == 2
        session.close()
        replies, code, _ = session.end()
        assert code == grpc.StatusCode.OK and replies == []
    finally:
        session.cancel()
    # What the session did is the group's state on the leader, seen through another node.
    pending = stubs[second].GetPending(pb.GetPendingRequest(stream="consumed", group="g"), timeout=10)
    assert (pending.count, pending.lowest_offset) == (1, 2)
    read = stubs[second].Read(
        pb.ReadRequest(stream="consumed", group="g", consumer="c2", claim_idle_ms=0, ack_offsets=[2]),
        timeout=10,
    )
    assert read.acknowledged == 1
    info = stubs[first].GetGroupInfo(pb.GetGroupInfoRequest(stream="consumed", group="g"), timeout=10).group
    assert (info.pending, info.next_offset) == (0, 3)


def test_the_leaders_errors_and_trailers_come_back_unchanged(stubs: Stubs) -> None:
    _leader, (first, _second) = create(stubs, "conditional", b"x", b"y")
    error = failure(
        stubs[first].Append, pb.AppendRequest(stream="conditional", payloads=[b"z"], expected_next_offset=5)
    )
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (NEXT_OFFSET_TRAILER, "2") in tuple(error.trailing_metadata())
    error = failure(stubs[first].GetGroupInfo, pb.GetGroupInfoRequest(stream="conditional", group="none"))
    assert error.code() == grpc.StatusCode.NOT_FOUND and "none" in error.details()
    # Names the cluster does not know are answered where they arrive.
    error = failure(stubs[first].Read, pb.ReadRequest(stream="never-created"))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    error = failure(stubs[first].Append, pb.AppendRequest(stream="", payloads=[b"x"]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_redirect_mode_answers_with_the_leaders_address(stubs: Stubs, three_nodes: ClusterNodes) -> None:
    leader, (first, _second) = create(stubs, "redirected")
    epoch = leader_of(stubs["n1"], "redirected").leader_epoch
    error = failure(
        stubs[first].Append, pb.AppendRequest(stream="redirected", payloads=[b"x"]), metadata=REDIRECT
    )
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    trailers = dict(error.trailing_metadata())
    assert trailers["streamlog-leader-id"] == leader
    assert trailers["streamlog-leader-address"] == three_nodes.target(leader)
    assert trailers["streamlog-leader-epoch"] == str(epoch)
    # Nothing was written; the leader itself serves the same call.
    assert (
        stubs[leader]
        .Append(pb.AppendRequest(stream="redirected", payloads=[b"x"]), metadata=REDIRECT, timeout=10)
        .first_offset
        == 1
    )


def test_a_forwarded_call_is_never_forwarded_again(stubs: Stubs) -> None:
    leader, (first, _second) = create(stubs, "once")
    error = failure(
        stubs[first].Read,
        pb.ReadRequest(stream="once"),
        metadata=(("streamlog-forwarded-by", "elsewhere"),),
    )
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert f"led by node {leader!r}" in error.details() and "'elsewhere'" in error.details()
    assert "streamlog-leader-id" not in dict(error.trailing_metadata())
    # Forwarded here for a stream this node has not heard of: its view is behind the forwarder's,
    # so not NOT_FOUND (which would say the stream does not exist) but a retry.
    error = failure(
        stubs[first].Read,
        pb.ReadRequest(stream="unheard-of"),
        metadata=(("streamlog-forwarded-by", "elsewhere"),),
    )
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "has not heard of it yet" in error.details()


def test_describe_cluster_and_list_streams_show_the_whole_cluster(
    stubs: Stubs, three_nodes: ClusterNodes
) -> None:
    names = [f"catalog-{i}" for i in range(4)]
    for index, name in enumerate(names):
        stubs[NODES[index % 3]].Append(pb.AppendRequest(stream=name, payloads=[b"x"]), timeout=10)
    for name in names:
        placed(stubs, name)
    for node in NODES:
        described = stubs[node].DescribeCluster(pb.DescribeClusterRequest(prefix="catalog-"), timeout=10)
        assert (described.cluster_name, described.node_id) == ("streamlog", node)
        assert [(n.id, n.address, n.alive) for n in described.nodes] == [
            (n, three_nodes.target(n), True) for n in NODES
        ]
        assert sum(n.controller for n in described.nodes) == 1
        assert [s.name for s in described.streams] == names
        for placement in described.streams:
            assert placement.leader in NODES and list(placement.replicas) == [placement.leader]
            assert list(placement.in_sync_replicas) == [placement.leader] and placement.leader_epoch == 1
            assert placement.replication_factor == 1
            # The high watermark and progress come from the leader only (1 entry, committed).
            if placement.leader == node:
                assert placement.high_watermark == 1
                assert [(p.node, p.log_end_offset) for p in placement.progress] == [(node, 1)]
            else:
                assert not placement.HasField("high_watermark") and not placement.progress
        # New streams go to the least loaded nodes: four streams are not all on one.
        assert len({s.leader for s in described.streams}) > 1
        # ListStreams pages through the cluster's catalog on any node.
        listed, token = [], ""
        while True:
            page = stubs[node].ListStreams(
                pb.ListStreamsRequest(prefix="catalog-", page_size=3, page_token=token), timeout=10
            )
            listed += page.streams
            token = page.next_page_token
            if not token:
                break
        assert listed == names


def test_delete_stream_through_any_node_deletes_it_from_the_cluster(stubs: Stubs) -> None:
    _leader, (first, second) = create(stubs, "doomed", b"a", b"b")
    stubs[first].DeleteStream(pb.DeleteStreamRequest(stream="doomed"), timeout=10)
    listing = pb.ListStreamsRequest(prefix="doomed")
    for stub in stubs.values():
        # Whether the node has heard of the deletion yet or forwards to the leader, which has.
        assert failure(stub.Read, pb.ReadRequest(stream="doomed")).code() == grpc.StatusCode.NOT_FOUND
        eventually(lambda stub=stub: not stub.ListStreams(listing, timeout=10).streams)
    error = failure(stubs[second].DeleteStream, pb.DeleteStreamRequest(stream="doomed"))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    # The name can be taken again: a new, empty stream.
    assert (
        stubs[second].Append(pb.AppendRequest(stream="doomed", payloads=[b"new"]), timeout=10).first_offset
        == 0
    )
    placed(stubs, "doomed")
    read = stubs[first].Read(pb.ReadRequest(stream="doomed"), timeout=10)
    assert [e.payload for e in read.entries] == [b"new"]


def test_the_cluster_command_prints_nodes_and_leaders(stubs: Stubs, three_nodes: ClusterNodes) -> None:
    leader, _others = create(stubs, "shown")
    out = io.StringIO()
    assert cli_main(["cluster", "--prefix", "shown", "--address", three_nodes.target("n2")], out=out) == 0
    lines = out.getvalue().splitlines()
    assert lines[0] == "cluster streamlog, as node n2 sees it"
    assert lines[2].split() == ["NODE", "ADDRESS", "STATE", "CONTROLLER", "VERSION", "STARTED"]
    assert [line.split()[:3] for line in lines[3:6]] == [[n, three_nodes.target(n), "alive"] for n in NODES]
    assert lines[7].split() == ["STREAM", "LEADER", "EPOCH", "REPLICAS", "IN", "SYNC", "FACTOR", "ACKS"]
    assert lines[8].split()[:5] == ["shown", leader, "1", leader, leader]
    out = io.StringIO()
    assert (
        cli_main(["cluster", "--json", "--prefix", "shown", "--address", three_nodes.target("n3")], out=out)
        == 0
    )
    described = json.loads(out.getvalue())
    assert described["node_id"] == "n3" and [n["id"] for n in described["nodes"]] == list(NODES)
    assert [(s["name"], s["leader"]) for s in described["streams"]] == [("shown", leader)]


def test_append_many_serves_each_batch_at_its_streams_leader_in_request_order(stubs: Stubs) -> None:
    streams = [f"many-{i}" for i in range(4)]
    for stream in streams:
        create(stubs, stream)
    leaders = {stream: placed(stubs, stream)[0] for stream in streams}
    assert len(set(leaders.values())) > 1, leaders  # the batches go to several leaders
    batches = [pb.AppendRequest(stream=s, payloads=[b"m", s.encode()]) for s in streams]
    batches += [
        pb.AppendRequest(stream=streams[0], payloads=[b"again"]),
        pb.AppendRequest(stream="", payloads=[b"bad"]),  # a bad name: its own error only
        pb.AppendRequest(stream="many-new", payloads=[b"n"]),  # placed, as an Append places it
    ]
    for node in NODES:
        results = stubs[node].AppendMany(pb.AppendManyRequest(batches=batches), timeout=20).results
        codes = [r.error.code for r in results]
        assert codes == [0] * 5 + [grpc.StatusCode.INVALID_ARGUMENT.value[0], 0], [r.error for r in results]
        done = NODES.index(node)  # rounds before this one: each wrote 2 entries per stream, 3 to the first
        offsets = [(result.first_offset, result.last_offset) for result in results[:5]]
        assert offsets == [(1 + 3 * done, 2 + 3 * done)] + [(1 + 2 * done, 2 + 2 * done)] * 3 + [
            (3 + 3 * done,) * 2
        ]
    # acks=quorum: a batch is answered once committed, so every node reads it at once.
    for node in NODES:
        read = stubs[node].Read(pb.ReadRequest(stream=streams[1], count=10), timeout=10)
        assert [e.payload for e in read.entries] == [b"first"] + [b"m", streams[1].encode()] * 3
        read = stubs[node].Read(pb.ReadRequest(stream=streams[0], count=20), timeout=10)
        assert [e.payload for e in read.entries] == [b"first"] + [b"m", streams[0].encode(), b"again"] * 3
    assert placed(stubs, "many-new")[0] in NODES


def test_append_many_in_redirect_mode_or_forwarded_refuses_the_batches_led_elsewhere(stubs: Stubs) -> None:
    leader, (first, _second) = create(stubs, "many-redirect")
    batch = pb.AppendRequest(stream="many-redirect", payloads=[b"x"])
    request = pb.AppendManyRequest(batches=[batch])
    (result,) = stubs[first].AppendMany(request, metadata=REDIRECT, timeout=10).results
    assert result.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert f"led by node {leader!r}" in result.error.message and "call it there" in result.error.message
    forwarded = (("streamlog-forwarded-by", "elsewhere"),)
    (result,) = stubs[first].AppendMany(request, metadata=forwarded, timeout=10).results
    assert (
        result.error.code == grpc.StatusCode.UNAVAILABLE.value[0] and "forwarded once" in result.error.message
    )
    (result,) = stubs[leader].AppendMany(request, metadata=REDIRECT, timeout=10).results
    assert not result.HasField("error") and result.first_offset == 1  # nothing was written before
