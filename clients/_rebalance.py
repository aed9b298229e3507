"""Plans for `streamlog cluster rebalance` and `drain`: which streams move to which nodes.

Pure functions over what DescribeCluster and GetStreamInfo report (no I/O here: the CLI
asks, plans, then writes each move with ReassignReplicas and the cluster carries it out).

- **rebalance**: replicas per live node even within one, moving a replica at a time from
  the node holding the most to the one holding the fewest (of the streams it could take,
  the one whose size best evens out their bytes); then bytes, by swapping a big replica
  of the fullest node with a smaller one of the emptiest while that narrows their gap by
  a tenth or more; then leaders per node even out (a leader that may stay, stays).
- **drain NODE**: every replica on NODE moves to the live node holding the fewest replicas
  (then bytes) that does not hold that stream; nothing else moves, and a leader that
  stays keeps leading.

Streams without a leader, or already moving, are not planned (a move needs a leader to
copy from), but count where they are. Replicas on nodes that are not alive stay where
they are (the cluster re-creates them after `replica_replace_after_ms`).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence

from clients.types import StreamPlacement

# A bytes step is taken only when it narrows the two nodes' gap by this fraction or more.
_BYTES_STEP = 0.1


@dataclasses.dataclass(frozen=True)
class Move:
    """One stream's move: from its replicas and leader now to `target` (the leader first)."""

    stream: str
    replicas: tuple[str, ...]
    leader: str
    target: tuple[str, ...]


class _Layout:
    """Replica sets being planned, with each live node's replica count, bytes and leaders."""

    def __init__(self, streams: Sequence[StreamPlacement], nodes: Iterable[str], sizes: Mapping[str, int]):
        self.nodes = sorted(nodes)
        self.sizes = sizes
        self.sets = {s.name: set(s.target_replicas or s.replicas) for s in streams}
        self.movable = sorted(s.name for s in streams if s.leader and not s.target_replicas)
        self.count: collections.Counter[str] = collections.Counter()
        self.bytes: collections.Counter[str] = collections.Counter()
        for name, holders in self.sets.items():
            for node in holders:
                self.count[node] += 1
                self.bytes[node] += sizes.get(name, 0)

    def move(self, name: str, source: str, destination: str) -> None:
        self.sets[name].remove(source)
        self.sets[name].add(destination)
        size = self.sizes.get(name, 0)
        self.count[source] -= 1
        self.count[destination] += 1
        self.bytes[source] -= size
        self.bytes[destination] += size

    def emptiest(self, eligible: Iterable[str]) -> str | None:
        return min(eligible, key=lambda node: (self.count[node], self.bytes[node], node), default=None)


def drain(
    streams: Sequence[StreamPlacement], live: Iterable[str], sizes: Mapping[str, int], node: str
) -> tuple[list[Move], list[str]]:
    """The moves that take every replica off `node`, and the streams that cannot move now (no
    leader, already moving, or no live node left to take them)."""
    layout = _Layout(streams, (n for n in live if n != node), sizes)
    stuck = []
    for s in streams:
        if node not in (s.target_replicas or s.replicas):
            continue
        destination = layout.emptiest(n for n in layout.nodes if n not in layout.sets[s.name])
        if s.name not in layout.movable or destination is None:
            stuck.append(s.name)
            continue
        layout.move(s.name, node, destination)
    return _moves(streams, layout, balance_leaders=False), stuck


def rebalance(
    streams: Sequence[StreamPlacement], live: Iterable[str], sizes: Mapping[str, int]
) -> list[Move]:
    """The moves that even out replicas, then bytes, then leaders, over the live nodes."""
    layout = _Layout(streams, live, sizes)
    if len(layout.nodes) < 2:
        return []
    _even_counts(layout)
    _even_bytes(layout)
    return _moves(streams, layout, balance_leaders=True)


def _even_counts(layout: _Layout) -> None:
    for _ in range(sum(layout.count.values()) + 1):
        fullest = max(layout.nodes, key=lambda n: (layout.count[n], layout.bytes[n], n))
        emptiest = layout.emptiest(layout.nodes)
        assert emptiest is not None
        if layout.count[fullest] - layout.count[emptiest] <= 1:
            return
        candidates = [
            name
            for name in layout.movable
            if fullest in layout.sets[name] and emptiest not in layout.sets[name]
        ]
        if not candidates:
            return
        # The size that brings the two nodes' bytes closest to equal.
        half_gap = (layout.bytes[fullest] - layout.bytes[emptiest]) / 2
        best = min(candidates, key=lambda name: (abs(half_gap - layout.sizes.get(name, 0)), name))
        layout.move(best, fullest, emptiest)


def _even_bytes(layout: _Layout) -> None:
    for _ in range(len(layout.movable) + 1):
        fullest = max(layout.nodes, key=lambda n: (layout.bytes[n], n))
        emptiest = min(layout.nodes, key=lambda n: (layout.bytes[n], n))
        gap = layout.bytes[fullest] - layout.bytes[emptiest]
        if gap <= 0:
            return
        best: tuple[float, str, str] | None = None
        for big in layout.movable:
            if fullest not in layout.sets[big] or emptiest in layout.sets[big]:
                continue
            for small in layout.movable:
                if emptiest not in layout.sets[small] or fullest in layout.sets[small]:
                    continue
                shift = layout.sizes.get(big, 0) - layout.sizes.get(small, 0)
                remaining = abs(gap - 2 * shift)
                if (
                    shift > 0
                    and remaining <= gap * (1 - _BYTES_STEP)
                    and (best is None or remaining < best[0])
                ):
                    best = (remaining, big, small)
        if best is None:
            return
        _, big, small = best
        layout.move(big, fullest, emptiest)
        layout.move(small, emptiest, fullest)


def _moves(streams: Sequence[StreamPlacement], layout: _Layout, *, balance_leaders: bool) -> list[Move]:
    """Each planned stream's target, its leader chosen (see the module docstring), where it differs
    from now."""
    planned = [s for s in streams if s.name in layout.movable]
    cap = math.ceil(len(streams) / max(1, len(layout.nodes))) if balance_leaders else len(streams)
    leaders = _Leaders(layout.sets, cap)
    for s in streams:
        if s.name not in layout.movable and s.leader:
            leaders.fixed[s.leader] += 1
    for s in planned:
        leaders.place(s)
    moves = []
    for s in planned:
        leader, holders = leaders.chosen[s.name], layout.sets[s.name]
        others = [n for n in s.replicas if n in holders and n != leader]
        others += sorted(holders - set(others) - {leader})
        target = (leader, *others)
        if set(target) != set(s.replicas) or leader != s.leader:
            moves.append(Move(s.name, tuple(s.replicas), s.leader, target))
    return moves


class _Leaders:
    """Leaders for the planned streams, at most `cap` per node where possible (a matching, found by
    augmenting paths as in Kuhn's algorithm): a stream's current leader first, then the holder
    leading the fewest, then one that holds the stream now (in sync: a leader change is then
    the only move)."""

    def __init__(self, sets: Mapping[str, set[str]], cap: int) -> None:
        self._sets = sets
        self._cap = cap
        self.fixed: collections.Counter[str] = collections.Counter()  # leaders of unplanned streams
        self.chosen: dict[str, str] = {}
        self._led: dict[str, list[str]] = collections.defaultdict(list)
        self._streams: dict[str, StreamPlacement] = {}

    def place(self, stream: StreamPlacement) -> None:
        self._streams[stream.name] = stream
        if not self._assign(stream.name, set()):
            self._take(stream.name, self._preferred(stream.name)[0])  # over the cap: the least loaded

    def _load(self, node: str) -> int:
        return self.fixed[node] + len(self._led[node])

    def _preferred(self, name: str) -> list[str]:
        stream = self._streams[name]
        return sorted(
            self._sets[name],
            key=lambda n: (n != stream.leader, self._load(n), n not in stream.replicas, n),
        )

    def _assign(self, name: str, visited: set[str]) -> bool:
        for node in self._preferred(name):
            if node in visited:
                continue
            visited.add(node)
            if self._load(node) < self._cap:
                self._take(name, node)
                return True
            for other in list(self._led[node]):
                self._led[node].remove(other)
                if self._assign(other, visited):
                    self._take(name, node)
                    return True
                self._led[node].append(other)
        return False

    def _take(self, name: str, node: str) -> None:
        self.chosen[name] = node
        self._led[node].append(name)
