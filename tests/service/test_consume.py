"""Consume: consumer-group sessions on one bidirectional call, end to end.

Real servers on loopback ports and real gRPC clients. A `Session` feeds the
call's requests from a queue and collects its replies on a thread of its own,
so a test can say "no reply came in this much time" without blocking. Every
wait is bounded: calls carry deadlines, `until` gives up after a few seconds,
and a quiet period is a fixed, short sleep.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc
import pytest
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from bench.common import free_port
from service.consume import ConsumeSession, SessionCalls
from service.groupwaits import WaitResult
from service.waiters import Wake
from storage import GroupReadOptions, GroupReadResult
from tests.service.helpers import ServerThread
from tests.service.test_groups_e2e import TIMEOUT, create, fill, gread, info, offsets, pending, until, waiting
from tests.service.test_metrics import scrape, value

QUIET_S = 0.3  # how long "nothing more is sent" is watched for
_END = object()  # the call ended with OK


class Session:
    """One Consume call: requests go in with `send`, replies come out with `next` and `end`."""

    def __init__(self, stub: pb_grpc.StreamLogServiceStub, timeout: float = TIMEOUT, **opening: Any) -> None:
        self._requests: queue.Queue[pb.ConsumeRequest | None] = queue.Queue()
        self._replies: queue.Queue[Any] = queue.Queue()
        self.call = stub.Consume(self._request_iterator(), timeout=timeout)
        self._receiver = threading.Thread(target=self._receive, daemon=True)
        self._receiver.start()
        if opening:
            self.send(**opening)

    def _request_iterator(self) -> Iterator[pb.ConsumeRequest]:
        while True:
            try:
                request = self._requests.get(timeout=0.05)
            except queue.Empty:
                call = getattr(self, "call", None)  # None: gRPC asked before Consume() returned
                if call is not None and call.done():
                    return  # ended (by the server, a cancel or the deadline): stop feeding it
                continue
            if request is None:
                return  # the client's half-close
            yield request

    def _receive(self) -> None:
        try:
            for reply in self.call:
                self._replies.put(reply)
            self._replies.put(_END)
        except grpc.RpcError as exc:
            self._replies.put(exc)

    def send(self, **fields: Any) -> None:
        self._requests.put(pb.ConsumeRequest(**fields))

    def close(self) -> None:
        """Half-close: the client sends nothing more."""
        self._requests.put(None)

    def cancel(self) -> None:
        self.call.cancel()

    def next(self, timeout_s: float = 5) -> pb.ConsumeResponse:
        """The next reply (fails if the call ended instead, or nothing came in time)."""
        item = self._replies.get(timeout=timeout_s)
        if isinstance(item, grpc.RpcError):
            raise item
        assert item is not _END, "the call ended with OK instead of sending a reply"
        return item

    def has_reply(self) -> bool:
        return not self._replies.empty()

    def quiet(self, for_s: float = QUIET_S) -> None:
        """Nothing is sent for a while."""
        time.sleep(for_s)
        assert self._replies.empty(), f"unexpected reply: {self._replies.queue[0]}"

    def end(self, timeout_s: float = 5) -> tuple[list[pb.ConsumeResponse], grpc.StatusCode, str]:
        """The replies still to come, then the call's status code and message."""
        replies = []
        deadline = time.monotonic() + timeout_s
        while True:
            item = self._replies.get(timeout=max(deadline - time.monotonic(), 0.01))
            if item is _END:
                return replies, grpc.StatusCode.OK, ""
            if isinstance(item, grpc.RpcError):
                return replies, item.code(), item.details()
            replies.append(item)

    def fails(self, timeout_s: float = 5) -> tuple[grpc.StatusCode, str]:
        """The call's error status (the replies before it are ignored)."""
        _replies, code, details = self.end(timeout_s)
        assert code != grpc.StatusCode.OK
        return code, details


@pytest.fixture
def sessions(stub: pb_grpc.StreamLogServiceStub) -> Iterator[Callable[..., Session]]:
    """Open sessions; any still running at teardown is cancelled."""
    opened: list[Session] = []

    def open_session(client: pb_grpc.StreamLogServiceStub | None = None, **opening: Any) -> Session:
        session = Session(client or stub, **opening)
        opened.append(session)
        return session

    yield open_session
    for session in opened:
        session.cancel()


@pytest.fixture
def stubs(server: ServerThread) -> Iterator[Callable[[], pb_grpc.StreamLogServiceStub]]:
    """Fresh channels, one per simulated client process; all closed at teardown."""
    channels: list[grpc.Channel] = []

    def make() -> pb_grpc.StreamLogServiceStub:
        channel = grpc.insecure_channel(server.target)
        channels.append(channel)
        return pb_grpc.StreamLogServiceStub(channel)

    yield make
    for channel in channels:
        channel.close()


def subscriptions(server: ServerThread) -> int:
    return server.call(lambda: server.server.servicer.subscriptions)


def counting_group_reads(server: ServerThread) -> list[int]:
    """Count the engine's group reads from now on (one-element list: the count)."""
    engine = server.server.engine
    assert engine is not None
    real = engine.read_group
    count = [0]

    def read_group(*args: Any, **kwargs: Any) -> GroupReadResult:
        count[0] += 1
        return real(*args, **kwargs)

    engine.read_group = read_group  # type: ignore[method-assign]
    return count


# ---------------------------------------------------------------------------- the happy path


@pytest.mark.parametrize("fsync", ["no", "always"])
def test_a_session_consumes_a_stream_in_batches_acking_each_batch_with_the_next_request(
    server: ServerThread, stub: pb_grpc.StreamLogServiceStub, sessions: Callable[..., Session], fsync: str
) -> None:
    """On an "always" stream, group reads and acks run in threads: the session awaits them."""
    fsync_policy = {"no": pb.FSYNC_POLICY_NO, "always": pb.FSYNC_POLICY_ALWAYS}[fsync]
    fill(stub, "s", 1)
    config = pb.StreamConfig(fsync=fsync_policy)
    stub.SetStreamConfig(pb.SetStreamConfigRequest(stream="s", config=config), timeout=TIMEOUT)
    assert server.server.engine is not None and server.server.engine.fsync_policy("s") == fsync
    fill(stub, "s", 24, start=1)
    create(stub, "s", "g")
    session = sessions(stream="s", group="g", consumer="a", count=4, batches=1)
    seen: list[int] = []
    previous: list[int] = []
    for _ in range(10):  # bound: 25 entries in batches of 4
        reply = session.next()
        batch = offsets(reply)
        # Each reply reports what the request that asked for it acknowledged: the previous batch.
        assert (reply.acknowledged, reply.ack_unknown) == (len(previous), 0)
        assert list(reply.delivery_counts) == [1] * len(batch)
        assert [e.payload for e in reply.entries] == [b"%d" % o for o in batch]
        assert (reply.first_offset, reply.end_offset) == (0, 25)
        seen += batch
        # One request per batch: acknowledge this one and ask for the next.
        session.send(ack_offsets=batch, batches=1)
        previous = batch
        if len(seen) == 25:
            break
    assert seen == list(range(25))  # in order, each once
    # The last request's batch cannot come (the stream is consumed); the session waits for it.
    until(lambda: waiting(server, "s", "g") == 1)
    session.close()
    replies, code, _ = session.end()
    assert code == grpc.StatusCode.OK
    # The last reply has no entries and reports the acknowledgement of the last batch.
    assert [(offsets(r), r.acknowledged, r.ack_unknown) for r in replies] == [([], 1, 0)]
    described = info(stub, "s", "g")
    assert (described.pending, described.lag, described.next_offset) == (0, 0, 25)
    assert (described.counters.delivered, described.counters.acked) == (25, 25)
    assert [c.name for c in described.consumers] == ["a"]
    until(lambda: subscriptions(server) == 0)
    assert waiting(server, "s", "g") == 0


def test_credit_is_respected_and_entries_are_assigned_only_when_asked_for(
    server: ServerThread, stub: pb_grpc.StreamLogServiceStub, sessions: Callable[..., Session]
) -> None:
    fill(stub, "s", 20)
    create(stub, "s", "g")
    # No credit: nothing is sent, nothing is assigned, the consumer does not exist yet.
    session = sessions(stream="s", group="g", consumer="a", count=2)
    until(lambda: subscriptions(server) == 1)
    session.quiet()
    described = info(stub, "s", "g")
    assert (described.next_offset, described.pending, list(described.consumers)) == (0, 0, [])

    session.send(batches=1)
    assert offsets(session.next()) == [0, 1]
    session.quiet()  # one batch owed, one sent: no more although entries are there
    summary = pending(stub, "s", "g")
    assert (summary.count, [(c.consumer, c.pending) for c in summary.consumers]) == (2, [("a", 2)])
    assert info(stub, "s", "g").next_offset == 2  # undelivered entries are not assigned to anyone

    # Credit ahead, with the entries there: the three batches come in one reply that says it
    # fills three, and then nothing more.
    session.send(batches=3)
    reply = session.next()
    assert (offsets(reply), reply.batches) == ([2, 3, 4, 5, 6, 7], 3)
    session.quiet()
    assert pending(stub, "s", "g").count == 8
    assert info(stub, "s", "g").next_offset == 8

    # Another consumer of the group gets the next entries: nothing was held for this session.
    assert offsets(gread(stub, "s", "g", "b", count=3)) == [8, 9, 10]
    session.close()
    assert session.end() == ([], grpc.StatusCode.OK, "")  # no acknowledgements to report


def test_acks_in_a_request_are_applied_before_the_batch_it_asks_for(
    stub: pb_grpc.StreamLogServiceStub, sessions: Callable[..., Session]
) -> None:
    fill(stub, "s", 6)
    create(stub, "s", "g", config=pb.GroupConfig(max_pending=2))
    held = gread(stub, "s", "g", "other", count=10)
    assert offsets(held) == [0, 1] and held.pending_full
    # The opening request acknowledges both (and an unknown offset) and asks for a batch: the room
    # its acknowledgements make serves that very batch.
    session = sessions(stream="s", group="g", consumer="a", count=10, batches=1, ack_offsets=[0, 1, 99])
    reply = session.next()
    assert offsets(reply) == [2, 3] and reply.pending_full
    assert (reply.acknowledged, reply.ack_unknown) == (2, 1)
    session.send(ack_ranges=[pb.OffsetRange(start_offset=2, end_offset=4)], batches=1)
    reply = session.next()
    assert offsets(reply) == [4, 5] and (reply.acknowledged, reply.ack_unknown) == (2, 0)
    session.close()
    assert session.end() == ([], grpc.StatusCode.OK, "")


def test_entries_removed_before_their_batch_are_reported_as_a_gap(
    stub: pb_grpc.StreamLogServiceStub, sessions: Callable[..., Session]
) -> None:
    fill(stub, "s", 5)
    create(stub, "s", "g")
    stub.Trim(pb.TrimRequest(stream="s", trim_to_offset=3), timeout=TIMEOUT)
    session = sessions(stream="s", group="g", consumer="a", count=10, batches=1)
    reply = session.next()
    assert offsets(reply) == [3, 4] and reply.first_offset == 3
    assert (reply.gap.start_offset, reply.gap.end_offset, reply.gap.reason) == (0, 3, pb.GAP_REASON_EVICTED)
    session.close()
    assert session.end() == ([], grpc.StatusCode.OK, "")


def test_acknowledging_huge_ranges_saturates_the_reported_counts(
    stub: pb_grpc.StreamLogServiceStub, sessions: Callable[..., Session]
) -> None:
    """The engine counts every offset of a range that was not pending: more than a reply's int64."""
    fill(stub, "s", 1)
    create(stub, "s", "g")
    everything = pb.OffsetRange(start_offset=0, end_offset=2**63 - 1)
    session = sessions(stream="s", group="g", consumer="a", batches=1, ack_ranges=[everything] * 2)
    reply = session.next()
    assert offsets(reply) == [0] and reply.ack_unknown == 2**63 - 1
    session.send(ack_ranges=[everything])
    session.send(ack_ranges=[everything])
    session.close()
    replies, code, details = session.end()
    assert code == grpc.StatusCode.OK, details
    assert [(r.acknowledged, r.ack_unknown) for r in replies] == [(1, 2**63 - 1)]


# ---------------------------------------------------------------------------- blocking and wake-ups


def test_a_blocked_session_is_woken_by_an_append_without_polling(
    server: ServerThread, stub: pb_grpc.StreamLogServiceStub, sessions: Callable[..., Session]
) -> None:
    fill(stub, "s", 1)
    create(stub, "s", "g", start=pb.START_POSITION_LATEST)
    session = sessions(stream="s", group="g", consumer="a", count=10, batches=1)
    until(lambda: waiting(server, "s", "g") == 1)
    reads = counting_group_reads(server)
    session.quiet()
    assert reads[0] == 0  # waiting, not polling
    fill(stub, "s", 2, start=1)
    reply = session.next()
    assert offsets(reply) == [1, 2] and reply.end_offset == 3
    assert reads[0] <= 2  # the append's wake-up: a read or two, not a loop
    session.close()
    assert session.end() == ([], grpc.StatusCode.OK, "")


def test_acks_apply_at_once_while_a_read_is_blocked_and_room_they_make_wakes_it(
    server: ServerThread, stub: pb_grpc.StreamLogServiceStub, sessions: Callable[..., Session]
) -> None:
    fill(stub, "s", 5)
    create(stub, "s", "g", config=pb.GroupConfig(max_pending=3))
    session = sessions(stream="s", group="g", consumer="a", count=2, batches=1)
    assert offsets(session.next()) == [0, 1]
    session.send(batches=1)
    full = session.next()
    assert offsets(full) == [2] and full.pending_full
    session.send(batches=1)  # the pending list is full: this batch waits for room
    until(lambda: waiting(server, "s", "g") == 1)
    session.quiet()
    # An acknowledgement of an unknown offset makes no room: still blocked, but applied at once.
    session.send(ack_offsets=[42])
    until(lambda: info(stub, "s", "g").counters.ack_unknown == 1)
    session.quiet()
    # One that makes room wakes the blocked read, whose reply reports both.
    session.send(ack_offsets=[0])
    reply = session.next()
    assert offsets(reply) == [3] and reply.pending_full
    assert (reply.acknowledged, reply.ack_unknown) == (1, 1)
    assert [r.offset for r in pending(stub, "s", "g").entries] == [1, 2, 3]

    # Acknowledgements while blocked on an empty stream (not on room) apply at once too.
    session.send(ack_offsets=[1, 2, 3])
    until(lambda: pending(stub, "s", "g").count == 0)
    session.send(batches=1)
    assert offsets(session.next()) == [4]
    session.send(ack_offsets=[4], batches=1)  # nothing left: blocks
    until(lambda: pending(stub, "s", "g").count == 0)
    until(lambda: waiting(server, "s", "g") == 1)
    session.close()
    replies, code, _ = session.end()
    assert code == grpc.StatusCode.OK
    assert [(offsets(r), r.acknowledged) for r in replies] == [([], 1)]


def test_a_half_close_reports_the_unreported_acks_ends_ok_and_every_ack_is_applied(
    server: ServerThread, stub: pb_grpc.StreamLogServiceStub, sessions: Callable[..., Session]
) -> None:
    fill(stub, "s", 10)
    create(stub, "s", "g")
    session = sessions(stream="s", group="g", consumer="a", count=10, batches=1)
    assert offsets(session.next()) == list(range(10))
    # Acknowledgements without batches: no reply for them until the end.
    session.send(ack_offsets=[0, 1, 2])
    session.send(ack_ranges=[pb.OffsetRange(start_offset=3, end_offset=8)], ack_offsets=[100])
    session.send(ack_offsets=[8, 9, 1])  # 1 again: unknown now
    session.send(batches=5)  # owed, and dropped at the half-close: nothing is left to send anyway
    session.close()
    replies, code, details = session.end()
    assert code == grpc.StatusCode.OK, details
    assert [(offsets(r), r.acknowledged, r.ack_unknown) for r in replies] == [([], 10, 2)]
    described = info(stub, "s", "g")
    assert (described.pending, described.counters.acked, described.counters.ack_unknown) == (0, 10, 2)
    until(lambda: subscriptions(server) == 0)
    assert waiting(server, "s", "g") == 0

    # After a half-close nothing more is assigned to the consumer, even as entries come.
    fill(stub, "s", 3, start=10)
    time.sleep(QUIET_S)
    assert pending(stub, "s", "g").count == 0 and info(stub, "s", "g").next_offset == 10

    # A session that acknowledged nothing ends with no reply at all.
    quiet = sessions(stream="s", group="g", consumer="a")
    quiet.close()
    assert quiet.end() == ([], grpc.StatusCode.OK, "")


def test_unacknowledged_entries_are_redelivered_after_retry_ms_with_their_delivery_counts(
    stub: pb_grpc.StreamLogServiceStub, sessions: Callable[..., Session]
) -> None:
    fill(stub, "s", 3)
    create(stub, "s", "g")
    session = sessions(stream="s", group="g", consumer="a", count=10, retry_ms=300, batches=1)
    first = session.next()
    assert offsets(first) == [0, 1, 2] and list(first.delivery_counts) == [1, 1, 1]
    started = time.monotonic()
    session.send(ack_offsets=[1], batches=1)
    again = session.next()
    assert time.monotonic() - started >= 0.2  # nothing was due before retry_ms
    assert offsets(again) == [0, 2] and list(again.delivery_counts) == [2, 2]
    assert again.acknowledged == 1
    rows = pending(stub, "s", "g").entries
    assert [(r.offset, r.consumer, r.delivery_count) for r in rows] == [(0, "a", 2), (2, "a", 2)]
    session.send(ack_offsets=[0, 2])
    session.close()
    replies, code, _ = session.end()
    assert code == grpc.StatusCode.OK and [r.acknowledged for r in replies] == [2]
    counters = info(stub, "s", "g").counters
    assert (counters.delivered, counters.redelivered, counters.acked) == (3, 2, 3)


def test_noack_sessions_leave_nothing_pending(
    stub: pb_grpc.StreamLogServiceStub, sessions: Callable[..., Session]
) -> None:
    fill(stub, "s", 7)
    create(stub, "s", "g")
    session = sessions(stream="s", group="g", consumer="a", count=3, noack=True, batches=3)
    reply = session.next()  # the three batches owed, there at once: one reply
    assert (offsets(reply), reply.batches) == ([0, 1, 2, 3, 4, 5, 6], 3)
    assert pending(stub, "s", "g").count == 0
    described = info(stub, "s", "g")
    assert (described.next_offset, described.counters.delivered, described.pending) == (7, 7, 0)
    session.close()
    assert session.end() == ([], grpc.StatusCode.OK, "")


def test_sessions_and_a_blocking_read_share_a_group_in_arrival_order(
    server: ServerThread,
    stub: pb_grpc.StreamLogServiceStub,
    stubs: Callable[[], pb_grpc.StreamLogServiceStub],
    sessions: Callable[..., Session],
) -> None:
    fill(stub, "s", 1)
    create(stub, "s", "g", start=pb.START_POSITION_LATEST)
    s1 = sessions(stubs(), stream="s", group="g", consumer="c1", count=1, batches=1)
    until(lambda: waiting(server, "s", "g") == 1)
    s2 = sessions(stubs(), stream="s", group="g", consumer="c2", count=1, batches=1)
    until(lambda: waiting(server, "s", "g") == 2)
    reader = stubs()

    def block() -> grpc.Future:
        request = pb.ReadRequest(stream="s", group="g", consumer="c3", count=1, block_ms=5000)
        return reader.Read.future(request, timeout=TIMEOUT)

    read = block()
    until(lambda: waiting(server, "s", "g") == 3)
    got: dict[str, list[int]] = {"c1": [], "c2": [], "c3": []}
    for i in range(9):
        fill(stub, "s", 1, start=1 + i)
        until(lambda read=read: s1.has_reply() or s2.has_reply() or read.done())
        served = [
            c for c, ready in (("c1", s1.has_reply()), ("c2", s2.has_reply()), ("c3", read.done())) if ready
        ]
        assert len(served) == 1, served
        if served == ["c3"]:
            got["c3"] += offsets(read.result())
            read = block()  # back in line, at the end
        else:
            session = s1 if served == ["c1"] else s2
            batch = offsets(session.next())
            got[served[0]] += batch
            session.send(ack_offsets=batch, batches=1)  # back in line, at the end
        until(lambda: waiting(server, "s", "g") == 3)
    assert got == {"c1": [1, 4, 7], "c2": [2, 5, 8], "c3": [3, 6, 9]}  # none twice, none lost
    read.cancel()
    described = info(stub, "s", "g")
    assert (described.counters.delivered, described.counters.redelivered) == (9, 0)
    assert described.pending == 3  # the Read's batches, which nobody acknowledged


# ---------------------------------------------------------------------------- errors


def test_a_missing_stream_or_group_ends_the_session_with_not_found(
    stub: pb_grpc.StreamLogServiceStub, sessions: Callable[..., Session]
) -> None:
    fill(stub, "s", 3)
    create(stub, "s", "g")
    code, details = sessions(stream="missing", group="g", consumer="a", batches=1).fails()
    assert code == grpc.StatusCode.NOT_FOUND and "'missing' does not exist" in details
    code, details = sessions(stream="s", group="nope", consumer="a", batches=1).fails()
    assert code == grpc.StatusCode.NOT_FOUND and "group 'nope' does not exist" in details
    # An acknowledgement names the group too.
    code, details = sessions(stream="s", group="nope", consumer="a", ack_offsets=[0]).fails()
    assert code == grpc.StatusCode.NOT_FOUND and "group 'nope'" in details
    assert info(stub, "s", "g").counters.delivered == 0


@pytest.mark.parametrize("target", ["group", "stream"])
def test_deleting_the_group_or_stream_mid_session_ends_it_with_not_found(
    server: ServerThread, stub: pb_grpc.StreamLogServiceStub, sessions: Callable[..., Session], target: str
) -> None:
    fill(stub, "s", 2)
    create(stub, "s", "g")
    session = sessions(stream="s", group="g", consumer="a", count=10, batches=2)
    assert offsets(session.next()) == [0, 1]
    until(lambda: waiting(server, "s", "g") == 1)  # blocked for its second batch
    if target == "group":
        stub.DeleteGroup(pb.DeleteGroupRequest(stream="s", group="g"), timeout=TIMEOUT)
    else:
        stub.DeleteStream(pb.DeleteStreamRequest(stream="s"), timeout=TIMEOUT)
    code, details = session.fails()
    assert code == grpc.StatusCode.NOT_FOUND, details
    until(lambda: subscriptions(server) == 0)


def test_a_later_request_that_sets_an_opening_field_is_refused(
    stub: pb_grpc.StreamLogServiceStub, sessions: Callable[..., Session]
) -> None:
    fill(stub, "s", 3)
    create(stub, "s", "g")
    later: list[dict[str, Any]] = [
        {"stream": "s"},
        {"group": "g"},
        {"consumer": "a"},
        {"count": 5},
        {"max_bytes": 100},
        {"noack": True},
        {"retry_ms": 0},  # set, though to zero
        {"expire_ms": 0},
        {"claim_idle_ms": 10},
    ]
    for fields in later:
        session = sessions(stream="s", group="g", consumer="a", count=1)
        session.send(batches=1, **fields)
        code, details = session.fails()
        assert code == grpc.StatusCode.INVALID_ARGUMENT, fields
        assert "set by the first request only" in details
    # None of them got a batch: the refused requests' credit was not taken.
    assert info(stub, "s", "g").counters.delivered == 0


def test_bad_credit_and_acknowledgements_are_refused(
    start_server: Callable[..., ServerThread],
) -> None:
    server = start_server(max_consume_batches=3)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        fill(stub, "s", 3)
        create(stub, "s", "g", start=pb.START_POSITION_LATEST)  # nothing to deliver: credit stays owed
        opening = dict(stream="s", group="g", consumer="a")
        cases: list[tuple[list[dict[str, Any]], grpc.StatusCode, str]] = [
            ([{**opening, "batches": -1}], grpc.StatusCode.INVALID_ARGUMENT, "batches: must not be negative"),
            ([opening, {"batches": -2}], grpc.StatusCode.INVALID_ARGUMENT, "batches: must not be negative"),
            ([{**opening, "batches": 4}], grpc.StatusCode.RESOURCE_EXHAUSTED, "max_consume_batches=3"),
            (
                [{**opening, "batches": 2}, {"batches": 1}, {"batches": 1}],
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "max_consume_batches=3",
            ),
            ([opening, {"ack_offsets": range(11)}], grpc.StatusCode.RESOURCE_EXHAUSTED, "max_ack_offsets=10"),
            (
                [opening, {"ack_offsets": [1], "ack_ranges": [pb.OffsetRange()] * 10}],
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "max_ack_offsets=10",
            ),
            ([opening, {"ack_offsets": [-1]}], grpc.StatusCode.INVALID_ARGUMENT, "ack_offsets: must not be"),
            (
                [opening, {"ack_ranges": [pb.OffsetRange(start_offset=5, end_offset=4)]}],
                grpc.StatusCode.INVALID_ARGUMENT,
                "ack_ranges[0]: end_offset 4 is before start_offset 5",
            ),
            ([{**opening, "count": -1}], grpc.StatusCode.INVALID_ARGUMENT, "count: must not be negative"),
            ([{**opening, "retry_ms": -1}], grpc.StatusCode.INVALID_ARGUMENT, "retry_ms: must not be"),
            ([{**opening, "consumer": ""}], grpc.StatusCode.INVALID_ARGUMENT, "consumer: must not be empty"),
        ]
        for requests, code, fragment in cases:
            session = Session(stub)
            for fields in requests:
                session.send(**fields)
            try:
                got, details = session.fails()
            finally:
                session.cancel()
            assert (got, fragment in details) == (code, True), (requests, details)
        # Credit up to the limit is fine: three owed, then one received lets one more be owed.
        session = Session(stub, **opening, batches=3)
        try:
            fill(stub, "s", 1, start=3)
            assert offsets(session.next()) == [3]
            session.send(batches=1)
            session.quiet()
            session.close()
            assert session.end() == ([], grpc.StatusCode.OK, "")
        finally:
            session.cancel()
        until(lambda: subscriptions(server) == 0)


def test_sessions_count_against_max_subscriptions(
    start_server: Callable[..., ServerThread],
) -> None:
    server = start_server(max_subscriptions=2)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        fill(stub, "s", 3)
        create(stub, "s", "g")
        first = Session(stub, stream="s", group="g", consumer="a")
        second = Session(stub, stream="s", group="g", consumer="b")
        try:
            until(lambda: subscriptions(server) == 2)
            code, details = Session(stub, stream="s", group="g", consumer="c", batches=1).fails()
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_subscriptions=2" in details
            # A Subscribe is refused the same way: they share the limit.
            with pytest.raises(grpc.RpcError) as caught:
                next(stub.Subscribe(pb.SubscribeRequest(stream="s"), timeout=TIMEOUT))
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            first.close()
            assert first.end() == ([], grpc.StatusCode.OK, "")
            until(lambda: subscriptions(server) == 1)
            third = Session(stub, stream="s", group="g", consumer="c", batches=1)
            try:
                assert offsets(third.next()) == [0, 1, 2]
            finally:
                third.cancel()
        finally:
            first.cancel()
            second.cancel()
        until(lambda: subscriptions(server) == 0)


def test_a_cancelled_session_frees_its_subscription_and_its_entries_stay_pending(
    server: ServerThread, stub: pb_grpc.StreamLogServiceStub, sessions: Callable[..., Session]
) -> None:
    fill(stub, "s", 4)
    create(stub, "s", "g")
    session = sessions(stream="s", group="g", consumer="a", count=4, retry_ms=200, batches=2)
    assert offsets(session.next()) == [0, 1, 2, 3]
    until(lambda: waiting(server, "s", "g") == 1)  # blocked for the second batch
    assert subscriptions(server) == 1
    session.send(ack_offsets=[1])
    until(lambda: pending(stub, "s", "g").count == 3)
    session.cancel()
    until(lambda: subscriptions(server) == 0)
    until(lambda: waiting(server, "s", "g") == 0)
    rows = pending(stub, "s", "g").entries
    assert [(r.offset, r.consumer) for r in rows] == [(0, "a"), (2, "a"), (3, "a")]
    # Redeliverable: another consumer gets them once retry_ms has passed.
    again = gread(stub, "s", "g", "b", count=10, block_ms=5000)
    assert offsets(again) == [0, 2, 3] and list(again.delivery_counts) == [2, 2, 2]


def test_a_draining_server_refuses_new_sessions_with_unavailable(
    server: ServerThread, stub: pb_grpc.StreamLogServiceStub
) -> None:
    fill(stub, "s", 3)
    create(stub, "s", "g")
    server.call(server.server.servicer.start_draining)
    session = Session(stub, stream="s", group="g", consumer="a", batches=1)
    try:
        code, details = session.fails()
    finally:
        session.cancel()
    assert code == grpc.StatusCode.UNAVAILABLE and "shutting down" in details
    assert subscriptions(server) == 0


@pytest.mark.parametrize("state", ["blocked", "idle"])
def test_server_shutdown_ends_sessions_with_unavailable_at_once(
    start_server: Callable[..., ServerThread], state: str
) -> None:
    """Blocked for a batch, or idle (no batch owed): either ends at once, not after the grace period."""
    server = start_server(shutdown_grace_ms=8_000)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        fill(stub, "s", 2)
        create(stub, "s", "g")
        session = Session(stub, stream="s", group="g", consumer="a", count=10, batches=1)
        try:
            assert offsets(session.next()) == [0, 1]
            if state == "blocked":
                session.send(batches=1)
                until(lambda: waiting(server, "s", "g") == 1)
            else:
                session.send(ack_offsets=[0])
                until(lambda: info(stub, "s", "g").pending == 1)
            started = time.monotonic()
            stopper = threading.Thread(target=server.stop)
            stopper.start()
            code, details = session.fails(timeout_s=10)
            elapsed = time.monotonic() - started
            stopper.join(timeout=30)
        finally:
            session.cancel()
        assert code == grpc.StatusCode.UNAVAILABLE, details
        assert "shutting down" in details  # the servicer's answer, not the server cancelling the call
        assert elapsed < 4, f"the session ended {elapsed:.1f}s after the shutdown began"


# ---------------------------------------------------------------------------- limits and metrics


def test_max_consumers_per_group_applies_to_the_session_consumer_and_metrics_count_sessions(
    start_server: Callable[..., ServerThread],
) -> None:
    server = start_server(max_consumers_per_group=2, metrics_port=free_port())
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        fill(stub, "s", 6)
        create(stub, "s", "g")
        gread(stub, "s", "g", "a", count=1)
        session = Session(stub, stream="s", group="g", consumer="b", count=2, batches=1)
        try:
            assert offsets(session.next()) == [1, 2]
            samples = scrape(server)
            assert value(samples, "streamlog_active_subscriptions") == 1
            assert value(samples, "streamlog_subscriptions_started_total", stream="s", mode="group") == 1
            # A third consumer is refused, by a session as by a read; known consumers are not.
            code, details = Session(stub, stream="s", group="g", consumer="c", batches=1).fails()
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_consumers_per_group=2" in details
            with pytest.raises(grpc.RpcError) as caught:
                gread(stub, "s", "g", "c")
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            known = Session(stub, stream="s", group="g", consumer="a", count=2, batches=1)
            try:
                assert offsets(known.next()) == [3, 4]
                known.close()
                assert known.end() == ([], grpc.StatusCode.OK, "")
            finally:
                known.cancel()
            session.send(ack_offsets=[1, 2])
            session.close()
            replies, code, _ = session.end()
            assert code == grpc.StatusCode.OK and [r.acknowledged for r in replies] == [2]
        finally:
            session.cancel()
        assert sorted(c.name for c in info(stub, "s", "g").consumers) == ["a", "b"]
        until(lambda: subscriptions(server) == 0)
        samples = scrape(server)
        assert value(samples, "streamlog_rpc_duration_seconds_count", method="Consume", code="OK") == 2
        assert (
            value(
                samples, "streamlog_rpc_duration_seconds_count", method="Consume", code="RESOURCE_EXHAUSTED"
            )
            == 1
        )
        assert value(samples, "streamlog_refusals_total", kind="limit", reason="max_consumers_per_group") == 2
        assert value(samples, "streamlog_subscribe_replies_total", stream="s") == 3  # 2 batches, 1 last
        assert value(samples, "streamlog_active_subscriptions") == 0


# ---------------------------------------------------------------------------- the session alone


class FakeCalls:
    """What a session asks of the servicer, with acks and reads the test releases by hand."""

    def __init__(self) -> None:
        self.available = 0  # entries the group has, one per batch
        self.changed = asyncio.Event()
        self.ack_gate = asyncio.Event()
        self.acks: list[list[int]] = []
        self.next_offset = 0

    async def read_or_wait(
        self, batches: int, wait_s: float | None, until: asyncio.Event | None
    ) -> WaitResult:
        while not self.available:
            if wait_s == 0 or (until is not None and until.is_set()):
                return GroupReadResult() if wait_s == 0 else Wake.TIMEOUT
            self.changed.clear()
            waits = [asyncio.ensure_future(self.changed.wait())]
            if until is not None:
                waits.append(asyncio.ensure_future(until.wait()))
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for pending_wait in waits:
                pending_wait.cancel()
        self.available -= 1
        self.next_offset += 1
        return GroupReadResult(records=[b""], offsets=[self.next_offset - 1], delivery_counts=[1])

    def add(self, entries: int) -> None:
        self.available += entries
        self.changed.set()

    async def ack(self, offsets: list[int], ranges: list[tuple[int, int]]) -> tuple[int, int]:
        await self.ack_gate.wait()  # as an ack on an fsync=always stream, in a thread
        self.acks.append(offsets)
        return len(offsets), 0

    def reply(self, result: GroupReadResult | None, batches: int, acknowledged: int, unknown: int) -> bytes:
        return repr((result.offsets if result else [], acknowledged, unknown)).encode()

    def session_calls(self, max_batches: int = 1000) -> SessionCalls:
        return SessionCalls(
            read_or_wait=self.read_or_wait,
            ack=self.ack,
            ack_items=lambda offsets, ranges: (
                list(offsets),
                [(r.start_offset, r.end_offset) for r in ranges],
            ),
            reply=self.reply,
            draining=lambda: False,
            stream="s",
            count=1,
            max_batches=max_batches,
        )


def test_a_batch_sent_while_an_ack_is_being_applied_is_not_owed_again() -> None:
    """Credit is counted from what is owed when the request's acks are done, not before them."""

    async def scenario() -> list[bytes]:
        calls = FakeCalls()
        requests: asyncio.Queue[pb.ConsumeRequest | None] = asyncio.Queue()

        async def request_iterator() -> AsyncIterator[pb.ConsumeRequest]:
            while (request := await requests.get()) is not None:
                yield request

        session = ConsumeSession(calls.session_calls())
        replies = session.run(
            pb.ConsumeRequest(stream="s", group="g", consumer="a", batches=1), request_iterator()
        )
        sent: list[bytes] = []

        async def collect() -> None:
            async for reply in replies:
                sent.append(reply)

        collector = asyncio.create_task(collect())
        await asyncio.sleep(0.01)  # blocked: one batch owed, no entries
        # Acknowledge (slowly) and ask for one more batch; meanwhile the owed batch goes out.
        await requests.put(pb.ConsumeRequest(ack_offsets=[7], batches=1))
        await asyncio.sleep(0.01)
        calls.add(10)  # plenty: only credit limits what is sent
        await asyncio.sleep(0.01)
        assert len(sent) == 1
        calls.ack_gate.set()
        await asyncio.sleep(0.05)
        await requests.put(None)  # half-close
        await asyncio.wait_for(collector, timeout=5)
        return sent

    sent = asyncio.run(scenario())
    # Two batches asked for in all: two sent, and the last reply reports nothing new.
    assert sent == [b"([0], 0, 0)", b"([1], 1, 0)"]


def test_opening_a_session_costs_the_same_in_a_group_of_10_000(
    start_server: Callable[..., ServerThread],
) -> None:
    """Issue 13: opening a session once described the whole group (every consumer listed and sorted,
    about 27 ms of event-loop time at 10,000 consumers) just to check that it exists. Compared at 100
    and 10,000 consumers, the best of several openings each, with a generous factor."""
    server = start_server(max_consumers_per_group=20_000)
    engine = server.server.engine
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        fill(stub, "s", 1)
        for group, size in (("small", 100), ("big", 10_000)):
            create(stub, "s", group)
            # 10,000 reads on the loop took over 10 s under a CPU hog.
            server.call(
                lambda group=group, size=size: [
                    engine.read_group("s", group, GroupReadOptions(f"c{i}", 0)) for i in range(size)
                ],
                timeout_s=90,
            )

        def best_opening(group: str) -> float:
            best = float("inf")
            for i in range(12):
                opening = pb.ConsumeRequest(stream="s", group=group, consumer=f"new{i}")
                started = time.perf_counter()
                assert list(stub.Consume(iter([opening]), timeout=TIMEOUT)) == []  # opened, closed: OK
                best = min(best, time.perf_counter() - started)
            return best

        small, big = best_opening("small"), best_opening("big")
        assert big < 3 * small + 0.005, (small, big)
