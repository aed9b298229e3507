"""Consumer-group state replicated with its stream (cluster/replication/, issue 15): in-process
nodes as in test_replication.py; followers' groups follow the leader's op batches."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grpc
import pytest
from streamlog.internal.v1 import replication_pb2 as rpb

from cluster.replication.service import PEER_SECRET
from storage import GroupConfig, GroupReadOptions
from storage.errors import PreconditionError
from tests.cluster.etcd_server import EtcdCluster
from tests.cluster.helpers import run, until
from tests.cluster.test_replication import SECRET, Cluster, Node, append, cluster, created


async def group_call(node: Node, call, *args, **kwargs):
    """A group call on the leader, answered as the service answers it: after its barrier."""
    result = call(*args, **kwargs)
    await node.manager.barrier("s", 0, quorum=True, group_seq=node.engine.group_seq("s"))
    return result


def applied(node: Node) -> int:
    return node.engine.group_seq("s")


def in_sync_state(nodes: Cluster, leader: Node) -> list[dict]:
    isr = leader.placement.locate("s").isr
    return [nodes.nodes[n].engine._groups.dump("s") for n in isr if n != leader.node_id]


def test_group_calls_answer_once_every_in_sync_follower_applied_them(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with cluster(etcd, tmp_path, "a", "b", "c") as nodes:
            _, leader, followers = await created(nodes)
            await append(leader, [b"entry-%d" % i for i in range(30)])
            engine = leader.engine
            await group_call(leader, engine.create_group, "s", "g", config=GroupConfig(retry_ms=60_000))
            read = await group_call(leader, engine.read_group, "s", "g", GroupReadOptions("a", 10))
            assert read.offsets == list(range(10))
            await group_call(leader, engine.ack, "s", "g", ranges=[(0, 4)])
            # Each barrier returned only once both followers applied the batch: no waiting here.
            assert [applied(nodes.nodes[f]) for f in followers] == [applied(leader)] * 2
            assert in_sync_state(nodes, leader) == [engine._groups.dump("s")] * 2
            await group_call(leader, engine.nack, "s", "g", [5])
            await group_call(leader, engine.claim, "s", "g", "b", 0, [6, 7])
            await group_call(leader, engine.delete_consumer, "s", "g", "a")
            await group_call(leader, engine.set_group_offset, "s", "g", 20)
            assert in_sync_state(nodes, leader) == [engine._groups.dump("s")] * 2
            follower = nodes.nodes[followers[0]]
            with pytest.raises(PreconditionError):  # passive: a follower's groups serve nothing
                follower.engine.read_group("s", "g", GroupReadOptions("a", 10))
            with pytest.raises(PreconditionError):
                follower.engine.ack("s", "g", [4])

    run(scenario())


def test_streams_replicated_with_no_group_leave_no_group_store_on_any_node(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    """Each leader ships every stream's group snapshot and each follower installs it: for streams
    with no group, no node makes a store; the first group made later still reaches the followers."""

    async def scenario() -> None:
        async with cluster(etcd, tmp_path, "a", "b", "c") as nodes:
            names = [f"s{i}" for i in range(6)] + ["s"]
            for name in names:
                _, leader, _ = await created(nodes, name)
                await append(leader, [b"x"], name)  # answered once each follower fetched it
            for node in nodes.nodes.values():
                assert node.engine._groups.stores.all() == [], node.node_id
            _, leader, _ = await created(nodes, "s")
            await group_call(leader, leader.engine.create_group, "s", "g")
            assert in_sync_state(nodes, leader) == [leader.engine._groups.dump("s")] * 2

    run(scenario())


def test_a_new_leader_carries_on_from_the_groups_it_holds(etcd: EtcdCluster, tmp_path: Path) -> None:
    """Pending entries stay pending, acknowledged ones are never delivered again, and the group drains."""

    async def scenario() -> None:
        async with cluster(etcd, tmp_path, "a", "b", "c") as nodes:
            _, old, followers = await created(nodes)
            await append(old, [b"entry-%d" % i for i in range(20)])
            engine = old.engine
            await group_call(old, engine.create_group, "s", "g", config=GroupConfig(retry_ms=100))
            await group_call(old, engine.read_group, "s", "g", GroupReadOptions("a", 12))
            await group_call(old, engine.ack, "s", "g", ranges=[(0, 6)])
            pending = engine.pending("s", "g", count=100)
            await nodes.stop(old.node_id)  # its lease goes: the controller elects a follower
            placement = nodes.nodes[followers[0]].placement
            await until(lambda: placement.locate("s").leader in followers, timeout_s=20)
            await until(lambda: any(nodes.nodes[f].manager.ready("s") for f in followers), timeout_s=20)
            new = next(nodes.nodes[f] for f in followers if nodes.nodes[f].manager.ready("s"))
            taken = new.engine.pending("s", "g", count=100)
            assert [r.offset for r in taken.rows] == list(range(6, 12))
            assert [dataclasses.replace(r, idle_ms=0) for r in taken.rows] == [
                dataclasses.replace(r, idle_ms=0) for r in pending.rows
            ]
            delivered: list[int] = []
            for _ in range(100):
                options = GroupReadOptions("b", 5, claim_idle_ms=0)  # the pending ones too, at once
                result = await group_call(new, new.engine.read_group, "s", "g", options)
                delivered += result.offsets
                await group_call(new, new.engine.ack, "s", "g", result.offsets)
                if new.engine.group_info("s", "g").pending == 0 and new.engine.group_info("s", "g").lag == 0:
                    break
            assert sorted(set(delivered)) == list(range(6, 20))  # nothing acknowledged came back
            other = nodes.nodes[next(f for f in followers if f != new.node_id)]
            await until(lambda: applied(other) == applied(new))
            assert other.engine._groups.dump("s") == new.engine._groups.dump("s")

    run(scenario())


def test_a_follower_back_from_a_stop_takes_a_snapshot_then_the_batches(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with cluster(etcd, tmp_path, "a", "b", "c") as nodes:
            _, leader, (gone, *_) = await created(nodes)
            await append(leader, [b"x"] * 50)
            engine = leader.engine
            await group_call(leader, engine.create_group, "s", "g")
            await nodes.stop(gone)
            for i in range(25):  # answered once the stopped follower left the in-sync set
                await group_call(leader, engine.read_group, "s", "g", GroupReadOptions(f"c{i}", 2))
            back = await nodes.start(gone)
            await until(lambda: gone in leader.placement.locate("s").isr, timeout_s=20)
            await group_call(leader, engine.ack, "s", "g", [0, 1])
            assert applied(back) == applied(leader)
            assert back.engine._groups.dump("s") == engine._groups.dump("s")

    run(scenario())


def test_the_leader_refuses_a_group_seq_it_did_not_send(etcd: EtcdCluster, tmp_path: Path) -> None:
    """A follower's acknowledgement must be of the group data this session sent it."""

    async def scenario() -> None:
        async with cluster(etcd, tmp_path, "a", "b", "c") as nodes:
            record, leader, (follower, *_) = await created(nodes)
            await group_call(leader, leader.engine.create_group, "s", "g")
            call = nodes._connect(leader.node_id)(metadata=((PEER_SECRET, SECRET),))
            request = rpb.FetchRequest(
                stream="s",
                incarnation=record.incarnation,
                leader_epoch=record.epoch,
                follower_id=follower,
                log_end=0,
                last_epoch=record.epoch,
                group_seq=0,
            )
            await call.write(request)
            first = await call.read()
            assert first.data.group_snapshot.seq == applied(leader) == 1
            request.group_seq = 7
            await call.write(request)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call.read()
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "group_seq 7" in refused.value.details()
            bad = rpb.FetchRequest()
            bad.CopyFrom(request)
            bad.group_seq = -1
            call = nodes._connect(leader.node_id)(metadata=((PEER_SECRET, SECRET),))
            await call.write(bad)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call.read()
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    run(scenario())
