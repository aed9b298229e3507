"""The client's layout cache (clients/_routing.py) without a server, and its cost against a single
server (one DescribeCluster, ever). Routing in a real cluster: tests/cluster/test_client_routing.py."""

from __future__ import annotations

import time

import grpc
import pytest
from streamlog.v1 import streamlog_pb2 as pb

from clients import Client
from clients._routing import (
    PASS_OVER_S,
    Attempts,
    Routes,
    redirect_address,
    retryable,
    seed_addresses,
    stream_of,
)
from clients.errors import UnavailableError, from_rpc_error
from clients.types import ClusterDescription, ClusterNode, StreamPlacement
from tests.service.helpers import ServerThread


class Failed(grpc.RpcError):
    """A failed call as gRPC raises it: a status code, details and trailers."""

    def __init__(
        self, code: grpc.StatusCode, trailers: tuple[tuple[str, str], ...] = (), details: str = "refused"
    ) -> None:
        self._code, self._trailers, self._details = code, trailers, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailers


REDIRECT = Failed(grpc.StatusCode.UNAVAILABLE, (("streamlog-leader-address", "h2:2"),))
DOWN = Failed(grpc.StatusCode.UNAVAILABLE)
NOT_SENT = Failed(  # gRPC's own words when it has no connection to the node
    grpc.StatusCode.UNAVAILABLE,
    details="failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Connection refused",
)


def placement(name: str, leader: str) -> StreamPlacement:
    return StreamPlacement(name, leader, ["a", "b", "c"], ["a", "b", "c"], 1, 3, "quorum")


CLUSTER = ClusterDescription(
    "prod",
    "a",
    [ClusterNode("a", "h1:1", True), ClusterNode("b", "h2:2", True), ClusterNode("c", "", False)],
    [placement("orders", "b"), placement("electing", ""), placement("stranded", "c")],
)


def routes(*seeds: str) -> tuple[Routes, list[str]]:
    """A layout cache over these seeds, and the addresses it opened channels to (which connect
    only when called, and these are not)."""
    opened: list[str] = []

    def open_channel(address: str) -> grpc.Channel:
        opened.append(address)
        return grpc.insecure_channel(address)

    return Routes(list(seeds), open_channel), opened


def test_seed_addresses_come_as_one_a_list_or_comma_separated() -> None:
    assert seed_addresses("h1:1") == ["h1:1"]
    assert seed_addresses("h1:1, h2:2,,h3:3 ") == ["h1:1", "h2:2", "h3:3"]
    assert seed_addresses(["h1:1", "h2:2"]) == ["h1:1", "h2:2"]
    with pytest.raises(ValueError, match="no server address"):
        seed_addresses(" , ")


def test_only_stream_scoped_requests_are_routed() -> None:
    assert stream_of(pb.AppendRequest(stream="orders")) == "orders"
    assert stream_of(pb.ReadRequest(stream="")) == ""
    assert stream_of(pb.DescribeClusterRequest(prefix="orders")) is None
    assert stream_of(pb.ListStreamsRequest()) is None


def test_a_single_server_is_described_once_and_then_takes_every_call() -> None:
    table, opened = routes("h1:1", "h2:2")
    assert table.leader("orders") is None  # not known yet: look it up
    table.learn("h2:2", ClusterDescription("", "", [ClusterNode("", "h2:2", True)], []))
    assert table.cluster is False
    assert table.leader("orders") == table.leader("other") == "h2:2"  # the seed that answered
    assert opened == ["h1:1"]  # the first seed's channel, opened with the client; no other


def test_a_cluster_layout_names_each_streams_leader_and_opens_a_channel_per_node_used() -> None:
    table, opened = routes("h1:1")
    table.learn("h1:1", CLUSTER)
    assert table.cluster is True
    assert table.leader("orders") == "h2:2"
    assert table.leader("electing") is None  # no leader now: looked up again next time
    assert table.leader("stranded") is None  # its leader is not alive
    assert table.leader("unknown") is None
    assert table.stub("h2:2") is table.stub("h2:2")
    assert opened == ["h1:1", "h2:2"]


def test_a_redirect_names_the_new_leader_at_once() -> None:
    table, _ = routes("h1:1")
    table.learn("h1:1", CLUSTER)
    table._leaders["orders"] = "h1:1"  # stale
    assert table.failed("orders", from_rpc_error(REDIRECT)) is True
    assert table.leader("orders") == "h2:2" and table.redirects == 1
    assert redirect_address(from_rpc_error(REDIRECT)) == redirect_address(REDIRECT) == "h2:2"


def test_a_failure_without_redirect_forgets_the_leader_and_asks_other_nodes_first() -> None:
    table, _ = routes("h1:1", "h3:3")
    table.learn("h1:1", CLUSTER)
    assert table.describers() == ["h1:1", "h2:2", "h3:3"]
    assert table.failed("orders", from_rpc_error(DOWN)) is False
    assert table.leader("orders") is None
    assert table.describers() == ["h1:1", "h3:3", "h2:2"]  # the failed leader last
    table.learn("h1:1", CLUSTER)  # a new description clears suspicion
    assert table.describers() == ["h1:1", "h2:2", "h3:3"]


def in_sync(*names: str, isr: tuple[str, ...] = ("a", "b", "c")) -> ClusterDescription:
    """Three live nodes; streams led by "a" with these in-sync replicas."""
    nodes = [ClusterNode("a", "h1:1", True), ClusterNode("b", "h2:2", True), ClusterNode("c", "h3:3", True)]
    streams = [StreamPlacement(name, "a", ["a", "b", "c"], list(isr), 1, 3, "quorum") for name in names]
    return ClusterDescription("prod", "a", nodes, streams)


def test_reads_from_replicas_go_to_each_streams_replica_chosen_in_turn_and_kept() -> None:
    table, _ = routes("h1:1")
    assert table.replica("s1") is None  # nothing known: look it up
    table.learn("h1:1", in_sync("s1", "s2", "s3"))
    chosen = [table.replica(name) for name in ("s1", "s2", "s3")]
    assert sorted(chosen) == ["h1:1", "h2:2", "h3:3"]  # three streams, each in turn: all three nodes
    assert [table.replica(name) for name in ("s1", "s2", "s3")] == chosen  # kept
    assert [table.leader(name) for name in ("s1", "s2", "s3")] == ["h1:1"] * 3
    # Only live in-sync replicas are chosen; a stream without a leader has none.
    table.learn("h1:1", CLUSTER)
    assert table.replica("orders") in ("h1:1", "h2:2")
    assert table.replica("stranded") is table.replica("electing") is None
    # A new description that leaves the chosen replica out of the in-sync set moves the reads.
    table.learn("h1:1", in_sync("s1", isr=("a",)))
    assert table.replica("s1") == "h1:1"


def test_a_failed_replica_read_looks_the_replicas_up_again() -> None:
    table, _ = routes("h1:1")
    table.learn("h1:1", in_sync("s", isr=("a", "c")))
    first = table.replica("s")
    # Redirected (the node does not serve the stream in sync now): the leader is named.
    assert table.failed_replica("s", from_rpc_error(REDIRECT)) is True
    assert table.replica("s") is None and table.leader("s") == "h2:2" and table.redirects == 1
    table.learn("h1:1", in_sync("s", isr=("a", "c")))
    second = table.replica("s")
    assert {first, second} == {"h1:1", "h3:3"}  # chosen in turn: the other one now
    # Down: looked up again, asking the others first.
    assert table.failed_replica("s", from_rpc_error(DOWN)) is False
    assert table.replica("s") is None and table.describers()[-1] == second


def test_a_read_may_prefer_a_replica_while_it_is_in_sync_and_has_not_failed(monkeypatch) -> None:
    table, _ = routes("h1:1")
    assert table.replica("s", "b") is None  # nothing known: look it up
    table.learn("h1:1", in_sync("s", isr=("a", "b")))
    assert [table.replica("s", node) for node in ("a", "b")] == ["h1:1", "h2:2"]
    # Not an in-sync replica (out of the set, not a node at all): the replica chosen in turn.
    chosen = table.replica("s")
    assert table.replica("s", "c") == table.replica("s", "nowhere") == chosen
    # Its read failed: passed over for the stream's replica reads (preferred or chosen), even
    # while the layout still lists it (a node killed, its lease not yet expired).
    assert table.failed_replica("s", from_rpc_error(DOWN), "h2:2") is False
    table.learn("h1:1", in_sync("s", "t", isr=("a", "b")))
    assert table.replica("s", "b") == table.replica("s") == "h1:1"
    assert table.replica("t", "b") == "h2:2"  # for that stream only
    # Once the pass-over is over, it is preferred again.
    later = time.monotonic() + PASS_OVER_S + 1
    monkeypatch.setattr(time, "monotonic", lambda: later)
    assert table.replica("s", "b") == "h2:2"


def test_a_replica_read_that_fails_everywhere_still_has_a_replica_to_go_to() -> None:
    table, _ = routes("h1:1")
    table.learn("h1:1", in_sync("s", isr=("a", "b")))
    for address in ("h1:1", "h2:2"):
        table.failed_replica("s", from_rpc_error(DOWN), address)
    table.learn("h1:1", in_sync("s", isr=("a", "b")))
    assert table.replica("s", "b") in ("h1:1", "h2:2")  # all passed over: any of them


def test_a_single_server_takes_reads_from_replicas_too() -> None:
    table, _ = routes("h1:1")
    table.learn("h1:1", ClusterDescription("", "", [ClusterNode("", "h1:1", True)], []))
    assert table.replica("orders") == "h1:1"


def test_what_is_retried_after_unavailable() -> None:
    plain = pb.AppendRequest(stream="s", payloads=[b"x"])
    idempotent = pb.AppendRequest(stream="s", payloads=[b"x"], producer_id="p", producer_sequence=1)
    assert retryable("Append", plain, REDIRECT)  # refused before it was served
    assert not retryable("Append", plain, DOWN)  # may have been written: not blindly
    assert retryable("Append", plain, NOT_SENT)  # never left the client
    assert retryable("Append", idempotent, DOWN)  # a resend is answered as a duplicate
    assert retryable("Read", pb.ReadRequest(stream="s"), DOWN)
    assert not retryable("CreateGroup", pb.CreateGroupRequest(stream="s", group="g"), DOWN)
    assert not retryable("Read", pb.ReadRequest(stream="s"), Failed(grpc.StatusCode.NOT_FOUND))


def test_attempts_pause_longer_each_time_and_stop_at_the_deadline() -> None:
    attempts = Attempts(10.0)
    assert attempts.pause(redirected=True) == 0.0  # the leader is named: go at once
    pauses = [attempts.pause(redirected=False) for _ in range(4)]
    assert all(p is not None and 0 < p <= 1.0 for p in pauses)
    assert pauses[-1] is not None and pauses[-1] >= 0.4  # 0.05 s doubled four times, halved at worst
    remaining = attempts.remaining()
    assert remaining is not None and 9 < remaining <= 10
    assert Attempts(0.0).pause(redirected=False) is None
    assert Attempts(None).remaining() is None


def test_a_client_on_a_single_server_asks_once_and_sends_every_call_there(server: ServerThread) -> None:
    with Client(server.target) as client:
        for i in range(3):
            client.append(f"s{i}", b"x")
            assert client.read(f"s{i}", 0).entries[0].payload == b"x"
        assert client._routes.cluster is False and client._routes.lookups == 1
        assert client.route("s0") == server.target


def test_a_client_reading_from_replicas_on_a_single_server_works_as_any(server: ServerThread) -> None:
    with pytest.raises(ValueError, match="read_from must be one of leader, replica, not 'follower'"):
        Client(server.target, read_from="follower")
    with Client(server.target, read_from="replica") as client:
        client.append("s", [b"x", b"y"])
        assert [e.payload for e in client.read("s", 0).entries] == [b"x", b"y"]
        with client.subscribe("s", 0) as subscription:
            assert [e.payload for e in next(iter(subscription)).entries] == [b"x", b"y"]
        assert client._routes.cluster is False and client._routes.lookups == 1


def test_a_client_whose_first_seed_is_down_uses_the_next(server: ServerThread) -> None:
    with Client(["127.0.0.1:1", server.target], timeout=10) as client:
        client.append("s", b"x")
        assert client.read("s", 0).entries[0].payload == b"x"
        assert client._routes.default == server.target


def test_a_single_servers_unavailable_is_raised_at_once_not_retried() -> None:
    started = time.monotonic()
    with Client("127.0.0.1:1", timeout=10) as client, pytest.raises(UnavailableError):
        client.read("s", 0)
    assert time.monotonic() - started < 5  # not retried for the call's 10 s
