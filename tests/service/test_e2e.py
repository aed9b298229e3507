"""End-to-end: a real server on 127.0.0.1, real gRPC clients, the real engine."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from storage.cleanmark import marker_in
from storage.fs import FileSystem
from storage.layout import segment_name, stream_directory
from tests.service.helpers import ServerThread, append, payloads_of


def test_append_then_read_round_trips_every_field(stub: pb_grpc.StreamLogServiceStub) -> None:
    entries = [
        pb.Entry(
            payload=b"first", tag="user-1", headers={"trace": b"\x00\x01", "kind": b"k"}, deliver_at_ms=5
        ),
        pb.Entry(payload=b""),
        pb.Entry(payload=bytes(range(256)), tag="user-2"),
    ]
    before_ms = int(time.time() * 1000)
    reply = stub.Append(pb.AppendRequest(stream="rides", entries=entries), timeout=10)
    assert (reply.first_offset, reply.last_offset) == (0, 2)
    assert reply.timestamp_ms >= before_ms

    read = stub.Read(pb.ReadRequest(stream="rides", offset=0, count=10), timeout=10)
    assert [e.offset for e in read.entries] == [0, 1, 2]
    for got, sent in zip(read.entries, entries, strict=True):
        assert (got.payload, got.tag, dict(got.headers), got.deliver_at_ms) == (
            sent.payload,
            sent.tag,
            dict(sent.headers),
            sent.deliver_at_ms,
        )
        assert got.timestamp_ms == reply.timestamp_ms
    assert (read.first_offset, read.next_offset, read.end_offset) == (0, 3, 3)
    assert not read.HasField("gap")


def test_offsets_are_contiguous_across_batches(stub: pb_grpc.StreamLogServiceStub) -> None:
    firsts = [append(stub, "s", *[b"x"] * n).first_offset for n in (1, 5, 2)]
    assert firsts == [0, 1, 6]
    read = stub.Read(pb.ReadRequest(stream="s", offset=0), timeout=10)
    assert [e.offset for e in read.entries] == list(range(8))


def test_client_supplied_offset_and_timestamp_are_ignored(stub: pb_grpc.StreamLogServiceStub) -> None:
    stub.Append(pb.AppendRequest(stream="s", entries=[pb.Entry(offset=99, timestamp_ms=7, payload=b"a")]))
    entry = stub.Read(pb.ReadRequest(stream="s", offset=0)).entries[0]
    assert entry.offset == 0
    assert entry.timestamp_ms > 7


def test_read_pages_with_count_and_next_offset(stub: pb_grpc.StreamLogServiceStub) -> None:
    append(stub, "s", *[b"%d" % i for i in range(50)])
    seen: list[bytes] = []
    offset = 0
    for _ in range(20):  # bounded: 50 entries in pages of 7 need 8 reads
        reply = stub.Read(pb.ReadRequest(stream="s", offset=offset, count=7))
        if not reply.entries:
            break
        assert len(reply.entries) <= 7
        seen += payloads_of(reply)
        offset = reply.next_offset
    assert seen == [b"%d" % i for i in range(50)]
    assert offset == 50


def test_read_count_zero_uses_the_default_and_large_counts_are_capped(
    stub: pb_grpc.StreamLogServiceStub, server: ServerThread
) -> None:
    for _ in range(7):
        append(stub, "s", *[b"x"] * 100)
    assert (
        len(stub.Read(pb.ReadRequest(stream="s", offset=0)).entries) == server.settings.default_read_entries
    )
    capped = stub.Read(pb.ReadRequest(stream="s", offset=0, count=2**31 - 1))
    assert len(capped.entries) == server.settings.max_read_entries


def test_read_max_bytes_limits_the_reply_but_returns_at_least_one_entry(
    stub: pb_grpc.StreamLogServiceStub,
) -> None:
    append(stub, "s", *[b"y" * 1000] * 10)
    reply = stub.Read(pb.ReadRequest(stream="s", offset=0, max_bytes=3500))
    assert 1 <= len(reply.entries) <= 3
    one = stub.Read(pb.ReadRequest(stream="s", offset=0, max_bytes=1))
    assert len(one.entries) == 1 and one.next_offset == 1


def test_reverse_read_walks_back_to_the_start(stub: pb_grpc.StreamLogServiceStub) -> None:
    append(stub, "s", *[b"%d" % i for i in range(10)])
    newest = stub.Read(pb.ReadRequest(stream="s", offset=2**62, count=3, reverse=True))
    assert [e.offset for e in newest.entries] == [9, 8, 7]
    assert newest.next_offset == 6
    rest = stub.Read(pb.ReadRequest(stream="s", offset=newest.next_offset, count=100, reverse=True))
    assert [e.offset for e in rest.entries] == list(range(6, -1, -1))
    assert rest.next_offset == -1


def test_read_past_the_end_is_empty_and_continues_there(stub: pb_grpc.StreamLogServiceStub) -> None:
    append(stub, "s", b"a", b"b")
    reply = stub.Read(pb.ReadRequest(stream="s", offset=5))
    assert list(reply.entries) == []
    assert (reply.next_offset, reply.end_offset) == (5, 2)


def test_read_of_evicted_offsets_reports_the_gap(stub: pb_grpc.StreamLogServiceStub) -> None:
    append(stub, "s", *[b"%d" % i for i in range(40)])
    trimmed = stub.Trim(pb.TrimRequest(stream="s", trim_to_offset=25))
    assert trimmed.first_offset == 25
    reply = stub.Read(pb.ReadRequest(stream="s", offset=10, count=5))
    assert (reply.gap.start_offset, reply.gap.end_offset, reply.gap.reason) == (10, 25, pb.GAP_REASON_EVICTED)
    assert [e.offset for e in reply.entries] == [25, 26, 27, 28, 29]
    assert reply.first_offset == 25 and reply.next_offset == 30


def test_trim_modes(stub: pb_grpc.StreamLogServiceStub, server: ServerThread) -> None:
    node = server.settings.node_entries
    for _ in range(7):  # one full macro node per batch: nodes [0,16), [16,32), ... [96,112)
        append(stub, "s", *[b"x"] * node)
    # Eviction is by whole nodes: offset 20 lies in [16,32), so only [0,16) goes.
    assert stub.Trim(pb.TrimRequest(stream="s", evict_up_to_offset=20)).first_offset == node
    # Keep at least 40 of 112: the node starting at 64 leaves 48; the next would leave 32.
    assert stub.Trim(pb.TrimRequest(stream="s", keep_last=40)).first_offset == 64
    assert stub.Trim(pb.TrimRequest(stream="s", trim_to_offset=111)).first_offset == 111
    assert stub.Trim(pb.TrimRequest(stream="s", trim_to_offset=112)).first_offset == 112
    assert list(stub.Read(pb.ReadRequest(stream="s", offset=0)).entries) == []


def test_blocking_read_wakes_on_append(stub: pb_grpc.StreamLogServiceStub) -> None:
    append(stub, "s", b"old")
    future = stub.Read.future(pb.ReadRequest(stream="s", offset=1, block_ms=5000), timeout=10)
    time.sleep(0.2)
    assert not future.done()
    started = time.monotonic()
    append(stub, "s", b"new")
    reply = future.result(timeout=5)
    assert payloads_of(reply) == [b"new"]
    assert time.monotonic() - started < 2


def test_blocking_read_waits_for_the_stream_to_exist(stub: pb_grpc.StreamLogServiceStub) -> None:
    future = stub.Read.future(pb.ReadRequest(stream="later", offset=0, block_ms=5000), timeout=10)
    time.sleep(0.2)
    append(stub, "later", b"hello")
    assert payloads_of(future.result(timeout=5)) == [b"hello"]


def test_blocking_read_for_a_far_offset_ignores_earlier_appends(stub: pb_grpc.StreamLogServiceStub) -> None:
    # RCP 11: a reader may skip N entries by blocking on old_offset + N.
    future = stub.Read.future(pb.ReadRequest(stream="s", offset=3, block_ms=5000), timeout=10)
    append(stub, "s", b"0", b"1")
    append(stub, "s", b"2")
    time.sleep(0.2)
    assert not future.done()
    append(stub, "s", b"3", b"4")
    assert payloads_of(future.result(timeout=5)) == [b"3", b"4"]


def test_blocking_read_times_out_empty(stub: pb_grpc.StreamLogServiceStub) -> None:
    append(stub, "s", b"a")
    started = time.monotonic()
    # No deadline on this call: block_ms alone bounds the wait.
    reply = stub.Read(pb.ReadRequest(stream="s", offset=1, block_ms=300))
    elapsed = time.monotonic() - started
    assert list(reply.entries) == [] and reply.next_offset == 1
    assert 0.25 <= elapsed < 2


def test_blocking_read_returns_before_the_deadline(stub: pb_grpc.StreamLogServiceStub) -> None:
    started = time.monotonic()
    # The server answers a tenth of the time left before the deadline: here at ~1.35 s.
    reply = stub.Read(pb.ReadRequest(stream="s", offset=0, block_ms=10_000), timeout=1.5)
    elapsed = time.monotonic() - started
    assert list(reply.entries) == []
    assert 1.2 <= elapsed < 1.5


def test_blocking_read_of_a_deleted_stream_ends_not_found(stub: pb_grpc.StreamLogServiceStub) -> None:
    append(stub, "s", b"a")
    future = stub.Read.future(pb.ReadRequest(stream="s", offset=1, block_ms=5000), timeout=10)
    time.sleep(0.2)
    stub.DeleteStream(pb.DeleteStreamRequest(stream="s"))
    with pytest.raises(grpc.RpcError) as caught:
        future.result(timeout=5)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_appends_to_an_always_fsync_stream_are_durable_and_wake_readers(
    stub: pb_grpc.StreamLogServiceStub,
) -> None:
    append(stub, "durable", b"0")
    config = pb.StreamConfig(fsync=pb.FSYNC_POLICY_ALWAYS)
    stub.SetStreamConfig(pb.SetStreamConfigRequest(stream="durable", config=config))
    future = stub.Read.future(pb.ReadRequest(stream="durable", offset=1, block_ms=5000), timeout=10)
    time.sleep(0.1)
    # Concurrent appends go through the thread pool and share fsyncs; all must land.
    results: list[int] = []
    threads = [
        threading.Thread(target=lambda: results.append(append(stub, "durable", b"x").first_offset))
        for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert sorted(results) == list(range(1, 9))
    assert len(future.result(timeout=5).entries) >= 1
    info = stub.GetStreamInfo(pb.GetStreamInfoRequest(stream="durable")).info
    assert info.next_offset == 9 and info.effective_fsync == pb.FSYNC_POLICY_ALWAYS


def _subscribe(stub: pb_grpc.StreamLogServiceStub, **fields: object) -> grpc.Call:
    return stub.Subscribe(pb.SubscribeRequest(**fields), timeout=20)


def test_subscribe_sends_history_then_follows_live(stub: pb_grpc.StreamLogServiceStub) -> None:
    for start in range(0, 450, 90):
        append(stub, "s", *[b"%d" % i for i in range(start, start + 90)])
    call = _subscribe(stub, stream="s", start=pb.START_POSITION_OLDEST, count=200)
    received: list[bytes] = []
    batches = 0
    for reply in call:
        batches += 1
        assert len(reply.entries) <= 200
        received += payloads_of(reply)
        if len(received) == 450:
            break
    assert batches >= 3
    for i in range(450, 455):
        append(stub, "s", b"%d" % i)
        reply = next(call)
        assert payloads_of(reply) == [b"%d" % i]
        assert reply.next_offset == i + 1 and reply.end_offset >= i + 1
    call.cancel()
    assert received == [b"%d" % i for i in range(450)]


def test_subscribe_first_reply_tells_the_start_at_once(stub: pb_grpc.StreamLogServiceStub) -> None:
    append(stub, "s", b"a", b"b", b"c")
    call = _subscribe(stub, stream="s", start=pb.START_POSITION_LATEST)
    first = next(call)
    assert list(first.entries) == [] and first.next_offset == 3 and first.end_offset == 3
    append(stub, "s", b"d")
    assert payloads_of(next(call)) == [b"d"]
    call.cancel()


def test_subscribe_from_offset_and_from_time(stub: pb_grpc.StreamLogServiceStub) -> None:
    append(stub, "s", b"a", b"b")
    time.sleep(0.01)
    mark_ms = int(time.time() * 1000) + 1
    time.sleep(0.01)
    append(stub, "s", b"c")
    by_offset = _subscribe(stub, stream="s", offset=1)
    assert payloads_of(next(by_offset)) == [b"b", b"c"]
    by_offset.cancel()
    by_time = _subscribe(stub, stream="s", start=pb.START_POSITION_TIMESTAMP, timestamp_ms=mark_ms)
    assert payloads_of(next(by_time)) == [b"c"]
    by_time.cancel()
    assert stub.SeekTime(pb.SeekTimeRequest(stream="s", timestamp_ms=mark_ms)).offset == 2


def test_subscribe_to_a_missing_stream_waits_for_it(stub: pb_grpc.StreamLogServiceStub) -> None:
    call = _subscribe(stub, stream="future", start=pb.START_POSITION_OLDEST)
    first = next(call)
    assert list(first.entries) == [] and first.next_offset == 0
    append(stub, "future", b"born")
    assert payloads_of(next(call)) == [b"born"]
    call.cancel()


def test_subscribe_reports_a_gap_when_it_lagged_behind_eviction(stub: pb_grpc.StreamLogServiceStub) -> None:
    append(stub, "s", *[b"%d" % i for i in range(30)])
    stub.Trim(pb.TrimRequest(stream="s", trim_to_offset=20))
    call = _subscribe(stub, stream="s", offset=5)
    reply = next(call)
    assert (reply.gap.start_offset, reply.gap.end_offset) == (5, 20)
    assert reply.entries[0].offset == 20
    call.cancel()


def test_subscription_ends_not_found_when_the_stream_is_deleted(stub: pb_grpc.StreamLogServiceStub) -> None:
    append(stub, "s", b"a")
    call = _subscribe(stub, stream="s")
    assert payloads_of(next(call)) == [b"a"]
    stub.DeleteStream(pb.DeleteStreamRequest(stream="s"))
    with pytest.raises(grpc.RpcError) as caught:
        next(call)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_cancelled_subscriptions_are_released(
    stub: pb_grpc.StreamLogServiceStub, server: ServerThread
) -> None:
    calls = [_subscribe(stub, stream="s", start=pb.START_POSITION_LATEST) for _ in range(5)]
    for call in calls:
        next(call)
    assert server.call(lambda: server.server.servicer.subscriptions) == 5
    for call in calls:
        call.cancel()
    deadline = time.monotonic() + 5
    while server.call(lambda: server.server.servicer.subscriptions) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.call(lambda: server.server.servicer.subscriptions) == 0


def test_subscription_limit_answers_resource_exhausted(start_server) -> None:
    server = start_server(max_subscriptions=2)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        calls = [_subscribe(stub, stream="s") for _ in range(2)]
        for call in calls:
            next(call)
        with pytest.raises(grpc.RpcError) as caught:
            next(_subscribe(stub, stream="s"))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_subscriptions=2" in caught.value.details()
        for call in calls:
            call.cancel()


def test_admin_rpcs(stub: pb_grpc.StreamLogServiceStub) -> None:
    for name in ("b", "a", "c/d", "ä", "a2"):
        append(stub, name, b"x", b"y")
    listed: list[str] = []
    token = ""
    for _ in range(10):  # bounded; default page size is 3 in these tests
        page = stub.ListStreams(pb.ListStreamsRequest(page_token=token))
        listed += page.streams
        token = page.next_page_token
        if not token:
            break
    assert listed == ["a", "a2", "b", "c/d", "ä"]
    assert list(stub.ListStreams(pb.ListStreamsRequest(prefix="a")).streams) == ["a", "a2"]
    assert list(stub.ListStreams(pb.ListStreamsRequest(prefix="zz")).streams) == []

    info = stub.GetStreamInfo(pb.GetStreamInfoRequest(stream="c/d")).info
    assert (info.name, info.first_offset, info.next_offset, info.entries, info.entries_added) == (
        "c/d",
        0,
        2,
        2,
        2,
    )
    assert info.segments >= 1 and info.bytes_on_disk > 0 and info.last_timestamp_ms > 0
    assert info.effective_fsync == pb.FSYNC_POLICY_EVERYSEC

    config = pb.StreamConfig(max_entries=1000, max_age_ms=60_000, compaction=True, fsync=pb.FSYNC_POLICY_NO)
    set_reply = stub.SetStreamConfig(pb.SetStreamConfigRequest(stream="c/d", config=config))
    assert set_reply.config.max_entries == 1000 and not set_reply.config.HasField("max_bytes")
    assert set_reply.config.tombstone_retention_ms == 86_400_000
    info = stub.GetStreamInfo(pb.GetStreamInfoRequest(stream="c/d")).info
    assert info.config == set_reply.config and info.effective_fsync == pb.FSYNC_POLICY_NO

    assert stub.CountRange(pb.CountRangeRequest(stream="a", start_offset=0)).count == 2
    assert stub.CountRange(pb.CountRangeRequest(stream="a", start_offset=1, end_offset=2)).count == 1

    stub.DeleteStream(pb.DeleteStreamRequest(stream="b"))
    assert "b" not in stub.ListStreams(pb.ListStreamsRequest(page_size=100)).streams
    assert append(stub, "b", b"new").first_offset == 0  # a new stream, from offset 0


def test_ack_of_a_group_that_does_not_exist_is_not_found(stub: pb_grpc.StreamLogServiceStub) -> None:
    append(stub, "s", b"a")
    with pytest.raises(grpc.RpcError) as caught:
        stub.Ack(pb.AckRequest(stream="s", group="g", offsets=[0]))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert "group 'g'" in caught.value.details()


def test_health_reports_serving(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "streamlog.v1.StreamLogService"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_shutdown_drains(start_server) -> None:
    """Stopping: health NOT_SERVING, subscriptions end UNAVAILABLE, blocked reads return empty."""
    server = start_server(shutdown_grace_ms=3000)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=20)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        append(stub, "s", b"a")
        subscription = _subscribe(stub, stream="s")
        assert payloads_of(next(subscription)) == [b"a"]
        blocked = stub.Read.future(pb.ReadRequest(stream="s", offset=1, block_ms=9000), timeout=20)
        time.sleep(0.2)

        stopper = threading.Thread(target=server.stop)
        started = time.monotonic()
        stopper.start()
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as caught:
            next(subscription)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "resubscribe from offset 1" in caught.value.details()
        assert list(blocked.result(timeout=5).entries) == []
        assert time.monotonic() - started < 2.5
        watch.cancel()
        stopper.join(15)
        assert not stopper.is_alive()


def test_data_survives_a_restart(start_server, tmp_path) -> None:
    data = tmp_path / "persist"
    first = start_server(data_dir=data)
    with grpc.insecure_channel(first.target) as channel:
        append(pb_grpc.StreamLogServiceStub(channel), "s", *[b"%d" % i for i in range(100)])
    first.stop()
    second = start_server(data_dir=data)
    with grpc.insecure_channel(second.target) as channel:
        reply = pb_grpc.StreamLogServiceStub(channel).Read(pb.ReadRequest(stream="s", offset=0, count=500))
        assert payloads_of(reply) == [b"%d" % i for i in range(100)]


def test_aio_client_sees_the_same_bytes_as_the_engine(server: ServerThread) -> None:
    """The pass-through reply parses into exactly what the engine stored."""

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = pb_grpc.StreamLogServiceStub(channel)
            entries = [pb.Entry(payload=b"p%d" % i, tag="t" * (i % 3)) for i in range(40)]
            await stub.Append(pb.AppendRequest(stream="s", entries=entries))
            reply = await stub.Read(pb.ReadRequest(stream="s", offset=0, count=40))
            stored = server.server.engine.read("s", 0, 40).entries()
            assert [(e.offset, e.tag, e.payload) for e in reply.entries] == [
                (s.offset, s.tag, s.payload) for s in stored
            ]

    asyncio.run(scenario())


def test_payloads_form_appends_plain_entries(stub: pb_grpc.StreamLogServiceStub) -> None:
    payloads = [b"a", b"", b"c" * 1000]
    reply = stub.Append(pb.AppendRequest(stream="fast", payloads=payloads), timeout=10)
    assert (reply.first_offset, reply.last_offset) == (0, 2)
    read = stub.Read(pb.ReadRequest(stream="fast", offset=0, count=10), timeout=10)
    assert [(e.offset, e.payload, e.tag) for e in read.entries] == [
        (0, b"a", ""),
        (1, b"", ""),
        (2, b"c" * 1000, ""),
    ]


def test_payloads_and_entries_together_are_refused(stub: pb_grpc.StreamLogServiceStub) -> None:
    request = pb.AppendRequest(stream="fast", entries=[pb.Entry(payload=b"x")], payloads=[b"y"])
    with pytest.raises(grpc.RpcError) as refused:
        stub.Append(request, timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not both" in refused.value.details()
    with pytest.raises(grpc.RpcError) as missing:
        stub.Read(pb.ReadRequest(stream="fast", offset=0), timeout=10)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND  # nothing was written


def test_idempotent_append_retry_writes_nothing(stub: pb_grpc.StreamLogServiceStub) -> None:
    request = pb.AppendRequest(
        stream="idem", payloads=[b"a", b"b"], producer_id="writer-1", producer_sequence=4
    )
    first = stub.Append(request, timeout=10)
    again = stub.Append(request, timeout=10)
    assert (first.first_offset, first.last_offset, first.duplicate) == (0, 1, False)
    assert (again.first_offset, again.last_offset, again.duplicate) == (0, 1, True)
    entries = stub.Read(pb.ReadRequest(stream="idem", offset=0, count=10), timeout=10).entries
    assert [e.payload for e in entries] == [b"a", b"b"]
    assert (entries[-1].producer_id, entries[-1].producer_sequence) == ("writer-1", 4)
    with pytest.raises(grpc.RpcError) as bad:
        stub.Append(pb.AppendRequest(stream="idem", payloads=[b"c"], producer_id="w", producer_sequence=-1))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_conditional_append_reports_the_actual_next_offset(stub: pb_grpc.StreamLogServiceStub) -> None:
    assert (
        stub.Append(pb.AppendRequest(stream="cas", payloads=[b"a"], expected_next_offset=0)).first_offset == 0
    )
    with pytest.raises(grpc.RpcError) as moved:
        stub.Append(pb.AppendRequest(stream="cas", payloads=[b"b"], expected_next_offset=0), timeout=10)
    assert moved.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "next offset is 1" in moved.value.details()
    assert dict(moved.value.trailing_metadata())["streamlog-next-offset"] == "1"
    assert (
        stub.Append(pb.AppendRequest(stream="cas", payloads=[b"b"], expected_next_offset=1)).first_offset == 1
    )


@pytest.mark.parametrize("small_streams", ["slots", "off"])
def test_a_subscription_and_a_blocked_read_are_woken_on_a_stream_the_cache_closed(
    start_server, small_streams: str
) -> None:
    server = start_server(max_open_streams=2, small_streams=small_streams)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        append(stub, "room", b"hello")
        call = _subscribe(stub, stream="room", start=pb.START_POSITION_OLDEST, count=10)
        assert payloads_of(next(call)) == [b"hello"]
        blocked = stub.Read.future(
            pb.ReadRequest(stream="room", offset=1, count=10, block_ms=10_000), timeout=20
        )
        for name in ("a", "b", "c", "d"):  # the cache closes "room" (its waiters hold its name)
            append(stub, name, b"x")
        assert server.call(lambda: server.server.engine.open_streams()) <= 3
        assert not server.call(lambda: server.server.engine.is_open("room"))
        if small_streams == "off":  # under everysec the next maintenance round syncs it and writes its marker
            segment = stream_directory(server.settings.data_dir, "room") / segment_name(0)
            deadline = time.monotonic() + 10
            while marker_in(FileSystem(), segment) is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert marker_in(FileSystem(), segment) is not None
        append(stub, "room", b"again")
        assert payloads_of(next(call)) == [b"again"]
        assert payloads_of(blocked.result(timeout=20)) == [b"again"]
        call.cancel()
