"""The `streamlog` data source: batch reads, streaming reads, and the sink's entry points."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from pyspark_streamlog.connection import Connection
from pyspark_streamlog.errors import OptionError
from pyspark_streamlog.options import EARLIEST, Position, ReadOptions, parse_read, parse_write
from pyspark_streamlog.reading import (
    StreamRange,
    check_user_schema,
    data_loss,
    read_range,
    resolve,
    spark_schema,
    split,
    spread,
    stream_reaches,
)
from pyspark_streamlog.sink import StreamlogBatchWriter, StreamlogStreamWriter, check_write_schema

log = logging.getLogger("pyspark_streamlog")


class StreamlogDataSource(DataSource):
    """`format("streamlog")`: read streams into DataFrames and append DataFrames to streams."""

    @classmethod
    def name(cls) -> str:
        return "streamlog"

    def schema(self) -> StructType:
        # Only the schema-shaping options are looked at here; the reader checks the rest.
        options = {k.lower(): v for k, v in self.options.items()}
        as_string = options.get("payloadas", "binary").strip().lower() == "string"
        headers = options.get("includeheaders", "true").strip().lower() != "false"
        return spark_schema(as_string, headers)

    def reader(self, schema: StructType) -> DataSourceReader:
        return StreamlogBatchReader(parse_read(self.options, streaming=False), schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return StreamlogStreamReader(parse_read(self.options, streaming=True), schema)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        return StreamlogBatchWriter(parse_write(self.options), check_write_schema(schema, overwrite))

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        return StreamlogStreamWriter(parse_write(self.options), check_write_schema(schema, overwrite))


def _partitions(
    options: ReadOptions, connection: Connection, bounds: dict[str, tuple[int, int]], turn: int = 0
) -> list[StreamRange]:
    """The ranges cut into partitions, each given an in-sync replica of its stream to read from
    (readFrom=replica on a cluster: the layout as a node describes it now), else the leader."""
    ranges = [(stream, start, end) for stream, (start, end) in bounds.items()]
    pieces = split(ranges, options.entries_per_partition, options.min_partitions)
    in_sync: dict[str, list[str]] = {}
    if options.read_from == "replica":
        in_sync = {stream: connection.in_sync_replicas(stream) for stream in bounds}
    return [
        StreamRange(
            options.server,
            stream,
            start,
            end,
            options.fail_on_data_loss,
            options.payload_as_string,
            options.include_headers,
            options.timeout_s,
            replica,
        )
        for (stream, start, end), replica in zip(pieces, spread(pieces, in_sync, turn), strict=True)
    ]


def _read(partition: InputPartition) -> Iterator[pa.RecordBatch]:
    # Spark plans one partition of value None when partitions() returns none: nothing to read.
    if not isinstance(partition, StreamRange):
        return iter(())
    return read_range(partition)


def _check_start(options: ReadOptions, stream: str, start: int, first: int) -> int:
    """The offset to read from, after checking that entries below the stream's first are not wanted."""
    if start < first:
        data_loss(
            f"stream {stream!r} starts at offset {first} (older entries were evicted) but the query "
            f"starts at {start}",
            options.fail_on_data_loss,
        )
        return first
    return start


class StreamlogBatchReader(DataSourceReader):
    """spark.read: each stream's range is fixed when the query is planned."""

    def __init__(self, options: ReadOptions, schema: StructType) -> None:
        check_user_schema(schema, spark_schema(options.payload_as_string, options.include_headers))
        self.options = options
        connection = Connection(options.server, options.timeout_s)
        self.bounds: dict[str, tuple[int, int]] = {}
        for stream in options.streams:
            state = connection.stream_state(stream)
            first, following = state.first_offset, state.next_offset
            start = resolve(connection, stream, options.starting[stream], first, following)
            end = resolve(connection, stream, options.ending[stream], first, following)
            if end > following:
                raise OptionError(
                    f"endingOffsets for {stream!r} is {end}, past the stream's end ({following})"
                )
            if start > end:
                raise OptionError(
                    f"stream {stream!r}: the range starts at offset {start}, after its end {end}"
                )
            self.bounds[stream] = (_check_start(options, stream, start, first), end)

    def partitions(self) -> Sequence[InputPartition]:
        # A Connection of this process (kept per process and server): the reader is pickled into
        # the tasks, a channel does not travel.
        return _partitions(self.options, Connection(self.options.server, self.options.timeout_s), self.bounds)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return _read(partition)


class StreamlogStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """spark.readStream: offsets are {stream: next offset to read}, one entry per stream.

    Runs in one long-lived Python process on the driver, so it may keep state
    between calls (the connection, the availableNow target).
    """

    def __init__(self, options: ReadOptions, schema: StructType) -> None:
        check_user_schema(schema, spark_schema(options.payload_as_string, options.include_headers))
        self.options = options
        self._target: dict[str, int] | None = None
        self._open: Connection | None = None
        self._plans = 0

    def __getstate__(self) -> dict:
        # Spark pickles the reader into its executor tasks; a channel does not travel.
        state = self.__dict__.copy()
        state["_open"] = None
        return state

    @property
    def _connection(self) -> Connection:
        if self._open is None:
            self._open = Connection(self.options.server, self.options.timeout_s)
        return self._open

    def _states(self) -> dict[str, tuple[int, int]]:
        out = {}
        for stream in self.options.streams:
            state = self._connection.stream_state(stream)
            out[stream] = (state.first_offset, state.next_offset)
        return out

    def initialOffset(self) -> dict:
        offsets = {}
        for stream, (first, following) in self._states().items():
            start = resolve(self._connection, stream, self.options.starting[stream], first, following)
            if start > following:
                raise OptionError(
                    f"startingOffsets for {stream!r} is {start}, past the stream's end ({following})"
                )
            offsets[stream] = _check_start(self.options, stream, start, first)
        return offsets

    def getDefaultReadLimit(self) -> ReadLimit:
        limit = self.options.max_entries_per_trigger
        return ReadMaxRows(limit) if limit else ReadAllAvailable()

    def reportLatestOffset(self) -> dict:
        return {stream: following for stream, (_, following) in self._states().items()}

    def prepareForTriggerAvailableNow(self) -> None:
        # Trigger.AvailableNow reads what exists now, in limited batches, and no more.
        self._target = self.reportLatestOffset()

    def _start_of(self, start: dict, stream: str, first: int, following: int) -> int:
        if stream in start:
            return int(start[stream])
        # A stream added to the streams option after the checkpoint was written:
        # like a new Kafka partition, it is read from its earliest entry.
        log.info("stream %r is new to this query; reading it from its earliest entry", stream)
        return resolve(self._connection, stream, Position(offset=EARLIEST), first, following)

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        begin: dict[str, int] = {}
        latest: dict[str, int] = {}
        for stream, (first, following) in self._states().items():
            begin[stream] = self._start_of(start, stream, first, following)
            latest[stream] = following
            if self._target is not None:
                latest[stream] = min(following, self._target.get(stream, following))
            if following < begin[stream] and not stream_reaches(
                self._connection, stream, begin[stream], self.options.timeout_s
            ):
                data_loss(
                    f"stream {stream!r} now ends at offset {following}, before this query's position "
                    f"{begin[stream]} (was it deleted and recreated?)",
                    self.options.fail_on_data_loss,
                )
                # Going on from the stream's new end; nothing before it is read.
                begin[stream] = latest[stream] = following
            latest[stream] = max(latest[stream], begin[stream])
        if isinstance(limit, ReadMaxRows):
            return _admit(begin, latest, limit.max_rows)
        return latest

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        bounds = {}
        for stream, stop in end.items():
            begin = int(start.get(stream, stop))
            if stop > begin:
                bounds[stream] = (begin, int(stop))
        self._plans += 1  # each micro-batch's partitions start their spread on another node
        return _partitions(self.options, self._connection, bounds, self._plans)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return _read(partition)

    def commit(self, end: dict) -> None:
        # The server keeps nothing for a plain reader: Spark's checkpoint is the
        # only record of progress, so there is nothing to release here.
        log.debug("streamlog source committed %s", end)


def _admit(begin: dict[str, int], latest: dict[str, int], budget: int) -> dict[str, int]:
    """End offsets that admit at most `budget` entries, shared in proportion to each stream's backlog.

    Remainders go one by one to the streams with the largest backlog, so the
    whole budget is used when enough is waiting and every batch makes progress.
    """
    backlog = {s: latest[s] - begin[s] for s in begin}
    total = sum(backlog.values())
    if total <= budget:
        return dict(latest)
    share = {s: budget * n // total for s, n in backlog.items()}
    left = budget - sum(share.values())
    for stream in sorted(backlog, key=lambda s: (-backlog[s], s)):
        if left <= 0:
            break
        if share[stream] < backlog[stream]:
            share[stream] += 1
            left -= 1
    return {s: begin[s] + share[s] for s in begin}
