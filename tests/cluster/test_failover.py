"""Replicated streams on real `streamlog serve --cluster` processes: a leader killed, paused past its
lease, a follower restarted. What each test checks is what clients were told and the replicas' logs,
read offline afterwards (bench/replicalogs.py) as each node would serve them after a restart."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from bench.replicalogs import read_replica
from tests.cluster.helpers import TEST_TTL_MS
from tests.cluster.nodes import ClusterNodes, eventually, leader_of
from tests.cluster.proxy import FaultProxy

NODES = ("n1", "n2", "n3")
REPLICATED = {"default_replication_factor": "3", "replica_lag_ms": "1000"}
# A dead or paused node's lease expires within its TTL, plus etcd's expiry check and the election.
EXPIRY_S = TEST_TTL_MS / 1000 + 5
# What takes EXPIRY_S on an idle machine may take several times that on a loaded one (a CI run
# once took more than 12 s to elect): these tests check outcomes, not speed (failover times are
# bench.cluster's), so they wait this long.
SETTLE_S = EXPIRY_S + 50
pytestmark = pytest.mark.timeout(300)  # several SETTLE_S waits in a row, on a bad day

Stubs = Callable[[str], pb_grpc.StreamLogServiceStub]


def payloads(batch: int, size: int = 10) -> list[bytes]:
    return [b"batch-%03d-entry-%02d" % (batch, i) for i in range(size)]


def append_until_acknowledged(stubs: Stubs, names: tuple[str, ...], request: pb.AppendRequest) -> int:
    """Append through any live node until one acknowledges it (the producer id makes retries safe);
    the acknowledged last offset."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        for name in names:
            try:
                return stubs(name).Append(request, timeout=5).last_offset
            except grpc.RpcError as exc:
                assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), exc
        assert time.monotonic() < deadline, "no node acknowledged the append"
        time.sleep(0.1)


def isr(stubs: Stubs, via: str, stream: str) -> set[str]:
    return set(leader_of(stubs(via), stream).in_sync_replicas)


def logs(cluster_nodes: ClusterNodes, stream: str) -> dict[str, list[tuple[int, int, str, bytes]]]:
    """Each stopped node's log of the stream, read offline: (offset, timestamp, tag, payload)."""
    found = {}
    for name in NODES:
        replica, problems = read_replica(cluster_nodes.directory / name, name)
        assert problems == [], problems
        found[name] = [(e.offset, e.timestamp_ms, e.tag, e.payload) for e in replica[stream].entries]
    return found


def test_a_killed_leaders_acknowledged_entries_are_all_on_the_new_leader(
    cluster_nodes: ClusterNodes, stubs: Stubs
) -> None:
    cluster_nodes.start(*NODES, **REPLICATED)
    acknowledged: dict[int, bytes] = {}
    for batch in range(20):
        request = pb.AppendRequest(
            stream="s", payloads=payloads(batch), producer_id="p", producer_sequence=batch
        )
        last = stubs("n1").Append(request, timeout=10).last_offset
        acknowledged.update(zip(range(last - 9, last + 1), request.payloads, strict=True))
    old = leader_of(stubs("n1"), "s").leader
    placement = leader_of(stubs(old), "s")  # the leader reports the high watermark
    assert set(placement.in_sync_replicas) == set(NODES) and placement.high_watermark == 200
    cluster_nodes.kill(old)  # kill -9: no lease revoked
    others = tuple(n for n in NODES if n != old)
    for batch in range(20, 30):  # through the failover: retried until a new leader acknowledges
        request = pb.AppendRequest(
            stream="s", payloads=payloads(batch), producer_id="p", producer_sequence=batch
        )
        last = append_until_acknowledged(stubs, others, request)
        acknowledged.update(zip(range(last - 9, last + 1), request.payloads, strict=True))
    new = leader_of(stubs(others[0]), "s")
    assert new.leader in others and new.leader_epoch > placement.leader_epoch
    read = stubs(new.leader).Read(pb.ReadRequest(stream="s", count=10_000), timeout=10)
    assert {e.offset: e.payload for e in read.entries} == acknowledged  # none lost, none twice
    # The killed node comes back as a follower, catches up and rejoins the in-sync set.
    cluster_nodes.start(old, **REPLICATED)
    # Rejoining waits for a lag timer and a CAS; a loaded machine (CI) took more than 20 s once.
    eventually(lambda: isr(stubs, others[0], "s") == set(NODES), timeout_s=SETTLE_S)
    for name in NODES:
        cluster_nodes.stop(name)
    replicas = logs(cluster_nodes, "s")
    assert replicas[old] == replicas[others[0]] == replicas[others[1]]  # byte for byte, stamps too
    assert {offset: payload for offset, _, _, payload in replicas[old]} == acknowledged


def test_a_streams_config_and_trim_set_on_the_leader_are_in_force_on_the_next_leader(
    cluster_nodes: ClusterNodes, stubs: Stubs
) -> None:
    cluster_nodes.start(*NODES, **REPLICATED)
    for batch in range(10):
        stubs("n1").Append(pb.AppendRequest(stream="s", payloads=payloads(batch)), timeout=10)
    old = leader_of(stubs("n1"), "s").leader
    via = next(n for n in NODES if n != old)  # forwarded to the leader
    config = pb.StreamConfig(max_entries=1000, compaction=True, fsync=pb.FSYNC_POLICY_ALWAYS)
    set_reply = stubs(via).SetStreamConfig(pb.SetStreamConfigRequest(stream="s", config=config), timeout=10)
    trimmed = stubs(via).Trim(pb.TrimRequest(stream="s", trim_to_offset=42), timeout=10).first_offset
    assert trimmed == 42
    eventually(lambda: isr(stubs, old, "s") == set(NODES), timeout_s=SETTLE_S)
    # Acknowledged at quorum: every in-sync follower applied a fetch answer that carried the new
    # entry, and with it the leader's first offset.
    stubs(via).Append(pb.AppendRequest(stream="s", payloads=[b"after the trim"]), timeout=10)
    placement = leader_of(stubs(old), "s")
    cluster_nodes.stop(old)
    others = tuple(n for n in NODES if n != old)
    eventually(lambda: leader_of(stubs(others[0]), "s").leader_epoch > placement.leader_epoch, SETTLE_S)
    info = stubs(others[0]).GetStreamInfo(pb.GetStreamInfoRequest(stream="s"), timeout=10).info
    assert info.config == set_reply.config
    assert (info.config.max_entries, info.config.compaction) == (1000, True)
    assert info.first_offset == 42


class Links:
    """A fault proxy in front of each node, on an event loop of its own (a thread): the nodes dial
    one another through them (`peer_addresses`), so a test can cut a node off from its peers."""

    def __init__(self, ports: dict[str, int]) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.proxies = {name: self._run(self._proxy(port)) for name, port in ports.items()}

    @staticmethod
    async def _proxy(port: int) -> FaultProxy:
        proxy = FaultProxy(("127.0.0.1", port))
        await proxy.start()
        return proxy

    def _run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=10)

    async def _do(self, action: Callable[[], None]) -> None:
        action()

    def peer_addresses(self) -> str:
        return ",".join(f"{name}=127.0.0.1:{proxy.address[1]}" for name, proxy in self.proxies.items())

    def cut(self, name: str) -> None:
        """Nothing the peers send `name` arrives, nothing it answers them leaves."""
        self._run(self._do(self.proxies[name].block))

    def heal(self, name: str) -> None:
        """The cut connections are reset (what they held is never delivered) and new ones pass."""
        proxy = self.proxies[name]
        self._run(self._do(lambda: (proxy.reset(), proxy.unblock())))

    def close(self) -> None:
        for proxy in self.proxies.values():
            self._run(proxy.stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


def test_a_leader_paused_past_its_lease_is_deposed_and_its_unreplicated_suffix_truncated(
    cluster_nodes: ClusterNodes, stubs: Stubs, links: Links
) -> None:
    # acks=leader lets the leader acknowledge what its followers have not copied (Kafka's acks=1).
    settings = {**REPLICATED, "replica_lag_ms": "5000", "default_acks": "leader"}
    cluster_nodes.start(*NODES, **settings, peer_addresses=links.peer_addresses())
    stubs("n1").Append(pb.AppendRequest(stream="s", payloads=payloads(0)), timeout=10)
    old = leader_of(stubs("n1"), "s").leader
    followers = tuple(n for n in NODES if n != old)
    eventually(lambda: leader_of(stubs(old), "s").high_watermark == 10)
    # Cut off from its followers (they stay in sync: well within the lag), the leader writes a
    # suffix only it holds, then pauses past its lease.
    links.cut(old)
    stubs(old).Append(pb.AppendRequest(stream="s", payloads=[b"only on the old leader"] * 5), timeout=10)
    cluster_nodes.signal(old, signal.SIGSTOP)
    # Its lease expires; a follower is elected and takes appends.
    eventually(lambda: leader_of(stubs(followers[0]), "s").leader in followers, timeout_s=SETTLE_S)
    new = leader_of(stubs(followers[0]), "s").leader
    links.heal(old)
    reply = append_until_acknowledged(stubs, followers, pb.AppendRequest(stream="s", payloads=payloads(1)))
    assert reply == 19  # offsets 10..19: the old leader's suffix is not in the new leader's log
    cluster_nodes.signal(old, signal.SIGCONT)

    # Back, it finds itself deposed, follows, truncates its suffix and catches up. In the in-sync
    # set is not enough: a member may lag by up to replica_lag_ms, and at acks=leader the stops
    # below could then elect the third copy without offsets 10..19 (a load-7 run did: "n3 elected
    # at epoch 3 from offset 10"). A high watermark of 20 says every member holds them.
    def all_hold_everything() -> bool:
        state = leader_of(stubs(new), "s")
        return set(state.in_sync_replicas) == set(NODES) and state.high_watermark == 20

    eventually(all_hold_everything, timeout_s=SETTLE_S)
    for name in NODES:
        cluster_nodes.stop(name)
    replicas = logs(cluster_nodes, "s")
    assert replicas[old] == replicas[new] == replicas[next(n for n in followers if n != new)]
    assert [payload for _, _, _, payload in replicas[old]] == payloads(0) + payloads(1)


def test_a_publish_session_answers_only_what_is_committed(cluster_nodes: ClusterNodes, stubs: Stubs) -> None:
    # Publish is acknowledged like Append: at acks=quorum, a message is answered once the in-sync
    # replicas hold it. With both followers paused, nothing is answered; once they leave the
    # in-sync set, the session ends UNAVAILABLE (resend), and no answer ever claimed a commit.
    cluster_nodes.start(*NODES, **REPLICATED)
    stubs("n1").Append(pb.AppendRequest(stream="s", payloads=[b"first"]), timeout=10)
    leader = leader_of(stubs("n1"), "s").leader
    followers = [name for name in NODES if name != leader]
    for name in followers:
        cluster_nodes.signal(name, signal.SIGSTOP)
    try:
        messages = iter([pb.PublishRequest(stream="s", payloads=[b"while paused"], request_id=1)])
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            answers = list(stubs(leader).Publish(messages, timeout=30))
            raise AssertionError(f"answered without a quorum: {answers}")
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        assert time.monotonic() - started >= 0.5  # it waited for the followers first
    finally:
        for name in followers:
            cluster_nodes.signal(name, signal.SIGCONT)
    # Back in sync, the resent message is answered, committed on every replica.
    eventually(lambda: isr(stubs, leader, "s") == set(NODES), timeout_s=SETTLE_S)
    resent = iter([pb.PublishRequest(stream="s", payloads=[b"resent"], request_id=2)])
    (answer,) = list(stubs(leader).Publish(resent, timeout=30))
    assert answer.request_id == 2 and not answer.error.code and answer.last_offset >= 1


def until_answered(call: Callable[[], Any]) -> Any:
    """A call retried (bounded) while no node can answer it: the failover is under way."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        try:
            return call()
        except grpc.RpcError as exc:
            assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), exc
        assert time.monotonic() < deadline, "no node answered"
        time.sleep(0.1)


def test_a_killed_leaders_consumer_group_carries_on_on_the_new_leader(
    cluster_nodes: ClusterNodes, stubs: Stubs
) -> None:
    """The same pending list, nothing acknowledged delivered again, and the group drains."""
    cluster_nodes.start(*NODES, **REPLICATED)
    stubs("n1").Append(pb.AppendRequest(stream="s", payloads=payloads(0, 30)), timeout=10)
    old = leader_of(stubs("n1"), "s").leader
    stub = stubs(old)
    config = pb.GroupConfig(retry_ms=600_000)  # nothing comes back by itself during the test
    stub.CreateGroup(pb.CreateGroupRequest(stream="s", group="g", config=config), timeout=10)
    read = stub.Read(pb.ReadRequest(stream="s", group="g", consumer="a", count=20), timeout=10)
    assert [e.offset for e in read.entries] == list(range(20))
    stub.Ack(pb.AckRequest(stream="s", group="g", ranges=[pb.OffsetRange(start_offset=0, end_offset=10)]))
    pending = pb.GetPendingRequest(stream="s", group="g", count=100)
    before = [(e.offset, e.consumer, e.delivery_count) for e in stub.GetPending(pending, timeout=10).entries]
    assert [offset for offset, _, _ in before] == list(range(10, 20))
    cluster_nodes.kill(old)  # kill -9: no lease revoked
    others = tuple(n for n in NODES if n != old)
    after = until_answered(lambda: stubs(others[0]).GetPending(pending, timeout=5))
    assert [(e.offset, e.consumer, e.delivery_count) for e in after.entries] == before
    assert leader_of(stubs(others[0]), "s").leader in others
    delivered: list[int] = []
    read_more = pb.ReadRequest(stream="s", group="g", consumer="b", count=7, claim_idle_ms=0)
    while True:  # claim-on-read takes the pending entries at once; each batch acknowledged
        got = [e.offset for e in until_answered(lambda: stubs(others[0]).Read(read_more, timeout=5)).entries]
        if not got:
            break
        delivered += got
        ack = pb.AckRequest(stream="s", group="g", offsets=got)
        until_answered(lambda ack=ack: stubs(others[0]).Ack(ack, timeout=5))
    assert sorted(delivered) == list(range(10, 30))  # each once: nothing acknowledged came back
    assert until_answered(lambda: stubs(others[0]).GetPending(pending, timeout=5)).count == 0


def test_a_stopped_follower_of_an_idle_stream_leaves_the_in_sync_set_for_good_until_it_returns(
    cluster_nodes: ClusterNodes, stubs: Stubs
) -> None:
    # Caught up when it stopped (the stream takes nothing), the follower still leaves the set once
    # it stops fetching, and must not come back with the next change of the set: a member that is
    # down holds the high watermark of every acks=quorum append until it lags out again.
    cluster_nodes.start(*NODES, **REPLICATED)
    stubs("n1").Append(pb.AppendRequest(stream="idle", payloads=[b"one"]), timeout=SETTLE_S)
    leader = leader_of(stubs("n1"), "idle").leader
    gone = next(name for name in reversed(NODES) if name != leader)
    eventually(lambda: isr(stubs, leader, "idle") == set(NODES), timeout_s=SETTLE_S)
    cluster_nodes.stop(gone)
    eventually(lambda: gone not in isr(stubs, leader, "idle"), timeout_s=SETTLE_S)
    for _ in range(20):  # five replica_lag_ms periods: it stays out
        placement = leader_of(stubs(leader), "idle")
        assert gone not in placement.in_sync_replicas
        [progress] = [p for p in placement.progress if p.node == gone]
        assert progress.lag_ms > 0  # at the end of the log, yet lagging: it is silent
        time.sleep(0.25)
    cluster_nodes.start(gone, **REPLICATED)
    eventually(lambda: isr(stubs, leader, "idle") == set(NODES), timeout_s=SETTLE_S)
