"""Group commit: concurrent appenders in `always` mode share one sync; new streams share the
sync of the directory that holds them (DirSync); and what one sync of a stream covers
(`sync_now`: its dirty files, its pending creation, the header it vouches for).

The first waiter whose entries are not yet durable becomes the leader and
syncs everything written so far; the others wait on the condition and are
released together. A failed sync is remembered: every later wait raises it,
because after a failed fsync the kernel may have dropped the dirty pages and
a retry could report success for data that is gone (PostgreSQL's fsyncgate).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from storage.errors import DurabilityError

if TYPE_CHECKING:
    from storage.fs import FileSystem
    from storage.stream import Stream


class SyncGate:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._synced_seq = 0
        self._syncing = False
        self.error: DurabilityError | None = None

    def wait(self, seq: int, sync: Callable[[], int]) -> None:
        """Return once writes up to `seq` are durable. `sync` syncs and returns the seq it covered."""
        with self._cond:
            while self._synced_seq < seq:
                if self.error is not None:
                    raise self.error
                if self._syncing:
                    self._cond.wait()
                    continue
                self._syncing = True
                self._cond.release()
                try:
                    covered = sync()
                except DurabilityError as exc:
                    covered = None
                    failure = exc
                finally:
                    self._cond.acquire()
                    self._syncing = False
                    self._cond.notify_all()
                if covered is None:
                    self.error = failure
                    raise failure
                self._synced_seq = max(self._synced_seq, covered)


class DirSync:
    """A directory whose new entries are made durable in batches (the streams directory: many
    streams created in a second share one fsync of it). A change takes a ticket; `ensure(ticket)`
    syncs unless a sync begun after that change already covered it. Failures raise
    DurabilityError (the caller's SyncGate remembers them)."""

    def __init__(self, fs: FileSystem, path: Path) -> None:
        self._fs = fs
        self._path = path
        self._lock = threading.Lock()  # held through the sync: waiters then find themselves covered
        self._changes = 0
        self._synced = 0

    def changed(self) -> int:
        with self._lock:
            self._changes += 1
            return self._changes

    def ensure(self, ticket: int) -> None:
        with self._lock:
            if self._synced >= ticket:
                return
            covered = self._changes
            self._fs.sync_dir(self._path)
            self._synced = covered


def sync_now(stream: Stream) -> int:
    """Sync what the stream wrote so far (its dirty files, a pending creation) and publish the
    end it now vouches for; returns the write sequence it covers (SyncGate's leader calls it)."""
    with stream.lock:
        while stream.blocked_writers:  # appends that waited for the last sync write first: they share this
            stream.sync_ended.wait()
        files = list(stream.dirty)
        stream.dirty.clear()
        seq = stream.write_seq
        upto = stream.end_offset
        cuts = stream.cuts
        node = stream.active
        node_seq = node.ref.header.seq if node is not None else 0
        # The header the sync begins with must stay in its slot until the sync ends, or the sync
        # cannot vouch for it: meanwhile an append goes to a new node (everysec, no) or waits
        # (always: `_check_writable`).
        if node is not None and node_seq > node.durable_seq:
            node.in_sync = True
    synced = False
    try:
        stream.home.make_durable(files)
        synced = True
    finally:
        with stream.lock:
            if node is not None:
                node.in_sync = False
                if synced:  # its appends keep this header's slot from now on (storage/growing.py)
                    node.made_durable(node_seq)
            stream.sync_ended.notify_all()
            # (A truncation meanwhile cut what `upto` counted: it is not ours to vouch for.)
            if synced and stream.cuts == cuts:
                stream.publish(max(stream.local_end, upto))
    return seq
