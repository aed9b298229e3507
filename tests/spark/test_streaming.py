"""spark.readStream.format("streamlog") into a file sink: rate limits, restarts, failures, data loss.

The file sink is exactly-once given a replayable source, so every test ends by
reading the sink's output and checking that each offset is there exactly once.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from pyspark.sql import functions as F
from pyspark.sql.streaming.datasource import ReadAllAvailable
from pyspark.sql.types import LongType
from streamlog.v1 import streamlog_pb2 as pb

from pyspark_streamlog import source as streamlog_source
from pyspark_streamlog.errors import DataLossError
from pyspark_streamlog.options import parse_read
from pyspark_streamlog.reading import spark_schema
from pyspark_streamlog.source import StreamlogStreamReader
from tests.spark.helpers import fill


def source(spark, server, **options):
    reader = spark.readStream.format("streamlog").option("endpoint", server.target)
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


def run_available_now(frame, out: Path, checkpoint: Path, timeout_s: float = 120):
    query = (
        frame.writeStream.format("parquet")
        .option("path", str(out))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    try:
        finished = query.awaitTermination(timeout_s)
    finally:
        query.stop()
    assert finished, "the availableNow query did not finish in time"
    return query


def offsets_in(spark, out: Path) -> list[int]:
    # spark.read of a file sink's directory follows its _spark_metadata log, so
    # files of a batch that failed before its commit are not counted.
    return sorted(r.offset for r in spark.read.parquet(str(out)).select("offset").collect())


def test_rate_limit_and_restart_read_each_entry_once(spark, server, stub, tmp_path) -> None:
    fill(stub, "clicks", 1000)
    frame = source(spark, server, streams="clicks", startingOffsets="earliest", maxEntriesPerTrigger=300)
    query = run_available_now(frame, tmp_path / "out", tmp_path / "cp")
    assert [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]] == [300, 300, 300, 100]
    end = query.lastProgress["sources"][0]["endOffset"]
    assert (json.loads(end) if isinstance(end, str) else end) == {"clicks": 1000}
    # Restarted from its checkpoint, the query reads only what came since.
    fill(stub, "clicks", 250)
    query = run_available_now(frame, tmp_path / "out", tmp_path / "cp")
    assert [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]] == [250]
    assert offsets_in(spark, tmp_path / "out") == list(range(1250))


def test_starting_offsets_latest_skips_what_exists(spark, server, stub, tmp_path) -> None:
    fill(stub, "news", 100)
    frame = source(spark, server, streams="news")  # startingOffsets defaults to latest
    run_available_now(frame, tmp_path / "out", tmp_path / "cp")
    fill(stub, "news", 50)
    run_available_now(frame, tmp_path / "out", tmp_path / "cp")
    assert offsets_in(spark, tmp_path / "out") == list(range(100, 150))


def test_a_batch_killed_midway_is_redone_without_duplicates(spark, server, stub, tmp_path) -> None:
    marker = tmp_path / "failed-once"
    fill(stub, "orders", 600)

    @F.udf(LongType())
    def fail_once(offset):
        # Kills the task reading offset 450 the first time: its batch (400..599) dies midway.
        if offset == 450 and not marker.exists():
            marker.touch()
            raise RuntimeError("injected failure at offset 450")
        return offset

    frame = source(spark, server, streams="orders", startingOffsets="earliest", maxEntriesPerTrigger=200)
    checked = frame.select("offset", fail_once("offset").alias("seen"))
    with pytest.raises(Exception, match="injected failure at offset 450"):
        run_available_now(checked, tmp_path / "out", tmp_path / "cp")
    assert marker.exists()
    assert offsets_in(spark, tmp_path / "out") == list(range(400))  # batches 0 and 1 were committed
    run_available_now(checked, tmp_path / "out", tmp_path / "cp")
    assert offsets_in(spark, tmp_path / "out") == list(range(600))


def test_stop_while_running_then_restart(spark, server, stub, tmp_path) -> None:
    fill(stub, "ticks", 200)
    frame = source(spark, server, streams="ticks", startingOffsets="earliest", maxEntriesPerTrigger=150)
    query = (
        frame.writeStream.format("parquet")
        .option("path", str(tmp_path / "out"))
        .option("checkpointLocation", str(tmp_path / "cp"))
        .trigger(processingTime="0 seconds")
        .start()
    )
    try:
        # Keep appending while the query runs, then stop it wherever it is.
        for _ in range(10):
            fill(stub, "ticks", 100)
            time.sleep(0.3)
    finally:
        query.stop()
    total = 200 + 10 * 100
    run_available_now(frame, tmp_path / "out", tmp_path / "cp")
    assert offsets_in(spark, tmp_path / "out") == list(range(total))


def test_fail_on_data_loss_when_retention_overtakes_a_stopped_query(spark, server, stub, tmp_path) -> None:
    fill(stub, "metrics", 500)
    frame = source(spark, server, streams="metrics", startingOffsets="earliest")
    run_available_now(frame, tmp_path / "out", tmp_path / "cp")
    fill(stub, "metrics", 500)
    stub.Trim(pb.TrimRequest(stream="metrics", trim_to_offset=700), timeout=10)
    with pytest.raises(Exception, match=r"entries 500\.\.699 of stream 'metrics' are gone \(evicted\)"):
        run_available_now(frame, tmp_path / "out", tmp_path / "cp")
    lenient = source(spark, server, streams="metrics", startingOffsets="earliest", failOnDataLoss="false")
    run_available_now(lenient, tmp_path / "out", tmp_path / "cp")
    assert offsets_in(spark, tmp_path / "out") == list(range(500)) + list(range(700, 1000))


def test_a_starting_offset_past_the_end_is_refused(spark, server, stub, tmp_path) -> None:
    fill(stub, "short", 10)
    frame = source(spark, server, streams="short", startingOffsets='{"short": 11}')
    with pytest.raises(Exception, match=r"startingOffsets for 'short' is 11, past the stream's end \(10\)"):
        run_available_now(frame, tmp_path / "out", tmp_path / "cp")


def test_a_stream_behind_the_querys_position_is_waited_for_before_it_is_data_loss(
    server, stub, monkeypatch
) -> None:
    # A new leader may report a shorter stream than its predecessor did when the query last planned,
    # for the moment its high watermark takes to catch up: the planner waits, and it is not data loss.
    fill(stub, "ticks", 100)
    waits: list[int] = []

    class CatchingUp(streamlog_source.Connection):
        def read(self, stream, offset, count, max_bytes, block_ms=0):
            if block_ms:
                waits.append(offset)
                if len(waits) == 1:  # the first wait, for offset 149: the entries come now
                    fill(stub, "ticks", 100)
            return super().read(stream, offset, count, max_bytes, block_ms)

    monkeypatch.setattr(streamlog_source, "Connection", CatchingUp)
    options = parse_read({"endpoint": server.target, "streams": "ticks", "timeoutMs": "400"}, streaming=True)
    reader = StreamlogStreamReader(options, spark_schema(False, True))
    assert reader.latestOffset({"ticks": 150}, ReadAllAvailable()) == {"ticks": 150}  # kept, not lost
    assert waits == [149]
    # Entries that never come are lost, once the wait is over (half the 400 ms deadline here).
    with pytest.raises(DataLossError, match=r"now ends at offset 200, before this query's position 250"):
        reader.latestOffset({"ticks": 250}, ReadAllAvailable())
    assert waits == [149, 249]
