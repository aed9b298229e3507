"""The node index (storage/index.py): `has_holes` says whether offsets are missing, as a walk of
every node would, with the gaps between nodes kept as nodes come and go (a stream's close asks)."""

from __future__ import annotations

import itertools
import random

import pytest

from storage.format import NODE_SPARSE, NodeHeader
from storage.index import NodeIndex
from storage.segment import NodeRef


def node(base: int, count: int, sparse: bool = False) -> NodeRef:
    # A sparse node covers `slots` offsets of which `count` are kept (compaction's holes).
    slots = count + 2 if sparse else count
    header = NodeHeader(1, count, base, slots, 0, 0, 0, 0, 0, base, NODE_SPARSE if sparse else 0)
    return NodeRef(None, base, header)  # type: ignore[arg-type]  (no segment read here)


def walked(index: NodeIndex, first_offset: int, damaged: bool) -> bool:
    """has_holes by a walk of every node."""
    nodes = index.nodes
    return (
        damaged
        or (bool(nodes) and nodes[0].base_offset > first_offset)
        or any(ref.header.flags & NODE_SPARSE for ref in nodes)
        or any(a.end_offset != b.base_offset for a, b in itertools.pairwise(nodes))
    )


@pytest.mark.parametrize("seed", range(20))
def test_has_holes_answers_as_a_walk_of_every_node_through_appends_drops_and_rewrites(seed):
    rng = random.Random(seed)
    index, end, first = NodeIndex(), 0, 0
    for _ in range(60):
        op = rng.random()
        if op < 0.6:
            ref = node(end + (rng.random() < 0.1), rng.randint(1, 4), sparse=rng.random() < 0.05)
            index.append(ref)
            end = ref.end_offset
        elif op < 0.75 and len(index):
            index.drop_first(rng.randint(1, len(index)))
            first = max(first, index.nodes[0].base_offset if len(index) else end)
        elif op < 0.85:
            segment = {ref.segment for ref in index.nodes}
            fresh = [node(ref.base_offset, ref.header.count) for ref in index.nodes]
            index.replace_segments(list(segment), fresh)  # (every node rewritten, no hole)
        elif op < 0.9:
            first += rng.randint(0, 2)  # a trim within the first node, or past it
        for damaged in (False, True):
            assert index.has_holes(first, damaged) == walked(index, first, damaged), (first, index.nodes)


def test_has_holes_after_appends_reads_no_node(monkeypatch):
    """The close of a new stream asks once; its nodes came by `append`, which kept the answer."""
    index = NodeIndex([node(0, 3), node(3, 2), node(5, 4)])
    reads: list[int] = []
    real = NodeRef.end_offset
    monkeypatch.setattr(NodeRef, "end_offset", property(lambda ref: (reads.append(1), real.fget(ref))[1]))
    assert not index.has_holes(0, False)
    assert index.has_holes(1, False) is False and index.has_holes(0, True)
    assert reads == []
    index.append(node(10, 1))  # a hole between 9 and 10
    assert index.has_holes(0, False) and reads == [1]
