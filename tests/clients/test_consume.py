"""Consume sessions from the client (Client.consume, AsyncClient.consume) against a real server.

Every wait is bounded: sessions carry a deadline (SESSION_S), waits for the
server's state give up after a few seconds, and "nothing more happens" is
watched for a short, fixed QUIET_S.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from clients import (
    AckResult,
    AsyncClient,
    Client,
    ConsumeSession,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    StreamlogError,
    _consume,
)
from tests.clients.conftest import SignalRaised
from tests.service.helpers import ServerThread

SESSION_S = 10.0  # every session's deadline: a hung test fails instead of hanging
QUIET_S = 0.3


def _fill(client: Client, stream: str, count: int) -> None:
    client.append(stream, [b"job-%d" % i for i in range(count)])


def _until(condition: Callable[[], Any], timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)
    return value


def _held(client: Client, consumer: str) -> int:
    """How many entries the group has assigned to `consumer` and not seen acknowledged."""
    return client.pending("s", "g").consumers.get(consumer, 0)


def test_a_session_consumes_the_stream_and_acknowledges_everything(client: Client) -> None:
    _fill(client, "s", 25)
    client.create_group("s", "g")
    seen: list[tuple[int, int]] = []
    reported = 0
    with client.consume("s", "g", "c1", count=4, ahead=2, timeout=SESSION_S) as session:
        assert isinstance(session, ConsumeSession)
        for batch in session:
            seen.extend((e.offset, e.delivery_count) for e in batch)
            reported += batch.acknowledged
            assert batch.ack_unknown == 0 and len(batch) <= 4 and batch.end_offset == 25
            session.ack(e.offset for e in batch)
            if len(seen) == 25:
                break
    assert seen == [(offset, 1) for offset in range(25)]
    # The batches reported what was applied before them; the last reply, the rest.
    assert session.result == AckResult(25, 0) == session.close()
    assert (session.acknowledged, session.unconsumed_offsets) == (25, [])
    assert reported < 25
    info = client.group_info("s", "g")
    assert (info.pending, info.lag, info.counters.acked, info.counters.delivered) == (0, 0, 25, 25)


def test_entries_come_as_they_are_appended(client: Client) -> None:
    client.create_group("s", "g", create_stream=True)
    timer = threading.Timer(0.2, _fill, args=(client, "s", 3))
    timer.start()
    try:
        with client.consume("s", "g", "c1", timeout=SESSION_S) as session:
            entries = session.entries()
            got = [next(entries).offset for _ in range(3)]
            session.ack(got)
    finally:
        timer.join()
    assert got == [0, 1, 2] and session.result == AckResult(3, 0)


@pytest.mark.parametrize("ahead", [1, 3])
def test_entries_are_assigned_only_for_the_batches_asked_for(client: Client, ahead: int) -> None:
    _fill(client, "s", 40)
    client.create_group("s", "g")
    with client.consume("s", "g", "c1", count=2, ahead=ahead, timeout=SESSION_S) as session:
        for taken in range(1, 4):
            batch = next(session)
            assert [e.offset for e in batch] == [2 * taken - 2, 2 * taken - 1]
            # Nothing acknowledged: what the consumer holds is what it took, plus the
            # batches asked for in advance (on their way, or waiting in the session).
            expected = 2 * (taken - 1 + ahead)
            _until(lambda expected=expected: _held(client, "c1") == expected)
            time.sleep(QUIET_S)
            assert _held(client, "c1") == expected
            assert client.group_info("s", "g").next_offset == expected
        # Acknowledging as it goes keeps the consumer's share at `ahead` batches.
        session.ack(range(6))
        session.ack(e.offset for e in next(session))
        next(session)
        _until(lambda: _held(client, "c1") == 2 * ahead)
        time.sleep(QUIET_S)
        assert _held(client, "c1") == 2 * ahead


def test_acknowledgement_counts_and_unknown_offsets(client: Client) -> None:
    _fill(client, "s", 10)
    client.create_group("s", "g")
    with client.consume("s", "g", "c1", count=5, timeout=SESSION_S) as session:
        first = next(session)
        # 0..4 were delivered; 7 was not (yet), 3 twice: unknown the second time.
        session.ack([0, 7], ranges=[(1, 3), range(3, 4)])
        session.ack([3])
        second = next(session)
        assert (second.acknowledged, second.ack_unknown) == (4, 2)
        assert [e.offset for e in second] == [5, 6, 7, 8, 9]
        session.ack([4, 7], ranges=[(5, 7), (8, 10)])
        session.flush()  # sent now, reported by the last reply
        _until(lambda: client.group_info("s", "g").pending == 0)
    assert (first.acknowledged, first.ack_unknown) == (0, 0)
    assert session.result == AckResult(10, 2)
    assert client.group_info("s", "g").counters.acked == 10


def test_many_scattered_acknowledgements_are_split_below_the_servers_limit(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The test server takes at most 10 offsets and ranges per request (max_ack_offsets).
    monkeypatch.setattr(_consume, "ACK_ITEMS_PER_REQUEST", 4)
    _fill(client, "s", 60)
    client.create_group("s", "g")
    with client.consume("s", "g", "c1", count=60, timeout=SESSION_S) as session:
        batch = next(session)
        session.ack(e.offset for e in batch if e.offset % 2 == 0)  # 30 single offsets
        session.ack(ranges=[(o, o + 1) for o in range(1, 60, 2)])  # 30 ranges
    assert session.result == AckResult(60, 0)
    assert client.group_info("s", "g").pending == 0


def test_close_without_batches_sends_the_acknowledgements_alone(client: Client) -> None:
    _fill(client, "s", 6)
    client.create_group("s", "g")
    assert client.consume("s", "g", "c1").close() == AckResult(0, 0)  # nothing said, nothing done
    read = client.read_group("s", "g", "c1", count=6)
    session = client.consume("s", "g", "c1", timeout=SESSION_S)
    session.ack(e.offset for e in read)
    assert session.close() == AckResult(6, 0)
    assert session.close() == AckResult(6, 0)  # closing again: the same result
    with pytest.raises(StreamlogError, match="closed"):
        session.ack([1])
    assert list(session) == []
    info = client.group_info("s", "g")
    assert (info.pending, info.next_offset) == (0, 6)  # no batch was asked for


def test_batches_that_arrive_after_close_began_are_reported_unconsumed(client: Client) -> None:
    _fill(client, "s", 9)
    client.create_group("s", "g")
    session = client.consume("s", "g", "c1", count=3, ahead=3, timeout=SESSION_S)
    batch = next(session)
    session.ack(e.offset for e in batch)
    _until(lambda: client.group_info("s", "g").next_offset == 9)  # the other two were assigned
    assert session.close() == AckResult(3, 0)
    # Never handed out, still pending for this consumer: the caller decides (nack, say).
    assert session.unconsumed_offsets == [3, 4, 5, 6, 7, 8]
    assert client.pending("s", "g").consumers == {"c1": 6}
    assert client.nack("s", "g", session.unconsumed_offsets).released == 6


def test_stop_ends_a_waiting_session_from_another_thread(client: Client) -> None:
    _fill(client, "s", 2)
    client.create_group("s", "g")
    session = client.consume("s", "g", "c1", timeout=SESSION_S)
    with session:
        batch = next(session)
        timer = threading.Timer(0.2, session.stop)
        timer.start()
        started = time.monotonic()
        assert list(session) == []  # waited for entries until stop(), then ended
        assert time.monotonic() - started < 3
        timer.join()
        # Acknowledgements made after stop() cannot ride on the call: close() sends them in an Ack.
        session.ack(e.offset for e in batch)
    assert session.result == AckResult(2, 0)
    assert client.group_info("s", "g").pending == 0


def test_cancel_abandons_the_session_and_keeps_the_acknowledgements(client: Client) -> None:
    _fill(client, "s", 4)
    client.create_group("s", "g")
    with client.consume("s", "g", "c1", count=4, timeout=SESSION_S) as session:
        batch = next(session)
        session.ack(e.offset for e in batch)
        session.cancel()
        assert list(session) == []
    with pytest.raises(StreamlogError, match="cancelled"):
        session.close()
    offsets, ranges = session.pending_acks()  # not sent: give them to someone else
    assert (offsets, ranges) == ([], [(0, 4)])
    assert client.ack("s", "g", offsets, ranges=ranges).acknowledged == 4


def test_a_failing_block_still_sends_its_acknowledgements(client: Client) -> None:
    _fill(client, "s", 4)
    client.create_group("s", "g")
    with (
        pytest.raises(RuntimeError, match="boom"),
        client.consume("s", "g", "c1", count=2, timeout=SESSION_S) as session,
    ):
        for batch in session:
            session.ack(e.offset for e in batch)
            raise RuntimeError("boom")
    assert session.result == AckResult(2, 0)
    assert client.pending("s", "g").count == 0


class _Interrupted(Exception):
    pass


def test_an_interrupted_wait_still_gets_the_acknowledgements_applied(client: Client) -> None:
    """After an exception raised in a wait (as KeyboardInterrupt is), close() does not wait for the
    server: it cancels the call and sends the acknowledgements in an Ack."""
    _fill(client, "s", 2)
    client.create_group("s", "g")

    def interrupt(signum: int, frame: Any) -> None:
        raise _Interrupted

    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        with (
            pytest.raises(_Interrupted),
            client.consume("s", "g", "c1", timeout=SESSION_S) as session,
        ):
            batch = next(session)
            session.ack(e.offset for e in batch)
            threading.Timer(0.2, os.kill, args=(os.getpid(), signal.SIGUSR1)).start()
            next(session)  # waits for entries that never come
    finally:
        signal.signal(signal.SIGUSR1, previous)
    # Sent twice (in the request for the next batch, then in the Ack): unknown the second time.
    assert session.result == AckResult(0, 2)
    assert client.group_info("s", "g").pending == 0


def _frames_in_wait(blocked: Callable[[], object]) -> list[str]:
    """The files of the main thread's frames while `blocked()` waits in it, seen from another
    thread, which then interrupts the wait."""
    seen: list[str] = []
    main = threading.main_thread().ident
    assert main is not None and threading.get_ident() == main

    def look_then_interrupt() -> None:
        frame = sys._current_frames()[main]
        while frame is not None:
            seen.append(frame.f_code.co_filename)
            frame = frame.f_back
        os.kill(os.getpid(), signal.SIGUSR1)

    def interrupt(signum: int, frame: Any) -> None:
        raise _Interrupted

    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        threading.Timer(0.3, look_then_interrupt).start()
        with pytest.raises(_Interrupted):
            blocked()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    return seen


def test_a_wait_for_a_batch_is_never_inside_grpc(client: Client) -> None:
    """Ctrl-C lands where the waiting thread is. Inside gRPC's own wait it can leave a gRPC lock
    held, and closing the call then hangs (a CI run saw it once): so the thread waits on a queue
    that a thread of the session fills from gRPC, and the session still closes after it."""
    _fill(client, "s", 1)
    client.create_group("s", "g")
    session = client.consume("s", "g", "c1", timeout=SESSION_S)
    session.ack(e.offset for e in next(session))
    frames = _frames_in_wait(lambda: next(session))  # waits for entries that never come
    assert frames and not [name for name in frames if f"{os.sep}grpc{os.sep}" in name], frames
    result = session.close(timeout=10)  # the acknowledgement went in a request, then in an Ack
    assert result.acknowledged + result.unknown == 1
    assert client.group_info("s", "g").pending == 0
    with client.subscribe("s", 1, timeout=SESSION_S) as subscription:
        assert next(subscription).entries == []  # where it starts; then it waits for entries
        frames = _frames_in_wait(lambda: next(subscription))
        assert frames and not [name for name in frames if f"{os.sep}grpc{os.sep}" in name], frames
        client.append("s", [b"after the interrupt"])
        assert [e.payload for e in next(subscription).entries] == [b"after the interrupt"]


@pytest.mark.timeout(60)  # before the fix, closing hung for ever
def test_a_session_left_by_ctrl_c_inside_a_grpc_call_closes_at_once(
    client: Client, interrupt_inside_grpc: Callable[[], None]
) -> None:
    """Ctrl-C landing in a gRPC call of the block, just after gRPC took the channel's lock (see
    interrupt_inside_grpc): close() waits for none of gRPC's threads and sends the
    acknowledgements in an Ack."""
    _fill(client, "s", 2)
    client.create_group("s", "g")
    started = time.monotonic()
    with pytest.raises(SignalRaised), client.consume("s", "g", "c1") as session:
        session.ack(e.offset for e in next(session))
        interrupt_inside_grpc()
        client.info("s")
    assert time.monotonic() - started < 10
    assert session.result == AckResult(2, 0)
    assert client.group_info("s", "g").pending == 0


def test_errors_map_like_every_other_call(start_server: Callable[..., ServerThread]) -> None:
    server = start_server(max_consume_batches=2)
    with Client(server.target, timeout=5) as client:
        _fill(client, "s", 3)
        client.create_group("s", "g")
        with pytest.raises(ValueError, match="ahead"):
            client.consume("s", "g", "c1", ahead=0)
        with client.consume("s", "g", "c1", timeout=SESSION_S) as session:
            with pytest.raises(ValueError, match="negative"):
                session.ack([-1])
            with pytest.raises(ValueError, match="start <= end"):
                session.ack(ranges=[(5, 4)])
        cases: list[tuple[dict[str, Any], type[StreamlogError]]] = [
            ({"group": "nope"}, NotFoundError),
            ({"stream": "missing"}, NotFoundError),
            ({"consumer": ""}, InvalidArgumentError),
            ({"ahead": 3}, ResourceExhaustedError),  # more than max_consume_batches owed
        ]
        for overrides, error in cases:
            args = {"stream": "s", "group": "g", "consumer": "c1", **overrides}
            with client.consume(**args, timeout=SESSION_S) as session:
                with pytest.raises(error) as caught:
                    next(session)
                assert caught.value.__cause__ is not None  # the grpc.RpcError
                with pytest.raises(error):
                    next(session)  # the same error again, not a new call
            with pytest.raises(error):
                session.close()  # the acknowledgements are not known to be applied
        # Nothing was assigned by the failed sessions.
        assert client.group_info("s", "g").pending == 0


def test_deleting_the_group_ends_a_waiting_session(client: Client) -> None:
    client.create_group("s", "g", create_stream=True)
    session = client.consume("s", "g", "c1", timeout=SESSION_S)
    timer = threading.Timer(0.2, client.delete_group, args=("s", "g"))
    timer.start()
    try:
        with pytest.raises(NotFoundError):
            next(session)
    finally:
        timer.join()
        session.cancel()


def test_the_async_session(server: ServerThread) -> None:
    async def scenario() -> None:
        async with AsyncClient(server.target, timeout=5) as client:
            await client.append("s", [b"%d" % i for i in range(7)])
            await client.create_group("s", "g")
            offsets: list[int] = []
            async with client.consume("s", "g", "c1", count=3, ahead=2, timeout=SESSION_S) as session:
                async for batch in session:
                    offsets.extend(e.offset for e in batch)
                    session.ack(e.offset for e in batch)
                    if len(offsets) == 7:
                        break
            assert offsets == list(range(7))
            assert session.result == AckResult(7, 0) == await session.close()
            assert (await client.group_info("s", "g")).pending == 0

            # Entries one by one, as they come; an ack-only flush; close() reports the rest.
            await client.append("s", [b"7", b"8"])
            async with client.consume("s", "g", "c2", timeout=SESSION_S) as session:
                entries = session.entries()
                first = await asyncio.wait_for(anext(entries), 5)
                session.ack([first.offset])
                await session.flush()
                second = await asyncio.wait_for(anext(entries), 5)
            assert (first.offset, second.offset) == (7, 8)
            assert session.result == AckResult(1, 0)
            assert (await client.pending("s", "g")).consumers == {"c2": 1}

            with pytest.raises(ValueError):
                client.consume("s", "g", "c1", ahead=0)
            async with client.consume("s", "nope", "c1", timeout=SESSION_S) as session:
                with pytest.raises(NotFoundError):
                    await asyncio.wait_for(anext(session), 5)
            with pytest.raises(NotFoundError):
                await session.close()

            # cancel() from another task ends iteration quietly; the acknowledgements stay with us.
            session = client.consume("s", "g", "c3", timeout=SESSION_S)
            session.ack([8])
            asyncio.get_running_loop().call_later(0.2, session.cancel)
            assert [batch async for batch in session] == []
            assert session.pending_acks() == ([8], [])

    asyncio.run(asyncio.wait_for(scenario(), 30))
