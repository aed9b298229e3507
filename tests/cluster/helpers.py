"""Helpers for the cluster tests: running a scenario, starting nodes, waiting for changes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

from cluster.coordinator import ClusterConfig, Coordinator
from cluster.placement import StreamPlacement
from cluster.tasks import within

# Short leases keep the tests short; etcd grants at least 2 s with its default timing.
TEST_TTL_MS = 2000


def run(scenario: Coroutine[Any, Any, Any], timeout_s: float = 60) -> Any:
    """Run an async scenario to completion, failing (not hanging) past the timeout."""

    async def bounded() -> Any:
        finished, result = await within(timeout_s, scenario)
        if not finished:
            raise TimeoutError(f"the scenario took more than {timeout_s} s")
        return result

    return asyncio.run(bounded())


def config(endpoints: Sequence[tuple[str, int]], node_id: str, **overrides: Any) -> ClusterConfig:
    fields: dict[str, Any] = {
        "endpoints": list(endpoints),
        "node_id": node_id,
        "advertise": f"127.0.0.1:{7100 + sum(map(ord, node_id)) % 800}",
        "cluster_name": "test",
        "lease_ttl_ms": TEST_TTL_MS,
    }
    return ClusterConfig(**{**fields, **overrides})


@contextlib.asynccontextmanager
async def nodes(
    endpoints: Sequence[tuple[str, int]], *node_ids: str, **overrides: Any
) -> AsyncIterator[list[Coordinator]]:
    """Started coordinators, one per id (in order), all stopped on exit."""
    started: list[Coordinator] = []
    try:
        for node_id in node_ids:
            node = Coordinator(config(endpoints, node_id, **overrides))
            await node.start()
            started.append(node)
        await settled(started)
        yield started
    finally:
        for node in started:
            await node.stop()


async def settled(coordinators: Sequence[Coordinator]) -> None:
    """Wait until every coordinator's mirror holds every change etcd has made so far."""
    if coordinators:
        _, revision = await coordinators[0].etcd.get_prefix(b"/")
        for node in coordinators:
            assert await node.mirror.wait_for(revision, timeout_s=10), f"{node.node_id} lags"


async def until(
    condition: Callable[[], bool], changes: asyncio.Event | None = None, timeout_s: float = 10
) -> None:
    """Wait (bounded) until `condition()` holds, re-checking whenever `changes` fires.

    Without `changes`, checks every 20 ms: for states that move with time or with
    other processes, where no event of ours marks the change.
    """
    async with asyncio.timeout(timeout_s):
        while not condition():
            if changes is None:
                await asyncio.sleep(0.02)
            else:
                await changes.wait()
                changes.clear()


class PlacementLog:
    """Every placement change a node's table reports, with an event to wait on."""

    def __init__(self, node: Coordinator) -> None:
        self.changes: list[tuple[str, StreamPlacement | None, StreamPlacement | None]] = []
        self.event = asyncio.Event()
        node.placement.add_listener(self._record)

    def _record(self, name: str, old: StreamPlacement | None, new: StreamPlacement | None) -> None:
        self.changes.append((name, old, new))
        self.event.set()
