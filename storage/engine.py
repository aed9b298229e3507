"""The engine: a data directory of streams, the public entry point of `storage`.

    from storage import AppendBatch, Engine
    with Engine("./data") as engine:
        first = engine.append("rides", AppendBatch([b'{"id": 1}', b'{"id": 2}'])).first_offset
        print(engine.read("rides", first, 10).entries())

The engine opens, creates and deletes streams in a data directory (laid out as
storage/layout.py says), hands each call to its stream, and runs the
maintenance thread; the consumer-group calls come from GroupCalls
(storage/groupsapi.py), the replication primitives from ReplicaCalls
(storage/replicaapi.py).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from storage.admission import check_batch, check_expected_end, check_producer
from storage.cache import NodeCache
from storage.config import EngineConfig, StreamConfig
from storage.context import EngineContext
from storage.errors import (
    CorruptionError,
    InvalidArgumentError,
    OffsetMismatchError,
    PreconditionError,
    StorageError,
    StreamNotFoundError,
)
from storage.fs import FileSystem
from storage.groupmanager import GroupManager
from storage.groupsapi import GroupCalls
from storage.layout import (
    DELETED_SUFFIX,
    LOCK_FILE,
    META_FILE,
    SEGMENT_SUFFIX,
    stream_directory,
    streams_root,
)
from storage.names import validate_name
from storage.replicaapi import ReplicaCalls
from storage.results import AppendResult, EntriesMeta, ReadResult, StreamInfo
from storage.stream import Stream
from storage.types import AppendBatch, FsyncPolicy, StreamBounds

log = logging.getLogger("streamlog.storage")

AppendListener = Callable[[str, int], None]
GROUP_JOURNAL_BYTES = 1 << 20  # per stream with groups; checkpointed into a snapshot as it fills


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class Engine(GroupCalls, ReplicaCalls):
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
        self._fs.makedirs(streams_root(self.data_dir))
        self._lock_fd = self._take_lock() if fs is None else None
        self._lock = threading.Lock()
        self._listeners: list[AppendListener] = []
        self._log_listeners: list[AppendListener] = []
        # Consumer groups install a floor here: retention never evicts at or above it.
        self.retention_floor: Callable[[str], int | None] = lambda name: None
        self._ctx = EngineContext(
            self._fs, self.config, self._clock, NodeCache(self.config.cache_nodes), self._floor
        )
        self._streams: dict[str, Stream] = {}
        self.unreadable: list[str] = []  # stream directories whose metadata failed its checks
        self._load()
        # Consumer groups (storage/groupmanager.py): their state lives beside each stream's segments.
        self._groups = GroupManager(
            self, self._fs, self._clock, journal_bytes=min(self.config.segment_bytes, GROUP_JOURNAL_BYTES)
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

    def _load(self) -> None:
        root = streams_root(self.data_dir)
        for dirname in self._fs.listdir(root):
            directory = root / dirname
            if dirname.endswith(DELETED_SUFFIX):
                self._fs.remove_tree(directory)  # a delete that crashed half-way
                continue
            if not self._fs.exists(directory / META_FILE):
                if not any(name.endswith(SEGMENT_SUFFIX) for name in self._fs.listdir(directory)):
                    self._fs.remove_tree(directory)  # a creation that a crash cut short
                continue
            try:
                stream = Stream.open(self._ctx, directory)
            except (CorruptionError, ValueError, KeyError) as exc:
                log.error("stream directory %s is unreadable: %s", dirname, exc)
                self.unreadable.append(dirname)
                continue
            self._streams[stream.name] = stream

    def close(self) -> None:
        """Sync every stream, mark a clean shutdown, stop the maintenance thread."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._worker is not None:
            self._worker.join()
        self._groups.close()
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            try:
                stream.close()
            except StorageError as exc:
                log.error("stream %r did not close cleanly: %s", stream.name, exc)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ streams

    def _stream(self, name: str) -> Stream:
        validate_name(name)
        stream = self._streams.get(name)
        if stream is None:
            raise StreamNotFoundError(f"stream {name!r} does not exist")
        return stream

    def _stream_or_create(self, name: str, incarnation: int = 0) -> Stream:
        stream = self._streams.get(name)
        if stream is not None:
            if incarnation and stream.epochs.incarnation != incarnation:
                raise PreconditionError(
                    f"stream {name!r} exists with incarnation {stream.epochs.incarnation}, not {incarnation}"
                )
            return stream
        validate_name(name)
        with self._lock:
            stream = self._streams.get(name)
            if stream is None:
                directory = stream_directory(self.data_dir, name)
                if directory.name in self.unreadable:
                    # Its metadata is damaged: keep the evidence, refuse to write over it.
                    raise PreconditionError(f"stream {name!r} is damaged on disk; see the server log")
                stream = Stream.create(self._ctx, name, directory, StreamConfig(), incarnation)
                self._streams[name] = stream
        return stream

    def exists(self, name: str) -> bool:
        return name in self._streams

    def list_streams(self) -> list[str]:
        return sorted(self._streams)

    def create_stream(self, name: str, config: StreamConfig | None = None, *, incarnation: int = 0) -> None:
        """Create the stream if it does not exist, and set its config if one is given. A replicated
        stream is created with its `incarnation` (a positive integer, kept with its epochs:
        storage/epochs.py); PreconditionError if it exists with another."""
        if not isinstance(incarnation, int) or incarnation < 0:
            raise InvalidArgumentError("an incarnation must be a non-negative integer")
        stream = self._stream_or_create(name, incarnation)
        if config is not None:
            stream.set_config(config)

    def delete_stream(self, name: str) -> None:
        stream = self._stream(name)
        self._groups.drop_stream(name)  # a stream's groups go with it
        with self._lock:
            self._streams.pop(name, None)
        stream.close(clean=False)
        # Rename first so a crash mid-delete leaves a directory that start-up finishes removing.
        doomed = stream.directory.with_name(stream.directory.name + DELETED_SUFFIX)
        self._fs.rename(stream.directory, doomed)
        self._fs.remove_tree(doomed)

    # ------------------------------------------------------------------ data

    def append(
        self,
        name: str,
        batch: AppendBatch,
        *,
        producer: tuple[str, int] | None = None,
        expected_end: int | None = None,
    ) -> AppendResult:
        """Append a batch; returns once it is as durable as the stream's fsync policy promises.

        With `producer` (producer id, sequence) the append is idempotent: a retry
        of the same (producer, sequence) within the dedup window writes nothing and
        returns the first attempt's offsets (`duplicate` set). With `expected_end`
        it is conditional: OffsetMismatchError (a PreconditionError carrying the
        stream's actual end offset) if the stream's end is elsewhere.
        """
        check_batch(self.config, batch)
        producer = check_producer(producer)
        check_expected_end(expected_end)
        if expected_end and name not in self._streams:
            validate_name(name)
            raise OffsetMismatchError(expected_end, 0)  # nothing created
        stream = self._stream_or_create(name)
        result = stream.append(batch, producer, expected_end)
        if not result.duplicate:
            if stream.commit is None:
                for listener in self._listeners:
                    listener(name, result.last_offset + 1)
            else:  # readers wake on commit (set_commit); replication learns of the new end
                for listener in self._log_listeners:
                    listener(name, stream.local_end)
        return result

    def append_many(
        self, name: str, appends: Sequence[tuple[AppendBatch, tuple[str, int] | None]]
    ) -> list[AppendResult | StorageError]:
        """Append several batches to one stream, in order, as one write: each is checked and
        written on its own (a batch that fails gets its error in its place, the others go on;
        a (producer id, sequence) makes one idempotent as in `append`), all under one lock and,
        under "always", made durable by one sync. One wake-up of the listeners for all."""
        checked: list[tuple[AppendBatch, tuple[str, int] | None]] = []
        refused: dict[int, StorageError] = {}
        for i, (batch, producer) in enumerate(appends):
            try:
                check_batch(self.config, batch)
                checked.append((batch, check_producer(producer)))
            except StorageError as exc:
                refused[i] = exc
        written: list[AppendResult | StorageError] = []
        if checked:
            stream = self._stream_or_create(name)
            written = stream.append_many(checked)
            # Offsets grow in order: the last batch written ends what the readers may now see.
            new = (r for r in reversed(written) if isinstance(r, AppendResult) and not r.duplicate)
            last = next(new, None)
            if last is not None and stream.commit is None:  # else readers wake on commit (set_commit)
                for listener in self._listeners:
                    listener(name, last.last_offset + 1)
        if not refused:
            return written
        results = iter(written)
        return [refused[i] if i in refused else next(results) for i in range(len(appends))]

    def read(
        self, name: str, offset: int, count: int, *, max_bytes: int = 0, reverse: bool = False
    ) -> ReadResult:
        return self._stream(name).read(offset, count, max_bytes, reverse)

    def seek_time(self, name: str, timestamp_ms: int) -> int:
        return self._stream(name).seek_time(timestamp_ms)

    def count(self, name: str, start: int, end: int) -> int:
        return self._stream(name).count(start, end)

    def entries_meta(self, name: str, start: int, stop: int) -> EntriesMeta:
        """Whether entries start..stop-1 may carry deliver_at_ms and how new they are, from node
        headers alone (no record is read): what a group read needs to pass a run through whole."""
        return self._stream(name).entries_meta(start, stop)

    def info(self, name: str) -> StreamInfo:
        return self._stream(name).info()

    def evict(self, name: str, up_to_offset: int) -> int:
        return self._stream(name).retention.evict(up_to_offset)

    def keep_last(self, name: str, n: int) -> int:
        return self._stream(name).retention.keep_last(n)

    def trim(self, name: str, first_offset: int) -> int:
        return self._stream(name).retention.trim(first_offset)

    def compact(self, name: str) -> int:
        return self._stream(name).cleaner.compact(self._clock())

    def apply_retention(self, name: str) -> None:
        self._stream(name).retention.apply(self._clock())

    def set_stream_config(self, name: str, config: StreamConfig) -> None:
        self._stream(name).set_config(config)

    def stream_config(self, name: str) -> StreamConfig:
        return self._stream(name).config

    def bounds(self, name: str) -> StreamBounds:
        """The stream's retained range as readers see it (StreamNotFoundError if there is none)."""
        return self._stream(name).bounds()

    def fsync_policy(self, name: str) -> FsyncPolicy:
        """The fsync policy in force for the stream: its own, or the engine's (also for a stream
        that does not exist yet: the policy its first append would get)."""
        stream = self._streams.get(name)
        return stream.fsync if stream is not None else self.config.fsync

    def add_append_listener(self, listener: AppendListener) -> None:
        """`listener(stream, end_offset)` runs after every append, on the appending thread."""
        self._listeners.append(listener)

    def add_log_listener(self, listener: AppendListener) -> None:
        """`listener(stream, local_end)` runs after every append to a stream under a commit cap
        (whose append listeners wait for the commit), on the appending thread: a leader's followers
        have something new to fetch. `local_end` is `log_end`: synced under fsync "always"."""
        self._log_listeners.append(listener)

    def sync(self) -> None:
        for stream in list(self._streams.values()):
            stream.sync()
        self._groups.sync()

    # ------------------------------------------------------------------ maintenance

    def maintain(self) -> None:
        """One round of background work: everysec syncs, packing, retention, compaction."""
        now = self._clock()
        for stream in list(self._streams.values()):
            if stream.closed:
                continue
            try:
                if stream.fsync is FsyncPolicy.EVERYSEC and stream.dirty:
                    stream.sync()
                stream.cleaner.pack_pending()
                stream.retention.apply(now)
                stream.save_producers(now)
                due = now - stream.cleaner.last_compaction_ms >= self.config.compaction_interval_ms
                if stream.config.compaction and due:
                    stream.cleaner.compact(now)
            except (StorageError, OSError) as exc:
                log.error("maintenance of stream %r failed: %s", stream.name, exc)
        self._groups.maintain()  # group expiry and dead letters, everysec journal syncs, checkpoints

    # ------------------------------------------------------------------ consumer groups
    # The group calls themselves come from GroupCalls (storage/groupsapi.py).

    def retention_holder(self, stream: str) -> tuple[str, int] | None:
        """(group, offset) of the consumer group holding the stream's retention back, or None."""
        self._stream(stream)
        return self._groups.retention_holder(stream)

    # ------------------------------------------------------------------ maintenance loop

    def _maintenance_loop(self) -> None:
        interval = self.config.maintenance_interval_ms / 1000
        while not self._stop.wait(interval):
            self.maintain()

    def stats(self) -> dict:
        infos = [s.info() for s in list(self._streams.values())]
        return {
            "streams": len(infos),
            "entries": sum(i.entries for i in infos),
            "bytes_on_disk": sum(i.bytes_on_disk for i in infos),
            "segments": sum(i.segments for i in infos),
            "nodes": sum(i.nodes for i in infos),
            "cache_hits": self._ctx.cache.hits,
            "cache_misses": self._ctx.cache.misses,
            "unreadable_streams": list(self.unreadable),
            # Only the real file system times its syncs; a test's stand-in may not.
            "fsync_seconds": getattr(self._fs, "sync_times", None),
            "per_stream": {i.name: i for i in infos},
        }
