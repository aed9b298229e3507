"""The controller's job: every stream led by a live node whenever its in-sync replicas allow.

When a node's key goes (its lease expired, or it was revoked at shutdown), each stream
it led gets a new leader: a live in-sync replica other than it (the first in replica
order, so the preferred one when it lives), at `epoch + 1`, with the dead leader out
of the in-sync set. No live in-sync replica: the leader becomes "" (offline) at
`epoch + 1`, the in-sync set kept as it is, until one of its members comes back. A
replica that is not in sync is never elected (no unclean election: it may lack
acknowledged entries).

The controller looks again at every stream when a node joins or leaves and when it
takes office, and at one stream whenever its record changes to a leader that is not
live, so a missed moment is repaired at the next. Each change is a compare-and-swap
fenced by the controller key (cluster/election.py); a conflict is decided again from
the fresh record.

It also carries out moves (cluster/reassign.py): a stream whose record has a target takes
its next step whenever its record changes (a replica joining the in-sync set wakes it, no
polling), at most `max_moves` streams copying at once (the others wait for a slot; a move
that finishes rescans them). And with `replace_after_s` set, a node that has been gone that
long (as this node saw it: a new controller counts from when it saw the node go, or from its
own start) has its replicas re-created on live nodes, by writing such a target.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Set

from cluster.errors import EtcdError
from cluster.etcd import Condition
from cluster.nodes import NodeDirectory, NodeInfo
from cluster.placement import PlacementTable, StreamPlacement
from cluster.reassign import copying, next_step, replace_dead, replica_load
from cluster.tasks import cancel_and_wait

log = logging.getLogger("streamlog.cluster.controller")

_RETRY_S = 0.25


def elect(record: StreamPlacement, live: Set[str]) -> StreamPlacement | None:
    """The record after an election, or None when the stream needs none."""
    if record.leader and record.leader in live:
        return None
    candidates = [node for node in record.replicas if node in record.isr and node in live]
    if candidates:
        isr = tuple(node for node in record.isr if node != record.leader)
        return dataclasses.replace(record, leader=candidates[0], epoch=record.epoch + 1, isr=isr)
    if record.leader:
        return dataclasses.replace(record, leader="", epoch=record.epoch + 1)
    return None


class Controller:
    """Runs elections while it holds a fence (set by the controller election)."""

    def __init__(
        self,
        placement: PlacementTable,
        nodes: NodeDirectory,
        *,
        max_moves: int = 4,
        replace_after_s: float = 0.0,
    ) -> None:
        """`max_moves`: streams copying for a move at once; `replace_after_s`: how long a node is
        gone before its replicas are re-created elsewhere (0: never)."""
        self._placement = placement
        self._nodes = nodes
        self._max_moves = max_moves
        self._replace_after_s = replace_after_s
        self._fence: Condition | None = None
        self._pending: set[str] = set()
        self._scan_all = False
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._copying: set[str] = set()  # streams whose move is copying (kept by the listener)
        self._started_at = time.monotonic()
        self._gone_since: dict[str, float] = {}  # nodes seen leaving, when (monotonic)
        self._replace_timers: dict[str, asyncio.TimerHandle] = {}
        self._due: set[str] = set()  # gone nodes whose replicas are to be re-created now
        nodes.add_listener(self._on_node)
        placement.add_listener(self._on_placement)

    @property
    def active(self) -> bool:
        return self._fence is not None

    def set_fence(self, fence: Condition | None) -> None:
        """Take office with the controller key's fence, or leave it (None)."""
        self._fence = fence
        self._schedule(None)
        if fence is not None:
            self._arm_replacements()
        else:
            self._disarm()

    def _disarm(self) -> None:
        for timer in self._replace_timers.values():
            timer.cancel()
        self._replace_timers.clear()
        self._due.clear()

    def _on_node(self, node: str, old: NodeInfo | None, new: NodeInfo | None) -> None:
        if new is None and old is not None:
            self._gone_since[node] = time.monotonic()
        elif new is not None:
            self._gone_since.pop(node, None)
            timer = self._replace_timers.pop(node, None)
            if timer is not None:
                timer.cancel()
            self._due.discard(node)
        self._schedule(None)
        self._arm_replacements()

    def _arm_replacements(self) -> None:
        """A timer per gone node holding replicas (or in a move's target), which marks it due once
        it has been gone `replace_after_s`."""
        if self._fence is None or self._replace_after_s <= 0:
            return
        holders = replica_load(self._placement.streams().values()).keys()
        loop = asyncio.get_running_loop()
        for node in holders - self._nodes.live().keys() - self._replace_timers.keys():
            due = self._gone_since.get(node, self._started_at) + self._replace_after_s
            self._replace_timers[node] = loop.call_later(
                max(0.0, due - time.monotonic()), self._mark_due, node
            )

    def _mark_due(self, node: str) -> None:
        if node not in self._nodes.live():
            self._due.add(node)
            self._schedule(None)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        self._fence = None
        self._disarm()
        if self._task is not None:
            await cancel_and_wait([self._task])

    def _on_placement(self, name: str, _old: StreamPlacement | None, new: StreamPlacement | None) -> None:
        if new is not None and copying(new):
            self._copying.add(name)
        elif name in self._copying:
            self._copying.discard(name)
            self._schedule(None)  # a slot freed: the moves waiting for one go on
        if new is not None and (new.leader not in self._nodes.live() or new.target):
            self._schedule(name)

    def _schedule(self, name: str | None) -> None:
        """Look at one stream soon (None: at every stream)."""
        if self._fence is None:
            return
        if name is None:
            self._scan_all = True
        else:
            self._pending.add(name)
        self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            names = list(self._placement.streams()) if self._scan_all else sorted(self._pending)
            self._scan_all = False
            self._pending.clear()
            failed = False
            for name in names:
                fence = self._fence
                if fence is None:
                    break
                try:
                    await self._settle(name, fence)
                except EtcdError as exc:
                    log.warning("election for stream %r failed (%s); trying again", name, exc)
                    self._pending.add(name)
                    failed = True
            if failed:
                await asyncio.sleep(_RETRY_S)
                self._wake.set()

    async def _settle(self, name: str, fence: Condition) -> None:
        record = self._placement.locate(name)
        while record is not None and self._fence == fence:
            update = self._decide(record)
            if update is None:
                return
            outcome = await self._placement.cas(record, update, fence=fence)
            if outcome.applied:
                log.info(
                    "stream %r: leader %r -> %r at epoch %d, replicas %s, in sync %s, target %s",
                    name,
                    record.leader,
                    update.leader,
                    update.epoch,
                    list(update.replicas),
                    list(update.isr),
                    list(update.target),
                )
                record = outcome.record  # a move may take its next step at once
                continue
            if outcome.record is not None and outcome.record.revision == record.revision:
                return  # the fence failed: this node is no longer the controller
            record = outcome.record

    def _decide(self, record: StreamPlacement) -> StreamPlacement | None:
        """The stream's next change: an election first, then a replacement of dead replicas, then
        its move's next step."""
        live = self._nodes.live().keys()
        update = elect(record, live)
        if update is not None:
            return update
        dead = self._due
        if dead and record.leader:  # offline: its replicas may yet return; nobody to copy from
            update = replace_dead(record, dead, live, replica_load(self._placement.streams().values()))
            if update is not None:
                return update
        may_start = record.name in self._copying or len(self._copying) < self._max_moves
        return next_step(record, live, may_start=may_start)
