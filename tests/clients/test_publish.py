"""Client.publisher and AsyncClient.publisher against a real server: pipelined appends answered in
order, a refused message failing only its own future, and what a session that ends leaves."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from clients import AsyncClient, CancelledError, Client, InvalidArgumentError, ProducerClosedError, Record
from storage import AppendBatch
from tests.service.helpers import ServerThread


def test_messages_are_answered_in_order_and_a_refused_one_fails_alone(client: Client) -> None:
    with client.publisher(max_in_flight=4) as session:
        futures = [session.publish("s", b"m%d" % i) for i in range(20)]
        bad = session.publish("", b"nameless")
        tagged = session.publish("s", [Record(b"a", tag="t"), b"b"], producer_id="p", producer_sequence=1)
        again = session.publish("s", [Record(b"a", tag="t"), b"b"], producer_id="p", producer_sequence=1)
    assert [f.result(0).first_offset for f in futures] == list(range(20))
    with pytest.raises(InvalidArgumentError, match="stream"):
        bad.result(0)
    assert (tagged.result(0).first_offset, tagged.result(0).count, tagged.result(0).duplicate) == (
        20,
        2,
        False,
    )
    assert (again.result(0).first_offset, again.result(0).duplicate) == (20, True)
    assert session.unanswered() == []
    with pytest.raises(ProducerClosedError):
        session.publish("s", b"too late")
    assert [e.tag for e in client.read("s", 20)] == ["t", ""]


def test_a_session_that_ends_fails_its_unanswered_messages_and_lists_them(start_server) -> None:
    server: ServerThread = start_server(fsync="always")
    engine = server.server.engine
    engine.append("s", AppendBatch([b"warm-up"]))
    held = threading.Event()
    real = engine.append_many

    def held_back(name: str, appends: Any) -> Any:
        held.wait(10)
        return real(name, appends)

    engine.append_many = held_back  # the server takes the messages and answers none yet
    try:
        with Client(server.target) as client:
            session = client.publisher()
            futures = [
                session.publish("s", b"m%d" % i, producer_id="p", producer_sequence=i) for i in range(3)
            ]
            session.cancel()
            for future in futures:
                with pytest.raises(CancelledError):
                    future.result(10)
            assert [(m.producer_id, m.producer_sequence) for m in session.unanswered()] == [
                ("p", i) for i in range(3)
            ]
            with pytest.raises(CancelledError):
                session.publish("s", b"after the end")
    finally:
        held.set()


def test_the_async_session_pipelines_and_answers_in_order(server: ServerThread) -> None:
    async def run() -> tuple[list[int], BaseException | None]:
        async with AsyncClient(server.target) as client, client.publisher(max_in_flight=8) as session:
            futures = [await session.publish("s", b"m%d" % i) for i in range(50)]
            bad = await session.publish("s", [b"x"] * 100_000)
            offsets = [(await f).first_offset for f in futures]
            return offsets, await asyncio.wait_for(asyncio.gather(bad, return_exceptions=True), 10)

    offsets, (error,) = asyncio.run(run())
    assert offsets == list(range(50))
    assert "max_batch_entries" in str(error)
