"""Stream operations replicated (cluster/replication/, issue 15): the stream's settings from placement
on every copy and enforced by a new leader, the leader's first offset followed by its followers
(trims, retention: KIP-107), and the holes compaction leaves copied. In-process nodes as in
test_replication.py."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from cluster.replication import copies
from storage import AppendBatch, GroupConfig, StreamConfig
from tests.cluster.etcd_server import EtcdCluster
from tests.cluster.helpers import run, until
from tests.cluster.test_replication import Cluster, Node, append, cluster, created
from tests.storage.conftest import SMALL as STORAGE_SMALL

# Small nodes and segments: a few hundred entries make many nodes and sealed segments.
SMALL = {key: value for key, value in STORAGE_SMALL.items() if key != "background"}


def first(node: Node, name: str = "s") -> int:
    return node.engine.bounds(name).first_offset


def reads(node: Node, name: str = "s") -> tuple | None:
    """What a reader of the copy gets: the bounds, every entry (offset, timestamp, tag, payload) and
    the gap it starts with, if any (None while there is no copy: one rebuilds)."""
    if not node.engine.exists(name):
        return None
    bounds = node.engine.bounds(name)
    result = node.engine.read(name, bounds.first_offset, 1_000_000)
    entries = [(e.offset, e.timestamp_ms, e.tag, e.payload) for e in result.entries()]
    return bounds, entries, result.gap


async def elect(nodes: Cluster, via: Node, leader: str) -> Node:
    """Move the stream's leadership to `leader` at a new epoch, as the controller would; the new
    leader once it is ready."""
    current = via.placement.locate("s")
    moved = dataclasses.replace(current, leader=leader, epoch=current.epoch + 1)
    assert (await via.placement.cas(current, moved)).applied
    new = nodes.nodes[leader]
    await until(lambda: new.manager.ready("s"), timeout_s=20)
    return new


def test_stream_settings_in_placement_are_on_every_copy_and_a_new_leader_enforces_them(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with cluster(etcd, tmp_path, "a", "b", "c", **SMALL) as nodes:
            record, leader, followers = await created(nodes)
            settings = StreamConfig(max_entries=20, fsync="always", tombstone_retention_ms=5)
            # What SetStreamConfig does on the leader (service/routing.py): the record first.
            assert (await leader.placement.cas(record, copies.with_settings(record, settings))).applied
            await until(lambda: all(n.engine.stream_config("s") == settings for n in nodes.nodes.values()))
            for batch in range(20):
                await append(leader, [b"entry-%02d" % batch * 30] * 5)
            # Followers run no retention of their own: their copies change only as the leader's.
            for node_id in followers:
                nodes.nodes[node_id].engine.maintain()
                assert first(nodes.nodes[node_id]) == 0
            # The leader stops; the controller elects a follower, which enforces the settings.
            await nodes.stop(leader.node_id)
            watcher = nodes.nodes[followers[0]]
            await until(lambda: watcher.placement.locate("s").leader in followers, timeout_s=20)
            new = nodes.nodes[watcher.placement.locate("s").leader]
            await until(lambda: new.manager.ready("s"), timeout_s=20)
            assert new.engine.stream_config("s") == settings
            new.engine.maintain()
            assert 0 < first(new) <= 100 - 20
            other = nodes.nodes[next(n for n in followers if n != new.node_id)]
            await append(new, [b"after"])  # (the other follower fetches from the new leader)
            await until(lambda: first(other) == first(new) and reads(other) == reads(new))
            # A copy created later (the old leader, wiped, back) gets the settings too.
            shutil.rmtree(leader.data)
            back = await nodes.start(leader.node_id)
            await until(lambda: back.engine.exists("s") and back.engine.stream_config("s") == settings)

    run(scenario())


@pytest.mark.parametrize("mode", ["trim_to_offset", "keep_last", "evict_up_to_offset"])
def test_a_trim_on_the_leader_moves_every_followers_first_offset_to_the_leaders(
    etcd: EtcdCluster, tmp_path: Path, mode: str
) -> None:
    async def scenario() -> None:
        async with cluster(etcd, tmp_path, "a", "b", "c", **SMALL) as nodes:
            _, leader, followers = await created(nodes)
            for batch in range(12):
                await append(leader, [b"entry-%02d" % batch] * 5)
            # A group holding retention at 20: only the exact trim goes past it (the leader's call).
            leader.engine.create_group("s", "held", start=20, config=GroupConfig(retention_hold=True))
            if mode == "trim_to_offset":
                moved = leader.engine.trim("s", 35)
                assert moved == 35
            elif mode == "keep_last":
                moved = leader.engine.keep_last("s", 5)
                assert 0 < moved <= 20
            else:
                moved = leader.engine.evict("s", 50)
                assert 0 < moved <= 20
            follower_nodes = [nodes.nodes[n] for n in followers]
            await until(lambda: all(first(n) == moved for n in follower_nodes))
            await append(leader, [b"after"] * 3)
            await until(lambda: all(reads(n) == reads(leader) for n in follower_nodes))

    run(scenario())


def test_retention_on_the_leader_moves_every_followers_first_offset(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with cluster(etcd, tmp_path, "a", "b", "c", **SMALL) as nodes:
            record, leader, followers = await created(nodes)
            settings = StreamConfig(max_bytes=4096)
            assert (await leader.placement.cas(record, copies.with_settings(record, settings))).applied
            for batch in range(30):
                await append(leader, [b"entry-%02d" % batch * 20] * 5)
            leader.engine.maintain()
            assert first(leader) > 0
            follower_nodes = [nodes.nodes[n] for n in followers]
            await until(lambda: all(first(n) == first(leader) for n in follower_nodes))
            await until(lambda: all(reads(n) == reads(leader) for n in follower_nodes))

    run(scenario())


def test_followers_that_rebuild_or_were_behind_copy_the_leaders_holes_and_a_failover_keeps_offsets(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with cluster(etcd, tmp_path, "a", "b", "c", **SMALL) as nodes:
            _, leader, (behind_id, wiped_id) = await created(nodes)
            for batch in range(10):  # tags of their own: compaction keeps them all
                await append_tagged(leader, batch, [f"once-{batch}-{i}" for i in range(3)] + [""])
            # One follower stops (it will be behind, across holes), the other loses its disk.
            await nodes.stop(behind_id)
            wiped_data = nodes.nodes[wiped_id].data
            await nodes.stop(wiped_id)
            shutil.rmtree(wiped_data)
            for batch in range(10, 200):  # the same tags again and again: only the latest survive
                await append_tagged(leader, batch, ["k0", "k1", "k2", ""], quorum=False)
            leader.engine.maintain()  # seals and packs full segments
            assert leader.engine.compact("s") > 0
            assert leader.engine.info("s").entries < 400  # holes past the stopped follower's end
            behind, wiped = await nodes.start(behind_id), await nodes.start(wiped_id)
            # In this order: the wiped copy leaves the in-sync set before it fetches, so the set can
            # be whole for a moment after its restart, before it caught up.
            await until(lambda: reads(behind) == reads(leader) == reads(wiped), timeout_s=30)
            await until(lambda: set(leader.placement.locate("s").isr) == {"a", "b", "c"}, timeout_s=30)
            # A failover to the rebuilt copy keeps every offset: appends go on after the old end.
            end = leader.engine.log_end("s")
            new = await elect(nodes, leader, wiped_id)
            result = new.engine.append("s", AppendBatch([b"after the failover"]))
            assert result.first_offset == end
            await new.manager.barrier("s", end + 1, quorum=True)
            await until(lambda: reads(leader) == reads(new) == reads(behind))

    run(scenario())


async def append_tagged(node: Node, batch: int, tags: list[str], *, quorum: bool = True) -> None:
    """A batch of tagged entries (compaction keeps each tag's latest) and an untagged one."""
    payloads = [b"batch-%03d-%s" % (batch, tag.encode()) * 10 for tag in tags]
    result = node.engine.append("s", AppendBatch(payloads, tags=tags))
    await node.manager.barrier("s", result.last_offset + 1, quorum=quorum)
