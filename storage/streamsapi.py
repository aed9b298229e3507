"""The engine's calls on one stream's data: appends, reads, bounds, retention, compaction and
config. `Engine` takes them from `StreamCalls`, so the engine's own file stays about the
streams as a whole (start-up, the catalog, the open-stream cache, maintenance, close).

Each finds its stream through the open-stream cache (storage/openstreams.py), pinned for the
call: a stream the cache closed is reopened, one that does not exist is created by an append.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from storage.admission import check_batch, check_expected_end, check_producer
from storage.catalog import Catalog
from storage.config import EngineConfig, StreamConfig
from storage.errors import OffsetMismatchError, StorageError
from storage.names import validate_name
from storage.openstreams import OpenStreams, Pinned
from storage.results import AppendResult, EntriesMeta, ReadResult, StreamInfo
from storage.slothome import fits_slot
from storage.stream import Stream
from storage.streaminfo import stream_info
from storage.types import AppendBatch, FsyncPolicy, StreamBounds

# One stream's batches for `append_many`: (batch, (producer id, sequence) or None), in order.
StreamAppends = Sequence[tuple[AppendBatch, tuple[str, int] | None]]
# A stream's part of `append_many_streams`: its batches' results and errors, or the error that refused it.
ManyOutcome = list[AppendResult | StorageError] | StorageError
# Streams `append_many_streams` writes before it waits for their syncs: each is pinned till then,
# so the open-stream cache may go this far over its limit (max_open_streams, 1,024 by default).
DURABLE_TOGETHER = 256


def _merged(
    written: list[AppendResult | StorageError], refused: dict[int, StorageError], count: int
) -> list[AppendResult | StorageError]:
    """The `count` batches' outcomes in order: those refused before the write, and `written`'s in the gaps."""
    if not refused:
        return written
    results = iter(written)
    return [refused[i] if i in refused else next(results) for i in range(count)]


class StreamCalls:
    config: EngineConfig  # set by the engine
    _catalog: Catalog
    _open: OpenStreams
    _listeners: list[Callable[[str, int], None]]
    _log_listeners: list[Callable[[str, int], None]]
    _clock: Callable[[], int]
    _use: Callable[[str], Pinned]
    _create: Callable[[str, int, bool], Stream]

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
        if producer is not None:
            producer = check_producer(producer)
        if expected_end is not None:
            check_expected_end(expected_end)
        stream = self._pinned_or_created(name, ((batch, producer),), expected_end)
        try:
            result = stream.append(batch, producer, expected_end)
        finally:
            self._open.unpin(stream)
        if not result.duplicate:
            self._appended(name, stream, result.last_offset + 1)
        return result

    def _pinned_or_created(
        self,
        name: str,
        first: Sequence[tuple[AppendBatch, tuple[str, int] | None]],
        expected_end: int | None = None,
    ) -> Stream:
        """The stream, pinned (the caller unpins it), created if it does not exist: in a slot if
        its `first` batches fit one. `_use_or_create` without its context object, for the calls
        that run once per Append and AppendMany batch: an open stream is not looked up in the
        catalog, a new one once (it was three times per AppendMany batch, issue 17). An
        `expected_end` other than 0 refuses to create it (OffsetMismatchError)."""
        stream = self._open.pin_if_open(name)
        if stream is None:
            if name not in self._catalog:
                validate_name(name)
                if expected_end:
                    raise OffsetMismatchError(expected_end, 0)  # nothing created
            stream = self._open.create(name, lambda: self._create(name, 0, fits_slot(b for b, _ in first)))
        return stream

    def _appended(self, name: str, stream: Stream, end_offset: int) -> None:
        """New entries up to `end_offset`: the readers are told, or, under a commit cap, replication
        (readers then wake on commit: set_commit)."""
        if stream.commit is None:
            for listener in self._listeners:
                listener(name, end_offset)
        else:
            for listener in self._log_listeners:
                listener(name, stream.local_end)

    def append_many(
        self, name: str, appends: Sequence[tuple[AppendBatch, tuple[str, int] | None]]
    ) -> list[AppendResult | StorageError]:
        """Append several batches to one stream, in order, as one write: each is checked on its
        own (a batch that fails gets its error in its place, the others go on; a (producer id,
        sequence) makes one idempotent as in `append`), consecutive payload-only batches without
        a producer are encoded and written together (each with its own offsets), all under one
        lock and, under "always", made durable by one sync. One wake-up of the listeners for all."""
        checked, refused = self._checked(appends)
        written: list[AppendResult | StorageError] = []
        if checked:
            stream = self._pinned_or_created(name, checked)
            try:
                written = stream.append_many(checked)
            finally:
                self._open.unpin(stream)
            self._appended_many(name, stream, written)
        return _merged(written, refused, len(appends))

    def append_many_streams(self, streams: Sequence[tuple[str, StreamAppends]]) -> list[ManyOutcome]:
        """`append_many` for several streams, each in its place: its results, or the error that
        refused it as a whole (deleted, a failed sync). Under "always" all of a part of them
        (DURABLE_TOGETHER) are written before any waits for its sync, so one sync covers many:
        slot streams share the packs' and the journal's (storage/slothome.py's `SlotSync`), new
        directory streams the streams directory's. Each stream's results are its own once its
        writes are durable; a sync's failure is the error of the streams it was to cover only."""
        outcomes: list[ManyOutcome] = []
        for start in range(0, len(streams), DURABLE_TOGETHER):
            outcomes.extend(self._append_together(streams[start : start + DURABLE_TOGETHER]))
        return outcomes

    def _append_together(self, streams: Sequence[tuple[str, StreamAppends]]) -> list[ManyOutcome]:
        """Write each stream's batches, then wait for their syncs, with every stream pinned meanwhile."""
        outcomes: list[ManyOutcome] = []
        pending: list[tuple[int, Stream, list[AppendResult | StorageError], int | None]] = []
        refusals: list[dict[int, StorageError]] = []
        try:
            for name, appends in streams:
                checked, refused = self._checked(appends)
                refusals.append(refused)
                outcomes.append([])
                if not checked:
                    continue
                try:
                    stream = self._pinned_or_created(name, checked)
                except StorageError as exc:
                    outcomes[-1] = exc
                    continue
                try:
                    written, seq = stream.write_many(checked)
                except StorageError as exc:
                    self._open.unpin(stream)
                    outcomes[-1] = exc
                    continue
                pending.append((len(outcomes) - 1, stream, written, seq))
            for i, stream, written, seq in pending:
                if seq is not None:
                    try:
                        stream.wait_durable(seq)
                    except StorageError as exc:  # none of its results: their writes may be lost
                        outcomes[i] = exc
                        continue
                outcomes[i] = written
                self._appended_many(streams[i][0], stream, written)
        finally:
            for _, stream, *_ in pending:
                self._open.unpin(stream)
        return [
            outcome if isinstance(outcome, StorageError) else _merged(outcome, refused, len(appends))
            for outcome, refused, (_, appends) in zip(outcomes, refusals, streams, strict=True)
        ]

    def _checked(
        self, appends: Sequence[tuple[AppendBatch, tuple[str, int] | None]]
    ) -> tuple[list[tuple[AppendBatch, tuple[str, int] | None]], dict[int, StorageError]]:
        """The batches that pass `check_batch` (their producers checked), and the others' errors by index."""
        checked: list[tuple[AppendBatch, tuple[str, int] | None]] = []
        refused: dict[int, StorageError] = {}
        for i, (batch, producer) in enumerate(appends):
            try:
                check_batch(self.config, batch)
                checked.append((batch, check_producer(producer)))
            except StorageError as exc:
                refused[i] = exc
        return checked, refused

    def _appended_many(self, name: str, stream: Stream, written: list[AppendResult | StorageError]) -> None:
        """One wake-up of the listeners for a stream's batches written by `append_many`."""
        # Offsets grow in order: the last batch written ends what is new.
        new = (r for r in reversed(written) if isinstance(r, AppendResult) and not r.duplicate)
        last = next(new, None)
        if last is not None:
            self._appended(name, stream, last.last_offset + 1)

    def read(
        self, name: str, offset: int, count: int, *, max_bytes: int = 0, reverse: bool = False
    ) -> ReadResult:
        validate_name(name)
        stream = self._open.pin(name)  # as `_use`, spelled out on the hot path: no context object
        try:
            return stream.read(offset, count, max_bytes, reverse)
        finally:
            self._open.unpin(stream)

    def seek_time(self, name: str, timestamp_ms: int) -> int:
        with self._use(name) as stream:
            return stream.seek_time(timestamp_ms)

    def count(self, name: str, start: int, end: int) -> int:
        with self._use(name) as stream:
            return stream.count(start, end)

    def entries_meta(self, name: str, start: int, stop: int) -> EntriesMeta:
        """Whether entries start..stop-1 may carry deliver_at_ms and how new they are, from node
        headers alone (no record is read): what a group read needs to pass a run through whole."""
        validate_name(name)
        stream = self._open.pin(name)  # as `_use`, spelled out on the group read's hot path
        try:
            return stream.entries_meta(start, stop)
        finally:
            self._open.unpin(stream)

    def info(self, name: str) -> StreamInfo:
        with self._use(name) as stream:
            return stream_info(stream)

    def evict(self, name: str, up_to_offset: int) -> int:
        with self._use(name) as stream:
            return stream.retention.evict(up_to_offset)

    def keep_last(self, name: str, n: int) -> int:
        with self._use(name) as stream:
            return stream.retention.keep_last(n)

    def trim(self, name: str, first_offset: int) -> int:
        with self._use(name) as stream:
            return stream.retention.trim(first_offset)

    def compact(self, name: str) -> int:
        with self._use(name) as stream:
            return stream.cleaner.compact(self._clock())

    def apply_retention(self, name: str) -> None:
        with self._use(name) as stream:
            stream.retention.apply(self._clock())

    def set_stream_config(self, name: str, config: StreamConfig) -> None:
        with self._use(name) as stream:
            stream.set_config(config)

    def stream_config(self, name: str) -> StreamConfig:
        with self._use(name) as stream:
            return stream.config

    def bounds(self, name: str) -> StreamBounds:
        """The stream's retained range as readers see it (StreamNotFoundError if there is none)."""
        validate_name(name)
        stream = self._open.pin(name)  # as `_use`, spelled out on the group read's hot path
        try:
            return stream.bounds()
        finally:
            self._open.unpin(stream)

    def fsync_policy(self, name: str) -> FsyncPolicy:
        """The fsync policy in force for the stream: its own, or the engine's (also for a stream
        that does not exist yet: the policy its first append would get)."""
        stream = self._open.glance(name)
        if stream is not None:
            return stream.fsync
        if name not in self._catalog:
            return self.config.fsync
        with self._use(name) as stream:
            return stream.fsync
