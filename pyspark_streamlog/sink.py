"""The streamlog sink: `df.write` and `writeStream` appends that a retry never duplicates.

Every task appends under its own producer id, derived from what Spark keeps
stable across retries: for a streaming query, its id (saved in the checkpoint),
the micro-batch id and the partition; for a batch write, an id chosen once per
write (or the producerId option) and the partition. The task numbers its
appends 0, 1, 2, ... per target stream, and cuts rows into appends by count
and size only, so a retried task (or a micro-batch replayed after a restart)
sends the same batches under the same sequences, and the server answers
`duplicate` instead of writing them again. That makes the sink exactly-once
as long as Spark hands a retried task the same rows in the same order: true of
queries that read, select and filter a replayable source; after a shuffle the
order within a task can change, and docs/SPARK.md says to sort within partitions.

Appends are visible to readers as soon as the server acknowledges them; Spark's
commit on the driver has nothing left to publish, and an aborted batch leaves
what its tasks wrote, which the retry then finds and skips.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark import TaskContext
from pyspark.sql.datasource import DataSourceArrowWriter, DataSourceStreamArrowWriter, WriterCommitMessage
from pyspark.sql.types import BinaryType, MapType, StringType, StructType

from clients.types import Record
from pyspark_streamlog.connection import Connection
from pyspark_streamlog.errors import OptionError
from pyspark_streamlog.options import WriteOptions

log = logging.getLogger("pyspark_streamlog")

# Columns the server assigns itself; a DataFrame read from streamlog has them, and
# writing it back (to another stream) should just work, as Append ignores them.
_IGNORED = ("offset", "timestamp")
_ENTRY_OVERHEAD_BYTES = 16  # protobuf framing of one entry, for the bytesPerAppend estimate


def check_write_schema(schema: StructType, overwrite: bool) -> StructType:
    """The DataFrame's schema, after checking that the sink can write it."""
    if overwrite:
        raise OptionError("streamlog streams are append-only: use mode('append'), not overwrite")
    types = {f.name: f.dataType for f in schema.fields}
    if "payload" not in types:
        raise OptionError(
            f"the DataFrame needs a payload column (binary or string); it has {', '.join(types) or 'none'}"
        )
    if not isinstance(types["payload"], BinaryType | StringType):
        raise OptionError(f"payload must be binary or string, not {types['payload'].simpleString()}")
    for name in ("tag", "stream"):
        if name in types and not isinstance(types[name], StringType):
            raise OptionError(f"{name} must be a string column, not {types[name].simpleString()}")
    kind = types.get("headers")
    if kind is not None and not (
        isinstance(kind, MapType)
        and isinstance(kind.keyType, StringType)
        and isinstance(kind.valueType, BinaryType | StringType)
    ):
        raise OptionError(f"headers must be map<string, binary or string>, not {kind.simpleString()}")
    unknown = sorted(set(types) - {"payload", "tag", "headers", "stream", *_IGNORED})
    if unknown:
        raise OptionError(
            f"the streamlog sink writes payload, tag, headers and stream columns; drop or rename "
            f"{', '.join(unknown)}"
        )
    return schema


@dataclass
class AppendReport(WriterCommitMessage):
    """What one task did, per stream: entries appended, entries found already written, appends."""

    producer_id: str
    streams: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class _Pending:
    payloads: list[bytes] = field(default_factory=list)
    entries: list[Record] | None = None  # used once a row has a tag or headers
    size: int = 0

    def __len__(self) -> int:
        return len(self.entries) if self.entries is not None else len(self.payloads)


class _Appender:
    """Cuts one task's rows into idempotent appends, per target stream."""

    def __init__(self, options: WriteOptions, producer_id: str) -> None:
        self.options = options
        self.connection = Connection(options.server, options.timeout_s)
        self.report = AppendReport(producer_id)
        self._pending: dict[str, _Pending] = {}
        self._sequence: dict[str, int] = {}

    def _flush(self, stream: str) -> None:
        pending = self._pending.pop(stream, None)
        if not pending:
            return
        sequence = self._sequence.get(stream, 0)
        self._sequence[stream] = sequence + 1
        reply = self.connection.append(
            stream,
            self.report.producer_id,
            sequence,
            pending.payloads if pending.entries is None else pending.entries,
        )
        counts = self.report.streams.setdefault(stream, [0, 0, 0])
        if reply is None or reply.duplicate:
            counts[1] += len(pending)
        else:
            counts[0] += len(pending)
        counts[2] += 1

    def add_payloads(self, stream: str, payloads: list[bytes], sizes: np.ndarray) -> None:
        """Rows that carry only a payload, a slice at a time.

        The same rule as add_entry, applied to whole slices: a row joins the
        pending append unless that would pass bytesPerAppend (a row alone always
        fits), and an append is sent when it holds entriesPerAppend rows or the
        next row does not fit. Where Spark's Arrow batches end plays no part.
        """
        limit_rows, limit_bytes = self.options.entries_per_append, self.options.bytes_per_append
        done = 0
        # Each turn takes a row or sends a non-empty append, so 2 turns per row at most.
        for _ in range(2 * len(payloads) + 1):
            if done >= len(payloads):
                return
            pending = self._pending.setdefault(stream, _Pending())
            window = sizes[done : done + limit_rows - len(pending)]
            cumulative = np.cumsum(window)
            take = int(np.searchsorted(cumulative, limit_bytes - pending.size, side="right"))
            if not take and not len(pending):
                take = 1
            if take:
                chunk = payloads[done : done + take]
                if pending.entries is None:
                    pending.payloads.extend(chunk)
                else:
                    pending.entries.extend(Record(p) for p in chunk)
                pending.size += int(cumulative[take - 1])
                done += take
            if take < len(window) or len(pending) >= limit_rows:
                self._flush(stream)
        raise AssertionError("add_payloads made no progress")

    def add_entry(self, stream: str, entry: Record, size: int) -> None:
        pending = self._pending.get(stream)
        if pending and pending.size + size > self.options.bytes_per_append:
            self._flush(stream)
        pending = self._pending.setdefault(stream, _Pending())
        if pending.entries is None:
            pending.entries = [Record(p) for p in pending.payloads]
            pending.payloads = []
        pending.entries.append(entry)
        pending.size += size
        if len(pending) >= self.options.entries_per_append:
            self._flush(stream)

    def finish(self) -> AppendReport:
        for stream in list(self._pending):
            self._flush(stream)
        return self.report


def _binary(column: pa.Array) -> pa.Array:
    column = column.cast(pa.binary()) if pa.types.is_string(column.type) else column
    return column.fill_null(b"") if column.null_count else column


def _has_values(batch: pa.RecordBatch, name: str) -> bool:
    index = batch.schema.get_field_index(name)
    if index < 0:
        return False
    column = batch.column(index)
    if column.null_count == len(column):
        return False
    if name == "headers":
        # Arrow's list length kernels do not take maps; the offsets tell the same.
        offsets = column.offsets
        return offsets[len(offsets) - 1].as_py() > offsets[0].as_py()
    return bool(pc.sum(pc.binary_length(column)).as_py())


def _write(options: WriteOptions, producer_id: str, batches: Iterator[pa.RecordBatch]) -> AppendReport:
    appender = _Appender(options, producer_id)
    for batch in batches:
        if not batch.num_rows:
            continue
        payloads = _binary(batch.column(batch.schema.get_field_index("payload")))
        plain = not any(_has_values(batch, name) for name in ("tag", "headers", "stream"))
        if plain:
            # The common case: one target stream, payloads only, the Append's fast form.
            if options.stream is None:
                raise OptionError(
                    "no target stream: set the stream option or give the DataFrame a stream column"
                )
            sizes = pc.binary_length(payloads).to_numpy(zero_copy_only=False).astype(np.int64)
            appender.add_payloads(options.stream, payloads.to_pylist(), sizes + _ENTRY_OVERHEAD_BYTES)
            continue
        _write_rows(options, appender, batch, payloads)
    return appender.finish()


def _write_rows(
    options: WriteOptions, appender: _Appender, batch: pa.RecordBatch, payloads: pa.Array
) -> None:
    """Rows with tags, headers or their own target stream: one Record each."""
    names = batch.schema.names
    rows = batch.num_rows
    tags = batch.column(names.index("tag")).to_pylist() if "tag" in names else [None] * rows
    streams = batch.column(names.index("stream")).to_pylist() if "stream" in names else [None] * rows
    headers = batch.column(names.index("headers")).to_pylist() if "headers" in names else [None] * rows
    for payload, tag, stream, items in zip(payloads.to_pylist(), tags, streams, headers, strict=True):
        target = stream or options.stream
        if target is None:
            raise OptionError("a row has no stream and the stream option is not set: give every row a target")
        tag = tag or ""
        size = len(payload) + len(tag) + _ENTRY_OVERHEAD_BYTES
        fields: dict[str, bytes] = {}
        for key, value in items or ():
            raw = value.encode() if isinstance(value, str) else (value or b"")
            fields[key] = raw
            size += len(key) + len(raw)
        appender.add_entry(target, Record(payload, tag, fields or None), size)


def _task() -> TaskContext:
    context = TaskContext.get()
    if context is None:
        raise RuntimeError("the streamlog sink's write() runs inside a Spark task")
    return context


def _summary(messages: list, action: str) -> str:
    written = duplicates = 0
    for message in messages:
        if isinstance(message, AppendReport):
            for counts in message.streams.values():
                written += counts[0]
                duplicates += counts[1]
    return (
        f"streamlog sink {action}: {written} entries appended, "
        f"{duplicates} already written by an earlier attempt"
    )


class StreamlogBatchWriter(DataSourceArrowWriter):
    """df.write: one producer per (write, partition); the write id is fixed on the driver."""

    def __init__(self, options: WriteOptions, schema: StructType) -> None:
        self.options = options
        # Created once per write on the driver and pickled into every task, so a
        # retried task finds the same id; producerId makes it stable across runs.
        self.write_id = options.producer_id or uuid.uuid4().hex

    def write(self, iterator: Iterator[pa.RecordBatch]) -> AppendReport:
        producer = f"spark-write:{self.write_id}:{_task().partitionId()}"
        return _write(self.options, producer, iterator)

    def commit(self, messages: list) -> None:
        log.info(_summary(messages, "committed"))

    def abort(self, messages: list) -> None:
        log.warning(_summary(messages, "aborted (a retry with the same producerId skips what was written)"))


class StreamlogStreamWriter(DataSourceStreamArrowWriter):
    """writeStream: one producer per (query, micro-batch, partition)."""

    def __init__(self, options: WriteOptions, schema: StructType) -> None:
        self.options = options

    def write(self, iterator: Iterator[pa.RecordBatch]) -> AppendReport:
        context = _task()
        batch_id = context.getLocalProperty("streaming.sql.batchId")
        # The query id is kept in the checkpoint: the same after a restart, unlike the run id.
        query = self.options.producer_id or context.getLocalProperty("sql.streaming.queryId")
        if batch_id is None or query is None:
            raise RuntimeError("the streamlog stream writer runs inside a streaming query's task")
        producer = f"spark:{query}:{batch_id}:{context.partitionId()}"
        return _write(self.options, producer, iterator)

    def commit(self, messages: list, batchId: int) -> None:
        log.info("%s (batch %d)", _summary(messages, "committed"), batchId)

    def abort(self, messages: list, batchId: int) -> None:
        log.warning("%s (batch %d)", _summary(messages, "aborted; a replay of the batch skips them"), batchId)
