"""Append rates and group lag over the last minutes, kept in memory for the console's charts.

A sample is taken every `interval_s` (5 s; `samples` of them, 10 minutes, are
kept), so the charts have their history the moment a page opens. What it costs:

- Appends: the engine's append listener stores each stream's new end in a dict
  (one assignment per appended batch, only when the HTTP API is on). A sample
  keeps, per stream that grew, how many entries it gained; idle streams cost
  nothing per sample, so 100,000 quiet streams add nothing to memory. A stream's
  end before its first append is learnt when the engine opens it (its open
  listener), never at start-up: start-up opens no stream (a million of them).
- Groups: each sample reads the groups of up to `max_group_streams` streams
  that have groups (taking turns beyond that), off the event loop, and keeps
  each group's lag (None where it cannot be known) and pending count.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable

from storage import Engine, StorageError

log = logging.getLogger(__name__)

INTERVAL_S = 5.0
SAMPLES = 120
MAX_GROUP_STREAMS = 1000


class History:
    def __init__(
        self,
        interval_s: float = INTERVAL_S,
        samples: int = SAMPLES,
        max_group_streams: int = MAX_GROUP_STREAMS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.interval_s = interval_s
        self._max_group_streams = max_group_streams
        self._clock = clock
        self._engine: Engine | None = None
        # stream -> its end as the append listener last saw it; and as the previous sample saw it.
        self._ends: dict[str, int] = {}
        self._seen: dict[str, int] = {}
        # (time ms, {stream: entries appended since the sample before}) for streams that grew.
        self._appended: collections.deque[tuple[int, dict[str, int]]] = collections.deque(maxlen=samples)
        # (time ms, {(stream, group): (lag or None, pending)}).
        self._groups: collections.deque[tuple[int, dict[tuple[str, str], tuple[int | None, int]]]] = (
            collections.deque(maxlen=samples)
        )
        self._turn = 0
        self._task: asyncio.Task[None] | None = None

    def on_append(self, stream: str, end: int) -> None:
        """The engine's append listener (on the appending thread: one dict store)."""
        self._ends[stream] = end

    def on_open(self, stream: str, end: int) -> None:
        """The engine's open listener: the stream's end before it grows (the first one counts: the
        sampler moves it on)."""
        self._seen.setdefault(stream, end)

    async def start(self, engine: Engine) -> None:
        """Count from the ends of the streams open now, and of the others as they open; then
        sample every interval."""
        self._engine = engine
        engine.add_open_listener(self.on_open)
        engine.add_append_listener(self.on_append)
        for stream, info in (await asyncio.to_thread(engine.stats))["per_stream"].items():
            self.on_open(stream, info.end_offset)
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await asyncio.to_thread(self.sample)
            except Exception:  # a sample lost is a gap in a chart, never a dead sampler
                log.exception("console history: sample failed")

    def sample(self) -> None:
        """Take one sample now (the sampler does it every interval, in a thread)."""
        engine = self._engine
        if engine is None:
            return
        now_ms = int(self._clock() * 1000)
        ends = self._ends.copy()  # atomic: the listener may store meanwhile
        seen = self._seen
        grown = {}
        for stream, end in ends.items():
            before = seen.get(stream, 0)
            if end != before:
                # An end below the last one is a stream deleted and created again, from 0.
                grown[stream] = end - before if end > before else end
                seen[stream] = end
        for stream in [s for s in grown if not engine.exists(s)]:
            del grown[stream], seen[stream]
            self._ends.pop(stream, None)
        self._appended.append((now_ms, grown))
        self._groups.append((now_ms, self._group_sample(engine)))

    def _group_sample(self, engine: Engine) -> dict[tuple[str, str], tuple[int | None, int]]:
        streams = sorted(engine.group_streams())
        if len(streams) > self._max_group_streams:
            start = self._turn % len(streams)
            self._turn = start + self._max_group_streams
            streams = (streams + streams)[start : start + self._max_group_streams]
        found = {}
        for stream in streams:
            try:
                groups = engine.list_groups(stream)
            except StorageError:
                continue  # deleted meanwhile
            for group in groups:
                found[(stream, group.name)] = (group.lag, group.pending)
        return found

    def appended(self, stream: str) -> list[tuple[int, int]]:
        """(time ms, entries appended in the interval before) per sample, oldest first."""
        return [(at, grown.get(stream, 0)) for at, grown in self._appended]

    def group(self, stream: str, group: str) -> list[tuple[int, int | None, int]]:
        """(time ms, lag or None, pending) per sample that saw the group, oldest first."""
        key = (stream, group)
        return [(at, *groups[key]) for at, groups in self._groups if key in groups]
