"""Retention: moving a stream's first offset by RCP 11's rules and the stream's limits.

- an exact trim (first_offset becomes exactly the offset asked, as far as the end);
- RCP's TEVICT: evict whole nodes up to an offset, or keep the last N entries;
- the stream's limits, applied by maintenance: max_entries (RCP's BACKLOG),
  max_age_ms, max_bytes, evicting whole nodes.

Everything but the exact trim stops at the consumer groups' retention floor
(entries a group with retention_hold still needs). A new first offset is made
durable in the stream's meta file first, then the index forgets the nodes
below it and whole segments below it are deleted. All of it runs under the
stream's `maintenance_lock`, so it never races packing or compaction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from storage.errors import InvalidArgumentError
from storage.segment import NodeRef

if TYPE_CHECKING:
    from storage.stream import Stream


class Retention:
    def __init__(self, stream: Stream) -> None:
        self._stream = stream

    def trim(self, first_offset: int) -> int:
        """Exact trim: first_offset becomes exactly `first_offset` (clamped to the stream's end)."""
        if first_offset < 0:
            raise InvalidArgumentError("trim offset must not be negative")
        s = self._stream
        with s.maintenance_lock, s.lock:
            self._move_to(min(first_offset, s.end_offset))
            return s.first_offset

    def evict(self, up_to_offset: int) -> int:
        """RCP TEVICT with a positive offset: drop whole nodes whose entries are all <= up_to_offset."""
        if up_to_offset < 0:
            raise InvalidArgumentError("evict offset must not be negative")
        s = self._stream
        with s.maintenance_lock, s.lock:
            self._drop_whole_nodes(lambda ref: ref.end_offset - 1 <= up_to_offset)
            return s.first_offset

    def keep_last(self, n: int) -> int:
        """RCP TEVICT with a negative count: keep at least n entries, dropping whole nodes."""
        if n < 0:
            raise InvalidArgumentError("keep count must not be negative")
        s = self._stream
        with s.maintenance_lock, s.lock:
            self._keep_last(n)
            return s.first_offset

    def apply(self, now_ms: int) -> None:
        """The stream's limits (max_age_ms, max_entries, max_bytes), as maintenance applies them."""
        s = self._stream
        cfg = s.config
        if cfg.max_entries is None and cfg.max_age_ms is None and cfg.max_bytes is None:
            return
        with s.maintenance_lock:
            if cfg.max_age_ms is not None:
                cutoff = s.seek_time(now_ms - cfg.max_age_ms)
                with s.lock:
                    self._move_to(self._guarded(cutoff))
            with s.lock:
                if cfg.max_entries is not None:
                    self._keep_last(cfg.max_entries)
                if cfg.max_bytes is not None:
                    nodes = s.index.nodes
                    total = sum(ref.disk_size for ref in nodes)
                    k = 0
                    while k + 1 < len(nodes) and total > cfg.max_bytes:
                        total -= nodes[k].disk_size
                        k += 1
                    self._evict_before(k)

    def _keep_last(self, n: int) -> None:
        s = self._stream
        nodes = s.index.nodes
        k = 0
        while k + 1 < len(nodes) and s.end_offset - nodes[k + 1].base_offset >= n:
            k += 1
        self._evict_before(k)

    def _drop_whole_nodes(self, drop: Callable[[NodeRef], bool]) -> None:
        nodes = self._stream.index.nodes
        k = 0
        while k + 1 < len(nodes) and drop(nodes[k]):
            k += 1
        self._evict_before(k)

    def _evict_before(self, k: int) -> None:
        """Evict the first k indexed nodes (none when k is 0), as far as the retention floor."""
        if k:
            self._move_to(self._guarded(self._stream.index.nodes[k].base_offset))

    def _guarded(self, target: int) -> int:
        s = self._stream
        floor = s.ctx.retention_floor(s.name)
        return target if floor is None else min(target, floor)

    def _move_to(self, offset: int) -> None:
        """Move first_offset forward (call with both of the stream's locks held): persist it, then
        forget nodes and delete segments wholly below it."""
        s = self._stream
        if offset <= s.first_offset:
            return
        # Durable first: a trim that fails (disk full) must change nothing.
        s.write_meta(offset, s.config)
        s.first_offset = offset
        nodes = s.index.nodes
        keep_active = s.active.ref if s.active is not None else None
        k = 0
        while k < len(nodes) and nodes[k].end_offset <= offset and nodes[k] is not keep_active:
            k += 1
        s.index.drop_first(k)
        s.damaged = [g for g in s.damaged if g.end_offset > offset]
        while len(s.segments) > 1 and s.segments[0].end_offset() <= offset:
            segment = s.segments.pop(0)
            s.release(segment)
            s.ctx.fs.remove(segment.path)
