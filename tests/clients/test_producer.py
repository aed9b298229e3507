"""Producer against a real server: batching, linger, flush, close, errors, retries that never duplicate."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from clients import Client, Producer, ProducerClosedError, Record, ResourceExhaustedError, UnavailableError
from tests.service.helpers import ServerThread


def _payloads(client: Client, stream: str) -> list[bytes]:
    return [e.payload for e in client.read(stream, 0, count=500)]


def test_entries_are_batched_in_order_and_get_their_offsets(client: Client) -> None:
    # A linger longer than the test: a batch goes when it is full, the rest when the block ends
    # (a short linger could send a batch early on a loaded machine).
    with Producer(client, "s", max_batch_entries=100, linger_ms=60_000) as producer:
        futures = [producer.send(b"%d" % i) for i in range(250)]
    assert [f.result(0) for f in futures] == list(range(250))
    # 250 entries in batches of at most 100: three appends.
    assert producer.batches_sent == 3
    assert _payloads(client, "s") == [b"%d" % i for i in range(250)]


def test_max_batch_bytes_splits_batches(client: Client) -> None:
    with Producer(client, "s", max_batch_bytes=2500, linger_ms=60_000) as producer:
        futures = [producer.send(b"x" * 1000) for _ in range(6)]
    assert [f.result(0) for f in futures] == list(range(6))
    assert producer.batches_sent == 3


def test_linger_waits_for_more_entries_and_flush_cuts_it_short(client: Client) -> None:
    with Producer(client, "s", linger_ms=60_000) as producer:
        future = producer.send(b"one")
        time.sleep(0.2)
        assert not future.done()  # lingering for company
        started = time.monotonic()
        producer.flush(timeout=10)
        assert future.result(0) == 0
        assert time.monotonic() - started < 5


def test_tags_headers_and_records(client: Client) -> None:
    with Producer(client, "s", linger_ms=1) as producer:
        producer.send(b"a", tag="k1", headers={"h": b"v"})
        producer.send(Record(b"b", tag="k2"))
        producer.send(b"c")
    assert [(e.payload, e.tag, e.headers) for e in client.read("s", 0)] == [
        (b"a", "k1", {"h": b"v"}),
        (b"b", "k2", {}),
        (b"c", "", {}),
    ]


def test_sends_from_many_threads_keep_each_threads_order(client: Client) -> None:
    results: dict[int, list[int]] = {}

    def work(producer: Producer, thread: int) -> None:
        futures = [producer.send(b"%d-%d" % (thread, i)) for i in range(100)]
        results[thread] = [f.result(20) for f in futures]

    with Producer(client, "s", max_batch_entries=50, linger_ms=2, max_buffered=60) as producer:
        threads = [threading.Thread(target=work, args=(producer, t)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    offsets = [o for t in range(4) for o in results[t]]
    assert sorted(offsets) == list(range(400))
    assert all(results[t] == sorted(results[t]) for t in range(4))


def test_a_refused_batch_fails_its_futures_and_the_producer_goes_on(client: Client) -> None:
    # The test server's max_entry_bytes is 4 KiB.
    with Producer(client, "s", linger_ms=1) as producer:
        too_big = producer.send(b"x" * 5000)
        producer.flush(timeout=10)
        fine = producer.send(b"ok")
    with pytest.raises(ResourceExhaustedError, match="max_entry_bytes"):
        too_big.result(0)
    assert fine.result(0) == 0
    assert producer.retries == 0  # not a transient error


def test_send_after_close_is_refused(client: Client) -> None:
    producer = Producer(client, "s")
    future = producer.send(b"last")
    producer.close()
    assert future.result(0) == 0  # close flushed it
    with pytest.raises(ProducerClosedError):
        producer.send(b"too late")


class _LostReply(grpc.RpcError):
    """What a client sees when the connection drops after the server has written the batch."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "connection lost (test)"

    def trailing_metadata(self) -> tuple:
        return ()


class DropAnswers(grpc.StreamStreamClientInterceptor):
    """Lets the first `count` Publish sessions reach the server, then loses each one's answers
    (the connection drops after the server has written the first message), and records every
    message sent."""

    def __init__(self, count: int) -> None:
        self.remaining = count
        self.requests: list[Any] = []

    def intercept_stream_stream(self, continuation: Callable, details: Any, request_iterator: Any) -> Any:
        def recorded() -> Any:
            for request in request_iterator:
                self.requests.append(request)
                yield request

        call = continuation(details, recorded())
        if not details.method.endswith("/Publish") or not self.remaining:
            return call
        self.remaining -= 1
        return _LosingCall(call)


class _LosingCall:
    def __init__(self, call: Any) -> None:
        self._call = call

    def __iter__(self) -> _LosingCall:
        return self

    def __next__(self) -> Any:
        next(self._call)  # the server has answered: the message is written
        self._call.cancel()
        raise _LostReply()

    def cancel(self) -> None:
        self._call.cancel()


def test_a_resend_after_lost_answers_writes_nothing_twice(server: ServerThread) -> None:
    interceptor = DropAnswers(count=2)
    channel = grpc.intercept_channel(grpc.insecure_channel(server.target), interceptor)
    try:
        client = Client(channel=channel, timeout=10)
        # A long linger: the five entries go as one batch, when flush() asks.
        with Producer(client, "s", linger_ms=10_000, initial_backoff_s=0.01) as producer:
            futures = [producer.send(b"%d" % i) for i in range(5)]
            producer.flush(timeout=10)
            later = producer.send(b"after")
        assert [f.result(0) for f in futures] == [0, 1, 2, 3, 4]
        assert later.result(0) == 5
        # Two sessions lost their answers: the batch was resent twice, on new sessions, and the
        # second resend was answered as a duplicate of the first attempt.
        assert producer.retries == 2 and producer.duplicates == 1
        first, *resends = [
            r for r in interceptor.requests if list(r.payloads) == [b"%d" % i for i in range(5)]
        ]
        assert len(resends) == 2
        assert {(r.producer_id, r.producer_sequence) for r in resends} == {
            (first.producer_id, first.producer_sequence)
        }
        assert first.producer_id == producer.producer_id
        with Client(server.target) as plain:
            assert _payloads(plain, "s") == [b"0", b"1", b"2", b"3", b"4", b"after"]
    finally:
        channel.close()


def test_batches_are_pipelined_on_one_session(client: Client) -> None:
    with Producer(client, "s", max_batch_entries=1, linger_ms=0, max_in_flight=8) as producer:
        futures = [producer.send(b"%d" % i) for i in range(200)]
        assert [f.result(10) for f in futures] == list(range(200))
    assert producer.batches_sent == 200 and producer.retries == 0
    with pytest.raises(ValueError, match="dedup window"):
        Producer(client, "s", max_in_flight=33)


def test_retries_ride_out_a_server_restart(start_server: Callable[..., ServerThread], tmp_path) -> None:
    data = tmp_path / "restart"
    first = start_server(data)
    port = first.server.port
    # Reconnect soon after the server is back, not after gRPC's default backoff of seconds.
    fast_reconnect = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.max_reconnect_backoff_ms", 200)]
    with Client(first.target, timeout=5, options=fast_reconnect) as client:
        producer = Producer(client, "s", linger_ms=1, initial_backoff_s=0.02, max_backoff_s=0.2)
        try:
            assert producer.send(b"before").result(10) == 0
            first.stop()
            pending = [producer.send(b"during-%d" % i) for i in range(3)]
            time.sleep(0.5)
            assert not any(f.done() for f in pending)
            assert producer.retries > 0
            start_server(data, port=port)
            assert [f.result(20) for f in pending] == [1, 2, 3]
        finally:
            producer.close(timeout=20)
        assert _payloads(client, "s") == [b"before", b"during-0", b"during-1", b"during-2"]


def test_a_delivery_timeout_fails_the_batch(start_server: Callable[..., ServerThread]) -> None:
    server = start_server()
    target = server.target
    server.stop()
    with Client(target, timeout=1) as client:
        producer = Producer(client, "s", delivery_timeout_s=0.5, initial_backoff_s=0.05, linger_ms=1)
        future = producer.send(b"nowhere")
        with pytest.raises(UnavailableError):
            future.result(10)
        producer.close(timeout=5)


class CountCalls(grpc.UnaryUnaryClientInterceptor):
    """Counts unary calls by method; loses the answer of the first `lose` AppendMany calls (the
    server has written their batches: the connection drops afterwards)."""

    def __init__(self, lose: int = 0) -> None:
        self.calls: list[str] = []
        self.lose = lose

    def intercept_unary_unary(self, continuation: Callable, details: Any, request: Any) -> Any:
        method = details.method.rsplit("/", 1)[-1]
        self.calls.append(method)
        outcome = continuation(details, request)
        if method == "AppendMany" and self.lose:
            self.lose -= 1
            outcome.result()  # written
            raise _LostReply()
        return outcome


def _counting_client(server: ServerThread, interceptor: CountCalls) -> tuple[Client, grpc.Channel]:
    channel = grpc.intercept_channel(grpc.insecure_channel(server.target), interceptor)
    return Client(channel=channel, timeout=10), channel


def test_entries_for_several_streams_go_as_one_append_many_in_order(server: ServerThread) -> None:
    interceptor = CountCalls()
    client, channel = _counting_client(server, interceptor)
    try:
        with Producer(client, linger_ms=10_000) as producer:
            futures = [producer.send(b"%d" % i, stream=f"device-{i % 3}") for i in range(9)]
            producer.flush(timeout=10)
        assert [f.result(0) for f in futures] == [i // 3 for i in range(9)]
        assert interceptor.calls == ["AppendMany"]  # one call for the three streams' batches
        assert producer.batches_sent == 3
        assert _payloads(client, "device-1") == [b"1", b"4", b"7"]
        with pytest.raises(ValueError, match="name a stream"):
            Producer(client).send(b"where to?")
    finally:
        channel.close()


def test_a_batch_for_several_streams_waits_for_the_sessions_answers_before_it(client: Client) -> None:
    # Small batches at once: those of "s" alone go on the session, those mixing streams by AppendMany.
    with Producer(client, "s", max_batch_entries=10, linger_ms=0, max_in_flight=8) as producer:
        pipelined = [producer.send(b"p%d" % i) for i in range(30)]
        mixed = [producer.send(b"m%d" % i, stream="s" if i % 2 else "other") for i in range(10)]
        producer.flush(timeout=10)
    assert [f.result(0) for f in pipelined] == list(range(30))
    assert [f.result(0) for f in mixed[1::2]] == list(range(30, 35))
    expected = [b"p%d" % i for i in range(30)] + [b"m%d" % i for i in (1, 3, 5, 7, 9)]
    assert _payloads(client, "s") == expected


def test_a_refused_stream_batch_fails_only_its_entries(client: Client) -> None:
    with Producer(client, linger_ms=10_000) as producer:
        fine = producer.send(b"ok", stream="a")
        too_big = producer.send(b"x" * 5000, stream="b")  # past the test server's max_entry_bytes
        producer.flush(timeout=10)
    assert fine.result(0) == 0
    with pytest.raises(ResourceExhaustedError, match="max_entry_bytes"):
        too_big.result(0)
    assert producer.retries == 0


def test_an_append_many_whose_answer_is_lost_is_resent_and_written_once(server: ServerThread) -> None:
    interceptor = CountCalls(lose=1)
    client, channel = _counting_client(server, interceptor)
    try:
        with Producer(client, linger_ms=10_000, initial_backoff_s=0.01) as producer:
            futures = [producer.send(b"%d" % i, stream=f"t{i % 2}") for i in range(4)]
            producer.flush(timeout=10)
        assert [f.result(0) for f in futures] == [0, 0, 1, 1]
        assert interceptor.calls == ["AppendMany", "AppendMany"]
        assert producer.retries == 1 and producer.duplicates == 2
        assert _payloads(client, "t0") == [b"0", b"2"] and _payloads(client, "t1") == [b"1", b"3"]
    finally:
        channel.close()
