"""Reading offset ranges of streams into Arrow record batches: planning and executor side.

The driver turns options into per-stream offset ranges, splits them into
`StreamRange` partitions and, on a cluster, gives each one of its stream's in-sync
replicas to read from (`spread`); each executor task reads its range with large Read
calls (up to 10,000 entries per reply) and hands Spark one record batch per
reply. Everything a task needs travels inside its partition, since tasks run on
a pickled copy of the reader in another process.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
from pyspark.sql.datasource import InputPartition
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import (
    BinaryType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from pyspark_streamlog.connection import Connection
from pyspark_streamlog.errors import DataLossError, OptionError
from pyspark_streamlog.options import EARLIEST, LATEST, Position, Server
from pyspark_streamlog.wire import Gap, ReadReply, decode_read_response

log = logging.getLogger("pyspark_streamlog")

READ_ENTRIES = 10_000  # the server's default max_read_entries; it lowers larger counts anyway
READ_BYTES = 64 << 20  # the server lowers this to its max_read_bytes: take as much as it allows
# A stream's new leader may for a moment serve less than its predecessor did (its high watermark
# catches up within a fetch round): a stream found to end before an offset the query had seen is
# waited for this long (at most half the call's deadline) before its entries are called lost.
TAIL_WAIT_S = 10.0


def spark_schema(payload_as_string: bool, include_headers: bool) -> StructType:
    """The rows of a streamlog read. Nothing is nullable: an entry always has every field."""
    fields = [
        StructField("stream", StringType(), False),
        StructField("offset", LongType(), False),
        StructField("timestamp", TimestampType(), False),
        StructField("tag", StringType(), False),
        StructField("payload", StringType() if payload_as_string else BinaryType(), False),
    ]
    if include_headers:
        fields.append(StructField("headers", MapType(StringType(), BinaryType(), False), False))
    return StructType(fields)


def check_user_schema(given: StructType, expected: StructType) -> None:
    if given != expected:
        raise OptionError(
            "a streamlog source has a fixed schema (set payloadAs or includeHeaders to change it); "
            f"do not call .schema() on it. Expected {expected.simpleString()}, got {given.simpleString()}"
        )


@dataclass(frozen=True)
class StreamRange(InputPartition):
    """One task's work: offsets [start, end) of one stream, and how to read them. `replica`: the
    node id of the in-sync replica to read from (another, or the leader, when it is no longer
    one or fails); None: the stream's leader."""

    server: Server
    stream: str
    start: int
    end: int
    fail_on_data_loss: bool
    payload_as_string: bool
    include_headers: bool
    timeout_s: float
    replica: str | None = None


def resolve(connection: Connection, stream: str, position: Position, first: int, following: int) -> int:
    """An absolute offset for a position, given the stream's first and next offsets."""
    if position.timestamp_ms is not None:
        return connection.seek_time(stream, position.timestamp_ms)
    if position.offset == EARLIEST:
        return first
    if position.offset == LATEST:
        return following
    assert position.offset is not None  # a position without a time has an offset (options.py)
    return position.offset


def split(
    ranges: list[tuple[str, int, int]], entries_per_partition: int, min_partitions: int | None
) -> list[tuple[str, int, int]]:
    """Cut each stream's [start, end) into pieces of at most entries_per_partition offsets.

    When that gives fewer than min_partitions pieces, the ranges are cut further
    in proportion to their sizes (as Kafka's connector does with minPartitions),
    so large streams get most of the extra tasks.
    """
    sized = [(s, a, b) for s, a, b in ranges if b > a]
    pieces = {(s, a, b): -(-(b - a) // entries_per_partition) for s, a, b in sized}
    total = sum(b - a for _, a, b in sized)
    wanted = min_partitions or 0
    if sum(pieces.values()) < wanted and total:
        for key in pieces:
            _, a, b = key
            share = max(1, round(wanted * (b - a) / total))
            pieces[key] = min(b - a, max(pieces[key], share))
    out: list[tuple[str, int, int]] = []
    for (stream, a, b), count in pieces.items():
        bounds = np.linspace(a, b, count + 1).round().astype(np.int64).tolist()
        out.extend((stream, lo, hi) for lo, hi in itertools.pairwise(bounds) if hi > lo)
    return out


def spread(
    pieces: Sequence[tuple[str, int, int]], in_sync: Mapping[str, Sequence[str]], turn: int = 0
) -> list[str | None]:
    """The replica each piece (stream, start, end) is read from: of its stream's in-sync replicas
    (node ids), the one given the fewest offsets so far in this plan (ties: in node id order,
    starting `turn` nodes on, so that successive plans start on different nodes); None for a
    stream with none (its leader serves it)."""
    nodes = sorted({node for ids in in_sync.values() for node in ids})
    rank = {node: (i - turn) % len(nodes) for i, node in enumerate(nodes)}
    load = dict.fromkeys(nodes, 0)
    chosen: list[str | None] = []
    for stream, start, end in pieces:
        candidates = in_sync.get(stream)
        if not candidates:
            chosen.append(None)
            continue
        node = min(candidates, key=lambda n: (load[n], rank[n]))
        load[node] += end - start
        chosen.append(node)
    return chosen


def _timestamp_column(timestamps_ms: np.ndarray) -> pa.Array:
    micros = timestamps_ms.astype(np.int64) * 1000
    return pa.Array.from_buffers(pa.timestamp("us", tz="UTC"), len(micros), [None, pa.py_buffer(micros)])


def _constant_string(value: str, rows: int) -> pa.Array:
    raw = value.encode()
    offsets = np.arange(rows + 1, dtype=np.int32) * len(raw)
    return pa.Array.from_buffers(pa.string(), rows, [None, pa.py_buffer(offsets), pa.py_buffer(raw * rows)])


def _headers_column(reply: ReadReply, kind: pa.DataType) -> pa.Array:
    rows = len(reply)
    counts = np.zeros(rows, dtype=np.int32)
    keys: list[str] = []
    values: list[bytes] = []
    for row, items in reply.headers:
        counts[row] = len(items)
        keys.extend(k for k, _ in items)
        values.extend(v for _, v in items)
    offsets = np.zeros(rows + 1, dtype=np.int32)
    np.cumsum(counts, out=offsets[1:])
    return pa.MapArray.from_arrays(
        pa.array(offsets), pa.array(keys, pa.string()), pa.array(values, pa.binary()), type=kind
    )


def _payload_strings(reply: ReadReply, stream: str) -> pa.Array:
    try:
        return reply.payloads.cast(pa.string())
    except pa.ArrowInvalid:
        for row, value in enumerate(reply.payloads.to_pylist()):
            try:
                value.decode()
            except UnicodeDecodeError:
                raise ValueError(
                    f"payloadAs=string: the payload of {stream!r} offset {int(reply.offsets[row])} is not "
                    "valid UTF-8; read it with payloadAs=binary"
                ) from None
        raise


def to_batch(reply: ReadReply, part: StreamRange, schema: pa.Schema) -> pa.RecordBatch:
    rows = len(reply)
    columns = [
        _constant_string(part.stream, rows),
        pa.array(reply.offsets, pa.int64()),
        _timestamp_column(reply.timestamps_ms),
        reply.tags,
        _payload_strings(reply, part.stream) if part.payload_as_string else reply.payloads,
    ]
    if part.include_headers:
        columns.append(_headers_column(reply, schema.field("headers").type))
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def data_loss(message: str, fail: bool) -> None:
    """Raise (failOnDataLoss true) or log and go on (false)."""
    if fail:
        raise DataLossError(
            f"{message}. Set failOnDataLoss to false to skip lost entries and go on (they are logged)"
        )
    log.warning("streamlog data loss, skipped: %s", message)


def tail_wait_ms(timeout_s: float) -> int:
    return int(min(TAIL_WAIT_S, timeout_s / 2) * 1000)


def stream_reaches(connection: Connection, stream: str, end: int, timeout_s: float) -> bool:
    """Whether `stream` ends at `end` (> 0) or later, once entry end - 1 is there or the tail
    wait is over (a blocking Read: woken as soon as it is)."""
    reply = connection.read(stream, end - 1, 1, READ_BYTES, block_ms=tail_wait_ms(timeout_s))
    return decode_read_response(reply).end_offset >= end


def _gap_message(stream: str, gap: Gap) -> str:
    return (
        f"entries {gap.start_offset}..{gap.end_offset - 1} of stream {stream!r} are gone ({gap.reason}) "
        "but the query needs them"
    )


def read_range(part: StreamRange) -> Iterator[pa.RecordBatch]:
    """The entries of [part.start, part.end), one record batch per Read reply."""
    connection = Connection(part.server, part.timeout_s)
    schema = to_arrow_schema(spark_schema(part.payload_as_string, part.include_headers), timezone="UTC")
    block_ms = tail_wait_ms(part.timeout_s)  # before calling the rest of the range lost (TAIL_WAIT_S)

    def ask(offset: int):
        count = min(READ_ENTRIES, part.end - offset)
        return connection.read_ahead(part.stream, offset, count, READ_BYTES, replica=part.replica)

    def wait(offset: int):
        # From the leader: a replica may trail its high watermark, and lost entries are only
        # called lost on the leader's word.
        count = min(READ_ENTRIES, part.end - offset)
        return lambda: connection.read(part.stream, offset, count, READ_BYTES, block_ms=block_ms)

    offset = part.start
    pending = ask(offset) if offset < part.end else None
    waited = False
    # Every turn either moves `offset` forward, or waits once for the range's end, or ends the
    # loop, so there are at most 2 * (end - start) turns; the bound is a guard against a server bug.
    for _ in range(2 * (part.end - part.start) + 1):
        if pending is None:
            return
        reply = decode_read_response(pending())
        following = reply.next_offset
        pending = ask(following) if offset < following < part.end else None
        gap = reply.gap
        if gap is not None and gap.is_loss and gap.start_offset < part.end and gap.end_offset > offset:
            clipped = Gap(max(gap.start_offset, offset), min(gap.end_offset, part.end), gap.reason)
            data_loss(_gap_message(part.stream, clipped), part.fail_on_data_loss)
        rows = int(np.searchsorted(reply.offsets, part.end))
        if rows:
            yield to_batch(reply.head(rows), part, schema)
        if following <= offset:
            if not waited:
                pending, waited = wait(offset), True
                continue
            # No entry and no gap, even after waiting: the stream now ends before `end` (deleted
            # and recreated, or its tail lost); the rest of the range is gone.
            lost = Gap(offset, part.end, f"missing: the stream now ends at {reply.end_offset}")
            data_loss(_gap_message(part.stream, lost), part.fail_on_data_loss)
            return
        offset, waited = following, False
    raise AssertionError(f"read of {part.stream!r} [{part.start}, {part.end}) made no progress")
