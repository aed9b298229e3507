"""A node that lost its copy of a stream leaves the in-sync set before it takes any role in it.

A copy is lost when the node has none (a wiped data directory) or an unreadable one
for a stream that existed before it looked (not one it saw created). Such a node
may be in the stream's in-sync set (ISR) in placement, even its leader: elected
with an empty log it would serve nothing, and its followers would truncate to it.
So before anything else it changes placement by compare-and-swap:

- other ISR members remain: it leaves the ISR (and, if it led, the leadership, at a
  new epoch: the controller elects one of them);
- it was the only ISR member: the stream goes to the live replica whose copy holds
  the most (the highest last epoch, then the longest log, as Raft compares logs),
  asked with ReplicaState, as the new leader and only ISR member at a new epoch.
  Every entry acknowledged at acks=quorum was on a majority, so on at least one other
  replica; the one most recently in sync holds them all. With no replica answering,
  it tries again later (the stream stays as it is meanwhile, served by no one).

Then it follows like any follower, rebuilding its copy from the leader.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Iterable

from cluster.placement import PlacementTable, StreamPlacement

log = logging.getLogger("streamlog.cluster.replication")

# (node id, stream, incarnation) -> (last epoch, log end) of that node's copy; None: no answer
AskState = Callable[[str, str, int], Awaitable[tuple[int, int] | None]]

_RETRY_S = (0.2, 2.0)


async def hand_over(
    placement: PlacementTable, node_id: str, name: str, live: Callable[[], Iterable[str]], ask_state: AskState
) -> None:
    """Take this node out of the stream's ISR (see the module docstring); returns once placement
    no longer counts it in sync (or the stream is gone)."""
    delay = _RETRY_S[0]
    while True:
        record = placement.locate(name)
        if record is None or node_id not in record.isr:
            return
        updated = await _without(record, node_id, set(live()), ask_state)
        if updated is not None:
            try:
                outcome = await placement.cas(record, updated)
            except Exception as exc:  # etcd unreachable: try again
                log.warning("stream %r: could not leave the in-sync set: %s", name, exc)
            else:
                if outcome.applied:
                    log.warning(
                        "stream %r: this node lost its copy: it leaves the in-sync set (now %s, leader %r)",
                        name,
                        list(updated.isr),
                        updated.leader,
                    )
                    return
                continue  # placement changed meanwhile: decide again from it
        await asyncio.sleep(delay)
        delay = min(delay * 2, _RETRY_S[1])


async def _without(
    record: StreamPlacement, node_id: str, live: set[str], ask_state: AskState
) -> StreamPlacement | None:
    others = tuple(node for node in record.isr if node != node_id)
    if others:
        if record.leader != node_id:
            return dataclasses.replace(record, isr=others)
        return dataclasses.replace(record, isr=others, leader="", epoch=record.epoch + 1)
    candidates = [node for node in record.replicas if node != node_id and node in live]
    states = await asyncio.gather(*(ask_state(node, record.name, record.incarnation) for node in candidates))
    known = [(state, node) for node, state in zip(candidates, states, strict=True) if state is not None]
    if not known:
        log.warning("stream %r: this node lost its copy and no other replica answers yet", record.name)
        return None
    _, best = max(known)
    return dataclasses.replace(record, isr=(best,), leader=best, epoch=record.epoch + 1)
