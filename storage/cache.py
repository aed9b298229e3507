"""A bounded, thread-safe LRU of decoded nodes, so sequential reads decode each node once.

A node is keyed by (segment uid, node position). A node that changes in place (a truncation's
resumed node, storage/truncation.py) or a segment that leaves its stream must have its entries
dropped (`drop_segment`): the keys are indexed by segment, so a drop costs what it drops, not a
walk of the whole cache (8.5 us with its 256 nodes full, at every close, issue 17).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from storage.format import NodeBody


class NodeCache:
    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._items: OrderedDict[tuple[int, int], NodeBody] = OrderedDict()
        self._positions: dict[int, set[int]] = {}  # segment uid -> positions of its cached nodes
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: tuple[int, int], load: Callable[[], NodeBody]) -> NodeBody:
        with self._lock:
            body = self._items.get(key)
            if body is not None:
                self._items.move_to_end(key)
                self.hits += 1
                return body
        body = load()  # outside the lock: decompression releases the GIL
        with self._lock:
            self.misses += 1
            items = self._items
            items[key] = body
            self._positions.setdefault(key[0], set()).add(key[1])
            while len(items) > self._capacity:
                (uid, pos), _ = items.popitem(last=False)
                positions = self._positions[uid]
                positions.discard(pos)
                if not positions:
                    del self._positions[uid]
        return body

    def drop_all(self) -> None:
        with self._lock:
            self._items.clear()
            self._positions.clear()

    def drop_segment(self, segment_uid: int) -> None:
        with self._lock:
            positions = self._positions.pop(segment_uid, None)
            if positions:
                items = self._items
                for pos in positions:
                    del items[segment_uid, pos]
