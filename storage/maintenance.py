"""The engine's background work, one round per maintenance interval on its own thread (or
`maintain()` called directly): everysec syncs and creation commits of the open streams,
their packing, retention, producer snapshots and due compaction; closed streams whose upkeep
is due (storage/catalog.py) opened for it a few at a time; group upkeep; the catalog file
rewritten when streams came or went, or when its journal is full. Between rounds, while closed
slot streams' figures are unknown (after a crash), the thread recounts them in short slices.
`Engine` takes it from `Maintenance`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from storage.catalog import Catalog
from storage.config import EngineConfig
from storage.errors import CorruptionError, StorageError
from storage.groupmanager import GroupManager
from storage.handoff import UnsyncedCloses
from storage.openstreams import OpenStreams
from storage.packs import NO_PLACE
from storage.slothome import Slots
from storage.stream import Stream
from storage.types import FsyncPolicy

log = logging.getLogger("streamlog.storage")
UPKEEP_BATCH = 16  # closed streams a maintenance round visits at most
# Closed slot streams whose figures a round reads from their slots at most (one pread each, no
# open: their close journals none, so after a crash they are unknown until then).
RECOUNT_BATCH = 1024
# Between rounds the thread goes on recounting them in slices of this much of its own CPU
# (about 26 us a stream: some 40 of them), each followed by a pause three times as long:
# 100,000 streams in 15 to 16 s instead of 110, the closed-stream call p99 during it 1.5 to
# 3.8 ms (bench.recount, docs/PERFORMANCE.md); slices and pauses of 2 ms: 9 to 13 s, 2.2 to 4.9 ms.
RECOUNT_SLICE_S = 0.001
RECOUNT_PAUSE_S = 0.003
CATALOG_SAVE_S = 60  # the catalog file is rewritten at most this often when streams came or went
# ... or sooner, once this many came or went: a start-up after a kill -9 checks the directory of
# each stream created since the file (~0.1 ms apiece), so a load's 60 s of creations took seconds.
CATALOG_SAVE_CHANGES = 10_000
# ... and at once when its journal holds JOURNAL_RECORDS_MAX records (storage/catalog.py): streams
# opened and closed at large change no stream's presence, yet each makes two records.


class Maintenance:
    config: EngineConfig  # set by the engine
    _clock: Callable[[], int]
    _catalog: Catalog
    _catalog_saved: float
    _open: OpenStreams
    _unsynced: UnsyncedCloses
    _slots: Slots
    _groups: GroupManager
    _stop: threading.Event
    _wake: threading.Event
    _save_catalog: Callable[..., bool]
    retention_active: Callable[[str], bool]

    def maintain(self) -> None:
        """One round of background work: on the open streams that have any due (`_idle`), everysec
        syncs, packing, retention, compaction; then up to UPKEEP_BATCH closed streams whose upkeep
        is due (storage/catalog.py) are opened for it and closed again; the catalog file is
        rewritten if it is due."""
        now = self._clock()
        self._unsynced.finish_all()  # the streams the cache closed since the last round
        self._sync_slots()  # every slot stream's writes, open or closed: one sync for all
        for stream in self._open.values():
            if _idle(stream):
                continue  # nothing to sync, commit or keep up: no pin, no call (1,024 streams a second)
            if not self._open.hold(stream):
                continue  # closed by the cache meanwhile
            try:
                if stream.fsync is FsyncPolicy.EVERYSEC and (stream.dirty or stream.creation is not None):
                    stream.sync()
                stream.commit_creation()  # under "no" too: a directory is whole within a round
                self._upkeep(stream, now)
            except (StorageError, OSError) as exc:
                log.error("maintenance of stream %r failed: %s", stream.name, exc)
            finally:
                self._open.unpin(stream)
        for name in self._due(now):
            self._visit(name, now)
        self._groups.maintain()  # group expiry and dead letters, everysec journal syncs, checkpoints
        changes, since = self._catalog.changes, time.monotonic() - self._catalog_saved
        if self._catalog.journal_full() or (
            changes and (changes >= CATALOG_SAVE_CHANGES or since >= CATALOG_SAVE_S)
        ):
            try:
                self._slots.sync.wait()  # the file must name no slot a power loss could take back
                self._save_catalog()
            except StorageError as exc:
                log.error("the catalog could not be saved: %s", exc)

    def _due(self, now: int) -> list[str]:
        """Up to UPKEEP_BATCH closed streams whose upkeep is due, to visit; on the way, up to
        RECOUNT_BATCH closed slot streams given their figures from their slots (with the default
        config a slot stream needs no other upkeep; one whose slot does not read is visited)."""
        recounted = 0
        while recounted < RECOUNT_BATCH:
            names = self._catalog.due(now, UPKEEP_BATCH)
            visits = [name for name in names if not self._recount(name)]
            recounted += len(names) - len(visits)
            if visits or len(names) < UPKEEP_BATCH:
                return visits
        return []

    def _recount_slice(self, visits: int) -> tuple[bool, int]:
        """Between rounds: the closed streams due now, for RECOUNT_SLICE_S of this thread's CPU,
        the slot streams among them recounted and at most `visits` others visited (as the
        round's `_due` would). Whether any may be left, and the visits left."""
        now, end = self._clock(), time.thread_time() + RECOUNT_SLICE_S
        while visits and time.thread_time() < end:
            limit = min(UPKEEP_BATCH, visits)  # what is taken from the catalog's due is visited
            names = self._catalog.due(now, limit)
            for name in names:
                if not self._recount(name):
                    self._visit(name, now)
                    visits -= 1
            if len(names) < limit:
                return False, visits
        return visits > 0, visits

    def uncounted_streams(self) -> int:
        """Streams whose figures the totals miss until maintenance recounts or visits them
        (after a crash: storage/catalog.py's `uncounted`); 0 once they are all known."""
        return self._catalog.uncounted()

    def _visit(self, name: str, now: int) -> None:
        """A closed stream's upkeep: opened for it, then closed again."""
        try:
            stream = self._open.visit(name)
        except StorageError as exc:
            log.error("maintenance could not open stream %r: %s", name, exc)
            return
        try:
            self._upkeep(stream, now)
        except (StorageError, OSError) as exc:
            log.error("maintenance of stream %r failed: %s", stream.name, exc)
        finally:
            self._open.end_visit(stream)

    def _recount(self, name: str) -> bool:
        place = self._catalog.place(name)
        if place == NO_PLACE or self._open.glance(name) is not None:
            return False
        try:
            return self._catalog.recounted(name, self._slots.summary(name, place))
        except CorruptionError:
            return False

    def _sync_slots(self) -> None:
        """The round's sync of slot streams (storage/slothome.py's SlotSync): the packs written,
        the catalog journal, then its `r` record. A failure is logged; every slot stream's next
        "always" append and sync then fails with it."""
        try:
            self._slots.sync.wait()
        except StorageError as exc:
            log.error("the packs of slot streams did not sync: %s", exc)

    def _upkeep(self, stream: Stream, now: int) -> None:
        """A stream's packing, retention, producer snapshot and due compaction (maintenance)."""
        seq = stream.write_seq
        stream.cleaner.pack_pending()
        retains = self.retention_active(stream.name)
        if retains:
            stream.retention.apply(now)
        stream.save_producers(now)
        due = now - stream.cleaner.last_compaction_ms >= self.config.compaction_interval_ms
        if retains and stream.config.compaction and due:
            stream.cleaner.compact(now)
        stream.upkept_seq, stream.upkept_ms = seq, now

    def _maintenance_loop(self) -> None:
        """A round every interval, or at once when woken: by the stop, or by closes piling up past
        BACKLOG_BOUND (storage/handoff.py) during the wait or the round before, so a load closing
        streams faster than a round a second finishes them keeps the rounds going back to back,
        each batch's syncfs covering the closes that came meanwhile. While closed streams are
        due (after a crash, slot streams whose figures are unknown), the wait is cut into
        recount slices (`_recount_slice`), with UPKEEP_BATCH visits of other streams at most
        between two rounds."""
        interval = self.config.maintenance_interval_ms / 1000
        next_round = time.monotonic() + interval
        due, visits = True, UPKEEP_BATCH  # at start-up: after a crash many may be due
        while True:
            left = next_round - time.monotonic()
            woken = self._wake.wait(min(left, RECOUNT_PAUSE_S) if due else left)
            if self._stop.is_set():
                return
            if woken or time.monotonic() >= next_round:
                self._wake.clear()
                self.maintain()
                next_round = time.monotonic() + interval
                due, visits = True, UPKEEP_BATCH  # the round may have left some
            else:
                due, visits = self._recount_slice(visits)


def _idle(stream: Stream) -> bool:
    """Whether a round has nothing to do for an open stream: no write since its last upkeep (so
    nothing to sync, pack, snapshot or cut by count or size), its creation durable, no producer
    to expire, and no limit or compaction that time alone can make due. Read without a pin or a
    lock: a write that lands meanwhile moves `write_seq`, which the next round sees. The rounds
    hold the GIL for their Python work, and every call that overlaps one waits its share:
    about 10 µs a stream, 10 ms a round with a full cache of idle streams, was the tail of
    a call to a closed stream (issue 17)."""
    cfg = stream.config
    return (
        stream.write_seq == stream.upkept_seq
        and not stream.dirty
        and stream.creation is None
        and not stream.pack_queue
        and not len(stream.producers)
        and cfg.max_entries is None
        and cfg.max_age_ms is None
        and cfg.max_bytes is None
        and not cfg.compaction
    )
