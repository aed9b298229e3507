"""The engine: a data directory of streams, the public entry point of `storage`.

    from storage import AppendBatch, Engine
    with Engine("./data") as engine:
        first = engine.append("rides", AppendBatch([b'{"id": 1}', b'{"id": 2}'])).first_offset
        print(engine.read("rides", first, 10).entries())

The engine knows every stream of a data directory (laid out as
storage/layout.py says) by name, keeps at most `max_open_streams` of them open
(storage/openstreams.py: start-up opens none, a stream is opened, and after an
unclean shutdown recovered, before it is first served), creates and deletes
streams, hands each call to its stream, and runs the maintenance thread; the
consumer-group calls come from GroupCalls (storage/groupsapi.py), the
replication primitives from ReplicaCalls (storage/replicaapi.py), the catalog's
reading at start-up and its writing from CatalogFiles (storage/catalogfiles.py),
the offline unpack of slot streams from Unpacking (storage/unpack.py).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from storage.cache import NodeCache
from storage.catalog import CATALOG_CLEAN, Catalog, SortedNames
from storage.catalogfiles import CatalogFiles
from storage.closer import FileCloser
from storage.config import DEFAULT_STREAM_CONFIG, EngineConfig, StreamConfig
from storage.context import EngineContext
from storage.creation import Adopted
from storage.durability import DirSync
from storage.errors import (
    CorruptionError,
    InvalidArgumentError,
    PreconditionError,
    StorageError,
    StreamNotFoundError,
)
from storage.fs import FileSystem
from storage.groupmanager import GroupManager
from storage.groupsapi import GroupCalls
from storage.handoff import UnsyncedCloses
from storage.layout import LOCK_FILE, streams_root
from storage.maintenance import Maintenance
from storage.names import dirname_for, validate_name
from storage.openstreams import OpenStreams, Pinned
from storage.packs import NO_PLACE
from storage.replicaapi import ReplicaCalls
from storage.slothome import SlotHome, Slots
from storage.stream import Stream
from storage.streaminfo import stream_info
from storage.streamsapi import StreamCalls
from storage.unpack import Unpacking

log = logging.getLogger("streamlog.storage")

AppendListener = Callable[[str, int], None]
GROUP_JOURNAL_BYTES = 1 << 20  # per stream with groups; checkpointed into a snapshot as it fills


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class Engine(StreamCalls, Maintenance, CatalogFiles, GroupCalls, ReplicaCalls, Unpacking):
    def __init__(
        self,
        data_dir: str | os.PathLike,
        config: EngineConfig | None = None,
        *,
        clock: Callable[[], int] | None = None,
        fs: FileSystem | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.data_dir = Path(data_dir)
        self._fs = fs or FileSystem()
        self._clock = clock or wall_clock_ms
        self._streams_root = streams_root(self.data_dir)  # joined once: each new stream's path is one join
        self._fs.makedirs(self._streams_root)
        self._lock_fd = self._take_lock() if fs is None else None
        self._lock = threading.Lock()
        self._listeners: list[AppendListener] = []
        self._log_listeners: list[AppendListener] = []
        self._open_listeners: list[AppendListener] = []
        # Consumer groups install a floor here: retention never evicts at or above it.
        self.retention_floor: Callable[[str], int | None] = lambda name: None
        # Streams whose retention and compaction run as EngineConfig.retention_passive does not say.
        self._retention_switched: set[str] = set()
        self._ctx = EngineContext(
            self._fs,
            self.config,
            self._clock,
            NodeCache(self.config.cache_nodes),
            self._floor,
            DirSync(self._fs, self._streams_root),
        )
        self._catalog = Catalog()  # every stream (storage/catalog.py)
        self._catalog_saved = time.monotonic()
        self._catalog_on_disk = True  # until a deletion removes it (_drop_catalog_file)
        self._leftovers = False  # a deletion left its directory: the next start-up must list
        self._wake = threading.Event()  # a round now: closes piled up (storage/handoff.py), or the stop
        # Closed by the cache, synced by the next round.
        self._unsynced = UnsyncedCloses(self._fs, self.data_dir, self._wake.set)
        self._closer = FileCloser(self.config.background)  # the cache's closes' files (storage/closer.py)
        self._open = OpenStreams(self.config.max_open_streams, self._open_stream, self._close_by_cache)
        self.unreadable: list[str] = []  # stream directories whose metadata failed its checks
        self._adopted: dict[Path, Adopted] = {}  # crashed creations start-up keeps, synced together
        # Streams in slots of pack files (storage/slothome.py): created only under small_streams
        # "slots", opened whatever the setting (a data directory keeps those it has).
        self._slots = Slots(self._ctx, self.data_dir, self._catalog)
        self._small = self.config.small_streams == "slots"
        self._load()
        if self._fs.exists(self._slots.packs.directory):
            kept = self._catalog.unreadable().values()  # (their slots the operator's: never reused)
            self._slots.packs.adopt([*self._catalog.placed().values(), *kept])
            if not self._clean_start and self._slots.packs.clear_unnamed():
                self._slots.sync.wait()  # before a stream is created: a scan never brings them back
        # Consumer groups (storage/groupmanager.py): their state lives beside each stream's segments.
        self._groups = GroupManager(
            self,
            self._fs,
            self._clock,
            journal_bytes=min(self.config.segment_bytes, GROUP_JOURNAL_BYTES),
            passive=self.config.groups_passive,
        )
        self.retention_floor = self._groups.retention_floor
        self._closed = False
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None
        if self.config.background:
            self._worker = threading.Thread(
                target=self._maintenance_loop, name="streamlog-maintenance", daemon=True
            )
            self._worker.start()

    # ------------------------------------------------------------------ lifecycle

    def _take_lock(self) -> int:
        fd = os.open(self.data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(fd)
            raise PreconditionError(f"data directory {self.data_dir} is in use by another process") from exc
        return fd

    def _floor(self, name: str) -> int | None:
        return self.retention_floor(name)

    def _open_stream(self, name: str) -> Stream:
        """Open a stream of the catalog (OpenStreams calls this on a miss)."""
        if name not in self._catalog:
            raise StreamNotFoundError(f"stream {name!r} does not exist")
        dirname = dirname_for(name)
        place = self._catalog.place(name)
        try:
            if place == NO_PLACE:
                stream = Stream.open(
                    self._ctx,
                    self._streams_root / dirname,
                    self._unsynced.take(name),
                    self._catalog.entries(name),
                )
            else:
                stream = Stream.open_in_slot(self._ctx, self._slots, name, self._streams_root, place)
        except (CorruptionError, ValueError, KeyError, FileNotFoundError) as exc:
            log.error("stream directory %s is unreadable: %s", dirname, exc)
            with self._lock:
                self._catalog.remove(name, unreadable=True)
                self.unreadable.append(dirname)
            raise StreamNotFoundError(f"stream {name!r} is damaged on disk; see the server log") from exc
        self._catalog.opened(name)
        for listener in self._open_listeners:
            listener(name, stream.visible_end)
        return stream

    def _close_by_cache(self, stream: Stream) -> None:
        """Close a stream the cache lets go (or the engine's close). Under a policy that promises
        writes to the next round its syncs are that round's, not those of the call that needed the
        room (storage/handoff.py)."""
        handed = stream.close(hand_off=not stream.fsync.blocks, closer=self._closer.close)
        if handed is not None:
            self._unsynced.add(stream.name, handed)
        self._note_closed(stream)

    def _note_closed(self, stream: Stream) -> None:
        if stream.closed_summary is not None:
            self._catalog.closed(stream.name, stream.closed_summary)

    def close(self) -> None:
        """Sync every stream, mark a clean shutdown, stop the maintenance thread."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake.set()
        if self._worker is not None:
            self._worker.join()
        self._groups.close()
        now = self._clock()
        for stream in self._open.values():
            try:
                # Its syncs and marker handed to the finish below with the cache's closes: past
                # SYNCFS_BATCH streams one syncfs for all (storage/handoff.py), not ~4 fsyncs each.
                stream.save_producers(now)
                self._close_by_cache(stream)
            except StorageError as exc:
                log.error("stream %r did not close cleanly: %s", stream.name, exc)
        self._closer.stop()
        self._unsynced.finish_all()
        try:
            self._slots.sync.wait()  # before the catalog file names their slots
        except StorageError as exc:
            log.error("the packs of slot streams could not be synced: %s", exc)
        try:
            complete = self._save_catalog()
            if complete and not self.unreadable and not self._leftovers:
                # After the file is durable; not synced itself: lost, the next start-up lists.
                self._fs.create_marker(self.data_dir / CATALOG_CLEAN)
        except StorageError as exc:  # start-up rebuilds it from the directories
            log.error("the catalog could not be saved: %s", exc)
        self._catalog.close_journal()
        self._slots.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ streams

    def _stream(self, name: str) -> Stream:
        """The open stream, for a caller that uses it at once (the replication calls, storage/
        replicaapi.py; see OpenStreams.peek)."""
        validate_name(name)
        return self._open.peek(name)

    def _use(self, name: str) -> Pinned:
        """`with self._use(name) as stream`: the stream, kept open until the block ends."""
        if name not in self._catalog:  # a name in the catalog was checked when it entered it
            validate_name(name)
        return Pinned(self._open, name)

    def _use_or_create(self, name: str, incarnation: int = 0, small: bool = False) -> Pinned:
        """As `_use`, creating the stream if it does not exist (`small`: see `_create`)."""
        if name not in self._catalog:
            validate_name(name)
        return Pinned(self._open, name, lambda: self._create(name, incarnation, small))

    def _create(self, name: str, incarnation: int, small: bool = False) -> Stream:
        """Open the stream, or create it if it is not in the catalog (called by OpenStreams.create):
        in a slot of a pack file under small_streams "slots" when it is `small` (its first write
        fits one, with the default config) and not replicated, else in a directory of its own."""
        if name in self._catalog:
            stream = self._open_stream(name)
        else:
            # (A name was checked by the caller: its directory's name is worked out only if needed.)
            if self.unreadable and dirname_for(name) in self.unreadable:
                # Its metadata is damaged: keep the evidence, refuse to write over it.
                raise PreconditionError(f"stream {name!r} is damaged on disk; see the server log")
            # Placed in the catalog; not after a failed sync of the packs (appends refused till restart).
            if small and self._small and not incarnation and self._slots.sync.error is None:
                return Stream.create_in_slot(self._ctx, self._slots, name, self._streams_root)
            self._catalog.creating(name)  # journaled before its directory is made
            directory = self._streams_root / dirname_for(name)
            stream = Stream.create(self._ctx, name, directory, DEFAULT_STREAM_CONFIG, incarnation)
            self._catalog.add(name)
        return stream

    def exists(self, name: str) -> bool:
        return name in self._catalog

    def list_streams(self) -> list[str]:
        """Every stream's name, sorted (a copy: stream_names pages without one)."""
        return self._catalog.names()

    def stream_names(self) -> SortedNames:
        """Every stream's name, sorted, read in place (a page of a million names copies none)."""
        return self._catalog.sorted_view()

    def stream_count(self) -> int:
        return len(self._catalog)

    def open_streams(self) -> int:
        """How many streams are open now (at most max_open_streams, but for streams in use)."""
        return len(self._open)

    def is_open(self, name: str) -> bool:
        """Whether the stream is open now: a call to it needs no file created or opened (a hint:
        the cache may close it meanwhile)."""
        return self._open.glance(name) is not None

    def create_stream(self, name: str, config: StreamConfig | None = None, *, incarnation: int = 0) -> None:
        """Create the stream if it does not exist, and set its config if one is given. A replicated
        stream is created with its `incarnation` (a positive integer, kept with its epochs:
        storage/epochs.py); PreconditionError if it exists with another."""
        if not isinstance(incarnation, int) or incarnation < 0:
            raise InvalidArgumentError("an incarnation must be a non-negative integer")
        small = config is None or config == DEFAULT_STREAM_CONFIG
        with self._use_or_create(name, incarnation, small) as stream:
            if incarnation and stream.epochs.incarnation != incarnation:
                raise PreconditionError(
                    f"stream {name!r} exists with incarnation {stream.epochs.incarnation}, not {incarnation}"
                )
            if config is not None:
                stream.set_config(config)
            if stream.fsync.blocks:
                stream.sync()  # under "always" the stream exists, durably, when this returns

    def delete_stream(self, name: str) -> None:
        with self._use(name) as stream:
            self._groups.drop_stream(name)  # a stream's groups go with it
            self._retention_switched.discard(name)  # a new copy starts as the config says
            self._catalog.remove(name)
            self._open.discard(name)
        stream.close(clean=False)
        if not isinstance(stream.home, SlotHome):  # a slot's `-` is durable before its zeroing can be
            self._drop_catalog_file()
        self._leftovers = True  # until its files are gone: start-up would finish the removal
        stream.home.remove()
        self._leftovers = False

    def _in_directory(self, name: str) -> None:
        """Promote the stream to a directory of its own if it is in a slot (before what needs
        one: its first consumer group, storage/groupsapi.py)."""
        if self._catalog.place(name) != NO_PLACE:
            with self._use(name) as stream:
                stream.directory_home()

    def add_append_listener(self, listener: AppendListener) -> None:
        """`listener(stream, end_offset)` runs after every append, on the appending thread."""
        self._listeners.append(listener)

    def add_log_listener(self, listener: AppendListener) -> None:
        """`listener(stream, local_end)` runs after every append to a stream under a commit cap
        (whose append listeners wait for the commit), on the appending thread: a leader's followers
        have something new to fetch. `local_end` is `log_end`: synced under fsync "always"."""
        self._log_listeners.append(listener)

    def add_open_listener(self, listener: AppendListener) -> None:
        """`listener(stream, end_offset)` runs when a stream that exists is opened (start-up opens
        none; the cache closes and reopens them), on the opening thread: its end before any append
        of this opening, for a caller that wants a stream's end only once it is used."""
        self._open_listeners.append(listener)

    def sync(self) -> None:
        """Sync every stream: the open ones, and those the cache closed unsynced or in slots."""
        self._unsynced.finish_all()
        self._slots.sync.wait()
        for stream in self._open.values():
            if self._open.hold(stream):
                try:
                    stream.sync()
                finally:
                    self._open.unpin(stream)
        self._groups.sync()

    # ------------------------------------------------------------------ consumer groups
    # The group calls themselves come from GroupCalls (storage/groupsapi.py).

    def retention_holder(self, stream: str) -> tuple[str, int] | None:
        """(group, offset) of the consumer group holding the stream's retention back, or None."""
        if stream not in self._catalog:
            validate_name(stream)
            raise StreamNotFoundError(f"stream {stream!r} does not exist")
        return self._groups.retention_holder(stream)

    def stats(self) -> dict:
        """Totals over every stream (the closed ones as of their last close: storage/catalog.py),
        and the open streams' figures one by one (no closed stream is opened for this)."""
        open_streams = self._open.values()
        infos = [stream_info(s) for s in open_streams]
        totals = self._catalog.totals()
        for key in totals:
            totals[key] += sum(getattr(i, key) for i in infos)
        return {
            "streams": len(self._catalog),
            "open_streams": len(infos),
            "closes_waiting": self._unsynced.waiting(),  # for the round's syncs (storage/handoff.py)
            # Open streams with writes or a creation no sync has taken up yet (everysec: the round's).
            "open_unsynced": sum(1 for s in open_streams if s.dirty or s.creation is not None),
            **totals,
            "cache_hits": self._ctx.cache.hits,
            "cache_misses": self._ctx.cache.misses,
            "unreadable_streams": list(self.unreadable),
            # Only the real file system times its syncs; a test's stand-in may not.
            "fsync_seconds": getattr(self._fs, "sync_times", None),
            "per_stream": {i.name: i for i in infos},
        }
