"""Replication (cluster/replication/): in-process nodes, each an engine, a coordinator on a real etcd,
a replica manager and a gRPC server with the ReplicaService; followers fetch over loopback."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from streamlog.internal.v1 import replication_pb2 as rpb
from streamlog.internal.v1 import replication_pb2_grpc as rpb_grpc

from cluster.coordinator import Coordinator
from cluster.placement import StreamPlacement
from cluster.replication.follower import StreamFollower
from cluster.replication.leader import NotEnoughReplicasError, NotLeadingError
from cluster.replication.manager import ReplicaManager, ReplicationConfig
from cluster.replication.service import PEER_SECRET, ReplicaServicer, add_to_server
from storage import AppendBatch, Engine, EngineConfig, StreamConfig
from storage.fs import SegmentFile
from storage.layout import EPOCHS_FILE, stream_directory
from tests.cluster.etcd_server import EtcdCluster
from tests.cluster.helpers import config, run, settled, until

SECRET = "s3cret"
LAG_MS = 600


@dataclasses.dataclass
class Node:
    """One in-process cluster node."""

    node_id: str
    data: Path
    coordinator: Coordinator
    engine: Engine
    manager: ReplicaManager
    server: grpc.aio.Server
    port: int

    @property
    def placement(self):
        return self.coordinator.placement

    async def stop(self) -> None:
        await self.manager.stop()
        await self.server.stop(0)
        await self.coordinator.stop()
        self.engine.close()


class Cluster:
    def __init__(
        self, etcd: EtcdCluster, root: Path, lag_ms: int, engine: dict[str, Any], hw_linger_ms: int = 10
    ) -> None:
        self._etcd = etcd
        self._lag_ms = lag_ms
        self._hw_linger_ms = hw_linger_ms
        self._engine = engine
        self._root = root
        self.nodes: dict[str, Node] = {}
        self.ports: dict[str, int] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _connect(self, node_id: str):
        channel = self._channels.get(node_id)
        if channel is None:
            channel = self._channels[node_id] = grpc.aio.insecure_channel(f"127.0.0.1:{self.ports[node_id]}")
        return channel.stream_stream(
            "/streamlog.internal.v1.ReplicaService/Replicate",
            request_serializer=rpb.FetchRequest.SerializeToString,
            response_deserializer=rpb.FetchResponse.FromString,
        )

    async def _ask_state(self, node_id: str, name: str, incarnation: int) -> tuple[int, int] | None:
        channel = self._channels.get(node_id) or grpc.aio.insecure_channel(f"127.0.0.1:{self.ports[node_id]}")
        self._channels[node_id] = channel
        stub = rpb_grpc.ReplicaServiceStub(channel)
        request = rpb.ReplicaStateRequest(stream=name, incarnation=incarnation)
        try:
            reply = await stub.ReplicaState(request, metadata=[(PEER_SECRET, SECRET)], timeout=2)
        except grpc.aio.AioRpcError:
            return None
        return reply.last_epoch, reply.log_end

    async def start(self, node_id: str) -> Node:
        data = self._root / node_id
        engine = Engine(data, EngineConfig(background=False, **self._engine))
        server = grpc.aio.server()
        port = self.ports.get(node_id) or 0
        port = server.add_insecure_port(f"127.0.0.1:{port}")
        self.ports[node_id] = port
        coordinator = Coordinator(config(self._etcd.endpoints, node_id, advertise=f"127.0.0.1:{port}"))
        manager = ReplicaManager(
            node_id,
            engine,
            coordinator.placement,
            lease_valid_until=lambda: coordinator.membership.lease_valid_until,
            connect=self._connect,
            metadata=[(PEER_SECRET, SECRET)],
            config=ReplicationConfig(
                replica_lag_ms=self._lag_ms, max_fetch_bytes=4096, hw_linger_ms=self._hw_linger_ms
            ),
            live=lambda: coordinator.nodes.live().keys(),
            ask_state=self._ask_state,
        )
        add_to_server(ReplicaServicer(node_id, manager.leader, manager.state, SECRET.encode()), server)
        await server.start()
        manager.start()
        coordinator.placement.add_listener(manager.on_placement)
        await coordinator.start()
        manager.go_live()
        node = self.nodes[node_id] = Node(node_id, data, coordinator, engine, manager, server, port)
        return node

    async def stop(self, node_id: str) -> None:
        await self.nodes.pop(node_id).stop()

    async def close(self) -> None:
        for node_id in list(self.nodes):
            await self.stop(node_id)
        for channel in self._channels.values():
            await channel.close()


@contextlib.asynccontextmanager
async def cluster(
    etcd: EtcdCluster, root: Path, *node_ids: str, lag_ms: int = LAG_MS, hw_linger_ms: int = 10, **engine: Any
) -> AsyncIterator[Cluster]:
    """Nodes started in turn; `engine`: EngineConfig settings for every node."""
    nodes = Cluster(etcd, root, lag_ms, engine, hw_linger_ms)
    try:
        for node_id in node_ids:
            await nodes.start(node_id)
        await settled([n.coordinator for n in nodes.nodes.values()])
        yield nodes
    finally:
        await nodes.close()


async def created(nodes: Cluster, name: str = "s") -> tuple[StreamPlacement, Node, list[str]]:
    """A new stream: its record, its leader (ready), and its followers' ids."""
    first = next(iter(nodes.nodes.values()))
    record = await first.placement.create_if_absent(name)
    await settled([n.coordinator for n in nodes.nodes.values()])
    leader = nodes.nodes[record.leader]
    await until(lambda: leader.manager.ready(name))
    return record, leader, [n for n in record.replicas if n != record.leader]


async def append(node: Node, payloads: list[bytes], name: str = "s") -> int:
    result = node.engine.append(name, AppendBatch(payloads))
    await node.manager.barrier(name, result.last_offset + 1, quorum=True)
    return result.last_offset + 1


def records(node: Node, name: str = "s") -> bytes:
    end = node.engine.log_end(name)
    chunk = node.engine.read_replica(name, node.engine.bounds(name).first_offset, 1 << 30) if end else None
    return b"" if chunk is None else chunk.records


def test_a_quorum_append_is_on_every_in_sync_replica_byte_for_byte(etcd: EtcdCluster, tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(etcd, tmp_path, "a", "b", "c") as nodes:
            record, leader, _ = await created(nodes)
            assert set(record.isr) == {"a", "b", "c"}
            follower_nodes = [n for n in nodes.nodes.values() if n is not leader]
            assert leader.engine.read("s", 0, 10).count == 0
            end = 0
            for i in range(30):
                end = await append(leader, [b"entry-%d-%d" % (i, j) * 20 for j in range(7)])
            assert leader.engine.bounds("s").end_offset == end == 210  # readers see the commit
            assert leader.manager.leader("s").hw == end
            for node in follower_nodes:
                # Every acknowledged entry is on each in-sync follower (HW = min over the set).
                assert node.engine.log_end("s") >= end
            await until(lambda: all(records(n) == records(leader) for n in follower_nodes))
            assert all(n.engine.epochs("s") == leader.engine.epochs("s") == [(1, 0)] for n in follower_nodes)
            assert all(n.engine.incarnation("s") == record.incarnation for n in nodes.nodes.values())

    run(scenario())


def test_a_stopped_follower_leaves_the_in_sync_set_and_rejoins_once_caught_up(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with cluster(etcd, tmp_path, "a", "b", "c") as nodes:
            _, leader, (gone, *_) = await created(nodes)
            await append(leader, [b"before"] * 10)
            await nodes.stop(gone)
            # A quorum append waits for the stopped follower until the leader drops it from the set.
            end = await asyncio.wait_for(append(leader, [b"while away"] * 50), LAG_MS / 1000 * 10)
            assert gone not in leader.placement.locate("s").isr
            assert leader.manager.leader("s").hw == end
            back = await nodes.start(gone)
            await until(lambda: gone in leader.placement.locate("s").isr, timeout_s=20)
            await until(lambda: records(back) == records(leader))
            assert back.engine.epochs("s") == leader.engine.epochs("s")

    run(scenario())


def test_below_a_majority_in_sync_quorum_appends_are_refused_and_leader_appends_are_not(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with cluster(etcd, tmp_path, "a", "b", "c") as nodes:
            record, leader, followers = await created(nodes)
            for node_id in followers:
                await nodes.stop(node_id)
            leader.engine.append("s", AppendBatch([b"x"]))
            await until(lambda: leader.placement.locate("s").isr == (record.leader,), timeout_s=20)
            with pytest.raises(NotEnoughReplicasError):
                await leader.manager.barrier("s", 1, quorum=True)
            await leader.manager.barrier("s", 1, quorum=False)

    run(scenario())


def test_a_deposed_leaders_unreplicated_suffix_is_truncated_when_it_follows(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with cluster(etcd, tmp_path, "a", "b", "c") as nodes:
            _, old, followers = await created(nodes)
            await append(old, [b"committed"] * 20)
            # Cut the old leader off from its followers: they stop fetching (their managers are
            # stopped and a new epoch is written as the controller would, electing `new`).
            for node_id in followers:
                await nodes.stop(node_id)
            old.engine.append("s", AppendBatch([b"never acknowledged"] * 5))
            assert old.engine.log_end("s") == 25
            new_id = followers[0]
            current = old.placement.locate("s")
            elected = dataclasses.replace(
                current, leader=new_id, epoch=current.epoch + 1, isr=tuple(followers)
            )
            assert (await old.placement.cas(current, elected)).applied
            with pytest.raises(NotLeadingError):
                await old.manager.barrier("s", 25, quorum=True)
            for node_id in followers:
                await nodes.start(node_id)
            # The controller may elect again meanwhile (the new leader was not live yet): whoever
            # leads now, it is one of the two that held every acknowledged entry.
            await until(lambda: old.placement.locate("s").leader in followers, timeout_s=20)
            now = old.placement.locate("s")
            new = nodes.nodes[now.leader]
            await until(lambda: new.manager.ready("s"), timeout_s=20)
            assert new.engine.epochs("s") == [(1, 0), (now.epoch, 20)]
            await append(new, [b"new epoch"] * 3)
            # The old leader follows now: its 5 unreplicated entries are cut, the new ones fetched.
            await until(lambda: records(old) == records(new), timeout_s=20)
            await until(lambda: old.engine.bounds("s").end_offset == 23)  # its commit cap follows the HW
            got = [e.payload for e in old.engine.read("s", 0, 100).entries()]
            assert got == [b"committed"] * 20 + [b"new epoch"] * 3
            assert old.engine.epochs("s") == new.engine.epochs("s")

    run(scenario())


def test_a_follower_behind_the_leaders_first_offset_rebuilds_from_it(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with cluster(etcd, tmp_path, "a", "b", "c") as nodes:
            _, leader, (gone, *_) = await created(nodes)
            await nodes.stop(gone)
            await append(leader, [b"old"] * 40)
            leader.engine.trim("s", 30)
            back = await nodes.start(gone)
            await append(leader, [b"new"] * 5)
            # (The copy is deleted and created again as it rebuilds: look while it exists.)
            await until(lambda: back.engine.exists("s") and back.engine.log_end("s") == 45, timeout_s=20)
            assert back.engine.bounds("s").first_offset == 30
            assert records(back) == records(leader)

    run(scenario())


def test_the_replica_service_refuses_what_it_cannot_serve(etcd: EtcdCluster, tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(etcd, tmp_path, "a", "b") as nodes:
            record, leader, (follower,) = await created(nodes)
            good = rpb.FetchRequest(
                stream="s", incarnation=record.incarnation, leader_epoch=record.epoch, follower_id=follower
            )
            async with grpc.aio.insecure_channel(f"127.0.0.1:{leader.port}") as channel:
                stub = rpb_grpc.ReplicaServiceStub(channel)

                async def status(request: rpb.FetchRequest, secret: str = SECRET) -> grpc.StatusCode:
                    call = stub.Replicate(iter([request]), metadata=[(PEER_SECRET, secret)])
                    try:
                        async for _ in call:
                            pass
                    except grpc.aio.AioRpcError as exc:
                        return exc.code()
                    return grpc.StatusCode.OK

                assert await status(good, "wrong") == grpc.StatusCode.UNAUTHENTICATED
                bad = [
                    dict(stream=""),
                    dict(stream="a\0b"),
                    dict(follower_id="../x"),
                    dict(incarnation=0),
                    dict(log_end=-5),
                    dict(last_epoch=-7),
                    dict(max_bytes=1 << 40),
                ]
                for fields in bad:
                    request = rpb.FetchRequest()
                    request.CopyFrom(good)
                    for key, value in fields.items():
                        setattr(request, key, value)
                    assert await status(request) == grpc.StatusCode.INVALID_ARGUMENT, fields
                stale = rpb.FetchRequest()
                stale.CopyFrom(good)
                stale.leader_epoch = record.epoch + 7
                call = stub.Replicate(iter([stale]), metadata=[(PEER_SECRET, SECRET)])
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in call:
                        pass
                assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert ("streamlog-leader-epoch", str(record.epoch)) in tuple(err.value.trailing_metadata())

                # ReplicaState: checked too.
                async def state_status(
                    stream: str, incarnation: int, secret: str = SECRET
                ) -> grpc.StatusCode:
                    request = rpb.ReplicaStateRequest(stream=stream, incarnation=incarnation)
                    try:
                        await stub.ReplicaState(request, metadata=[(PEER_SECRET, secret)], timeout=5)
                    except grpc.aio.AioRpcError as exc:
                        return exc.code()
                    return grpc.StatusCode.OK

                assert await state_status("s", record.incarnation) == grpc.StatusCode.OK
                assert await state_status("s", record.incarnation, "wrong") == grpc.StatusCode.UNAUTHENTICATED
                assert await state_status("", record.incarnation) == grpc.StatusCode.INVALID_ARGUMENT
                assert await state_status("s", 0) == grpc.StatusCode.INVALID_ARGUMENT
                assert await state_status("s", record.incarnation + 1) == grpc.StatusCode.FAILED_PRECONDITION
                # The follower's own session goes on, undisturbed by all of this.
                end = await append(leader, [b"after"] * 3)
                assert end == 3

    run(scenario())


@pytest.mark.parametrize("damage", ["wiped", "damaged"])
def test_a_follower_whose_copy_was_wiped_leaves_the_in_sync_set_and_rebuilds(
    etcd: EtcdCluster, tmp_path: Path, damage: str
) -> None:
    async def scenario() -> None:
        # A lag far longer than the test: only the rule for lost entries can take it out of the set.
        async with cluster(etcd, tmp_path, "a", "b", "c", lag_ms=60_000) as nodes:
            _, leader, (wiped, *_) = await created(nodes)
            await append(leader, [b"acknowledged"] * 25)
            isr_changes: list[tuple[str, ...]] = []
            leader.placement.add_listener(lambda _n, _o, new: new and isr_changes.append(new.isr))
            data = nodes.nodes[wiped].data
            await nodes.stop(wiped)
            if damage == "wiped":
                shutil.rmtree(data)
            else:  # its epochs file fails its checks: the stream is unreadable at start-up
                (stream_directory(data, "s") / EPOCHS_FILE).write_bytes(b"garbage")
            back = await nodes.start(wiped)
            # Out of the in-sync set at its first fetch (well before the lag), then back once caught up.
            await until(
                lambda: wiped in leader.placement.locate("s").isr and len(isr_changes) >= 2, timeout_s=20
            )
            assert wiped not in isr_changes[0]
            assert records(back) == records(leader)

    run(scenario())


def test_a_leader_deposed_before_it_wrote_in_its_epoch_follows_the_next_one(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with cluster(etcd, tmp_path, "a", "b", "c") as nodes:
            _, first, (other, *_) = await created(nodes)
            await append(first, [b"epoch one"] * 10)
            # Elected again (epoch 2): it records the epoch, then loses it before writing anything.
            current = first.placement.locate("s")
            outcome = await first.placement.cas(
                current, dataclasses.replace(current, epoch=current.epoch + 1)
            )
            assert outcome.applied and outcome.record is not None
            again = outcome.record
            await until(lambda: first.engine.epochs("s") == [(1, 0), (again.epoch, 10)])
            moved = dataclasses.replace(again, leader=other, epoch=again.epoch + 1)
            assert (await first.placement.cas(again, moved)).applied
            new = nodes.nodes[other]
            await until(lambda: new.manager.ready("s"))
            await append(new, [b"epoch three"] * 2)
            await until(lambda: records(first) == records(new))
            # Its empty epoch 2 is gone: its history is the new leader's.
            assert first.engine.epochs("s") == new.engine.epochs("s") == [(1, 0), (moved.epoch, 10)]

    run(scenario())


def test_the_only_in_sync_replica_that_lost_its_copy_hands_the_stream_to_the_fullest_other(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with cluster(etcd, tmp_path, "a", "b", "c") as nodes:
            record, leader, followers = await created(nodes)
            acknowledged = await append(leader, [b"acknowledged"] * 20)
            # The followers stop: the leader, alone, takes them out of the in-sync set.
            for node_id in followers:
                await nodes.stop(node_id)
            leader.engine.append("s", AppendBatch([b"x"]))
            await until(lambda: leader.placement.locate("s").isr == (record.leader,), timeout_s=20)
            # Then it dies and its disk is wiped; the others come back (offline: none is in sync).
            data = leader.data
            await nodes.stop(record.leader)
            shutil.rmtree(data)
            for node_id in followers:
                await nodes.start(node_id)
            back = await nodes.start(record.leader)
            # Back with nothing, it hands the stream to a replica that holds the acknowledged entries.
            await until(lambda: back.placement.locate("s").leader in followers, timeout_s=20)
            now = back.placement.locate("s")
            assert now.epoch > record.epoch and record.leader not in now.isr[:1]
            new = nodes.nodes[now.leader]
            await until(lambda: new.manager.ready("s"), timeout_s=20)
            got = new.engine.read("s", 0, 100).entries()
            assert [e.payload for e in got] == [b"acknowledged"] * acknowledged
            # It rebuilds from the new leader and is taken back in once caught up.
            await until(lambda: record.leader in back.placement.locate("s").isr, timeout_s=20)
            assert records(back)[: len(records(new))] == records(new)

    run(scenario())


def test_quorum_appends_in_a_row_take_one_fetch_answer_each_and_followers_learn_the_last_hw(
    etcd: EtcdCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A higher HW alone waits (hw_linger_ms) for the next entries to go with it: one answer per
    append to each follower, not one with the entries and another with the HW that covers them."""
    answers: list[str] = []
    apply = StreamFollower._apply

    def counted(self: StreamFollower, data: rpb.ReplicaData) -> None:
        answers.append(self._ctx.node_id)
        apply(self, data)

    monkeypatch.setattr(StreamFollower, "_apply", counted)

    async def scenario() -> None:
        # A heartbeat (lag / 4) and a linger far longer than the gap between two appends.
        async with cluster(etcd, tmp_path, "a", "b", "c", lag_ms=8000, hw_linger_ms=2000) as nodes:
            _, leader, followers = await created(nodes)
            end = await append(leader, [b"first"])
            answers.clear()
            appends = 20
            for i in range(appends):
                end = await append(leader, [b"entry %d" % i] * 3)
            for node_id in followers:
                # The last append's HW has not gone out yet: at most one answer each beyond the appends.
                assert answers.count(node_id) <= appends + 1, answers
            # With no entries after it, the last HW reaches the followers after the linger.
            await until(lambda: all(nodes.nodes[n].engine.bounds("s").end_offset == end for n in followers))

    run(scenario())


def test_readers_on_the_leader_see_committed_entries_only_and_wake_on_commit(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    async def scenario() -> None:
        # A lag far longer than the test: the stopped followers stay in the in-sync set.
        async with cluster(etcd, tmp_path, "a", "b", "c", lag_ms=60_000) as nodes:
            _, leader, followers = await created(nodes)
            await append(leader, [b"committed"] * 2)
            woken: list[int] = []
            leader.engine.add_append_listener(lambda name, end: woken.append(end))
            for node_id in followers:
                await nodes.stop(node_id)
            leader.engine.append("s", AppendBatch([b"not yet"] * 3))
            assert leader.engine.log_end("s") == 5
            assert [e.payload for e in leader.engine.read("s", 0, 10).entries()] == [b"committed"] * 2
            assert leader.engine.bounds("s").end_offset == 2 and woken == []
            for node_id in followers:
                await nodes.start(node_id)
            await until(lambda: woken == [5])  # readers woke once, when both followers held them
            assert leader.engine.read("s", 0, 10).count == 5

    run(scenario())


def test_followers_get_no_entry_the_leader_has_not_synced_under_fsync_always(
    etcd: EtcdCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        async with cluster(etcd, tmp_path, "a", "b", "c") as nodes:
            _, leader, followers = await created(nodes)
            leader.engine.set_stream_config("s", StreamConfig(fsync="always"))
            await append(leader, [b"synced"] * 3)
            syncing, release = threading.Event(), threading.Event()
            plain_sync = SegmentFile.sync

            def slow_sync(self: SegmentFile) -> None:
                syncing.set()
                assert release.wait(20)
                plain_sync(self)

            monkeypatch.setattr(SegmentFile, "sync", slow_sync)
            writer = asyncio.get_running_loop().run_in_executor(
                None, leader.engine.append, "s", AppendBatch([b"written, not synced"] * 2)
            )
            await asyncio.to_thread(syncing.wait, 10)  # written, its sync under way
            await asyncio.sleep(1.5)  # three heartbeats: the followers ask again meanwhile
            assert [nodes.nodes[n].engine.log_end("s") for n in followers] == [3, 3]
            monkeypatch.setattr(SegmentFile, "sync", plain_sync)
            release.set()
            result = await writer
            await leader.manager.barrier("s", result.last_offset + 1, quorum=True)
            assert all(records(nodes.nodes[n]) == records(leader) for n in followers)

    run(scenario())
