"""Publish: producer sessions on one bidirectional call, end to end against real servers.

Each test drives a session from a grpc.aio client on its own event loop (asyncio.run)
against a server on a loopback port; every wait is bounded by the call's deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from bench.common import free_port
from service import auth, limits
from tests.service.helpers import ServerThread
from tests.service.test_auth import ACL_TOML, TOKENS_TOML, bearer, write
from tests.service.test_metrics import scrape, value

TIMEOUT = 20


def message(stream: str, *payloads: bytes, request_id: int = 0, **fields: Any) -> pb.PublishRequest:
    return pb.PublishRequest(stream=stream, payloads=list(payloads), request_id=request_id, **fields)


async def publish_all(
    target: str, messages: Sequence[pb.PublishRequest], metadata: Sequence[tuple[str, str]] = ()
) -> list[pb.PublishResponse]:
    """Send every message without waiting, then half-close; the answers, in order."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        call = stub.Publish(iter(messages), timeout=TIMEOUT, metadata=tuple(metadata))
        return [answer async for answer in call]


def publish(
    server: ServerThread, messages: Sequence[pb.PublishRequest], **kwargs: Any
) -> list[pb.PublishResponse]:
    return asyncio.run(publish_all(server.target, messages, **kwargs))


def offsets(answers: Sequence[pb.PublishResponse]) -> list[tuple[int, int]]:
    return [(a.first_offset, a.last_offset) for a in answers]


def engine_of(server: ServerThread) -> Any:
    return server.server.engine


def test_messages_are_answered_in_order_with_their_offsets_and_request_ids(start_server):
    server = start_server()
    messages = [message("s", b"m%d" % i, request_id=100 + i) for i in range(50)]
    messages.append(
        pb.PublishRequest(stream="s", entries=[pb.Entry(payload=b"x", tag="t")] * 2, request_id=7)
    )
    messages.append(message("other", b"o", request_id=8))
    answers = publish(server, messages)
    assert [a.request_id for a in answers] == [100 + i for i in range(50)] + [7, 8]
    assert offsets(answers) == [(i, i) for i in range(50)] + [(50, 51), (0, 0)]
    assert not any(a.HasField("error") for a in answers)
    read = engine_of(server).read("s", 0, 100)
    assert [e.payload for e in read.entries()] == [b"m%d" % i for i in range(50)] + [b"x", b"x"]


def test_a_bad_message_gets_its_error_and_the_session_goes_on(start_server):
    server = start_server()
    messages = [
        message("s", b"a", request_id=1),
        message("", b"b", request_id=2),  # no stream name
        pb.PublishRequest(stream="s", request_id=3),  # no entries
        pb.PublishRequest(stream="s", payloads=[b"c"], entries=[pb.Entry(payload=b"c")], request_id=4),
        message("s", *[b"x"] * (server.settings.max_batch_entries + 1), request_id=5),
        message("s", b"big" * server.settings.max_entry_bytes, request_id=6),
        message("s", b"d", request_id=7, producer_id="p", producer_sequence=-1),
        message("s", b"e", request_id=8),
    ]
    answers = publish(server, messages)
    codes = [grpc.StatusCode.OK.value[0] if not a.HasField("error") else a.error.code for a in answers]
    assert codes == [
        grpc.StatusCode.OK.value[0],
        grpc.StatusCode.INVALID_ARGUMENT.value[0],
        grpc.StatusCode.INVALID_ARGUMENT.value[0],
        grpc.StatusCode.INVALID_ARGUMENT.value[0],
        grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
        grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
        grpc.StatusCode.INVALID_ARGUMENT.value[0],
        grpc.StatusCode.OK.value[0],
    ]
    assert "max_batch_entries" in answers[4].error.message
    assert "max_entry_bytes" in answers[5].error.message
    assert [a.request_id for a in answers] == list(range(1, 9))
    assert offsets([answers[0], answers[7]]) == [(0, 0), (1, 1)]
    assert [e.payload for e in engine_of(server).read("s", 0, 10).entries()] == [b"a", b"e"]


def test_resent_messages_of_an_idempotent_producer_are_answered_as_duplicates(start_server):
    server = start_server()
    first = [message("s", b"m%d" % i, producer_id="p1", producer_sequence=i, request_id=i) for i in range(5)]
    answers = publish(server, first[:3])  # a session that ended before the rest was sent
    assert offsets(answers) == [(0, 0), (1, 1), (2, 2)]
    # The producer reconnects and resends from its first message it holds no answer for (here: all
    # of them, as if the answers were lost with the connection).
    again = publish(server, first)
    assert [a.duplicate for a in again] == [True, True, True, False, False]
    assert offsets(again) == [(i, i) for i in range(5)]
    assert [e.payload for e in engine_of(server).read("s", 0, 10).entries()] == [b"m%d" % i for i in range(5)]


def test_messages_of_many_sessions_arriving_together_are_written_as_one_engine_write(start_server):
    server = start_server(fsync="always")
    engine = engine_of(server)
    engine.append("s", _batch(b"warm-up"))
    writes: list[int] = []
    real = engine.append_many

    def counted(name: str, appends: Any) -> Any:
        writes.append(len(appends))
        return real(name, appends)

    engine.append_many = counted
    sessions, per_session = 8, 25

    async def run() -> list[list[pb.PublishResponse]]:
        return await asyncio.gather(
            *(
                publish_all(server.target, [message("s", b"%d-%d" % (s, i)) for i in range(per_session)])
                for s in range(sessions)
            )
        )

    results = asyncio.run(run())
    written = sorted(a.first_offset for answers in results for a in answers)
    assert written == list(range(1, 1 + sessions * per_session))  # every message once, no holes
    for answers in results:  # each session's answers in its own order
        assert [a.first_offset for a in answers] == sorted(a.first_offset for a in answers)
    assert sum(writes) == sessions * per_session
    # Many messages per engine write (one sync each under "always"), not one write per message.
    assert len(writes) < sessions * per_session / 4, writes


def _batch(*payloads: bytes) -> Any:
    from storage import AppendBatch

    return AppendBatch(list(payloads))


def test_a_session_holds_no_more_than_its_bound_and_stops_reading_past_it(start_server):
    """Flow control: with the server's writes held back, a session takes max_publish_messages
    messages and reads no further until answers go out."""
    bound = 5
    server = start_server(fsync="always", max_publish_messages=bound)
    engine = engine_of(server)
    engine.append("s", _batch(b"warm-up"))  # so the first publish write is in a thread
    gate = __import__("threading").Event()
    real = engine.append_many

    def held(name: str, appends: Any) -> Any:
        gate.wait(TIMEOUT)
        return real(name, appends)

    engine.append_many = held

    async def run() -> tuple[int, list[pb.PublishResponse]]:
        sent = 0

        async def messages() -> AsyncIterator[pb.PublishRequest]:
            nonlocal sent
            for i in range(40):
                sent += 1
                yield message("s", b"x" * 100, request_id=i)

        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = pb_grpc.StreamLogServiceStub(channel)
            # A small window, so that the client's sends stop soon after the server stops reading.
            call = stub.Publish(messages(), timeout=TIMEOUT)
            # Wait until the server holds its bound of messages from this session.
            for _ in range(400):
                if _held_messages(server) >= bound:
                    break
                await asyncio.sleep(0.01)
            held_now = _held_messages(server)
            gate.set()
            answers = [a async for a in call]
            return held_now, answers

    held_now, answers = asyncio.run(run())
    assert held_now == bound
    assert [a.request_id for a in answers] == list(range(40))
    assert not any(a.HasField("error") for a in answers)


def _held_messages(server: ServerThread) -> int:
    def look() -> int:
        sessions = server.server._servicer._publish._sessions
        return max((len(s._held) for s in sessions), default=0)

    return server.call(look)


def test_each_message_needs_write_on_its_stream_and_a_refused_one_ends_nothing(start_server, tmp_path: Path):
    server = start_server(
        tokens_file=write(tmp_path / "tokens.toml", TOKENS_TOML),
        acl_file=write(tmp_path / "acl.toml", ACL_TOML),
    )
    messages = [
        message("s1", b"a", request_id=1),
        message("x", b"b", request_id=2),
        message("s2", b"c", request_id=3),
    ]
    answers = publish(server, messages, metadata=bearer("writer"))  # may write s*, not x
    assert [a.error.code for a in answers] == [0, grpc.StatusCode.PERMISSION_DENIED.value[0], 0]
    assert "may not Publish on stream 'x'" in answers[1].error.message
    assert offsets([answers[0], answers[2]]) == [(0, 0), (0, 0)]
    assert not engine_of(server).exists("x")
    # A reader may write nowhere: every message refused, the session still answers each.
    refused = publish(server, messages, metadata=bearer("reader"))
    assert {a.error.code for a in refused} == {grpc.StatusCode.PERMISSION_DENIED.value[0]}
    # Without credentials the call itself is refused (a sync client: grpc.aio's fails its own
    # pending send with INTERNAL when the call ends first).
    with grpc.insecure_channel(server.target) as channel, pytest.raises(grpc.RpcError) as info:
        list(pb_grpc.StreamLogServiceStub(channel).Publish(iter(messages), timeout=TIMEOUT))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert auth.METHOD_ACCESS["Publish"].permission == auth.WRITE


def test_answered_messages_count_as_appends_and_the_session_as_one_call(start_server):
    server = start_server(metrics_port=free_port(), max_streams=1)
    messages = [
        message("s", b"a", request_id=1),
        message("s", b"bc", b"d", request_id=2),
        message("new", b"x"),
    ]
    answers = publish(server, messages)
    assert answers[2].error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]  # max_streams, this one only
    assert "max_streams" in answers[2].error.message
    samples = scrape(server)
    assert value(samples, "streamlog_append_requests_total", stream="s") == 2
    assert value(samples, "streamlog_appended_entries_total", stream="s") == 3
    assert value(samples, "streamlog_refusals_total", kind="limit", reason="max_streams") == 1
    assert value(samples, "streamlog_rpc_duration_seconds_count", method="Publish", code="OK") == 1


def test_a_published_entry_is_sent_to_its_waiting_subscriber_before_its_answer(start_server, monkeypatch):
    """The write that takes a message wakes the stream's subscribers before it settles the
    message: each subscriber's reply is handed to gRPC ahead of the session's answer (which the
    publisher waits for less than the subscriber waits for the entry)."""
    sent: list[str] = []  # the method of each reply handed to gRPC, in order (server thread)
    real_send = limits.SendTimeout.send

    async def recorded(self: limits.SendTimeout, call: Any, reply: Any) -> None:
        sent.append(call.method)
        await real_send(self, call, reply)

    monkeypatch.setattr(limits.SendTimeout, "send", recorded)
    server = start_server()

    def waiting() -> bool:
        """The subscriber waits for the next entry and the session for the next message."""
        (session,) = server.server._servicer._publish._sessions
        return server.server._waiters.count("s") == 1 and not session._held and not session._news.is_set()

    async def run() -> None:
        async with (
            grpc.aio.insecure_channel(server.target) as producer,
            grpc.aio.insecure_channel(server.target) as reader,
        ):
            publish_call = pb_grpc.StreamLogServiceStub(producer).Publish(timeout=TIMEOUT)
            await publish_call.write(message("s", b"first", request_id=1))
            await publish_call.read()
            subscription = pb_grpc.StreamLogServiceStub(reader).Subscribe(
                pb.SubscribeRequest(stream="s", start=pb.START_POSITION_LATEST), timeout=TIMEOUT
            )
            await subscription.read()  # it starts after "first"
            for i in range(2, 12):
                for _ in range(1000):  # (bounded: 10 s)
                    if server.call(waiting):
                        break
                    await asyncio.sleep(0.01)
                sent.clear()
                await publish_call.write(message("s", b"m%d" % i, request_id=i))
                answer, reply = await asyncio.gather(publish_call.read(), subscription.read())
                assert answer.first_offset == reply.entries[0].offset == i - 1
                assert sent == ["Subscribe", "Publish"], (i, sent)
            await publish_call.done_writing()
            subscription.cancel()

    asyncio.run(run())
