"""Group commit: concurrent appenders in `always` mode share one sync; new streams share the
sync of the directory that holds them (DirSync).

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
