"""The open streams: a bounded cache of `Stream` objects, each holding its files and mappings.

A data directory may hold far more streams than a process can keep open (each open
segment is a file descriptor and a mapping). The engine knows every stream by name
(its catalog); this cache holds at most `max_open_streams` of them open, least
recently used first out. A stream is opened on demand (storage/loader.py: after an
unclean shutdown its tail is checked before it is first served) and closed cleanly
when it leaves (by the engine: synced, its SYNCED marker written, or under a policy
that promises writes to the next round, its syncs handed to that round,
storage/handoff.py), so reopening it reads no node body.

A caller uses a stream between `pin` and `unpin`; a pinned stream is never closed
under it. `peek` hands out a stream without a pin, for callers that use it at once
(the replication calls): it is not closed for `HOLD_S` after that. Streams
whose state lives only in memory are never closed: a replicated stream (its commit
cap, which replication sets), and one whose sync failed (it must refuse appends
until restart).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from storage.errors import StorageError
from storage.stream import Stream

log = logging.getLogger("streamlog.storage")

HOLD_S = 0.1  # a stream handed out by peek stays open at least this long


class OpenStreams:
    def __init__(
        self, limit: int, open_stream: Callable[[str], Stream], close_stream: Callable[[Stream], None]
    ) -> None:
        self._limit = limit
        self._open_stream = open_stream  # opens a stream of the catalog (raises if it cannot)
        self._close_stream = close_stream  # closes a stream the cache lets go (StorageError: it cannot)
        self._lock = threading.Lock()  # guards the dict and the pin counts
        self._opening = threading.Lock()  # opens, creations and closes, one at a time
        self._streams: OrderedDict[str, Stream] = OrderedDict()

    def __len__(self) -> int:
        return len(self._streams)

    def values(self) -> list[Stream]:
        with self._lock:
            return list(self._streams.values())

    def _hit(self, name: str, pin: bool) -> Stream | None:
        """The stream if it is open, marked used (call with `_lock` held)."""
        stream = self._streams.get(name)
        if stream is not None:
            self._streams.move_to_end(name)
            if pin:
                stream.pins.append(None)
            else:
                stream.touched = time.monotonic()
        return stream

    def pin(self, name: str) -> Stream:
        """The stream, opened if need be; it stays open until `unpin`.

        The hit takes no lock: the pin is published first, then `evicted` is checked, and
        `_close_one` sets `evicted` before it checks the pins again (both under the GIL's
        ordering), so either the closer sees the pin or the pinner sees `evicted` and goes
        the slow way, which waits for the close to end.
        """
        stream = self.pin_if_open(name)
        if stream is not None:
            return stream
        with self._lock:
            stream = self._hit(name, True)
        return stream if stream is not None else self._open(name, True)

    def pin_if_open(self, name: str) -> Stream | None:
        """The hot path of `pin`, `create` and the engine's append, taking no lock: the open stream,
        pinned, or None."""
        stream = self._streams.get(name)
        if stream is not None:
            stream.pins.append(None)
            if not stream.evicted:
                try:  # noqa: SIM105 (contextlib.suppress costs three calls on the hot path of every call)
                    self._streams.move_to_end(name)
                except KeyError:  # closed meanwhile: valid until unpinned, pinned first
                    pass
                return stream
            stream.pins.pop()
        return None

    def glance(self, name: str) -> Stream | None:
        """The stream if it is open now, neither pinned nor marked used: for reading one field
        at once (its fsync policy), which stays valid after a close."""
        return self._streams.get(name)

    def peek(self, name: str) -> Stream:
        """The stream, opened if need be, without a pin (see the module doc)."""
        with self._lock:
            stream = self._hit(name, False)
        return stream if stream is not None else self._open(name, False)

    def hold(self, stream: Stream) -> bool:
        """Pin a stream handed out by `values` if it is still open (False if it has been closed)."""
        stream.pins.append(None)
        if stream.evicted or self._streams.get(stream.name) is not stream:
            stream.pins.pop()
            return False
        return True

    def unpin(self, stream: Stream) -> None:
        stream.pins.pop()

    def _open(self, name: str, pin: bool) -> Stream:
        with self._opening:
            with self._lock:
                stream = self._hit(name, pin)  # opened by another thread meanwhile
            if stream is None:
                stream = self._open_stream(name)
                self.add(stream, pin)
            return stream

    def create(self, name: str, make: Callable[[], Stream]) -> Stream:
        """The stream, pinned: opened if it exists, else made by `make` (a new stream)."""
        stream = self.pin_if_open(name)
        if stream is not None:
            return stream
        with self._opening:
            with self._lock:
                stream = self._hit(name, True)
            if stream is None:
                stream = make()
                self.add(stream, True)
            return stream

    def add(self, stream: Stream, pin: bool) -> None:
        """Take a stream just opened or created (with `_opening` held), then close the least
        recently used ones past the limit."""
        if pin:
            stream.pins.append(None)
        else:
            stream.touched = time.monotonic()
        with self._lock:
            self._streams[stream.name] = stream
        while len(self._streams) > self._limit and self._close_one():
            pass

    def visit(self, name: str) -> Stream:
        """A stream that is not open, opened pinned for maintenance (storage/engine.py) without
        closing another for it: one over the limit until `end_visit`. Calls meanwhile use it."""
        with self._opening:
            with self._lock:
                stream = self._hit(name, True)
            if stream is None:
                stream = self._open_stream(name)
                stream.pins.append(None)
                with self._lock:
                    self._streams[name] = stream
                    self._streams.move_to_end(name, last=False)  # least recently used: first out
            return stream

    def end_visit(self, stream: Stream) -> None:
        """Unpin a visited stream and close it unless a call holds it now."""
        stream.pins.pop()
        with self._opening:
            if self._streams.get(stream.name) is stream and _closable(stream, time.monotonic()):
                self._close(stream)

    def _close_one(self) -> bool:
        now = time.monotonic()
        with self._lock:
            for victim in self._streams.values():  # (a loop: no generator made per eviction)
                if _closable(victim, now):
                    break
            else:
                return False  # all in use: over the limit until some are released
        return self._close(victim)

    def _close(self, victim: Stream) -> bool:
        """Close a stream if no call pins it (with `_opening` held); False if it stays open."""
        with self._lock:
            victim.evicted = True  # then the pins again: see `pin`
            if victim.pins or self._streams.get(victim.name) is not victim:
                victim.evicted = False
                return False
            del self._streams[victim.name]
        try:
            self._close_stream(victim)
        except StorageError as exc:
            log.error("stream %r could not be closed, it stays open: %s", victim.name, exc)
            with self._lock:
                victim.evicted = False
                self._streams[victim.name] = victim
            return False
        return True

    def discard(self, name: str) -> None:
        """Forget a stream (being deleted; the caller closes it)."""
        with self._lock:
            self._streams.pop(name, None)


def _closable(stream: Stream, now: float) -> bool:
    return (
        not stream.pins
        and now - stream.touched >= HOLD_S
        and stream.commit is None
        and not (stream.has_epochs and stream.epochs.incarnation)  # (a stream without makes none)
        and stream.sync_error is None
    )


class Pinned:
    """A stream kept open while a `with` block uses it (storage/engine.py's `_use`)."""

    __slots__ = ("_cache", "_make", "_name", "_stream")

    def __init__(self, cache: OpenStreams, name: str, make: Callable[[], Stream] | None = None) -> None:
        self._cache = cache
        self._name = name
        self._make = make

    def __enter__(self) -> Stream:
        if self._make is None:
            self._stream = self._cache.pin(self._name)
        else:
            self._stream = self._cache.create(self._name, self._make)
        return self._stream

    def __exit__(self, *exc: object) -> None:
        self._cache.unpin(self._stream)
