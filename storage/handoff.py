"""Streams the open-stream cache closed before their writes were synced (issue 17).

Under `everysec` (and `no`) a write is promised durable only by the next maintenance round,
so a stream the cache closes to make room need not be synced by the caller that needed the
room (about 4 ms of syncs for every new stream once the cache is full), nor write its marker
(a file to create: about a millisecond under load). Its close hands its unsynced segment files,
its pending creation and its marker over as an `UnsyncedClose`; the next round
(or `Engine.sync`, or the engine's close) finishes it as a synced close would have: the
segment files (by path: a closed mapping's dirty pages stay in the page cache), the creation
(storage/creation.py), then the `SYNCED` marker (storage/cleanmark.py).

A stream reopened before that takes its close back (`take`): nothing was lost, its files are
as it left them in the page cache, so it opens trusting its node bodies as after a clean
close, with those files to sync in its own next round, and no marker was written to remove;
its growing node keeps the header slot its last sync made durable (`durable_seq`: the header it
has now may not be, storage/growing.py).
If the round's sync failed, the stream reopens refusing appends, as a stream whose own sync
failed does (after a failed fsync the kernel may have dropped the pages: PostgreSQL's fsyncgate).

A close costs about four syncs (its segments, its directory, the streams directory's share):
about 4 ms, 200 closes a second, fewer than a load creating streams makes (issue 17: 480 a
second, the backlog grew without bound). A round with more than SYNCFS_BATCH closes waiting
that have something to sync finishes them with one syncfs(2) of the data directory's file
system instead, which writes back everything dirty on it (docs/DURABILITY.md has its cost on
a shared file system); a close that leaves only its marker needs no sync.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from storage.cleanmark import SyncedEnd, write_synced_end
from storage.creation import PendingCreation
from storage.errors import DurabilityError
from storage.fs import FileSystem

log = logging.getLogger("streamlog.storage")
# Closes a round finishes one by one; more take one syncfs. A syncfs writes back the whole file
# system's dirty data, which under such a load is mostly the closes' own: here it took 14 ms idle
# and 90 ms on average (140 at most) finishing hundreds of closes during a load, about what 32
# closes cost one by one (4.4 ms each).
SYNCFS_BATCH = 32
# Closes waiting that wake the maintenance thread for a round at once (storage/maintenance.py), not
# a second later: 4 batches. Past it a round's syncfs is worth its cost many times over, and closes
# that come this fast (a hundred in well under a second) would otherwise pile up a second's worth
# (480 under issue 17's load) with their acknowledged entries not yet durable and their memory
# held; below it, the once-a-second round finishes them as before.
BACKLOG_BOUND = 4 * SYNCFS_BATCH


class _State(Enum):
    PENDING = 1  # waiting for the round
    DONE = 2  # synced, SYNCED written: an ordinary closed stream
    FAILED = 3  # a sync failed
    TAKEN = 4  # reopened first: the stream has its files back


@dataclass(eq=False)
class UnsyncedClose:
    directory: Path
    files: list[Path]  # segment files written since their last sync
    creation: PendingCreation | None  # a new stream's creation, not yet durable
    durable_seq: int  # the seq of the last durable header of its growing node (0: none)
    synced: SyncedEnd | None  # the SYNCED marker to write once the files are synced
    marker_file: bool  # its directory may hold a SYNCED file (DirectoryHome.marker_file)
    state: _State = _State.PENDING
    error: DurabilityError | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def has_syncs(self) -> bool:
        """Whether finishing it syncs anything (files or a creation), not only writes its marker."""
        return bool(self.files) or self.creation is not None

    def finish(self, fs: FileSystem) -> None:
        """Sync what the close left unsynced, then mark the clean close (the round)."""
        with self.lock:
            if self.state is not _State.PENDING:
                return
            try:
                for path in self.files:
                    fs.sync_file(path)
                if self.creation is not None:
                    self.creation.commit(fs, self.directory, lambda: [])  # its files were synced above
            except DurabilityError as exc:
                self.fail(exc)
                return
            self.done(fs)

    def done(self, fs: FileSystem) -> None:
        """Its files are durable: write the marker (after the syncs: see Stream.close). Lock held."""
        if self.synced is not None:
            write_synced_end(fs, self.directory, self.synced, file_may_exist=self.marker_file)
        self.state = _State.DONE

    def fail(self, exc: DurabilityError) -> None:
        log.error("stream directory %s did not sync after its close: %s", self.directory.name, exc)
        self.state, self.error = _State.FAILED, exc


def finish_together(fs: FileSystem, root: Path, closes: list[UnsyncedClose]) -> None:
    """Finish many closes with file-system syncs of `root`'s file system, in the order of
    storage/creation.py: one syncfs (every close's segments, meta files and directories), the
    renames of `stream.meta.new`, a second syncfs only if one was renamed, then each creation
    marked committed and each marker written. A syncfs that fails fails every close of the batch
    still waiting.

    No close's lock is held across a syncfs (tens to hundreds of milliseconds under a load): a
    stream reopened meanwhile takes its close back at once (`UnsyncedCloses.take`), and the batch
    leaves it alone from then on. Its files and creation are the stream's again, made durable by
    its own next sync; a write-back error the syncfs met stays for that sync's fsync to report,
    as syncfs reports it through the file system, not through the files (Linux's errseq)."""
    waiting = []
    for close in closes:
        with close.lock:
            if close.state is _State.PENDING:
                if close.creation is not None:
                    close.creation.before_sync(fs, close.directory)
                waiting.append(close)
    if not _sync_filesystem(fs, root, waiting):
        return
    renamed = False
    for close in waiting:
        with close.lock:
            if close.state is _State.PENDING and close.creation is not None:
                try:
                    renamed = close.creation.rename_meta(fs, close.directory) or renamed
                except DurabilityError as exc:
                    close.fail(exc)
    if renamed and not _sync_filesystem(fs, root, waiting):
        return
    for close in waiting:
        with close.lock:  # held for a marker's write: a reopening waits for no more
            if close.state is _State.PENDING:
                if close.creation is not None:
                    close.creation.synced()
                close.done(fs)


def _sync_filesystem(fs: FileSystem, root: Path, closes: list[UnsyncedClose]) -> bool:
    """syncfs for a batch; False if it failed, and then so did every close of it still waiting."""
    try:
        fs.sync_filesystem(root)
    except DurabilityError as exc:
        for close in closes:
            with close.lock:
                if close.state is _State.PENDING:
                    close.fail(exc)
        return False
    return True


class UnsyncedCloses:
    """The closes waiting for the round, by stream name; safe to call from any thread."""

    def __init__(self, fs: FileSystem, root: Path, backlogged: Callable[[], None]) -> None:
        self._fs = fs
        self._root = root  # on the file system a batch's syncfs syncs (the data directory)
        self._backlogged = backlogged  # wakes the round: more than BACKLOG_BOUND closes wait
        self._lock = threading.Lock()
        self._closes: dict[str, UnsyncedClose] = {}

    def __len__(self) -> int:
        return len(self._closes)

    def waiting(self) -> int:
        """The closes the round has still to finish (not the failed ones kept for their reopening)."""
        with self._lock:
            closes = list(self._closes.values())
        return sum(close.state is _State.PENDING for close in closes)

    def add(self, name: str, close: UnsyncedClose) -> None:
        with self._lock:
            self._closes[name] = close
            waiting = len(self._closes)  # (failed ones too: rare, and they wake a round in vain)
        if waiting > BACKLOG_BOUND:
            self._backlogged()

    def take(self, name: str) -> UnsyncedClose | None:
        """The stream's close if it is not finished (the stream is being reopened and takes its
        files back), or one whose sync failed; None if there is none or it is done."""
        with self._lock:
            close = self._closes.pop(name, None)
        if close is None:
            return None
        with close.lock:  # waits for a round finishing it alone now, or for a batch's marker write
            if close.state is _State.DONE:
                return None
            close.state = _State.TAKEN if close.state is _State.PENDING else close.state
            return close

    def finish_all(self) -> None:
        """Finish every close waiting (the round); the failed ones stay for their reopening."""
        with self._lock:
            closes = list(self._closes.items())
        # A close with nothing to sync (a stream synced before it closed: its marker only) is
        # finished alone at no sync's cost; only the others make a batch worth a syncfs, which
        # writes back the whole file system (calls to closed streams close as many synced ones).
        syncing = [close for _, close in closes if close.state is _State.PENDING and close.has_syncs]
        if len(syncing) > SYNCFS_BATCH:
            finish_together(self._fs, self._root, syncing)
        for _, close in closes:
            close.finish(self._fs)  # (a close the batch finished or failed is left as it is)
        for name, close in closes:
            if close.state is _State.DONE:
                with self._lock:
                    if self._closes.get(name) is close:
                        del self._closes[name]

    def creating(self) -> set[str]:
        """The streams whose creation is not durable yet (the catalog file leaves them out)."""
        with self._lock:
            return {name for name, c in self._closes.items() if c.creation is not None and c.creation.pending}

    def discard(self, name: str) -> None:
        """The stream is being deleted: nothing of it needs to last."""
        with self._lock:
            self._closes.pop(name, None)
