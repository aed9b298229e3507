"""df.write / writeStream into streamlog: what lands in the streams, and that retries add nothing."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from tests.spark.helpers import fill, finish, info


def entries(stub: pb_grpc.StreamLogServiceStub, stream: str) -> list[pb.Entry]:
    out: list[pb.Entry] = []
    offset = 0
    for _ in range(1000):  # bounded: a test stream holds far fewer than 1000 replies
        reply = stub.Read(pb.ReadRequest(stream=stream, offset=offset, count=1000), timeout=10)
        if not reply.entries:
            return out
        out.extend(reply.entries)
        offset = reply.next_offset
    raise AssertionError("stream did not end")


def writer(frame, server, **options):
    w = frame.write.format("streamlog").mode("append").option("endpoint", server.target)
    for key, value in options.items():
        w = w.option(key, value)
    return w


def test_payload_only_write_in_order_and_rewrite_adds_nothing(spark, server, stub) -> None:
    frame = spark.range(0, 2500, numPartitions=1).selectExpr("cast(concat('p', id) as binary) as payload")
    writer(frame, server, stream="out", producerId="load-1", entriesPerAppend=300).save()
    written = entries(stub, "out")
    assert [e.payload for e in written] == [f"p{i}".encode() for i in range(2500)]
    # Each append of 300 (the last one 100) ends with the producer id and its sequence.
    marked = [(e.offset, e.producer_sequence) for e in written if e.producer_id]
    assert marked == [(300 * (k + 1) - 1, k) for k in range(8)] + [(2499, 8)]
    assert {e.producer_id for e in written if e.producer_id} == {"spark-write:load-1:0"}
    # The same write again (a job retried with the same producerId) writes nothing.
    writer(frame, server, stream="out", producerId="load-1", entriesPerAppend=300).save()
    assert info(stub, "out").next_offset == 2500
    # Without a producerId every write is a new one.
    writer(frame, server, stream="out").save()
    assert info(stub, "out").next_offset == 5000


def test_rows_with_tags_headers_and_their_own_streams(spark, server, stub) -> None:
    rows = [
        ("a", "k1", "text-1", {"h": "x"}),
        ("b", None, "text-2", None),
        (None, "k3", "text-3", {}),
        ("a", "", None, {"h": "y", "z": ""}),
    ]
    schema = "stream string, tag string, payload string, headers map<string,string>"
    frame = spark.createDataFrame(rows, schema)
    writer(frame.coalesce(1), server, stream="default").save()
    a = entries(stub, "a")
    assert [(e.tag, e.payload, dict(e.headers)) for e in a] == [
        ("k1", b"text-1", {"h": b"x"}),
        ("", b"", {"h": b"y", "z": b""}),  # a null payload is empty: a tombstone when tagged
    ]
    assert [(e.tag, e.payload) for e in entries(stub, "b")] == [("", b"text-2")]
    assert [(e.tag, e.payload) for e in entries(stub, "default")] == [("k3", b"text-3")]


def test_read_back_and_write_to_another_stream(spark, server, stub) -> None:
    # A DataFrame read from streamlog can be written as it is: offset and timestamp are ignored.
    fill(stub, "src", 1200)
    frame = spark.read.format("streamlog").option("endpoint", server.target).option("streams", "src").load()
    writer(frame.drop("stream"), server, stream="copy").save()
    copied = sorted(e.payload for e in entries(stub, "copy"))
    assert copied == sorted(f"e{i}".encode() for i in range(1200))


@pytest.mark.parametrize(
    ("select", "options", "message"),
    [
        ("cast(id as string) as body", {"stream": "x"}, "needs a payload column"),
        ("id as payload", {"stream": "x"}, "payload must be binary or string"),
        ("cast(id as string) as payload, id as extra", {"stream": "x"}, "drop or rename extra"),
        ("cast(id as string) as payload", {}, "no target stream"),
        ("cast(id as string) as payload, id as tag", {"stream": "x"}, "tag must be a string column"),
        ("cast(id as string) as payload", {"stream": "x", "streams": "y"}, "unknown option"),
    ],
)
def test_bad_frames_and_options_are_clear_errors(spark, server, select, options, message) -> None:
    frame = spark.range(3).selectExpr(*[s.strip() for s in select.split(",")])
    with pytest.raises(Exception, match=message):
        writer(frame, server, **options).save()


def test_overwrite_is_refused(spark, server) -> None:
    frame = spark.range(3).selectExpr("cast(id as string) as payload")
    with pytest.raises(Exception, match="append-only"):
        writer(frame, server, stream="x").mode("overwrite").save()


def test_stream_sink_is_exactly_once_across_a_failed_batch_and_a_replay(
    spark, start_server, tmp_path: Path
) -> None:
    """A micro-batch fails midway through its appends; the replay writes only what is missing.

    The sink's server refuses entries over 1 KiB, so the batch holding a 2 KiB
    entry dies after its first append went through. The server is restarted
    with a larger limit and the query resumes from its checkpoint: the replayed
    batch's first append is a duplicate, the rest are new. Then the last batch
    is replayed whole (its commit removed from the checkpoint, as after a crash
    between the sink's writes and Spark's commit): nothing new is written.
    """
    source = start_server(tmp_path / "source")
    sink_dir = tmp_path / "sink"
    sink = start_server(sink_dir, max_entry_bytes=1024)
    payloads = [b"x" * 2048 if i == 450 else f"r{i}".encode() for i in range(600)]
    with grpc.insecure_channel(source.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        stub.Append(pb.AppendRequest(stream="in", payloads=payloads[:500]), timeout=10)
        stub.Append(pb.AppendRequest(stream="in", payloads=payloads[500:]), timeout=10)

    def run(target: str) -> None:
        frame = (
            spark.readStream.format("streamlog")
            .option("endpoint", source.target)
            .option("streams", "in")
            .option("startingOffsets", "earliest")
            .option("maxEntriesPerTrigger", 200)
            .load()
            .select("payload")
        )
        query = (
            frame.writeStream.format("streamlog")
            .option("endpoint", target)
            .option("stream", "out")
            .option("entriesPerAppend", 25)
            .option("checkpointLocation", str(tmp_path / "cp"))
            .trigger(availableNow=True)
            .start()
        )
        finish(query)

    with pytest.raises(Exception, match="max_entry_bytes"):
        run(sink.target)
    with grpc.insecure_channel(sink.target) as channel:
        # Batches 0 and 1 (400 entries), then the 2 appends before offset 450 in batch 2.
        assert info(pb_grpc.StreamLogServiceStub(channel), "out").next_offset == 450
    sink.stop()
    sink = start_server(sink_dir)
    run(sink.target)
    with grpc.insecure_channel(sink.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        assert [e.payload for e in entries(stub, "out")] == payloads
        query_id = json.loads((tmp_path / "cp" / "metadata").read_text())["id"]
        producers = {e.producer_id for e in entries(stub, "out") if e.producer_id}
        assert producers == {f"spark:{query_id}:{batch}:0" for batch in range(3)}
        (tmp_path / "cp" / "commits" / "2").unlink()
        (tmp_path / "cp" / "commits" / ".2.crc").unlink(missing_ok=True)
        run(sink.target)
        assert info(stub, "out").next_offset == 600
