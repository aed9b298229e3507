"""The node cache (storage/cache.py): an LRU whose drop of a segment touches only that segment's keys."""

from __future__ import annotations

from array import array
from collections import OrderedDict

from storage.cache import NodeCache
from storage.format import NodeBody


class _NoWalk(OrderedDict):
    """The cache's items, refusing a walk over all of them: what a drop must not need."""

    def __iter__(self):
        raise AssertionError("the whole cache was walked")


def body(base: int) -> NodeBody:
    return NodeBody(base, array("I", [0, 1]), b"x")


def test_a_segments_drop_takes_its_nodes_only_and_walks_nothing_else():
    cache = NodeCache(capacity=6)
    cache._items = _NoWalk()
    loads: list[tuple[int, int]] = []

    def get(key: tuple[int, int]) -> NodeBody:
        return cache.get(key, lambda: loads.append(key) or body(key[1]))

    for pos in range(4):  # segment 1's four nodes, then segment 2's four: 1's first two evicted
        get((1, pos))
    for pos in range(4):
        get((2, pos))
    get((3, 0))  # segment 3's one node evicts 1's third
    assert list(cache._items.keys()) == [(1, 3), (2, 0), (2, 1), (2, 2), (2, 3), (3, 0)]
    cache.drop_segment(1)  # its one node left (the evicted ones are not looked for)
    cache.drop_segment(4)  # none cached: nothing to do
    assert list(cache._items.keys()) == [(2, 0), (2, 1), (2, 2), (2, 3), (3, 0)]
    cache.drop_segment(2)
    assert list(cache._items.keys()) == [(3, 0)]
    loads.clear()
    assert get((3, 0)).base_offset == 0 and get((2, 1)).base_offset == 1
    assert loads == [(2, 1)]  # a hit, then a dropped node loaded again
    cache.drop_all()
    cache.drop_segment(3)
    assert not cache._items
