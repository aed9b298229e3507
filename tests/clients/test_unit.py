"""Client-side tests on grpcio-testing's fake channel: the requests Client builds and how it maps replies.

Each test starts a client call in a thread, takes the request off the fake channel,
checks it, answers it, and checks what the call returned or raised.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import grpc
import grpc_testing
import pytest
from streamlog.v1 import streamlog_pb2 as pb

from clients import (
    Client,
    DeadlineExceededError,
    Entry,
    FailedPreconditionError,
    Gap,
    GapError,
    InvalidArgumentError,
    NotFoundError,
    OffsetMismatchError,
    OutOfRangeError,
    Record,
    ResourceExhaustedError,
    StreamConfig,
    StreamlogError,
    TransientError,
    UnavailableError,
)
from clients._connection import call_timeout

SERVICE = pb.DESCRIPTOR.services_by_name["StreamLogService"]
OK = grpc.StatusCode.OK


class Fake:
    """A Client on a fake channel, and the means to answer its calls."""

    def __init__(self) -> None:
        self.channel = grpc_testing.channel([SERVICE], grpc_testing.strict_real_time())
        self.client = Client(channel=self.channel, token="s3cret", timeout=5)
        self.pool = ThreadPoolExecutor(2)

    def call(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        return self.pool.submit(function, *args, **kwargs)

    def unary(self, name: str) -> tuple[Any, Any, Any]:
        """(invocation metadata, request, rpc) of the next call of method `name`."""
        return self.channel.take_unary_unary(SERVICE.methods_by_name[name])

    def answer(
        self, name: str, reply: Any, code: grpc.StatusCode = OK, details: str = "", trailers=()
    ) -> Any:
        """Answer the next call of `name`; return its request."""
        _, request, rpc = self.unary(name)
        rpc.terminate(reply, trailers, code, details)
        return request


@pytest.fixture
def fake() -> Iterator[Fake]:
    f = Fake()
    yield f
    f.pool.shutdown(wait=False, cancel_futures=True)


# ------------------------------------------------------------------ append


def test_a_list_of_bytes_uses_the_payloads_fast_form_and_sends_the_token(fake: Fake) -> None:
    future = fake.call(fake.client.append, "orders", [b"a", bytearray(b"b"), b""])
    metadata, request, rpc = fake.unary("Append")
    rpc.terminate(pb.AppendResponse(first_offset=10, last_offset=12, timestamp_ms=99), (), OK, "")
    assert list(request.payloads) == [b"a", b"b", b""]
    assert not request.entries
    assert request.stream == "orders"
    assert not request.producer_id and not request.HasField("expected_next_offset")
    assert ("authorization", "Bearer s3cret") in metadata
    result = future.result(5)
    assert (result.first_offset, result.last_offset, result.timestamp_ms, result.duplicate) == (
        10,
        12,
        99,
        False,
    )
    assert result.count == 3 and list(result.offsets) == [10, 11, 12]


def test_one_bytes_value_is_one_entry(fake: Fake) -> None:
    future = fake.call(fake.client.append, "s", b"only")
    assert list(fake.answer("Append", pb.AppendResponse()).payloads) == [b"only"]
    future.result(5)


def test_records_use_entries_with_tags_headers_and_delivery_times(fake: Fake) -> None:
    batch = [b"plain", Record(b"keyed", tag="k", headers={"h": b"v"}, deliver_at_ms=5)]
    future = fake.call(fake.client.append, "s", batch)
    request = fake.answer("Append", pb.AppendResponse(first_offset=0, last_offset=1))
    assert not request.payloads
    assert [(e.payload, e.tag, dict(e.headers), e.deliver_at_ms) for e in request.entries] == [
        (b"plain", "", {}, 0),
        (b"keyed", "k", {"h": b"v"}, 5),
    ]
    future.result(5)


def test_entries_read_back_can_be_appended_again(fake: Fake) -> None:
    old = Entry(offset=7, timestamp_ms=1, payload=b"p", tag="t", headers={"a": b"b"})
    future = fake.call(fake.client.append, "copy", [old])
    (entry,) = fake.answer("Append", pb.AppendResponse()).entries
    # Offsets and times are the server's to give: they are not sent.
    assert (entry.offset, entry.timestamp_ms, entry.payload, entry.tag, dict(entry.headers)) == (
        0,
        0,
        b"p",
        "t",
        {"a": b"b"},
    )
    future.result(5)


def test_idempotent_and_conditional_fields(fake: Fake) -> None:
    future = fake.call(
        fake.client.append, "s", [b"x"], producer_id="p1", producer_sequence=42, expected_next_offset=0
    )
    request = fake.answer("Append", pb.AppendResponse(first_offset=3, last_offset=3, duplicate=True))
    assert (request.producer_id, request.producer_sequence) == ("p1", 42)
    assert request.HasField("expected_next_offset") and request.expected_next_offset == 0
    assert future.result(5).duplicate is True


@pytest.mark.parametrize(
    ("data", "kwargs", "error"),
    [
        ("text", {}, TypeError),
        ([], {}, ValueError),
        ([1, 2], {}, TypeError),
        ([b"x"], {"producer_id": "p"}, ValueError),
        ([b"x"], {"producer_sequence": 1}, ValueError),
    ],
)
def test_bad_append_arguments_fail_before_any_call(fake: Fake, data: Any, kwargs: dict, error: type) -> None:
    with pytest.raises(error):
        fake.client.append("s", data, **kwargs)


def test_a_failed_conditional_append_says_where_the_stream_is(fake: Fake) -> None:
    future = fake.call(fake.client.append, "s", [b"x"], expected_next_offset=3)
    fake.answer(
        "Append",
        pb.AppendResponse(),
        grpc.StatusCode.FAILED_PRECONDITION,
        "expected_next_offset 3, stream is at 7",
        trailers=(("streamlog-next-offset", "7"),),
    )
    with pytest.raises(OffsetMismatchError) as caught:
        future.result(5)
    assert caught.value.next_offset == 7
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "stream is at 7" in caught.value.details
    assert isinstance(caught.value.__cause__, grpc.RpcError)


def test_failed_precondition_without_the_trailer_is_not_an_offset_mismatch(fake: Fake) -> None:
    future = fake.call(fake.client.append, "s", [b"x"], producer_id="p", producer_sequence=1)
    fake.answer("Append", pb.AppendResponse(), grpc.StatusCode.FAILED_PRECONDITION, "sequence too old")
    with pytest.raises(FailedPreconditionError) as caught:
        future.result(5)
    assert not isinstance(caught.value, OffsetMismatchError)


@pytest.mark.parametrize(
    ("code", "error", "retryable"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgumentError, False),
        (grpc.StatusCode.NOT_FOUND, NotFoundError, False),
        (grpc.StatusCode.OUT_OF_RANGE, OutOfRangeError, False),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhaustedError, False),
        (grpc.StatusCode.UNAVAILABLE, UnavailableError, True),
        (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceededError, True),
        (grpc.StatusCode.INTERNAL, StreamlogError, False),
    ],
)
def test_status_codes_map_to_exceptions(
    fake: Fake, code: grpc.StatusCode, error: type[StreamlogError], retryable: bool
) -> None:
    future = fake.call(fake.client.info, "s")
    fake.answer("GetStreamInfo", pb.GetStreamInfoResponse(), code, "why")
    with pytest.raises(StreamlogError) as caught:
        future.result(5)
    assert type(caught.value) is error
    assert caught.value.retryable is retryable
    assert isinstance(caught.value, TransientError) is retryable
    assert (caught.value.code, caught.value.details) == (code, "why")


# ------------------------------------------------------------------ reads


def test_read_request_and_result_with_a_gap(fake: Fake) -> None:
    future = fake.call(fake.client.read, "s", 5, count=10, max_bytes=1000)
    reply = pb.ReadResponse(
        entries=[pb.Entry(offset=8, timestamp_ms=3, tag="t", payload=b"p", headers={"h": b"1"})],
        first_offset=8,
        next_offset=9,
        end_offset=20,
        gap=pb.Gap(start_offset=5, end_offset=8, reason=pb.GAP_REASON_EVICTED),
    )
    request = fake.answer("Read", reply)
    assert (request.stream, request.offset, request.count, request.max_bytes) == ("s", 5, 10, 1000)
    assert (request.block_ms, request.reverse, request.group) == (0, False, "")
    result = future.result(5)
    assert result.entries == [Entry(8, 3, b"p", "t", {"h": b"1"})]
    assert result.gap == Gap(5, 8, "evicted") and result.gap.count == 3
    assert (result.first_offset, result.next_offset, result.end_offset, result.lag) == (8, 9, 20, 11)
    assert [e.offset for e in result] == [8] and len(result) == 1


def test_read_without_a_gap_and_reverse(fake: Fake) -> None:
    future = fake.call(fake.client.read, "s", 2**63 - 1, reverse=True, count=2)
    request = fake.answer("Read", pb.ReadResponse(next_offset=-1))
    assert request.reverse and request.offset == 2**63 - 1
    assert future.result(5).gap is None


def test_timeouts_default_to_the_clients_plus_the_blocking_time() -> None:
    assert call_timeout(30.0, None) == 30.0
    assert call_timeout(30.0, None, block_ms=5000) == 35.0
    assert call_timeout(30.0, 2.0, block_ms=5000) == 2.0
    assert call_timeout(None, None, block_ms=5000) is None


def _subscribe(fake: Fake, *args: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
    """Open a subscription; return it, its request and its fake rpc."""
    future = fake.call(fake.client.subscribe, "s", *args, **kwargs)
    _, request, rpc = fake.channel.take_unary_stream(SERVICE.methods_by_name["Subscribe"])
    return future.result(5), request, rpc


@pytest.mark.parametrize(
    ("args", "kwargs", "fields"),
    [
        ((), {}, {"start": pb.START_POSITION_OLDEST}),
        (("latest",), {}, {"start": pb.START_POSITION_LATEST}),
        ((17,), {}, {"start": pb.START_POSITION_OFFSET, "offset": 17}),
        ((), {"timestamp_ms": 1234}, {"start": pb.START_POSITION_TIMESTAMP, "timestamp_ms": 1234}),
    ],
)
def test_subscribe_start_positions(fake: Fake, args: tuple, kwargs: dict, fields: dict) -> None:
    subscription, request, rpc = _subscribe(fake, *args, **kwargs)
    for name, value in fields.items():
        assert getattr(request, name) == value
    rpc.terminate((), OK, "")
    assert list(subscription) == []


@pytest.mark.parametrize("start", ["newest", 1.5, None, True])
def test_subscribe_refuses_unknown_starts(fake: Fake, start: Any) -> None:
    with pytest.raises((ValueError, TypeError)):
        fake.client.subscribe("s", start)


def test_subscription_batches_track_next_offset_and_expose_gaps(fake: Fake) -> None:
    subscription, _, rpc = _subscribe(fake, 0)
    rpc.send_response(pb.SubscribeResponse(next_offset=0, end_offset=0))
    rpc.send_response(
        pb.SubscribeResponse(
            entries=[pb.Entry(offset=4, payload=b"x")],
            next_offset=5,
            end_offset=5,
            gap=pb.Gap(start_offset=0, end_offset=4, reason=pb.GAP_REASON_COMPACTED),
        )
    )
    first = next(subscription)
    assert first.entries == [] and subscription.next_offset == 0
    second = next(subscription)
    assert second.gap == Gap(0, 4, "compacted") and subscription.next_offset == 5
    rpc.terminate((), grpc.StatusCode.NOT_FOUND, "stream 's' was deleted")
    with pytest.raises(NotFoundError):
        next(subscription)


def test_subscription_entries_raise_on_a_gap_unless_told_what_to_do(fake: Fake) -> None:
    gap_reply = pb.SubscribeResponse(
        entries=[pb.Entry(offset=3, payload=b"c")],
        next_offset=4,
        gap=pb.Gap(start_offset=0, end_offset=3, reason=pb.GAP_REASON_EVICTED),
    )
    subscription, _, rpc = _subscribe(fake, 0)
    rpc.send_response(gap_reply)
    rpc.terminate((), OK, "")
    with pytest.raises(GapError) as caught:
        list(subscription.entries())
    assert caught.value.gap == Gap(0, 3, "evicted")

    subscription, _, rpc = _subscribe(fake, 0)
    rpc.send_response(gap_reply)
    rpc.send_response(pb.SubscribeResponse(entries=[pb.Entry(offset=4, payload=b"d")], next_offset=5))
    rpc.terminate((), OK, "")
    gaps: list[Gap] = []
    assert [e.payload for e in subscription.entries(on_gap=gaps.append)] == [b"c", b"d"]
    assert gaps == [Gap(0, 3, "evicted")]


# ------------------------------------------------------------------ admin


def test_list_streams_follows_every_page(fake: Fake) -> None:
    future = fake.call(fake.client.list_streams, "a", page_size=2)
    first = fake.answer("ListStreams", pb.ListStreamsResponse(streams=["a1", "a2"], next_page_token="t1"))
    second = fake.answer("ListStreams", pb.ListStreamsResponse(streams=["a3"]))
    assert (first.prefix, first.page_size, first.page_token) == ("a", 2, "")
    assert (second.prefix, second.page_token) == ("a", "t1")
    assert future.result(5) == ["a1", "a2", "a3"]


@pytest.mark.parametrize(
    ("kwargs", "field", "value"),
    [
        ({"to_offset": 5}, "trim_to_offset", 5),
        ({"keep_last": 0}, "keep_last", 0),
        ({"evict_up_to": 9}, "evict_up_to_offset", 9),
    ],
)
def test_trim_modes(fake: Fake, kwargs: dict, field: str, value: int) -> None:
    future = fake.call(fake.client.trim, "s", **kwargs)
    request = fake.answer("Trim", pb.TrimResponse(first_offset=4))
    assert request.WhichOneof("mode") == field and getattr(request, field) == value
    assert future.result(5) == 4


@pytest.mark.parametrize("kwargs", [{}, {"to_offset": 1, "keep_last": 2}])
def test_trim_needs_exactly_one_mode(fake: Fake, kwargs: dict) -> None:
    with pytest.raises(ValueError):
        fake.client.trim("s", **kwargs)


def test_set_config_sends_unset_limits_as_absent(fake: Fake) -> None:
    future = fake.call(fake.client.set_config, "s", StreamConfig(max_age_ms=1000, fsync="always"))
    reply = pb.SetStreamConfigResponse(config=pb.StreamConfig(max_age_ms=1000, fsync=pb.FSYNC_POLICY_ALWAYS))
    request = fake.answer("SetStreamConfig", reply)
    assert request.config.HasField("max_age_ms") and request.config.max_age_ms == 1000
    assert not request.config.HasField("max_entries") and not request.config.HasField("max_bytes")
    assert request.config.fsync == pb.FSYNC_POLICY_ALWAYS
    assert future.result(5) == StreamConfig(max_age_ms=1000, fsync="always")


def test_count_sends_an_open_end_as_absent(fake: Fake) -> None:
    future = fake.call(fake.client.count, "s", 10)
    request = fake.answer("CountRange", pb.CountRangeResponse(count=3))
    assert request.start_offset == 10 and not request.HasField("end_offset")
    assert future.result(5) == 3
    future = fake.call(fake.client.count, "s", 0, 0)
    request = fake.answer("CountRange", pb.CountRangeResponse(count=0))
    assert request.HasField("end_offset") and request.end_offset == 0
    future.result(5)


# ------------------------------------------------------------------ groups


def test_group_read_carries_acks_and_only_the_options_given(fake: Fake) -> None:
    future = fake.call(
        fake.client.read_group,
        "s",
        "g",
        "c",
        count=5,
        block_ms=100,
        ack=[1, 2],
        ack_ranges=[(10, 20)],
        retry_ms=0,
    )
    reply = pb.ReadResponse(
        entries=[pb.Entry(offset=30, payload=b"x"), pb.Entry(offset=31, payload=b"y")],
        delivery_counts=[1, 3],
        acknowledged=11,
        ack_unknown=1,
        pending_full=True,
    )
    request = fake.answer("Read", reply)
    assert (request.group, request.consumer, request.count, request.block_ms) == ("g", "c", 5, 100)
    assert list(request.ack_offsets) == [1, 2]
    assert [(r.start_offset, r.end_offset) for r in request.ack_ranges] == [(10, 20)]
    # retry_ms=0 is a value (redeliver at once), not "unset"; the others were not given.
    assert request.HasField("retry_ms") and request.retry_ms == 0
    assert not request.HasField("expire_ms") and not request.HasField("claim_idle_ms")
    result = future.result(5)
    assert [(e.offset, e.delivery_count) for e in result] == [(30, 1), (31, 3)]
    assert (result.acknowledged, result.ack_unknown, result.pending_full) == (11, 1, True)


def test_create_group_maps_start_config_and_the_reply(fake: Fake) -> None:
    from clients import GroupConfig

    config = GroupConfig(retry_ms=500, max_deliveries=3, dead_letter_stream="dlq")
    future = fake.call(fake.client.create_group, "s", "g", 7, config=config, create_stream=True)
    reply = pb.CreateGroupResponse(
        group=pb.GroupInfo(
            stream="s",
            name="g",
            config=pb.GroupConfig(retry_ms=500, max_deliveries=3, dead_letter_stream="dlq"),
            next_offset=7,
            entries_read=7,
            entries_added=9,
            pending=0,
            consumers=[pb.ConsumerInfo(name="c", pending=2, seen_ms=5)],
        )
    )
    request = fake.answer("CreateGroup", reply)
    assert (request.start, request.offset, request.create_stream) == (pb.START_POSITION_OFFSET, 7, True)
    assert request.config.retry_ms == 500 and not request.config.HasField("expire_ms")
    assert not request.HasField("entries_read")
    group = future.result(5)
    assert group.config == config
    assert (group.next_offset, group.lag, group.entries_added) == (7, None, 9)  # lag unset: unknown
    assert [(c.name, c.pending, c.active_ms) for c in group.consumers] == [("c", 2, None)]


def test_ack_ranges_accept_python_ranges(fake: Fake) -> None:
    future = fake.call(fake.client.ack, "s", "g", [4], ranges=[range(0, 3)])
    request = fake.answer("Ack", pb.AckResponse(acknowledged=4, unknown=0))
    assert list(request.offsets) == [4]
    assert [(r.start_offset, r.end_offset) for r in request.ranges] == [(0, 3)]
    assert future.result(5).acknowledged == 4
    with pytest.raises(ValueError):
        fake.client.ack("s", "g", ranges=[range(0, 10, 2)])


def test_pending_summary_and_rows(fake: Fake) -> None:
    future = fake.call(fake.client.pending, "s", "g", consumer="c", end_offset=50)
    reply = pb.GetPendingResponse(
        count=2,
        lowest_offset=3,
        highest_offset=9,
        consumers=[pb.ConsumerPending(consumer="c", pending=1)],
        released=1,
        entries=[pb.PendingEntry(offset=3, consumer="c", idle_ms=10, delivery_count=2, due_ms=99)],
    )
    request = fake.answer("GetPending", reply)
    assert request.consumer == "c" and request.HasField("end_offset") and request.end_offset == 50
    pending = future.result(5)
    assert (pending.count, pending.lowest_offset, pending.highest_offset, pending.released) == (2, 3, 9, 1)
    assert pending.consumers == {"c": 1}
    assert [(p.offset, p.consumer, p.idle_ms, p.delivery_count, p.due_ms) for p in pending.entries] == [
        (3, "c", 10, 2, 99)
    ]


def test_a_consume_session_asks_for_credit_and_carries_acknowledgements(fake: Fake) -> None:
    from clients import AckResult

    session = fake.client.consume("s", "g", "c", count=5, ahead=2, retry_ms=0)
    taking = fake.call(next, session)
    metadata, rpc = fake.channel.take_stream_stream(SERVICE.methods_by_name["Consume"])
    assert ("authorization", "Bearer s3cret") in metadata
    opening = rpc.take_request()
    assert (opening.stream, opening.group, opening.consumer, opening.count, opening.batches) == (
        "s",
        "g",
        "c",
        5,
        2,
    )
    assert opening.HasField("retry_ms") and opening.retry_ms == 0 and not opening.HasField("expire_ms")
    rpc.send_response(
        pb.ConsumeResponse(
            entries=[pb.Entry(offset=0, payload=b"a"), pb.Entry(offset=1, payload=b"b")],
            delivery_counts=[1, 2],
            first_offset=0,
            end_offset=9,
        )
    )
    batch = taking.result(5)
    assert [(e.offset, e.delivery_count) for e in batch] == [(0, 1), (1, 2)]
    assert (batch.end_offset, batch.acknowledged) == (9, 0)

    # Taking the next batch tops the credit up to `ahead`, with the acknowledgements made since.
    session.ack([0, 1, 5])
    taking = fake.call(next, session)
    request = rpc.take_request()
    assert (request.stream, request.batches, list(request.ack_offsets)) == ("", 1, [5])
    assert [(r.start_offset, r.end_offset) for r in request.ack_ranges] == [(0, 2)]
    rpc.send_response(pb.ConsumeResponse(entries=[pb.Entry(offset=2)], delivery_counts=[1], acknowledged=2))
    assert taking.result(5).acknowledged == 2

    # close(): what is queued, the half-close, the last reply's counts, OK.
    session.ack([2])
    closing = fake.call(session.close)
    request = rpc.take_request()
    assert (request.batches, list(request.ack_offsets)) == (0, [2])
    rpc.requests_closed()
    rpc.send_response(pb.ConsumeResponse(acknowledged=1))
    rpc.terminate((), OK, "")
    assert closing.result(5) == AckResult(3, 0) == session.result
    assert session.pending_acks() == ([], [])
