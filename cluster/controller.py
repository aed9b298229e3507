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
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Set

from cluster.errors import EtcdError
from cluster.etcd import Condition
from cluster.nodes import NodeDirectory
from cluster.placement import PlacementTable, StreamPlacement
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

    def __init__(self, placement: PlacementTable, nodes: NodeDirectory) -> None:
        self._placement = placement
        self._nodes = nodes
        self._fence: Condition | None = None
        self._pending: set[str] = set()
        self._scan_all = False
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        nodes.add_listener(lambda _node, _old, _new: self._schedule(None))
        placement.add_listener(self._on_placement)

    @property
    def active(self) -> bool:
        return self._fence is not None

    def set_fence(self, fence: Condition | None) -> None:
        """Take office with the controller key's fence, or leave it (None)."""
        self._fence = fence
        self._schedule(None)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        self._fence = None
        if self._task is not None:
            await cancel_and_wait([self._task])

    def _on_placement(self, name: str, _old: StreamPlacement | None, new: StreamPlacement | None) -> None:
        if new is not None and new.leader not in self._nodes.live():
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
            update = elect(record, self._nodes.live().keys())
            if update is None:
                return
            outcome = await self._placement.cas(record, update, fence=fence)
            if outcome.applied:
                log.info(
                    "stream %r: leader %r -> %r at epoch %d, in sync %s",
                    name,
                    record.leader,
                    update.leader,
                    update.epoch,
                    list(update.isr),
                )
                return
            if outcome.record is not None and outcome.record.revision == record.revision:
                return  # the fence failed: this node is no longer the controller
            record = outcome.record
