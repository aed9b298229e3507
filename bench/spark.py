"""The Spark connector's throughput on local[2]: python -m bench.spark [--entries N] [--quick]

Starts its own `streamlog serve` (subprocess, loopback, temp data directory,
fsync everysec) and a local[2] SparkSession, fills one stream with 100-byte
payloads through Append's payloads form, then measures:

- batch read: spark.read.format("streamlog") of every entry into Spark's
  `noop` sink (which consumes every row and writes nothing), rows/s; run twice,
  the first run includes the Python workers' start-up;
- streaming read: readStream with maxEntriesPerTrigger 100,000 (minPartitions 2,
  so both cores read) into the noop sink, trigger availableNow, rows/s;
- sink: spark.range -> 100-byte binary payloads -> df.write.format("streamlog"),
  rows/s into a fresh stream.

One JSON object per line (bench.common.emit). The server, Spark's JVM, its two
Python workers and this driver share the machine's cores, as they would on a
one-box deployment.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import grpc
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from bench.common import Timer, cpu_steal_ticks, emit
from bench.service import streamlog_server

PAYLOAD_BYTES = 100
APPEND_BATCH = 10_000  # the server's default max_batch_entries
TRIGGER_ENTRIES = 100_000


def fill(address: str, stream: str, entries: int) -> float:
    """Append `entries` 100-byte payloads; returns the seconds it took."""
    payloads = [os.urandom(PAYLOAD_BYTES) for _ in range(APPEND_BATCH)]
    limit = 64 << 20
    options = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
    with grpc.insecure_channel(address, options=options) as channel, Timer() as timer:
        stub = pb_grpc.StreamLogServiceStub(channel)
        for first in range(0, entries, APPEND_BATCH):
            count = min(APPEND_BATCH, entries - first)
            stub.Append(pb.AppendRequest(stream=stream, payloads=payloads[:count]), timeout=60)
    return timer.elapsed


def session(tmp: Path):
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    import pyspark_streamlog

    spark = (
        SparkSession.builder.master("local[2]")
        .appName("bench-spark")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.memory", "2g")
        .config("spark.sql.warehouse.dir", str(tmp / "warehouse"))
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    pyspark_streamlog.register(spark)
    return spark


def batch_read(spark, address: str, stream: str, entries: int, run: int) -> None:
    frame = spark.read.format("streamlog").option("endpoint", address).option("streams", stream).load()
    with Timer() as timer:
        frame.write.format("noop").mode("overwrite").save()
    emit(
        "spark_batch_read",
        entries / timer.elapsed,
        "rows/s",
        entries=entries,
        seconds=round(timer.elapsed, 2),
        run=run,
        partitions=frame.rdd.getNumPartitions(),
    )


def stream_read(spark, address: str, stream: str, entries: int, tmp: Path) -> None:
    frame = (
        spark.readStream.format("streamlog")
        .option("endpoint", address)
        .option("streams", stream)
        .option("startingOffsets", "earliest")
        .option("maxEntriesPerTrigger", TRIGGER_ENTRIES)
        .option("minPartitions", 2)
        .load()
    )
    query = (
        frame.writeStream.format("noop")
        .option("checkpointLocation", str(tmp / "stream-checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    with Timer() as timer:
        finished = query.awaitTermination(3600)
    query.stop()
    if not finished:
        raise RuntimeError("the streaming query did not finish within an hour")
    batches = [p for p in query.recentProgress if p["numInputRows"]]
    rows = sum(p["numInputRows"] for p in batches)
    if rows != entries:
        raise RuntimeError(f"the streaming query read {rows} rows, expected {entries}")
    emit(
        "spark_stream_read",
        rows / timer.elapsed,
        "rows/s",
        entries=rows,
        seconds=round(timer.elapsed, 2),
        max_entries_per_trigger=TRIGGER_ENTRIES,
        batches=len(batches),
    )


def sink_write(spark, address: str, entries: int) -> None:
    from pyspark.sql import functions as F

    frame = spark.range(0, entries, numPartitions=2).select(
        F.expr(f"cast(lpad(cast(id as string), {PAYLOAD_BYTES}, 'x') as binary)").alias("payload")
    )
    with Timer() as timer:
        frame.write.format("streamlog").mode("append").option("endpoint", address).option(
            "stream", "bench-sink"
        ).save()
    with grpc.insecure_channel(address) as channel:
        info = pb_grpc.StreamLogServiceStub(channel).GetStreamInfo(
            pb.GetStreamInfoRequest(stream="bench-sink"), timeout=30
        )
    if info.info.next_offset != entries:
        raise RuntimeError(f"the sink wrote {info.info.next_offset} entries, expected {entries}")
    emit(
        "spark_sink_write",
        entries / timer.elapsed,
        "rows/s",
        entries=entries,
        seconds=round(timer.elapsed, 2),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=5_000_000, help="entries to read (default 5,000,000)")
    parser.add_argument(
        "--sink-entries", type=int, default=2_000_000, help="rows to write (default 2,000,000)"
    )
    parser.add_argument("--quick", action="store_true", help="500,000 entries and rows: a smoke run")
    args = parser.parse_args()
    entries, sink_entries = (500_000, 500_000) if args.quick else (args.entries, args.sink_entries)
    steal_before = cpu_steal_ticks()
    with tempfile.TemporaryDirectory(prefix="bench-spark-") as tmp, streamlog_server("everysec") as address:
        seconds = fill(address, "bench", entries)
        emit("spark_bench_fill", entries / seconds, "entries/s", entries=entries, payload_bytes=PAYLOAD_BYTES)
        spark = session(Path(tmp))
        try:
            for run in (1, 2):
                batch_read(spark, address, "bench", entries, run)
            stream_read(spark, address, "bench", entries, Path(tmp))
            sink_write(spark, address, sink_entries)
        finally:
            spark.stop()
    steal_after = cpu_steal_ticks()
    if steal_before and steal_after:
        steal = steal_after[0] - steal_before[0]
        total = steal_after[1] - steal_before[1]
        emit("cpu_steal", 100 * steal / max(total, 1), "%")


if __name__ == "__main__":
    main()
