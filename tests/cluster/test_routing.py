"""Routing between clustered servers run in this process: auth, peer addresses, TLS, dead letters.

Each server runs on its own event loop and thread (tests.service.helpers.ServerThread),
on 127.0.0.1, with a real etcd. In a fresh cluster, new streams go to the node with
the fewest streams, ties broken by id: the first stream created through one node goes
to "a", the second to "b".
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from bench.common import free_port
from tests.cluster.etcd_server import EtcdCluster
from tests.cluster.helpers import TEST_TTL_MS
from tests.service.certs import CertificateAuthority
from tests.service.helpers import ServerThread, small_settings
from tests.service.http_client import HttpApi

ADMIN, WRITER, READER = "admin-token-0123456789", "writer-token-0123456789", "reader-token-0123456789"
TOKENS = f"""
[[tokens]]
principal = "admin"
token = "{ADMIN}"
[[tokens]]
principal = "writer"
token = "{WRITER}"
[[tokens]]
principal = "reader"
token = "{READER}"
"""


def rules(writer_streams: str) -> str:
    return f"""
[[rules]]
principals = ["admin"]
streams = ["*"]
permissions = ["admin"]
[[rules]]
principals = ["writer"]
streams = ["{writer_streams}"]
permissions = ["write", "read"]
[[rules]]
principals = ["reader"]
streams = ["first"]
permissions = ["read"]
"""


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def bearer(token: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {token}"),)


@pytest.fixture
def start_nodes(etcd: EtcdCluster, tmp_path: Path) -> Iterator[Callable[..., dict[str, ServerThread]]]:
    """Start nodes {id: settings overrides} on ports chosen first (a node may name its peers'
    ports); every one is stopped at teardown."""
    started: list[ServerThread] = []
    endpoints = ",".join(f"{host}:{port}" for host, port in etcd.endpoints)

    def start(
        nodes: dict[str, dict[str, Any]], ports: dict[str, int] | None = None
    ) -> dict[str, ServerThread]:
        ports = ports or {node: free_port() for node in nodes}
        servers = {}
        for node, overrides in nodes.items():
            settings = small_settings(
                tmp_path / node,
                port=ports[node],
                cluster=endpoints,
                node_id=node,
                advertise=f"127.0.0.1:{ports[node]}",
                cluster_name="routing",
                lease_ttl_ms=TEST_TTL_MS,
                default_replication_factor=1,
                **overrides,
            )
            servers[node] = ServerThread(settings)
            started.append(servers[node])
            servers[node].start()
        return servers

    yield start
    for server in reversed(started):
        server.stop()


def leaders(server: ServerThread, *streams: str) -> dict[str, str]:
    """Stream -> leader, as `server` sees placement once it sees all of `streams` (a node learns
    of streams created through another from its watch, a moment later)."""
    cluster = server.server.cluster
    assert cluster is not None
    placement = cluster.coordinator.placement

    def seen() -> dict[str, str] | None:  # on the server's loop, which updates the records
        records = placement.streams()
        return {name: r.leader for name, r in records.items()} if set(streams) <= records.keys() else None

    deadline = time.monotonic() + 10
    while (found := server.call(seen)) is None:
        assert time.monotonic() < deadline, f"{streams} not all in placement"
        time.sleep(0.02)
    return found


def test_a_forwarded_call_is_authorized_where_it_enters_and_again_at_the_leader(
    start_nodes, tmp_path: Path
) -> None:
    (tmp_path / "tokens.toml").write_text(TOKENS)
    (tmp_path / "a.toml").write_text(rules("*"))  # a lets the writer write anywhere
    (tmp_path / "b.toml").write_text(rules("first"))  # b only to "first"
    files = {"tokens_file": str(tmp_path / "tokens.toml")}
    nodes = start_nodes(
        {
            "a": {**files, "acl_file": str(tmp_path / "a.toml")},
            "b": {**files, "acl_file": str(tmp_path / "b.toml")},
        }
    )
    with grpc.insecure_channel(nodes["a"].target) as to_a, grpc.insecure_channel(nodes["b"].target) as to_b:
        a, b = pb_grpc.StreamLogServiceStub(to_a), pb_grpc.StreamLogServiceStub(to_b)
        for name in ("first", "second"):
            a.Append(pb.AppendRequest(stream=name, payloads=[b"x"]), metadata=bearer(ADMIN), timeout=10)
        assert leaders(nodes["a"], "first", "second") == {"first": "a", "second": "b"}
        assert leaders(nodes["b"], "first", "second") == {"first": "a", "second": "b"}

        # Through a (its rules allow it), to b, whose rules do not: b refuses with the caller's
        # identity, so the token was forwarded and checked again.
        with pytest.raises(grpc.RpcError) as caught:
            a.Append(pb.AppendRequest(stream="second", payloads=[b"y"]), metadata=bearer(WRITER), timeout=10)
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "'writer' may not Append on stream 'second'" in caught.value.details()
        # Refused where it enters, before any forwarding.
        with pytest.raises(grpc.RpcError) as caught:
            b.Append(pb.AppendRequest(stream="second", payloads=[b"y"]), metadata=bearer(WRITER), timeout=10)
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as caught:
            a.Read(pb.ReadRequest(stream="second"), timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Allowed at both: served by the leader through the other node.
        assert (
            b.Append(
                pb.AppendRequest(stream="first", payloads=[b"y"]), metadata=bearer(WRITER), timeout=10
            ).first_offset
            == 1
        )

        # DescribeCluster names every node, and only the streams the caller may see.
        for stub in (a, b):
            described = stub.DescribeCluster(pb.DescribeClusterRequest(), metadata=bearer(READER), timeout=10)
            assert [n.id for n in described.nodes] == ["a", "b"]
            assert [s.name for s in described.streams] == ["first"]
            listed = stub.ListStreams(pb.ListStreamsRequest(), metadata=bearer(READER), timeout=10)
            assert list(listed.streams) == ["first"]


def test_peers_are_dialled_at_peer_addresses_and_a_call_is_forwarded_once(start_nodes) -> None:
    ports = {node: free_port() for node in "abc"}
    # c dials a at b's address: what c forwards to a reaches b, which does not lead.
    nodes = start_nodes({"a": {}, "b": {}, "c": {"peer_addresses": f"a=127.0.0.1:{ports['b']}"}}, ports)
    with grpc.insecure_channel(nodes["c"].target) as to_c, grpc.insecure_channel(nodes["b"].target) as to_b:
        pb_grpc.StreamLogServiceStub(to_b).Append(pb.AppendRequest(stream="s", payloads=[b"x"]), timeout=10)
        assert leaders(nodes["c"], "s") == {"s": "a"}
        with pytest.raises(grpc.RpcError) as caught:
            pb_grpc.StreamLogServiceStub(to_c).Read(pb.ReadRequest(stream="s"), timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert caught.value.details() == (
        "stream 's' is led by node 'a', not by this node (b), and the call was already forwarded here by "
        "node 'c': calls are forwarded once; retry (the nodes' views of the cluster differ for a moment)"
    )


def test_forwarding_over_mutual_tls_and_certificate_callers_get_the_leaders_address(
    start_nodes, tmp_path: Path
) -> None:
    ca = CertificateAuthority()
    (tmp_path / "ca.crt").write_bytes(ca.cert_pem)
    client_cert, client_key = ca.issue("client", server=False).write(tmp_path, "client")
    (tmp_path / "tokens.toml").write_text(TOKENS)
    # The certificate "client" names a principal of its own, with every right.
    (tmp_path / "acl.toml").write_text(
        rules("*").replace('principals = ["admin"]', 'principals = ["admin", "client"]')
    )
    secure = {
        "tls_client_ca_file": str(tmp_path / "ca.crt"),
        "tokens_file": str(tmp_path / "tokens.toml"),
        "acl_file": str(tmp_path / "acl.toml"),
    }
    nodes = {}
    for node in ("a", "b"):
        # A node's certificate serves its port and identifies it to its peers.
        cert, key = ca.issue(node, server=True, client=True).write(tmp_path, node)
        nodes.update(start_nodes({node: {**secure, "tls_cert_file": str(cert), "tls_key_file": str(key)}}))
    credentials = grpc.ssl_channel_credentials(ca.cert_pem, client_key.read_bytes(), client_cert.read_bytes())
    with grpc.secure_channel(nodes["b"].target, credentials) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        stub.Append(pb.AppendRequest(stream="s", payloads=[b"x"]), metadata=bearer(ADMIN), timeout=10)
        assert leaders(nodes["b"], "s") == {"s": "a"}
        # With a token: forwarded to a over TLS, where the token is checked again.
        reply = stub.Append(
            pb.AppendRequest(stream="s", payloads=[b"y"]), metadata=bearer(WRITER), timeout=10
        )
        assert reply.first_offset == 1
        # Identified by its certificate alone, which cannot be passed on: told where the leader is.
        with pytest.raises(grpc.RpcError) as caught:
            stub.Read(pb.ReadRequest(stream="s"), timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert dict(caught.value.trailing_metadata())["streamlog-leader-address"] == nodes["a"].target
    with grpc.secure_channel(nodes["a"].target, credentials) as channel:
        read = pb_grpc.StreamLogServiceStub(channel).Read(pb.ReadRequest(stream="s"), timeout=10)
        assert [e.payload for e in read.entries] == [b"x", b"y"]


def test_a_dead_letter_stream_is_placed_beside_its_groups_stream(start_nodes) -> None:
    nodes = start_nodes({"a": {}, "b": {}})
    with grpc.insecure_channel(nodes["b"].target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        for name in ("on-a", "on-b", "also-on-a"):
            stub.Append(pb.AppendRequest(stream=name, payloads=[b"x"]), timeout=10)
        config = pb.GroupConfig(dead_letter_stream="dead", max_deliveries=1)
        stub.CreateGroup(pb.CreateGroupRequest(stream="on-a", group="g", config=config), timeout=10)
        # Created with the group's stream's replicas (not on b, the least loaded), so the same node
        # leads both.
        assert leaders(nodes["b"], "on-a", "on-b", "also-on-a", "dead") == {
            "on-a": "a",
            "on-b": "b",
            "also-on-a": "a",
            "dead": "a",
        }
        with pytest.raises(grpc.RpcError) as caught:
            stub.CreateGroup(pb.CreateGroupRequest(stream="on-b", group="g", config=config), timeout=10)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert (
            "config.dead_letter_stream: stream 'dead' is led by node a, not by node b"
            in caught.value.details()
        )
        # The dead letters land where the cluster serves that stream.
        stub.Read(pb.ReadRequest(stream="on-a", group="g", consumer="c"), timeout=10)
        stub.Nack(pb.NackRequest(stream="on-a", group="g", offsets=[0]), timeout=10)
        stub.Read(pb.ReadRequest(stream="on-a", group="g", consumer="c"), timeout=10)  # past max_deliveries
        read = stub.Read(pb.ReadRequest(stream="dead", block_ms=5000), timeout=10)
        assert len(read.entries) == 1


def test_http_calls_are_routed_like_grpc_calls(start_nodes) -> None:
    nodes = start_nodes({"a": {"http_port": free_port()}, "b": {"http_port": free_port()}})
    via_b = HttpApi.of(nodes["b"])
    assert via_b.post("Append", {"stream": "s", "payloads": [b64(b"x")]}).status == 200
    assert leaders(nodes["b"], "s") == {"s": "a"}
    # Forwarded to a with the request's headers as metadata (but HTTP's own, and those gRPC
    # cannot carry), answered through b.
    headers = {"Connection": "keep-alive", "x-note": "caf\xe9", "x-trace": "t-1"}
    reply = via_b.post("Append", {"stream": "s", "payloads": [b64(b"y")]}, headers=headers)
    assert (reply.status, reply.json["first_offset"]) == (200, "1")
    read = via_b.get("/v1/streams/s/entries")
    assert [base64.b64decode(e["payload"]) for e in read.json["entries"]] == [b"x", b"y"]
    events = via_b.events("/v1/streams/s/events")
    try:
        _kind, _id, first = next(iter(events))
        assert [base64.b64decode(e["payload"]) for e in first["entries"]] == [b"x", b"y"]
    finally:
        events.close()
    redirected = via_b.post("Read", {"stream": "s"}, headers={"streamlog-route": "redirect"})
    assert redirected.status == 503
    assert redirected.headers["streamlog-leader-address"] == nodes["a"].target
    cluster = via_b.get("/v1/cluster").json
    assert (cluster["cluster_name"], cluster["node_id"]) == ("routing", "b")
    assert [s["leader"] for s in cluster["streams"]] == ["a"]


def test_a_publish_session_carries_the_stream_of_its_first_message(start_nodes) -> None:
    nodes = start_nodes({"a": {}, "b": {}})
    with grpc.insecure_channel(nodes["a"].target) as to_a, grpc.insecure_channel(nodes["b"].target) as to_b:
        a, b = pb_grpc.StreamLogServiceStub(to_a), pb_grpc.StreamLogServiceStub(to_b)
        for name in ("first", "second"):
            a.Append(pb.AppendRequest(stream=name, payloads=[b"x"]), timeout=10)
        assert leaders(nodes["b"], "first", "second") == {"first": "a", "second": "b"}

        def publish(stub: pb_grpc.StreamLogServiceStub, *streams: str) -> list[pb.PublishResponse]:
            messages = [pb.PublishRequest(stream=s, payloads=[b"p"]) for s in streams]
            return list(stub.Publish(iter(messages), timeout=10))

        refused = grpc.StatusCode.FAILED_PRECONDITION.value[0]
        # Entering at b, led by a: forwarded whole; the message to b's own stream is refused too.
        through_b = publish(b, "first", "first", "second", "first")
        assert [(r.error.code, r.first_offset) for r in through_b] == [(0, 1), (0, 2), (refused, 0), (0, 3)]
        assert "one session per stream" in through_b[2].error.message
        # Served at its leader: the same rule.
        at_a = publish(a, "first", "second")
        assert [(r.error.code, r.first_offset) for r in at_a] == [(0, 4), (refused, 0)]
        # A session whose first message names a new stream places it, as Append does.
        created = publish(b, "third", "third")
        assert [r.error.code for r in created] == [0, 0]
        assert set(leaders(nodes["a"], "third")) >= {"first", "second", "third"}
        engine = nodes["a"].server.engine
        assert engine is not None and engine.info("first").end_offset == 5


def test_append_many_answers_a_batch_of_a_stream_without_a_leader_unavailable(start_nodes) -> None:
    nodes = start_nodes({"a": {}, "b": {}})
    with grpc.insecure_channel(nodes["b"].target) as to_b:
        b = pb_grpc.StreamLogServiceStub(to_b)
        for name in ("first", "second"):
            b.Append(pb.AppendRequest(stream=name, payloads=[b"x"]), timeout=10)
        assert leaders(nodes["b"], "first", "second") == {"first": "a", "second": "b"}
        request = pb.AppendManyRequest(
            batches=[pb.AppendRequest(stream=name, payloads=[b"y"]) for name in ("first", "second")]
        )
        results = b.AppendMany(request, timeout=10).results
        assert [(r.error.code, r.first_offset) for r in results] == [(0, 1), (0, 1)]  # one forwarded
        nodes["a"].stop()  # "first" (one replica) has no leader once b sees a gone
        unavailable = grpc.StatusCode.UNAVAILABLE.value[0]
        deadline = time.monotonic() + 30
        # Until b sees a gone, the batch forwarded to a fails to connect: UNAVAILABLE too.
        while "has no leader" not in (results := b.AppendMany(request, timeout=10).results)[0].error.message:
            assert results[0].error.code == unavailable, results[0]
            assert time.monotonic() < deadline, "b still takes a for first's leader"
            time.sleep(0.1)
        assert results[0].error.code == unavailable
        assert not results[1].HasField("error")  # the other stream's batch is written all the same
        engine = nodes["b"].server.engine
        assert engine is not None and [e.payload for e in engine.read("second", 0, 10).entries()][:3] == [
            b"x",
            b"y",
            b"y",
        ]
