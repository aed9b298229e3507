"""spark.read.format("streamlog") against a real server: rows, ranges, partitions, data loss, errors."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import time

import pytest
from streamlog.v1 import streamlog_pb2 as pb

import pyspark_streamlog
from pyspark_streamlog import reading
from pyspark_streamlog.errors import DataLossError
from pyspark_streamlog.options import Server
from pyspark_streamlog.reading import StreamRange, read_range
from tests.spark.helpers import fill, info


def read(spark, server, **options):
    reader = spark.read.format("streamlog").option("endpoint", server.target)
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


def test_rows_carry_every_field_of_every_entry(spark, server, stub) -> None:
    fill(stub, "rides", 2500)
    stub.Append(
        pb.AppendRequest(
            stream="rides",
            entries=[pb.Entry(tag="ride-9", payload=b"\x00\xff", headers={"src": b"api", "v": b"2"})],
        ),
        timeout=10,
    )
    fill(stub, "other", 10, prefix="o")
    # Found by name without register(): the session never registered it (auto-discovery).
    df = read(spark, server, streams="rides,other", entriesPerPartition=1000)
    assert df.schema.simpleString() == (
        "struct<stream:string,offset:bigint,timestamp:timestamp,tag:string,payload:binary,"
        "headers:map<string,binary>>"
    )
    assert df.rdd.getNumPartitions() == 4  # rides: 2501 entries in 3 ranges; other: 1
    rows = df.collect()
    by_stream: dict[str, list] = {}
    for row in rows:
        by_stream.setdefault(row.stream, []).append(row)
    rides = sorted(by_stream["rides"], key=lambda r: r.offset)
    assert [r.offset for r in rides] == list(range(2501))
    assert [bytes(r.payload) for r in rides[:2500]] == [f"e{i}".encode() for i in range(2500)]
    last = rides[-1]
    assert (last.tag, bytes(last.payload)) == ("ride-9", b"\x00\xff")
    assert {k: bytes(v) for k, v in last.headers.items()} == {"src": b"api", "v": b"2"}
    assert rides[0].headers == {} and rides[0].tag == ""
    now = dt.datetime.now(dt.UTC)
    assert all(now - dt.timedelta(minutes=10) < r.timestamp.replace(tzinfo=dt.UTC) <= now for r in rides)
    assert sorted(bytes(r.payload) for r in by_stream["other"]) == sorted(f"o{i}".encode() for i in range(10))


def test_offsets_and_times_bound_the_range(spark, server, stub) -> None:
    fill(stub, "a", 300)
    time.sleep(0.05)  # a later append time for the entries below
    middle_ms = int(time.time() * 1000)
    time.sleep(0.05)
    fill(stub, "a", 200)
    fill(stub, "b", 100)

    def offsets(**options) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for row in read(spark, server, **options).select("stream", "offset").collect():
            out.setdefault(row.stream, []).append(row.offset)
        return {k: sorted(v) for k, v in out.items()}

    got = offsets(
        streams="a,b",
        startingOffsets=json.dumps({"a": 250, "b": -2}),
        endingOffsets=json.dumps({"a": 260, "b": -1}),
    )
    assert got == {"a": list(range(250, 260)), "b": list(range(100))}
    assert offsets(streams="a", startingTimestamp=str(middle_ms)) == {"a": list(range(300, 500))}
    assert offsets(streams="a", endingTimestamp=str(middle_ms), startingOffsets="earliest") == {
        "a": list(range(300))
    }
    assert offsets(streams="a", startingOffsets="latest") == {}


def test_min_partitions_splits_ranges_in_proportion(spark, server, stub) -> None:
    fill(stub, "big", 900)
    fill(stub, "small", 100)
    df = read(spark, server, streams="big,small", minPartitions=10)
    assert df.rdd.getNumPartitions() == 10
    assert df.count() == 1000
    sizes = sorted(df.rdd.glom().map(len).collect())
    assert sizes == [100] * 10  # 9 pieces of "big" and 1 of "small"


def test_payload_as_string(spark, server, stub) -> None:
    fill(stub, "text", 5, prefix="héllo-")
    df = read(spark, server, streams="text", payloadAs="string", includeHeaders="false")
    assert df.schema.simpleString() == (
        "struct<stream:string,offset:bigint,timestamp:timestamp,tag:string,payload:string>"
    )
    assert sorted(r.payload for r in df.collect()) == [f"héllo-{i}" for i in range(5)]
    stub.Append(pb.AppendRequest(stream="text", payloads=[b"\xff\xfe"]), timeout=10)
    with pytest.raises(Exception, match="offset 5 is not valid UTF-8"):
        read(spark, server, streams="text", payloadAs="string").collect()


def test_data_loss_fails_or_is_skipped(spark, server, stub) -> None:
    fill(stub, "lossy", 500)
    stub.Trim(pb.TrimRequest(stream="lossy", trim_to_offset=200), timeout=10)
    wanted = json.dumps({"lossy": 100})
    with pytest.raises(Exception, match=r"starts at offset 200 .* but the query starts at 100"):
        read(spark, server, streams="lossy", startingOffsets=wanted).collect()
    rows = read(spark, server, streams="lossy", startingOffsets=wanted, failOnDataLoss="false").collect()
    assert sorted(r.offset for r in rows) == list(range(200, 500))
    # "earliest" is never data loss: it means whatever the stream still holds.
    assert read(spark, server, streams="lossy").count() == 300


def test_tasks_report_entries_evicted_after_planning(server, stub, caplog) -> None:
    # Each action plans its ranges first; entries evicted before a task reads them
    # are reported by the task itself, from the server's gap report.
    fill(stub, "racy", 400)
    stub.Trim(pb.TrimRequest(stream="racy", trim_to_offset=150), timeout=10)
    part = StreamRange(Server(server.target), "racy", 0, 300, True, False, True, 10.0)
    with pytest.raises(DataLossError, match=r"entries 0\.\.149 of stream 'racy' are gone \(evicted\)"):
        list(read_range(part))
    lenient = dataclasses.replace(part, fail_on_data_loss=False)
    with caplog.at_level(logging.WARNING, logger="pyspark_streamlog"):
        batches = list(read_range(lenient))
    assert [o for b in batches for o in b.column("offset").to_pylist()] == list(range(150, 300))
    assert "entries 0..149 of stream 'racy' are gone (evicted)" in caplog.text


def test_a_task_waits_for_the_end_of_its_range_before_calling_it_lost(server, stub, monkeypatch) -> None:
    # A stream's new leader may serve less than its predecessor did when the range was planned, for
    # the moment its high watermark takes to catch up: the entries come, and are not data loss.
    fill(stub, "tail", 100)
    waits: list[int] = []

    class CatchingUp(reading.Connection):
        def read(self, stream, offset, count, max_bytes, block_ms=0):
            if block_ms:
                waits.append(offset)
                if len(waits) == 1:  # the first wait, for offsets 100..199: they come now
                    fill(stub, "tail", 100)
            return super().read(stream, offset, count, max_bytes, block_ms)

    monkeypatch.setattr(reading, "Connection", CatchingUp)
    part = StreamRange(Server(server.target), "tail", 0, 200, True, False, True, 10.0)
    assert [o for b in read_range(part) for o in b.column("offset").to_pylist()] == list(range(200))
    assert waits == [100]
    # Entries that never come are lost, once the wait is over (half the deadline here).
    part = dataclasses.replace(part, end=250, timeout_s=0.4)
    with pytest.raises(DataLossError, match=r"entries 200\.\.249 of stream 'tail' are gone \(missing"):
        list(read_range(part))
    assert waits == [100, 200]


def test_register_is_one_call_and_idempotent(spark, server, stub) -> None:
    fill(stub, "r", 3)
    pyspark_streamlog.register(spark)
    pyspark_streamlog.register(spark)
    assert read(spark, server, streams="r").count() == 3


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "the streams option is required"),
        ({"streams": "s", "startingOffset": "earliest"}, "unknown option.*startingOffset"),
        ({"streams": "s", "startingOffsets": "{oops"}, "startingOffsets must be"),
        ({"streams": "s", "startingOffsets": '{"t": 1}'}, "not in the streams option: t"),
        ({"streams": "s", "minPartitions": "0"}, "minPartitions must be at least 1"),
        ({"streams": "s", "maxEntriesPerTrigger": "5"}, "unknown option.*maxEntriesPerTrigger"),
        ({"streams": "s", "payloadAs": "json"}, "payloadAs must be binary or string"),
        ({"streams": "s", "startingOffsets": "earliest", "startingTimestamp": "1"}, "not both"),
        ({"streams": "missing"}, "stream 'missing' does not exist"),
        ({"streams": "s", "endingOffsets": '{"s": 99}'}, "past the stream's end"),
    ],
)
def test_bad_options_are_clear_errors(spark, server, stub, options, message) -> None:
    fill(stub, "s", 5)
    with pytest.raises(Exception, match=message):
        read(spark, server, **options).collect()


def test_unreachable_endpoint_is_a_clear_error(spark) -> None:
    reader = spark.read.format("streamlog").option("endpoint", "127.0.0.1:1").option("streams", "s")
    with pytest.raises(Exception, match=r"cannot reach the streamlog server at 127\.0\.0\.1:1"):
        reader.load().collect()


def test_no_endpoint_is_a_clear_error(spark, monkeypatch) -> None:
    monkeypatch.delenv("STREAMLOG_ADDRESS", raising=False)
    with pytest.raises(Exception, match="no streamlog server given"):
        spark.read.format("streamlog").option("streams", "s").load().collect()


def test_stream_info_is_unchanged_by_reads(spark, server, stub) -> None:
    # A plain read changes nothing on the server: no group, no position kept there.
    fill(stub, "quiet", 50)
    before = info(stub, "quiet")
    assert read(spark, server, streams="quiet").count() == 50
    after = info(stub, "quiet")
    assert (after.first_offset, after.next_offset) == (before.first_offset, before.next_offset)
    assert after.groups == 0
