"""Wake-ups for blocked reads and subscriptions, driven by the engine's append listener.

A reader that found nothing at `offset` registers a future under its stream and
awaits it. Every append calls `on_append(stream, end_offset)`; it resolves the
futures of that stream's readers whose offset is now below `end_offset`, and
only those, so a reader waiting for a far offset (RCP 11: "block for an offset of
old_offset + N") is not woken for nothing. There is no polling anywhere: an idle
reader is one future in a dict.

Everything here runs on the event loop thread. The engine calls the listener on
the appending thread, which is the loop thread for appends made directly on it and
one of the server's threads for the others (an "always"-fsync append, the streams an
AppendMany creates or reopens); those hop to the loop through `LoopHops`
(service/loophops.py): one hop per call, or, for a thread's batch (AppendMany), one
hop for the whole batch, which hands `_wake_many` every stream's new end at once.

No wake-up is lost: a reader reads the engine and registers its future with no
`await` in between, and the engine calls the listener only after the appended
entries are visible to reads. So an append is either visible to that read, or its
listener call runs on the loop after the future is registered. In a batch the same
holds of the batch as a whole: its hop is made when the batch ends, after its last
append is visible, and runs on the loop after the loop's current step. A reader whose
read came before one of the batch's appends was visible either registered before
that step ended, and the hop finds it, or its read and registration run after the
hop was made, and the read sees every entry of the batch. (A batch could skip its
hop when no reader waits on any of its streams only if the reader read again after
registering: the thread cannot see a read that has not registered yet.)
"""

from __future__ import annotations

import asyncio
import enum
import threading

from service.loophops import LoopHops


class Wake(enum.Enum):
    """Why a wait ended."""

    APPENDED = "appended"  # the stream now has an entry at or after the offset waited for
    TIMEOUT = "timeout"  # the time given ran out first
    DELETED = "deleted"  # the stream was deleted
    CLOSED = "closed"  # the server is shutting down


class Waiters:
    """Per-stream registry of waiting readers. Create it on the event loop it serves."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        # The hops of the engine's listeners to this loop; AppendMany batches its thread's on it.
        self.hops = LoopHops()
        # stream -> {future: offset waited for}. A dict per stream makes removal O(1)
        # when one of thousands of subscribers leaves.
        self._waiting: dict[str, dict[asyncio.Future[Wake], int]] = {}
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def count(self, stream: str | None = None) -> int:
        """Readers waiting, on one stream or on all."""
        if stream is not None:
            return len(self._waiting.get(stream, ()))
        return sum(len(w) for w in self._waiting.values())

    async def wait(self, stream: str, offset: int, timeout_s: float | None) -> Wake:
        """Wait until `stream` has an entry at `offset` or later, or timeout/delete/close.

        Call it right after a read of `stream` found nothing at `offset`, with no
        `await` in between (see the module docstring for why that is race-free).
        """
        if self._closed:
            return Wake.CLOSED
        future: asyncio.Future[Wake] = self._loop.create_future()
        waiting = self._waiting.setdefault(stream, {})
        waiting[future] = offset
        try:
            async with asyncio.timeout(timeout_s):
                return await future
        except TimeoutError:
            return Wake.TIMEOUT
        finally:
            # Gone already if a wake-up popped it; the stream's dict goes when empty.
            left = self._waiting.get(stream)
            if left is not None:
                left.pop(future, None)
                if not left:
                    del self._waiting[stream]

    def on_append(self, stream: str, end_offset: int) -> None:
        """The engine's append listener; safe to call from any thread."""
        if threading.get_ident() == self._loop_thread:
            if stream in self._waiting:  # (most appends find no reader waiting)
                self._wake_appended(stream, end_offset)
            return
        self.hops.tell(self._wake_many, stream, end_offset)

    def on_delete(self, stream: str) -> None:
        """End every wait on `stream` with DELETED. Call on the loop thread."""
        self._wake_all(self._waiting.pop(stream, {}), Wake.DELETED)

    def close(self) -> None:
        """End every wait with CLOSED, and make later waits return CLOSED at once."""
        self._closed = True
        waiting, self._waiting = self._waiting, {}
        for futures in waiting.values():
            self._wake_all(futures, Wake.CLOSED)

    def _wake_many(self, ends: dict[str, int]) -> None:
        """Appends made on another thread: stream -> its new end."""
        for stream in ends.keys() & self._waiting.keys():
            self._wake_appended(stream, ends[stream])

    def _wake_appended(self, stream: str, end_offset: int) -> None:
        waiting = self._waiting.get(stream)
        if not waiting:
            return
        ready = [future for future, offset in waiting.items() if offset < end_offset]
        for future in ready:
            del waiting[future]
            if not future.done():
                future.set_result(Wake.APPENDED)
        if not waiting:
            del self._waiting[stream]

    @staticmethod
    def _wake_all(futures: dict[asyncio.Future[Wake], int], reason: Wake) -> None:
        for future in futures:
            if not future.done():
                future.set_result(reason)
