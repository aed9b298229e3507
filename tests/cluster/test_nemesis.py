"""The chaos nemesis (bench/nemesis.py): which faults a configuration gets, and what each cluster fault does.

The node faults (kill, pause, power loss, a full disk, the clients' link) run in
the chaos bench's CI runs (tests/reliability/test_chaos.py). Here the faults on
links and on etcd are injected into a testbed whose proxies and etcd run without
nodes, and checked one by one: exactly the chosen links held, in the chosen
direction, etcd's chosen member down; and healing undoes each.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from bench.history import History
from bench.nemesis import KINDS, Nemesis, kinds_for
from bench.testbed import Testbed, TestbedConfig
from tests.cluster.helpers import run, until
from tests.cluster.proxy import FROM_TARGET, TO_TARGET

BOTH_WAYS = {TO_TARGET, FROM_TARGET}


def test_each_configuration_gets_the_faults_it_survives():
    single = ["kill", "pause", "partition-client", "reset", "power", "disk-full"]
    assert kinds_for(1, 1, "always") == single
    assert kinds_for(1, 1, "everysec") == ["kill", "pause", "partition-client", "reset", "disk-full"]
    cluster = kinds_for(3, 1, "always")
    assert set(cluster) == set(KINDS) - {"wipe"}
    assert "power-all" not in kinds_for(3, 3, "everysec") and "power" in kinds_for(3, 3, "everysec")
    assert kinds_for(5, 3, "always") == list(KINDS)
    assert "etcd-leader-kill" not in kinds_for(3, 1, "always", etcd_members=1)


def test_faults_come_in_rounds_that_cover_every_kind():
    nemesis = Nemesis(None, History(), ["kill", "pause", "power"], random.Random(4))
    drawn = [nemesis.next_kind() for _ in range(9)]
    for start in (0, 3, 6):
        assert sorted(drawn[start : start + 3]) == ["kill", "pause", "power"]
    with pytest.raises(ValueError, match="not \\['flood'\\]"):
        Nemesis(None, History(), ["kill", "flood"], random.Random(4))


def test_a_run_stopped_before_its_minimum_of_faults_injects_the_rest_first():
    class Counting(Nemesis):
        async def one(self, kind: str | None = None) -> None:
            kind = kind or self.next_kind()
            self.injected[kind] = self.injected.get(kind, 0) + 1

    async def scenario(min_faults: int) -> int:
        nemesis = Counting(None, History(), ["kill", "pause"], random.Random(4), interval_s=(0.001, 0.002))
        stop = asyncio.Event()
        stop.set()  # a slow machine: the run's time is up before any fault
        await nemesis.run(stop, min_faults)
        return sum(nemesis.injected.values())

    assert asyncio.run(scenario(5)) == 5
    assert asyncio.run(scenario(0)) == 0


@pytest.mark.timeout(120)
def test_link_and_etcd_faults_hold_exactly_their_targets_and_healing_undoes_them(tmp_path):
    async def scenario() -> None:
        bed = Testbed(tmp_path, TestbedConfig(nodes=3, etcd_members=3))
        await bed.open_links()
        nemesis = Nemesis(bed, History(), KINDS, random.Random(7))

        def held() -> dict[str, set[str]]:
            names = {id(proxy): name for name, proxy in _named_links(bed).items()}
            return {names[id(p)]: p.blocked for p in bed.proxies() if p.blocked}

        try:
            for _ in range(4):  # several draws: both ways of a one-way partition, several targets
                for kind in ("partition", "partition-one-way", "partition-etcd", "partition-client"):
                    plan = await nemesis.plan(kind)
                    await plan.inject()
                    node = plan.target
                    blocked = held()
                    assert blocked and all(node in link for link in blocked), (kind, node, blocked)
                    if kind == "partition":
                        expected = {f"{a}->{b}" for a, b in bed.peer_links if node in (a, b)}
                        assert blocked == dict.fromkeys(expected, BOTH_WAYS)
                    elif kind == "partition-etcd":
                        assert blocked == {f"{node}->etcd{i}": BOTH_WAYS for i in range(3)}
                    elif kind == "partition-client":
                        assert list(blocked) == [f"clients->{node}"]
                    else:
                        outgoing = {f"{node}->{b}" for a, b in bed.peer_links if a == node}
                        incoming = {f"{a}->{node}" for a, b in bed.peer_links if b == node}
                        assert set(blocked) in (outgoing, incoming)
                        assert len({frozenset(ways) for ways in blocked.values()}) == 1
                        assert (
                            "its calls to its peers" in plan.detail or "its peers' calls to it" in plan.detail
                        )
                    await plan.heal()
                    assert held() == {}
            plan = await nemesis.plan("reset")
            await plan.inject()  # nothing is connected: nothing to reset, nothing blocked
            assert held() == {}

            etcd = bed.etcd
            assert etcd is not None
            leader = await asyncio.to_thread(etcd.leader)
            plan = await nemesis.plan("etcd-leader-kill")
            assert plan.target == f"etcd m{leader}"
            await plan.inject()
            assert etcd.members[leader].process.poll() is not None
            await until(lambda: _leader_or_none(etcd) not in (None, leader), timeout_s=30)
            await plan.heal()
            assert etcd.members[leader].process.poll() is None
            plan = await nemesis.plan("etcd-kill")
            follower = int(plan.target.removeprefix("etcd m"))
            assert follower != await asyncio.to_thread(etcd.leader)
            await plan.inject()
            assert etcd.members[follower].process.poll() is not None
            await plan.heal()
            assert all(member.process.poll() is None for member in etcd.members)
        finally:
            await bed.stop()

    run(scenario(), timeout_s=100)


def _named_links(bed: Testbed) -> dict[str, object]:
    names: dict[str, object] = {f"clients->{node}": proxy for node, proxy in bed.client_links.items()}
    names.update({f"{a}->{b}": proxy for (a, b), proxy in bed.peer_links.items()})
    names.update({f"{node}->etcd{i}": proxy for (node, i), proxy in bed.etcd_links.items()})
    return names


def _leader_or_none(etcd) -> int | None:
    try:
        return etcd.leader()
    except RuntimeError:
        return None
