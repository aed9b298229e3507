"""Listener calls from the engine's threads to the event loop: one hop per call, or one per batch.

The engine tells its listeners on the thread that made the change: the loop's own, or one of
the server's threads (a stream to create or reopen, a sync that blocks). A listener that serves
the loop hops there with `call_soon_threadsafe`, which wakes the loop (a write to its self-pipe,
a turn of its selector) for each call. A thread that writes many streams in one go (the thread
part of an AppendMany) opens a `batch`: the listeners' calls made on it are held, one dict per
receiver (key -> value, the last value of a key kept), and reach the loop in one hop when the
batch ends, where each receiver gets its dict once and looks up only what concerns it (a set
intersection, not a Python step per stream).

A receiver runs on the loop after the whole batch, so its news is never older than what the
batch wrote: the last value of a key is the newest. Batched news comes later than per-call
news would, by at most the rest of the batch; the call that made the batch answers after it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Hashable, Iterator
from typing import Any

# Runs on the loop with the news gathered for it: key -> the last value told.
Receiver = Callable[[dict[Any, Any]], None]


class LoopHops:
    """Hops to the event loop for the engine's listeners. Create it on the loop it serves."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._held = threading.local()  # .receivers: the open batch's news, per receiver

    def tell(self, receive: Receiver, key: Hashable, value: Any) -> None:
        """Have `receive({key: value, ...})` run on the loop, soon: in this thread's batch if it
        has one open (with the batch's other news), else in a hop of its own. Any thread."""
        receivers: dict[Receiver, dict[Any, Any]] | None = getattr(self._held, "receivers", None)
        if receivers is not None:
            news = receivers.get(receive)
            if news is None:
                news = receivers[receive] = {}
            news[key] = value
        elif threading.get_ident() == self._loop_thread:
            self._loop.call_soon(receive, {key: value})
        else:
            self._hop({receive: {key: value}})

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Hold this thread's `tell`s until the block ends, then hand them to the loop in one hop.
        A batch opened inside another joins it."""
        if getattr(self._held, "receivers", None) is not None:
            yield
            return
        receivers: dict[Receiver, dict[Any, Any]] = {}
        self._held.receivers = receivers
        try:
            yield
        finally:
            self._held.receivers = None
            if receivers:
                self._hop(receivers)

    def _hop(self, receivers: dict[Receiver, dict[Any, Any]]) -> None:
        # RuntimeError: the loop is closed, so the server has stopped and nobody waits.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._deliver, receivers)

    def _deliver(self, receivers: dict[Receiver, dict[Any, Any]]) -> None:
        # A callback each (no wake-up: this is the loop's thread), so that one receiver's error
        # reaches the loop's handler without keeping the news from the others.
        for receive, news in receivers.items():
            self._loop.call_soon(receive, news)
