"""The nemesis of a chaos run: one fault at a time, every few seconds, each recorded in the history.

A fault is injected, held for a while, then healed; its start and end go into the
history (bench/history.py) beside the clients' operations, so a violation's report
shows what happened before it. The kinds (`KINDS`):

| kind | what | healed by |
|---|---|---|
| kill | the node's process ends at once (kill -9; its page cache survives) | a restart |
| pause | SIGSTOP, sometimes past the lease TTL | SIGCONT |
| partition | the node's links to and from its peers are silent | unblocking |
| partition-one-way | its links to peers, or theirs to it: silent, or requests or replies held | unblocking |
| partition-etcd | the node cannot reach etcd | unblocking |
| partition-client | the clients' link to the node is silent (both ways or one) | unblocking |
| reset | every connection of the node (clients, peers, etcd) is reset | (instant) |
| etcd-kill | an etcd member that is not its leader is killed | a restart |
| etcd-leader-kill | etcd's leader is killed | a restart |
| power | one node loses power: only what it synced survives | a restart |
| power-all | every node loses power at once | restarting them all |
| disk-full | the node's disk is full | space again |
| wipe | the node is killed and its data directory deleted (a new disk) | a restart, empty |

`kinds_for` says which kinds a configuration survives without losing what it
acknowledged: the cluster kinds need a cluster; power loss needs fsync=always
(or replicas); a wiped disk needs replicas to rebuild from.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from bench.history import History
from bench.testbed import Testbed
from tests.cluster.proxy import BOTH, FROM_TARGET, TO_TARGET, FaultProxy

KINDS = (
    "kill",
    "pause",
    "partition",
    "partition-one-way",
    "partition-etcd",
    "partition-client",
    "reset",
    "etcd-kill",
    "etcd-leader-kill",
    "power",
    "power-all",
    "disk-full",
    "wipe",
)
CLUSTER_KINDS = frozenset(
    {"partition", "partition-one-way", "partition-etcd", "etcd-kill", "etcd-leader-kill", "power-all"}
)


def kinds_for(nodes: int, replication_factor: int, fsync: str, etcd_members: int = 3) -> list[str]:
    """The fault kinds a configuration survives with nothing acknowledged lost."""
    kinds = [kind for kind in KINDS if nodes > 1 or kind not in CLUSTER_KINDS]
    if etcd_members < 3:  # etcd itself survives losing a member only with 3 or more
        kinds = [kind for kind in kinds if kind not in ("etcd-kill", "etcd-leader-kill")]
    if fsync != "always":
        # Unsynced entries die with the power: one node's survive on a majority of replicas,
        # nobody's survive when every node goes down at once.
        kinds = [
            kind for kind in kinds if kind != "power-all" and (kind != "power" or replication_factor >= 3)
        ]
    if replication_factor < 3:
        kinds.remove("wipe")  # with fewer than 3 copies, a lost disk can hold the only one
    return kinds


# A full disk shows only when a node needs new space (a segment or a file to write):
# it is held long enough for a busy stream's segment to fill.
HOLD_S = {"disk-full": (2.0, 6.0)}

Action = Callable[[], Awaitable[None]]


async def _nothing() -> None:
    pass


@dataclass(frozen=True)
class Plan:
    """One fault: its target and detail, how to inject it, how to heal it."""

    target: str
    detail: str
    inject: Action
    heal: Action


class Nemesis:
    """Faults of `kinds` on `testbed`, one at a time, recorded in `history`."""

    def __init__(
        self,
        testbed: Testbed,
        history: History,
        kinds: Sequence[str],
        rng: random.Random,
        *,
        interval_s: tuple[float, float] = (1.0, 3.0),
        hold_s: tuple[float, float] = (0.5, 4.0),
    ) -> None:
        unknown = set(kinds) - set(KINDS)
        if unknown or not kinds:
            raise ValueError(
                f"fault kinds must be some of {', '.join(KINDS)}; not {sorted(unknown) or 'none'}"
            )
        self.testbed = testbed
        self.history = history
        self.kinds = list(kinds)
        self.rng = rng
        self.interval_s = interval_s
        self.hold_s = hold_s
        self.injected: dict[str, int] = {}
        self._deck: list[str] = []  # the kinds still to come in this round

    def next_kind(self) -> str:
        """The kinds come in rounds, each round every kind once in a random order: a run of
        n faults covers every kind once n reaches the number of kinds."""
        if not self._deck:
            self._deck = self.rng.sample(self.kinds, len(self.kinds))
        return self._deck.pop()

    async def run(self, stop: asyncio.Event, min_faults: int = 0) -> None:
        """Inject faults until `stop` is set and at least `min_faults` were injected (a slow
        machine gets through fewer in the same time); the fault under way is healed first."""
        stopped = asyncio.ensure_future(stop.wait())
        try:
            while True:
                pause = self.rng.uniform(*self.interval_s)
                done, _ = await asyncio.wait({stopped}, timeout=pause)
                if done:
                    if sum(self.injected.values()) >= min_faults:
                        return
                    await asyncio.sleep(pause)
                await self.one()
        finally:
            stopped.cancel()

    async def one(self, kind: str | None = None) -> None:
        """Inject one fault (of `kind`, or a random one), hold it, heal it."""
        kind = kind or self.next_kind()
        plan = await self.plan(kind)
        fault = self.history.fault_started(kind, plan.target, plan.detail)
        self.injected[kind] = self.injected.get(kind, 0) + 1
        try:
            await plan.inject()
            await asyncio.sleep(self.rng.uniform(*HOLD_S.get(kind, self.hold_s)))
        finally:
            await plan.heal()
            self.history.fault_ended(fault)

    async def plan(self, kind: str) -> Plan:
        """Choose the target of a fault of `kind` and say how to inject and heal it (nothing done yet)."""
        if kind not in KINDS:
            raise ValueError(f"unknown fault kind {kind!r}")
        return await getattr(self, "_" + kind.replace("-", "_"))()

    def _node(self) -> str:
        return self.rng.choice(sorted(self.testbed.nodes))

    # ------------------------------------------------------------------ the kinds: each plans one fault

    async def _kill(self) -> Plan:
        name = self._node()
        node = self.testbed.nodes[name]
        return Plan(
            name, "kill -9", lambda: asyncio.to_thread(node.kill), lambda: self.testbed.start_node(name)
        )

    async def _pause(self) -> Plan:
        name = self._node()
        node = self.testbed.nodes[name]

        async def pause() -> None:
            node.pause()

        async def resume() -> None:
            node.resume()

        return Plan(name, "SIGSTOP", pause, resume)

    @staticmethod
    def _blocking(name: str, links: list[FaultProxy], direction: str, detail: str) -> Plan:
        async def block() -> None:
            for proxy in links:
                proxy.block(direction)

        async def unblock() -> None:
            for proxy in links:
                proxy.unblock()

        return Plan(name, detail, block, unblock)

    async def _partition(self) -> Plan:
        name = self._node()
        links = [proxy for pair, proxy in self.testbed.peer_links.items() if name in pair]
        return self._blocking(name, links, BOTH, "from its peers, both ways")

    async def _partition_one_way(self) -> Plan:
        name = self._node()
        outgoing = self.rng.random() < 0.5
        links = [
            proxy
            for (dialer, dialed), proxy in self.testbed.peer_links.items()
            if (dialer if outgoing else dialed) == name
        ]
        direction = self.rng.choice((BOTH, TO_TARGET, FROM_TARGET))
        calls = "its calls to its peers" if outgoing else "its peers' calls to it"
        what = {BOTH: "silent", TO_TARGET: "requests held", FROM_TARGET: "replies held"}[direction]
        return self._blocking(name, links, direction, f"{calls}: {what}")

    async def _partition_etcd(self) -> Plan:
        name = self._node()
        links = [proxy for (node, _), proxy in self.testbed.etcd_links.items() if node == name]
        return self._blocking(name, links, BOTH, "from etcd")

    async def _partition_client(self) -> Plan:
        name = self._node()
        direction = self.rng.choice((BOTH, TO_TARGET, FROM_TARGET))
        return self._blocking(
            name, [self.testbed.client_links[name]], direction, f"the clients' link, {direction}"
        )

    async def _reset(self) -> Plan:
        name = self._node()

        async def reset() -> None:
            for proxy in self.testbed.links_of(name):
                proxy.reset()

        return Plan(name, "every connection reset", reset, _nothing)

    async def _etcd_member(self, leader: bool) -> Plan:
        etcd = self.testbed.etcd
        assert etcd is not None
        lead = await asyncio.to_thread(etcd.leader)
        index = lead if leader else self.rng.choice([i for i in range(len(etcd.members)) if i != lead])
        detail = "etcd's leader" if leader else "an etcd follower"
        return Plan(
            f"etcd m{index}",
            detail,
            lambda: asyncio.to_thread(etcd.kill, index),
            lambda: asyncio.to_thread(etcd.restart, index),
        )

    async def _etcd_kill(self) -> Plan:
        return await self._etcd_member(leader=False)

    async def _etcd_leader_kill(self) -> Plan:
        return await self._etcd_member(leader=True)

    async def _power(self) -> Plan:
        name = self._node()
        node = self.testbed.nodes[name]
        return Plan(
            name,
            f"power loss ({node.power_mode})",
            lambda: asyncio.to_thread(node.power_loss),
            lambda: self.testbed.start_node(name),
        )

    async def _power_all(self) -> Plan:
        names = sorted(self.testbed.nodes)

        async def cut() -> None:
            await asyncio.gather(*(asyncio.to_thread(self.testbed.nodes[name].power_loss) for name in names))

        async def restart() -> None:
            await asyncio.gather(*(self.testbed.start_node(name) for name in names))

        return Plan("all nodes", f"power loss ({self.testbed.config.power_mode})", cut, restart)

    async def _disk_full(self) -> Plan:
        name = self._node()
        node = self.testbed.nodes[name]
        return Plan(
            name,
            "disk full",
            lambda: asyncio.to_thread(node.disk_full, True),
            lambda: asyncio.to_thread(node.disk_full, False),
        )

    async def _wipe(self) -> Plan:
        name = self._node()
        node = self.testbed.nodes[name]

        async def wipe() -> None:
            await asyncio.to_thread(node.kill)
            node.wipe()

        return Plan(name, "killed, data directory deleted", wipe, lambda: self.testbed.start_node(name))
