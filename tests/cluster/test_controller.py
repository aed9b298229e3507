"""Elections: the rule itself, and the controller applying it on a real etcd when nodes die and return."""

from __future__ import annotations

import dataclasses
import time

from hypothesis import given
from hypothesis import strategies as st

from cluster.controller import elect
from cluster.etcd import Condition, EtcdClient
from cluster.keys import KeyLayout
from cluster.placement import StreamPlacement
from tests.cluster.etcd_server import EtcdCluster
from tests.cluster.helpers import TEST_TTL_MS, PlacementLog, nodes, run, settled, until
from tests.cluster.proxy import FaultProxy

KEYS = KeyLayout("test")
TTL_S = TEST_TTL_MS / 1000


def record(replicas: str, leader: str, isr: str, epoch: int = 5) -> StreamPlacement:
    return StreamPlacement("s", 1, 1, tuple(replicas), leader, epoch, tuple(isr), {})


def test_a_live_leader_keeps_its_stream() -> None:
    assert elect(record("abc", "a", "abc"), {"a"}) is None


def test_a_dead_leader_is_replaced_by_the_first_live_in_sync_replica_in_replica_order() -> None:
    new = elect(record("abc", "a", "cba"), {"b", "c"})
    assert (new.leader, new.epoch, new.isr) == ("b", 6, ("c", "b"))


def test_a_replica_out_of_sync_is_never_elected_the_stream_goes_offline() -> None:
    new = elect(record("abc", "a", "ab"), {"c"})
    assert (new.leader, new.epoch, new.isr) == ("", 6, ("a", "b"))  # the in-sync set is kept for their return
    assert elect(new, {"c"}) is None  # and nothing changes until one of them returns
    back = elect(new, {"b", "c"})
    assert (back.leader, back.epoch, back.isr) == ("b", 7, ("a", "b"))


@given(
    replicas=st.lists(st.sampled_from("abcdefg"), min_size=1, max_size=5, unique=True),
    data=st.data(),
)
def test_every_election_picks_a_live_in_sync_replica_or_none(
    replicas: list[str], data: st.DataObject
) -> None:
    isr = data.draw(st.lists(st.sampled_from(replicas), min_size=1, unique=True))
    leader = data.draw(st.sampled_from(["", *isr]))
    live = data.draw(st.sets(st.sampled_from("abcdefg")))
    before = record("".join(replicas), leader, "".join(isr))
    after = elect(before, live)
    if leader in live:
        assert after is None
        return
    if after is None:
        assert leader == "" and not live & set(isr)
        return
    after.check()
    assert after.epoch == before.epoch + 1
    assert after.leader == "" or (after.leader in before.isr and after.leader in live)
    assert set(after.isr) <= set(before.isr)
    assert elect(after, live) is None  # one election settles it


def assert_elections_were_clean(log: PlacementLog) -> None:
    """Every leader change a node heard chose an in-sync replica of the record before it."""
    for name, old, new in log.changes:
        if old is not None and new is not None and new.leader != old.leader:
            assert new.epoch > old.epoch, (name, old, new)
            assert new.leader == "" or new.leader in old.isr, (name, old, new)


def test_when_a_node_dies_its_streams_move_to_live_in_sync_replicas(etcd: EtcdCluster) -> None:
    async def scenario() -> None:
        async with nodes(etcd.endpoints, "a", "b", "c") as (a, b, _c):
            log = PlacementLog(b)
            for i in range(6):
                await a.placement.create_if_absent(f"s{i}", replication_factor=2)
                await settled([a])
            before = dict(b.placement.streams())
            led_by_a = {name for name, placed in before.items() if placed.leader == "a"}
            assert led_by_a and len(led_by_a) < len(before)

            await a.stop()
            await until(lambda: all(s.leader != "a" for s in b.placement.streams().values()), log.event)
            after = b.placement.streams()
            for name, old in before.items():
                if name in led_by_a:
                    new = after[name]
                    assert new.leader in {"b", "c"} and new.leader in old.isr
                    assert (new.epoch, new.isr) == (old.epoch + 1, tuple(n for n in old.isr if n != "a"))
                else:
                    assert after[name] == old  # streams a only followed are the leaders' business
            assert_elections_were_clean(log)

    run(scenario())


def test_a_stream_with_no_live_in_sync_replica_waits_offline_for_one_to_return(etcd: EtcdCluster) -> None:
    async def scenario() -> None:
        async with nodes(etcd.endpoints, "b", "a") as (b, a):
            log = PlacementLog(b)
            created = await a.placement.create_if_absent("s", replication_factor=2)
            assert created.leader == "a"
            # b fell behind and left the in-sync set (the leader's doing, in the replication layer).
            shrunk = (await a.placement.cas(created, dataclasses.replace(created, isr=("a",)))).record
            await a.stop()
            await until(lambda: b.placement.locate("s").leader != "a", log.event)
            offline = b.placement.locate("s")
            assert (offline.leader, offline.epoch, offline.isr) == ("", shrunk.epoch + 1, ("a",))
            async with nodes(etcd.endpoints, "a"):  # a comes back
                await until(lambda: b.placement.locate("s").leader == "a", log.event)
                back = b.placement.locate("s")
                assert (back.epoch, back.isr) == (offline.epoch + 1, ("a",))
            assert_elections_were_clean(log)

    run(scenario())


def test_a_controller_taking_office_repairs_streams_led_by_nodes_that_are_gone(etcd: EtcdCluster) -> None:
    async def scenario() -> None:
        # Written while no controller ran: led by x, which is not live.
        writer = EtcdClient(etcd.endpoints, timeout_s=2)
        stale = StreamPlacement("s", 0, 0, ("x", "a"), "x", 3, ("x", "a"), {"replication_factor": 2})
        key = KEYS.stream("s")
        assert (await writer.put_if(key, stale.to_json(), [Condition(key, 0, "create")])).succeeded
        await writer.close()
        async with nodes(etcd.endpoints, "a") as (a,):
            log = PlacementLog(a)
            await until(lambda: a.placement.locate("s").leader == "a", log.event)
            repaired = a.placement.locate("s")
            assert (repaired.epoch, repaired.isr) == (4, ("a",))

    run(scenario())


def test_a_leader_cut_off_from_etcd_is_replaced_once_its_lease_expires(etcd: EtcdCluster) -> None:
    async def scenario() -> None:
        proxy = FaultProxy(etcd.endpoints[0])
        await proxy.start()
        async with nodes(etcd.endpoints, "b") as (b,), nodes([proxy.address], "a") as (a,):
            await settled([a, b])
            log = PlacementLog(b)
            created = await a.placement.create_if_absent("s", replication_factor=2)
            assert created.leader == "a"
            await settled([a, b])
            proxy.block()
            blocked_at = time.monotonic()
            await until(lambda: b.placement.locate("s").leader == "b", log.event, timeout_s=TTL_S + 5)
            elected_at = time.monotonic()
            assert not a.membership.lease_valid()  # a stopped acting as leader before b was elected
            assert elected_at - blocked_at < TTL_S + 2
            assert b.placement.locate("s").epoch == created.epoch + 1
            proxy.unblock()
            assert_elections_were_clean(log)
        await proxy.stop()

    run(scenario())


def test_streams_keep_one_leader_per_epoch_while_nodes_come_and_go(etcd: EtcdCluster) -> None:
    async def scenario() -> None:
        async with nodes(etcd.endpoints, "observer", "a", "b", "c") as (observer, *members):
            log = PlacementLog(observer)
            for i in range(4):
                await members[i % 3].placement.create_if_absent(f"s{i}", replication_factor=3)
            await settled([observer, *members])
            for gone in ("a", "b"):
                node = next(m for m in members if m.node_id == gone)
                await node.stop()
                await until(
                    lambda gone=gone: all(s.leader != gone for s in observer.placement.streams().values()),
                    log.event,
                )
            # RF 3 of 4 nodes: each stream kept a live in-sync replica to lead it.
            assert {s.leader for s in observer.placement.streams().values()} <= {"c", "observer"}
            epochs: dict[tuple[str, int], str] = {}
            for name, _, new in log.changes:
                if new is not None:
                    assert epochs.setdefault((name, new.epoch), new.leader) == new.leader
            assert_elections_were_clean(log)

    run(scenario())
