"""A node's copies of streams follow placement (the replica manager creates and wipes them,
service/replicas.py deletes them and reports roles), against a real etcd and engine."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc
import pytest

from cluster.coordinator import Coordinator
from cluster.replication.manager import ReplicaManager
from cluster.replication.service import REPLICATE
from service.replicas import LocalReplicas, Role
from storage import AppendBatch, Engine
from tests.cluster.etcd_server import EtcdCluster
from tests.cluster.helpers import PlacementLog, config, nodes, run, settled, until


def test_copies_are_created_wiped_and_deleted_as_placement_says(
    etcd: EtcdCluster, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    engine = Engine(tmp_path / "data")
    engine.append("stray", AppendBatch([b"from before"]))  # placement will never know it
    engine.append("reused", AppendBatch([b"an older stream's entry"]))  # its name will be taken again

    async def scenario() -> None:
        async with nodes(etcd.endpoints, "other") as (other,):
            # Created while node a was away, led by it (as after a crash that lost its copy): the
            # controller takes the leadership away (no live in-sync replica: offline).
            log = PlacementLog(other)
            await other.placement.create_if_absent("lost", replicas=("a",))
            await until(lambda: other.placement.locate("lost").leader == "", log.event)
            a = Coordinator(config(etcd.endpoints, "a"))
            replicas = LocalReplicas("a")
            forgotten: list[str] = []
            dead_end = grpc.aio.insecure_channel("127.0.0.1:1")  # "other" serves no replication
            manager = ReplicaManager(
                "a",
                engine,
                a.placement,
                lease_valid_until=lambda: a.membership.lease_valid_until,
                connect=lambda _node: dead_end.stream_stream(REPLICATE),
                forget=forgotten.append,
            )
            roles: list[tuple[str, Role, Role]] = []
            changed = asyncio.Event()

            def record_role(name: str, before: Role, after: Role, _record: object) -> None:
                roles.append((name, before, after))
                changed.set()

            manager.start()
            a.placement.add_listener(replicas.on_placement)
            a.placement.add_listener(manager.on_placement)
            replicas.add_listener(record_role)
            replicas.attach(engine, forgotten.append)
            await a.start()
            try:
                replicas.go_live(lambda name: a.placement.locate(name) is not None)
                # a is elected again once it joins (before or after its copy of the records loads:
                # it hears the stream offline, then led by it, or led by it at once), and starts
                # an empty copy.
                await until(lambda: ("lost", Role.LEADER) in [(n, after) for n, _, after in roles], changed)
                await until(lambda: manager.ready("lost"))
                elected = len(roles)
                assert roles in (
                    [("lost", Role.NONE, Role.FOLLOWER), ("lost", Role.FOLLOWER, Role.LEADER)],
                    [("lost", Role.NONE, Role.LEADER)],
                )
                assert engine.exists("lost") and engine.info("lost").end_offset == 0
                assert engine.read("stray", 0, 10).count == 1
                warnings = [r.getMessage() for r in caplog.records]
                assert any("'lost': this node holds no copy of it; it starts empty" in w for w in warnings)
                assert any("not in the cluster's placement" in w and "'stray'" in w for w in warnings)

                # A new stream of a name this node holds an old copy of: the copy is wiped first.
                reused = await other.placement.create_if_absent("reused", replicas=("a",))
                await settled([a, other])
                await until(lambda: manager.ready("reused"))
                assert engine.info("reused").end_offset == 0
                assert engine.incarnation("reused") == reused.incarnation
                # A follower holds a copy too, of the stream's incarnation (to fetch into).
                followed = await other.placement.create_if_absent("followed", replicas=("other", "a"))
                await settled([a, other])
                await until(lambda: engine.exists("followed"))
                assert engine.incarnation("followed") == followed.incarnation
                # Deleted elsewhere: the copy goes, and its waiting readers are told.
                assert await other.placement.delete(a.placement.locate("lost"))
                await settled([a, other])
                assert not engine.exists("lost")
                assert forgotten == ["reused", "lost"]
                assert roles[elected:] == [
                    ("reused", Role.NONE, Role.LEADER),
                    ("followed", Role.NONE, Role.FOLLOWER),
                    ("lost", Role.LEADER, Role.NONE),
                ]
            finally:
                await manager.stop()
                await a.stop()
                await dead_end.close()

    try:
        run(scenario())
    finally:
        engine.close()
