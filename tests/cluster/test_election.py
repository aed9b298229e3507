"""Controller election against a real etcd: one controller, takeover, and fencing of a deposed one."""

from __future__ import annotations

import dataclasses

from cluster.coordinator import Coordinator
from cluster.keys import KeyLayout
from tests.cluster.etcd_server import EtcdCluster
from tests.cluster.helpers import TEST_TTL_MS, nodes, run, settled, until
from tests.cluster.proxy import FaultProxy

KEYS = KeyLayout("test")
TTL_S = TEST_TTL_MS / 1000


def the_controller(started: list[Coordinator]) -> Coordinator:
    """The one node acting as controller, once all agree who it is."""
    (holder,) = [node for node in started if node.controller.active]
    assert {node.election.controller_id for node in started} == {holder.node_id}
    assert holder.mirror.get(KEYS.controller).lease == holder.membership.lease_id  # it goes with its holder
    return holder


def test_one_node_is_controller_and_another_takes_over_when_it_stops(etcd: EtcdCluster) -> None:
    async def scenario() -> None:
        async with nodes(etcd.endpoints, "a", "b", "c") as started:
            await until(lambda: sum(node.controller.active for node in started) == 1)
            await settled(started)
            first = the_controller(started)
            await first.stop()
            rest = [node for node in started if node is not first]
            await until(lambda: sum(node.controller.active for node in rest) == 1)
            await settled(rest)
            assert the_controller(rest) is not first

    run(scenario())


def test_a_controller_cut_off_is_replaced_and_its_late_writes_are_fenced(etcd: EtcdCluster) -> None:
    async def scenario() -> None:
        proxy = FaultProxy(etcd.endpoints[0])
        await proxy.start()
        async with nodes([proxy.address], "a") as (a,), nodes(etcd.endpoints, "b") as (b,):
            await until(lambda: a.controller.active)  # a was first
            record = await b.placement.create_if_absent("s", replication_factor=2)
            await settled([a, b])
            proxy.block()
            await until(lambda: b.controller.active, timeout_s=TTL_S + 5)
            # a cannot know yet: it still holds its fence. Whatever it writes with it fails.
            stale_fence = a.election.fence
            assert stale_fence is not None
            proxy.unblock()
            outcome = await a.placement.cas(record, dataclasses.replace(record, epoch=9), fence=stale_fence)
            assert not outcome.applied and outcome.record.epoch != 9
            # a hears it lost office, registers again, and is an ordinary member.
            await until(lambda: not a.controller.active and a.membership.lease_valid())
            await settled([a, b])
            assert the_controller([a, b]) is b
            assert "a" in b.nodes.live()
        await proxy.stop()

    run(scenario())


def test_a_node_starting_alone_becomes_controller(etcd: EtcdCluster) -> None:
    async def scenario() -> None:
        async with nodes(etcd.endpoints, "a") as (a,):
            await until(lambda: a.controller.active)
            await settled([a])
            assert the_controller([a]) is a

    run(scenario())
