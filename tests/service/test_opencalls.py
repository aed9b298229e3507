"""The server's registry of open calls, by stream (service/opencalls.py): what a cluster node ends
when it stops leading a stream."""

from __future__ import annotations

import threading
import time

import grpc
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from tests.service.helpers import ServerThread, append


def _open_on(server: ServerThread, stream: str) -> list[str]:
    calls = server.server.ops.open_calls
    return sorted(call.method for call in server.call(lambda: calls.on_stream(stream)))


def _until(condition, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_open_calls_are_found_by_stream_while_open_and_forgotten_when_they_end(
    server: ServerThread,
) -> None:
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        append(stub, "a", b"x")
        stub.CreateGroup(pb.CreateGroupRequest(stream="b", group="g", create_stream=True), timeout=5)
        subscriptions = [stub.Subscribe(pb.SubscribeRequest(stream="a"), timeout=30) for _ in range(2)]
        for subscription in subscriptions:
            next(subscription)  # open on the server
        done = threading.Event()

        def consume_requests():
            yield pb.ConsumeRequest(stream="b", group="g", consumer="c", batches=1)
            done.wait(30)  # the session stays open while its client's side does

        consume = stub.Consume(consume_requests(), timeout=30)
        read = stub.Read.future(pb.ReadRequest(stream="a", offset=1, block_ms=9_000), timeout=30)
        _until(lambda: _open_on(server, "a") == ["Read", "Subscribe", "Subscribe"])
        _until(lambda: _open_on(server, "b") == ["Consume"])
        assert _open_on(server, "c") == []

        subscriptions[0].cancel()
        _until(lambda: _open_on(server, "a") == ["Read", "Subscribe"])
        ended = threading.Event()
        read.add_done_callback(lambda _: ended.set())
        append(stub, "a", b"y")  # the blocking read answers
        assert ended.wait(10) and len(read.result().entries) == 1
        _until(lambda: _open_on(server, "a") == ["Subscribe"])
        subscriptions[1].cancel()
        consume.cancel()
        done.set()
        _until(lambda: _open_on(server, "a") == [] and _open_on(server, "b") == [])
        assert server.call(lambda: len(server.server.ops.open_calls)) == 0
