"""Moving a stream's replicas (Kafka's reassignment): the steps from a record with a target.

A move is written into the stream's placement record as `target` (the replicas it is to
have, the preferred leader first) by whoever asks for it (ReassignReplicas, or the
controller replacing a dead node); the controller carries it out, one compare-and-swap
per step, each decided from the record as it is now, so a new controller resumes a move
where the last one left it:

1. **add**: the target's nodes that are not replicas yet become replicas, outside the
   in-sync set. Each creates an empty copy and fetches from the leader (a rebuild, like a
   follower that lost its copy: entries, group state as a snapshot then batches), and
   the leader takes it into the in-sync set once it holds everything committed.
2. **finish**, once every target node is in sync: replicas = target, in-sync set =
   target, the target cleared; the leader becomes the target's first node if it lives
   (else it stays, if it is in the target, else the first live target node), at a new
   epoch when it changes. The nodes left out drop their copies. A target of another size
   changes the stream's replica count, as in Kafka: its `replication_factor` setting becomes
   the target's size (dead-node repair and rebalancing keep the count).

Offsets, groups and producer ids are the leader's, copied as they are: nothing is
renumbered. A leader that changes ends its waiting calls as an election does (clients
retry on the new leader). While a move copies, acks=quorum counts a majority of the
target's size (`StreamPlacement.replica_count`), not of the replicas old and new.

A stream with no leader makes no step (no one to copy from); its election comes first.

A move not finished can be cancelled (Kafka's `--cancel`): the record goes back to the
replicas it had, the ones the move added (`added`) dropped, in one compare-and-swap; the
nodes dropped delete their copies. A finished move has nothing left to cancel.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping, Set

from cluster.errors import PlacementError
from cluster.placement import StreamPlacement


def copying(record: StreamPlacement) -> bool:
    """Whether the stream's move has added replicas that are still catching up."""
    return bool(record.target) and any(
        node in record.replicas and node not in record.isr for node in record.target
    )


def next_step(record: StreamPlacement, live: Set[str], *, may_start: bool) -> StreamPlacement | None:
    """The record after the move's next step, or None when there is nothing to do now (no move,
    no leader, replicas still catching up, or `may_start` False for a move that has to copy)."""
    target = record.target
    if not target or not record.leader:
        return None
    missing = tuple(node for node in target if node not in record.replicas)
    if missing:
        if not may_start:
            return None
        return dataclasses.replace(record, replicas=record.replicas + missing, added=record.added + missing)
    if not set(target) <= set(record.isr):
        return None  # catching up: the leader's change of the in-sync set wakes the controller
    leader = _finishing_leader(record, live)
    if leader is None:
        return None
    epoch = record.epoch if leader == record.leader else record.epoch + 1
    config = {**record.config, "replication_factor": len(target)}
    return dataclasses.replace(
        record, replicas=target, isr=target, leader=leader, epoch=epoch, target=(), added=(), config=config
    )


def cancelled(record: StreamPlacement) -> StreamPlacement | None:
    """The record with its move undone: the replicas it had before (those the move added
    dropped, from the in-sync set too), the leader kept, or None when no move is under way.
    Should the leader be one the move added (the original ones failed meanwhile), the first
    in-sync original replica leads at a new epoch; PlacementError when none is in sync (undoing
    the move would leave the stream without a replica that holds what it committed)."""
    if not record.target:
        return None
    replicas = tuple(node for node in record.replicas if node not in record.added)
    isr = tuple(node for node in record.isr if node in replicas)
    if not isr:
        raise PlacementError(
            f"stream {record.name!r}: none of its replicas before the move is in sync "
            f"(in sync: {', '.join(record.isr)}): the move cannot be undone, only finished"
        )
    leader, epoch = record.leader, record.epoch
    if leader and leader not in isr:  # (no leader: the election to come picks one)
        leader, epoch = isr[0], epoch + 1
    return dataclasses.replace(
        record, replicas=replicas, isr=isr, leader=leader, epoch=epoch, target=(), added=()
    )


def _finishing_leader(record: StreamPlacement, live: Set[str]) -> str | None:
    if record.target[0] in live:
        return record.target[0]
    if record.leader in record.target:
        return record.leader
    return next((node for node in record.target if node in live), None)


def replace_dead(
    record: StreamPlacement, dead: Set[str], live: Iterable[str], load: Mapping[str, int]
) -> StreamPlacement | None:
    """The record with a move that re-creates on live nodes the replicas it has on `dead` nodes
    (those of its target, if it is moving): each goes to the live node holding the fewest
    replicas (`load`; then the lowest id) that does not hold the stream. None when it has no
    replica on a dead node, or no live node can take one (it stays as it is)."""
    base = record.target or record.replicas
    gone = [node for node in base if node in dead]
    if not gone:
        return None
    spare = sorted(
        (node for node in live if node not in record.replicas and node not in base),
        key=lambda node: (load.get(node, 0), node),
    )
    if not spare:
        return None
    swap = dict(zip(gone, spare, strict=False))
    target = tuple(swap.get(node, node) for node in base)
    return dataclasses.replace(record, target=target) if target != base else None


def replica_load(records: Iterable[StreamPlacement]) -> collections.Counter[str]:
    """How many replicas each node holds or is taking on (a move's target counts)."""
    return collections.Counter(
        node for record in records for node in set(record.replicas) | set(record.target)
    )
