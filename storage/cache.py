"""A bounded, thread-safe LRU of decoded nodes, so sequential reads decode each node once."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from storage.format import NodeBody


class NodeCache:
    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._items: OrderedDict[tuple[int, int], NodeBody] = OrderedDict()
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
            self._items[key] = body
            while len(self._items) > self._capacity:
                self._items.popitem(last=False)
        return body

    def drop_all(self) -> None:
        with self._lock:
            self._items.clear()

    def drop_segment(self, segment_uid: int) -> None:
        with self._lock:
            for key in [k for k in self._items if k[0] == segment_uid]:
                del self._items[key]
