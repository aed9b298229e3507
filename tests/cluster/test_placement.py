"""The placement table against a real etcd: creation, replica choice, races, compare-and-swap, deletion."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from cluster.errors import PlacementError
from cluster.etcd import Condition, KeyValue
from cluster.keys import KeyLayout
from cluster.placement import StreamPlacement
from tests.cluster.etcd_server import EtcdCluster
from tests.cluster.helpers import PlacementLog, nodes, run, settled

KEYS = KeyLayout("test")


def test_a_new_stream_is_placed_on_the_least_loaded_live_nodes(etcd: EtcdCluster) -> None:
    async def scenario() -> None:
        async with nodes(etcd.endpoints, "c", "a", "b") as (c, a, b):
            first = await a.placement.create_if_absent("s1", replication_factor=2)
            # Fewest streams first (all none), then by id; the first replica leads; all in sync.
            assert (first.replicas, first.leader, first.epoch, first.isr) == (("a", "b"), "a", 1, ("a", "b"))
            assert first.config == {"replication_factor": 2, "acks": "quorum"}
            assert first.incarnation == first.revision > 0
            await settled([a, b, c])  # b's choice counts a's stream
            second = await b.placement.create_if_absent("s2", replication_factor=2)
            assert second.replicas == ("c", "a")  # c holds none; a and b one each, a before b
            await settled([a, b, c])
            # The factor is capped by the live nodes, and the asked-for one is kept in config.
            third = await c.placement.create_if_absent(
                "s3", config={"acks": "leader", "replication_factor": 5}
            )
            assert sorted(third.replicas) == ["a", "b", "c"]
            assert third.config == {"replication_factor": 5, "acks": "leader"}
            await settled([a, b, c])
            for node in (a, b, c):
                assert [node.placement.locate(name) for name in ("s1", "s2", "s3")] == [first, second, third]
            with pytest.raises(PlacementError, match="replication_factor must be a positive integer"):
                await a.placement.create_if_absent("s4", replication_factor=0)

    run(scenario())


def test_a_stream_placed_beside_another_or_with_its_followers_out_of_sync(etcd: EtcdCluster) -> None:
    async def scenario() -> None:
        async with nodes(etcd.endpoints, "a", "b", "c") as (a, _b, _c):
            # Given replicas (e.g. those of the stream a dead-letter stream serves), in that order.
            beside = await a.placement.create_if_absent("dlq", replicas=("c", "a"))
            assert (beside.replicas, beside.leader, beside.isr) == (("c", "a"), "c", ("c", "a"))
            # Followers not yet copying the leader are not in sync: only the leader can be elected.
            alone = await a.placement.create_if_absent("s", replication_factor=3, followers_in_sync=False)
            assert (alone.replicas, alone.leader, alone.isr) == (("b", "a", "c"), "b", ("b",))
            assert alone.config["replication_factor"] == 3
            with pytest.raises(PlacementError, match="a replica is listed twice"):
                await a.placement.create_if_absent("twice", replicas=("a", "a"))
            assert a.placement.locate("twice") is None

    run(scenario())


def test_nodes_creating_one_stream_at_once_all_get_the_one_record_that_won(etcd: EtcdCluster) -> None:
    async def scenario() -> None:
        async with nodes(etcd.endpoints, "a", "b", "c") as started:
            logs = [PlacementLog(node) for node in started]
            names = [f"race{i}" for i in range(5)]
            for name in names:
                records = await asyncio.gather(*(node.placement.create_if_absent(name) for node in started))
                assert records[0] == records[1] == records[2]
                kv = await started[0].etcd.get(KEYS.stream(name))
                assert kv.create_revision == kv.mod_revision == records[0].incarnation  # written once
            await settled(started)
            for log in logs:  # every node heard each creation once, and nothing else
                assert [(name, old) for name, old, _ in log.changes] == [(name, None) for name in names]

    run(scenario())


def test_a_compare_and_swap_that_lost_gets_the_record_that_won(etcd: EtcdCluster) -> None:
    async def scenario() -> None:
        async with nodes(etcd.endpoints, "a", "b") as (a, b):
            record = await a.placement.create_if_absent("s", replication_factor=2)
            shrink = dataclasses.replace(record, isr=("a",))
            move = dataclasses.replace(record, leader="b", epoch=2)
            results = await asyncio.gather(a.placement.cas(record, shrink), b.placement.cas(record, move))
            assert sorted(outcome.applied for outcome in results) == [False, True]
            winner = next(outcome for outcome in results if outcome.applied).record
            loser = next(outcome for outcome in results if not outcome.applied).record
            assert loser == winner and winner.revision > record.revision
            assert (winner.isr, winner.leader) in {(("a",), "a"), (("a", "b"), "b")}
            # Deciding again from the fresh record succeeds.
            again = await b.placement.cas(winner, dataclasses.replace(winner, epoch=winner.epoch + 1))
            assert again.applied and again.record.epoch == winner.epoch + 1
            await settled([a, b])
            assert a.placement.locate("s") == b.placement.locate("s") == again.record

    run(scenario())


def test_a_write_whose_fence_no_longer_holds_changes_nothing(etcd: EtcdCluster) -> None:
    async def scenario() -> None:
        async with nodes(etcd.endpoints, "a") as (a,):
            record = await a.placement.create_if_absent("s", replication_factor=1)
            stale_fence = Condition(
                KEYS.node("a"), a.mirror.get(KEYS.node("a")).create_revision + 1, "create"
            )
            outcome = await a.placement.cas(record, dataclasses.replace(record, epoch=2), fence=stale_fence)
            assert not outcome.applied and outcome.record == record
            fence = Condition(KEYS.node("a"), a.mirror.get(KEYS.node("a")).create_revision, "create")
            outcome = await a.placement.cas(record, dataclasses.replace(record, epoch=2), fence=fence)
            assert outcome.applied and outcome.record.epoch == 2

    run(scenario())


def test_updates_that_break_the_tables_rules_are_refused_before_etcd(etcd: EtcdCluster) -> None:
    async def scenario() -> None:
        async with nodes(etcd.endpoints, "a", "b") as (a, _b):
            record = await a.placement.create_if_absent("s", replication_factor=2)
            bad = {
                "epoch 0 < 1": dataclasses.replace(record, epoch=0),
                "leader must be an in-sync replica": dataclasses.replace(record, leader="b", isr=("a",)),
                "every in-sync replica must be a replica": dataclasses.replace(record, isr=("a", "z")),
                "cannot change a stream's name": dataclasses.replace(record, name="t"),
            }
            for message, update in bad.items():
                with pytest.raises(PlacementError, match=message):
                    await a.placement.cas(record, update)
            assert (await a.etcd.get(KEYS.stream("s"))).mod_revision == record.revision

    run(scenario())


def test_a_deleted_stream_created_again_is_a_new_incarnation(etcd: EtcdCluster) -> None:
    async def scenario() -> None:
        async with nodes(etcd.endpoints, "a", "b") as (a, b):
            log = PlacementLog(b)
            first = await a.placement.create_if_absent("s")
            assert await a.placement.delete(first)
            assert a.placement.locate("s") is None
            assert not await a.placement.delete(first)  # already gone
            second = await a.placement.create_if_absent("s")
            assert second.incarnation > first.incarnation
            assert not await a.placement.delete(first)  # an older incarnation never deletes a newer one
            outcome = await a.placement.cas(first, dataclasses.replace(first, epoch=2))
            assert not outcome.applied and outcome.record == second
            await settled([b])
            assert [(old, new) for _, old, new in log.changes] == [
                (None, first),
                (first, None),
                (None, second),
            ]

    run(scenario())


def test_a_record_that_does_not_decode_is_ignored_and_reported(etcd: EtcdCluster, caplog) -> None:
    async def scenario() -> None:
        async with nodes(etcd.endpoints, "a") as (a,):
            key = KEYS.stream("junk")
            await a.etcd.put_if(key, b'{"replicas": [], "leader": "x"}', [])
            good = await a.placement.create_if_absent("good")
            await settled([a])
            assert a.placement.locate("junk") is None
            assert a.placement.streams() == {"good": good}
            assert "ignoring the record at" in caplog.text

    run(scenario())


def test_records_round_trip_through_json_with_the_revisions_from_the_key() -> None:
    record = StreamPlacement(
        "s/x", 3, 9, ("a", "b"), "b", 4, ("b",), {"acks": "leader", "replication_factor": 2}
    )
    value = record.to_json()
    assert value == (
        b'{"config": {"acks": "leader", "replication_factor": 2}, "epoch": 4, "isr": ["b"], '
        b'"leader": "b", "replicas": ["a", "b"]}'
    )
    assert StreamPlacement.from_kv("s/x", KeyValue(KEYS.stream("s/x"), value, 3, 9, 0)) == record
