"""Blocked consumer-group readers: one queue per group, served in arrival order.

RCP 11: "when multiple clients are blocked with the same group we must
guarantee that the one that we serve first will return as the last one in the
queue of clients blocked, so that we can efficiently route the messages evenly
to all the clients that are participating to the group."

A group read (a blocking Read, or a Subscribe in group mode) that finds nothing
joins its group's queue and awaits a future. The queue's dispatcher serves the
waiters in arrival order: it reads for the first one; if that read returns
entries, the waiter gets them and leaves the queue (if it waits again, it joins
at the back), and the dispatcher goes on with the next one. A read that returns
nothing means every waiter that would read the same way (same `noack` and
`claim_idle_ms`) would get nothing too, so those are skipped until the next
wake-up: a wake-up costs one engine read per kind of waiter, not one per waiter.

Wake-ups, and never polling:

- an append to the group's stream (the engine's append listener);
- a change in the group that may let a reader proceed: an acknowledgement that
  makes room in a bounded pending list, a nack, a deleted consumer, a new
  position or configuration (the engine's group listener);
- one loop timer per queue, armed for the earliest `next_due_ms` its empty
  reads reported: a redelivery, a delayed entry, an entry idle long enough to
  claim falling due.

The engine calls listeners on whatever thread made the change, sometimes while
it holds another stream's group lock (dead letters), and forbids them to call
group methods. So listeners only hop to the loop and schedule the dispatcher,
which reads in a task of its own. The hops go through `LoopHops`
(service/loophops.py): a thread's batch of appends (AppendMany) reaches the loop in
one hop, and wakes the queues of the streams it wrote that have one. No wake-up is
lost, as for plain readers (service/waiters.py): a queue's first read runs on the loop
after the waiter joined it, and a hop runs after the loop step that made it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from service.loophops import LoopHops
from service.waiters import Wake
from storage import GroupReadOptions, GroupReadResult
from storage.engine import wall_clock_ms

# (stream, group, options, charge): `charge` is the waiter's, handed to the reader as it was
# given to `wait`, so that the reader reserves room for the reply it may fill (replybudget.py).
GroupReader = Callable[[str, str, GroupReadOptions, Any], Awaitable[GroupReadResult]]
WaitResult = GroupReadResult | Wake


def has_news(result: GroupReadResult) -> bool:
    """Whether a group read has something to tell: entries, or evicted entries it jumped over."""
    return bool(result.offsets) or result.gap is not None


class _Waiter:
    __slots__ = ("busy", "charge", "future", "options")

    def __init__(self, options: GroupReadOptions, charge: Any, future: asyncio.Future[WaitResult]) -> None:
        self.options = options
        self.charge = charge
        self.future = future
        self.busy = False  # the dispatcher is reading for it (in a thread: "always" streams)


class _Queue:
    __slots__ = ("dirty", "group", "running", "stream", "timer", "timer_at", "waiters")

    def __init__(self, stream: str, group: str) -> None:
        self.stream = stream
        self.group = group
        # Insertion-ordered: arrival order, with O(1) removal of a waiter that leaves.
        self.waiters: dict[_Waiter, None] = {}
        self.running = False  # a dispatcher task is serving this queue
        self.dirty = False  # something happened since the dispatcher last looked
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = 0.0


class GroupWaits:
    """Per-group queues of blocked readers. Create it on the event loop it serves."""

    def __init__(
        self, read: GroupReader, clock: Callable[[], int] = wall_clock_ms, hops: LoopHops | None = None
    ) -> None:
        """`hops`: the server's (shared with its plain readers, so that a batch makes one hop)."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._hops = hops or LoopHops()
        self._read = read
        self._clock = clock  # the engine's clock: next_due_ms is in its milliseconds
        self._queues: dict[str, dict[str, _Queue]] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # dispatchers, kept alive until done
        self._closed = False

    def count(self, stream: str | None = None, group: str | None = None) -> int:
        """Readers waiting: on one group, on one stream's groups, or on all."""
        streams = self._queues.values() if stream is None else [self._queues.get(stream, {})]
        return sum(
            len(queue.waiters)
            for queues in streams
            for name, queue in queues.items()
            if group is None or name == group
        )

    def busy(self, stream: str, group: str) -> bool:
        """Whether readers of this group are waiting or being served: a newcomer must queue behind them."""
        queue = self._queues.get(stream, {}).get(group)
        return queue is not None and (bool(queue.waiters) or queue.running)

    async def wait(
        self,
        stream: str,
        group: str,
        options: GroupReadOptions,
        timeout_s: float | None,
        charge: Any = None,
        *,
        due_ms: int | None = None,
        read_first: bool = True,
        until: asyncio.Event | None = None,
    ) -> WaitResult:
        """Queue up for the group's next entries; the result of the read that served us, or why not.

        `read_first`: have the dispatcher read for the queue now (needed unless the caller has
        just read, found nothing, and not awaited since; then `due_ms` is that read's
        next_due_ms). `until` ends the wait early, as a timeout does (TIMEOUT, unless a read
        for us is under way). A read error reaches the caller as the exception it raised.
        """
        if self._closed:
            return Wake.CLOSED
        queue = self._queues.setdefault(stream, {}).get(group)
        if queue is None:
            queue = self._queues[stream][group] = _Queue(stream, group)
        waiter = _Waiter(options, charge, self._loop.create_future())
        queue.waiters[waiter] = None
        if due_ms is not None:
            self._arm(queue, due_ms)
        if read_first:
            self._kick(queue)
        future = waiter.future
        ended = None if until is None else asyncio.ensure_future(until.wait())
        try:
            if ended is None:
                await asyncio.wait((future,), timeout=timeout_s)
            else:
                await asyncio.wait((future, ended), timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if not future.done() and waiter.busy:
                # A read for this waiter is under way: what it takes is handed to this consumer
                # and becomes pending, so deliver it rather than leave it with no one to receive it.
                await future
            if not future.done():
                return Wake.TIMEOUT
            return future.result()
        finally:
            if ended is not None:
                ended.cancel()
            if not future.done():
                future.cancel()  # the call went away: the dispatcher must not serve it
            queue.waiters.pop(waiter, None)
            self._forget_if_idle(queue)

    # ------------------------------------------------------------------ wake-ups

    def on_append(self, stream: str, end_offset: int) -> None:
        """The engine's append listener; safe to call from any thread."""
        if threading.get_ident() != self._loop_thread:
            self._hops.tell(self._wake_streams, stream, end_offset)
        elif stream in self._queues:  # (most appends find no group reader waiting)
            self._wake_stream(stream)

    def on_group_change(self, stream: str, group: str) -> None:
        """The engine's group listener; safe to call from any thread."""
        if threading.get_ident() == self._loop_thread:
            self._wake_group(stream, group)
        else:
            self._hops.tell(self._wake_groups, (stream, group), None)

    def kick(self, stream: str, group: str) -> None:
        """Have the group's waiters read again (e.g. after the group was deleted). Loop thread only."""
        self._wake_group(stream, group)

    def on_delete(self, stream: str) -> None:
        """End every wait on the stream's groups with DELETED. Loop thread only."""
        for queue in self._queues.pop(stream, {}).values():
            self._end(queue, Wake.DELETED)

    def close(self) -> None:
        """End every wait with CLOSED, and make later waits return CLOSED at once."""
        self._closed = True
        queues, self._queues = self._queues, {}
        for by_group in queues.values():
            for queue in by_group.values():
                self._end(queue, Wake.CLOSED)

    def _wake_streams(self, ends: dict[str, int]) -> None:
        """Appends made on another thread: stream -> its new end."""
        for stream in ends.keys() & self._queues.keys():
            self._wake_stream(stream)

    def _wake_stream(self, stream: str) -> None:
        for queue in list(self._queues.get(stream, {}).values()):
            self._kick(queue)

    def _wake_groups(self, changed: dict[tuple[str, str], None]) -> None:
        """Group changes made on another thread: (stream, group) -> None."""
        for stream, group in changed:
            self._wake_group(stream, group)

    def _wake_group(self, stream: str, group: str) -> None:
        queue = self._queues.get(stream, {}).get(group)
        if queue is not None:
            self._kick(queue)

    def _end(self, queue: _Queue, reason: Wake) -> None:
        if queue.timer is not None:
            queue.timer.cancel()
            queue.timer = None
        for waiter in queue.waiters:
            if not waiter.future.done():
                waiter.future.set_result(reason)
        queue.waiters.clear()

    # ------------------------------------------------------------------ serving

    def _kick(self, queue: _Queue) -> None:
        queue.dirty = True
        if queue.running or not queue.waiters or self._closed:
            return  # a running dispatcher sees `dirty` and looks again
        queue.running = True
        task = self._loop.create_task(self._dispatch(queue))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _dispatch(self, queue: _Queue) -> None:
        try:
            while queue.dirty and queue.waiters and not self._closed:
                queue.dirty = False
                await self._serve(queue)
        finally:
            queue.running = False
            if queue.dirty and queue.waiters and not self._closed:
                self._kick(queue)  # woken while the last read ran in a thread
            else:
                self._forget_if_idle(queue)

    async def _serve(self, queue: _Queue) -> None:
        """One pass over the waiters, in arrival order."""
        found_nothing: set[tuple[bool, int | None]] = set()
        due: int | None = None
        for waiter in list(queue.waiters):
            if waiter not in queue.waiters or waiter.future.done():
                continue  # left (timed out, cancelled) while an earlier read ran in a thread
            kind = waiter.options.kind
            if kind in found_nothing:
                continue
            waiter.busy = True
            try:
                result = await self._read(queue.stream, queue.group, waiter.options, waiter.charge)
            except Exception as exc:
                # NOT_FOUND (the group was deleted), UNAVAILABLE (draining), ...: the caller answers it.
                if not waiter.future.done():
                    waiter.future.set_exception(exc)
                queue.waiters.pop(waiter, None)
                continue
            finally:
                waiter.busy = False
            if has_news(result):
                # Served: it leaves the queue, and joins at the back if it waits again. (If its
                # call went away meanwhile, the entries stay pending for it: redelivered after
                # retry_ms or claimable, as when a client dies holding entries.)
                if not waiter.future.done():
                    waiter.future.set_result(result)
                queue.waiters.pop(waiter, None)
            else:
                found_nothing.add(kind)
                if result.next_due_ms is not None and (due is None or result.next_due_ms < due):
                    due = result.next_due_ms
        if due is not None and queue.waiters:
            self._arm(queue, due)

    def _arm(self, queue: _Queue, due_ms: int) -> None:
        """Make sure the queue is woken at due_ms: one timer per queue, kept at the earliest time."""
        # At least 1 ms: a time already past must not make the dispatcher spin.
        delay_s = max(due_ms - self._clock(), 1) / 1000
        when = self._loop.time() + delay_s
        if queue.timer is not None:
            if queue.timer_at <= when:
                return
            queue.timer.cancel()
        queue.timer = self._loop.call_at(when, self._on_timer, queue)
        queue.timer_at = when

    def _on_timer(self, queue: _Queue) -> None:
        queue.timer = None
        self._kick(queue)

    def _forget_if_idle(self, queue: _Queue) -> None:
        if queue.waiters or queue.running:
            return
        if queue.timer is not None:
            queue.timer.cancel()
            queue.timer = None
        by_group = self._queues.get(queue.stream)
        if by_group is not None and by_group.get(queue.group) is queue:
            del by_group[queue.group]
            if not by_group:
                del self._queues[queue.stream]
