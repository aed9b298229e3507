"""Consumer groups end to end: real servers on loopback ports, real gRPC clients.

Waits in these tests are bounded: blocking calls carry block_ms and timeouts,
and `until` gives up after a few seconds. Where a test needs time to pass (a
retry, an expiry, a delay), it says how much and checks the wall clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from tests.service.helpers import ServerThread

TIMEOUT = 10  # seconds: every call's deadline


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def until(condition: Callable[[], bool], timeout_s: float = 5) -> None:
    """Wait, bounded, for something another thread or the server does."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.002)


def fill(stub: pb_grpc.StreamLogServiceStub, stream: str, n: int, start: int = 0) -> None:
    """Append payloads b"start" .. b"start+n-1", in batches the test server takes (100 at most)."""
    for first in range(start, start + n, 100):
        batch = [b"%d" % i for i in range(first, min(first + 100, start + n))]
        stub.Append(pb.AppendRequest(stream=stream, payloads=batch), timeout=TIMEOUT)


def create(stub: pb_grpc.StreamLogServiceStub, stream: str, group: str, **fields: Any) -> pb.GroupInfo:
    fields.setdefault("start", pb.START_POSITION_OLDEST)
    return stub.CreateGroup(
        pb.CreateGroupRequest(stream=stream, group=group, **fields), timeout=TIMEOUT
    ).group


def gread(stub: pb_grpc.StreamLogServiceStub, stream: str, group: str, consumer: str, **fields: Any):
    request = pb.ReadRequest(stream=stream, group=group, consumer=consumer, **fields)
    return stub.Read(request, timeout=TIMEOUT)


def info(stub: pb_grpc.StreamLogServiceStub, stream: str, group: str) -> pb.GroupInfo:
    return stub.GetGroupInfo(pb.GetGroupInfoRequest(stream=stream, group=group), timeout=TIMEOUT).group


def pending(
    stub: pb_grpc.StreamLogServiceStub, stream: str, group: str, **fields: Any
) -> pb.GetPendingResponse:
    return stub.GetPending(pb.GetPendingRequest(stream=stream, group=group, **fields), timeout=TIMEOUT)


def offsets(reply: Any) -> list[int]:
    return [e.offset for e in reply.entries]


def waiting(server: ServerThread, stream: str, group: str) -> int:
    """Readers blocked on the group right now (read on the server's loop)."""
    return server.call(lambda: server.server.servicer.group_waits.count(stream, group))


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


def test_each_entry_goes_to_one_consumer_per_group_and_every_group_sees_every_entry(
    stub: pb_grpc.StreamLogServiceStub, stubs: Callable[[], pb_grpc.StreamLogServiceStub]
) -> None:
    fill(stub, "jobs", 150)
    members = {"g1": ["a", "b", "c"], "g2": ["x", "y"]}
    for group in members:
        create(stub, "jobs", group)
    got: dict[tuple[str, str], list[int]] = {}
    errors: list[BaseException] = []

    def consume(group: str, consumer: str) -> None:
        client = stubs()
        taken: list[int] = []
        acks: list[int] = []
        try:
            for _ in range(200):  # bound: 150 entries in batches of up to 7
                reply = gread(client, "jobs", group, consumer, count=7, block_ms=300, ack_offsets=acks)
                assert list(reply.delivery_counts) == [1] * len(reply.entries)
                acks = offsets(reply)
                if not acks:
                    break  # this read also acknowledged the last batch
                taken += acks
        except BaseException as exc:
            errors.append(exc)
        got[group, consumer] = taken

    threads = [threading.Thread(target=consume, args=(g, c)) for g, cs in members.items() for c in cs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    for group, consumers in members.items():
        seen = [o for c in consumers for o in got[group, c]]
        assert sorted(seen) == list(range(150))  # all of them, each exactly once
        described = info(stub, "jobs", group)
        assert (described.pending, described.lag, described.next_offset) == (0, 0, 150)
        assert (described.counters.delivered, described.counters.acked) == (150, 150)
        assert sorted(c.name for c in described.consumers) == consumers
    listed = stub.ListGroups(pb.ListGroupsRequest(stream="jobs")).groups
    assert [g.name for g in listed] == ["g1", "g2"]


def test_unacknowledged_entries_are_redelivered_after_retry_ms(stub: pb_grpc.StreamLogServiceStub) -> None:
    fill(stub, "s", 3)
    create(stub, "s", "g")
    first = gread(stub, "s", "g", "a", count=3, retry_ms=300)
    assert offsets(first) == [0, 1, 2]
    assert stub.Ack(pb.AckRequest(stream="s", group="g", offsets=[1, 7])).unknown == 1
    started = time.monotonic()
    again = gread(stub, "s", "g", "b", count=10, block_ms=5000)
    assert time.monotonic() - started >= 0.2  # nothing was due before retry_ms
    assert offsets(again) == [0, 2] and list(again.delivery_counts) == [2, 2]
    rows = pending(stub, "s", "g").entries
    assert [(r.offset, r.consumer, r.delivery_count) for r in rows] == [(0, "b", 2), (2, "b", 2)]
    assert rows[0].HasField("due_ms") is False  # b read without retry_ms, and the group has none
    done = gread(stub, "s", "g", "b", ack_offsets=[0, 2])
    assert done.acknowledged == 2 and not done.entries
    counters = info(stub, "s", "g").counters
    assert (counters.delivered, counters.redelivered, counters.acked, counters.ack_unknown) == (3, 2, 3, 1)


def test_exhausted_and_expired_entries_go_to_the_dead_letter_stream_with_headers(
    stub: pb_grpc.StreamLogServiceStub,
) -> None:
    stub.Append(
        pb.AppendRequest(stream="work", entries=[pb.Entry(tag="t-1", payload=b"poison", headers={"k": b"v"})])
    )
    create(
        stub,
        "work",
        "retrying",
        config=pb.GroupConfig(retry_ms=150, max_deliveries=2, dead_letter_stream="dlq"),
    )
    create(stub, "work", "expiring", config=pb.GroupConfig(expire_ms=200, dead_letter_stream="dlq"))
    create(stub, "work", "dropping", config=pb.GroupConfig(expire_ms=200))
    assert offsets(gread(stub, "work", "retrying", "a")) == [0]
    assert offsets(gread(stub, "work", "expiring", "a")) == [0]
    assert offsets(gread(stub, "work", "dropping", "a")) == [0]
    second = gread(stub, "work", "retrying", "b", block_ms=5000)
    assert offsets(second) == [0] and list(second.delivery_counts) == [2]

    # Nobody acknowledges: the server retires both entries by itself (its maintenance round).
    letters: list[pb.Entry] = []
    for _ in range(2):  # one or two maintenance rounds
        reply = stub.Read(pb.ReadRequest(stream="dlq", offset=len(letters), block_ms=5000), timeout=TIMEOUT)
        letters += reply.entries
        if len(letters) >= 2:
            break
    assert len(letters) == 2
    by_group = {e.headers["x-group"].decode(): e for e in letters}
    for group, count, reason in (("retrying", b"2", b"max_deliveries"), ("expiring", b"1", b"expired")):
        letter = by_group[group]
        assert (letter.payload, letter.tag) == (b"poison", "t-1")
        assert dict(letter.headers) == {
            "k": b"v",
            "x-origin-stream": b"work",
            "x-origin-offset": b"0",
            "x-group": group.encode(),
            "x-delivery-count": count,
            "x-reason": reason,
        }
        described = info(stub, "work", group)
        assert (described.pending, described.counters.dead_lettered) == (0, 1)
    # "dropping" expired with the others (it was read at the same time): without a dead-letter
    # stream the entry is dropped and counted.
    dropped = info(stub, "work", "dropping")  # looking at a group retires what is due
    assert (dropped.pending, dropped.counters.expired, dropped.counters.dead_lettered) == (0, 1, 0)


def test_delayed_entries_reach_groups_when_due_without_holding_back_later_ones(
    stub: pb_grpc.StreamLogServiceStub,
) -> None:
    stub.Append(pb.AppendRequest(stream="s", payloads=[b"seed"]))
    create(stub, "s", "g", start=pb.START_POSITION_LATEST)
    create(stub, "s", "slow", start=pb.START_POSITION_LATEST, config=pb.GroupConfig(delay_ms=300))
    due = now_ms() + 800
    stub.Append(pb.AppendRequest(stream="s", entries=[pb.Entry(payload=b"later", deliver_at_ms=due)]))
    appended = stub.Append(pb.AppendRequest(stream="s", payloads=[b"now"]))
    # A group with delay_ms gets every entry delay_ms after its append (delayed ones when due).
    slow = stub.Read.future(
        pb.ReadRequest(stream="s", group="slow", consumer="a", count=10, block_ms=5000), timeout=TIMEOUT
    )
    answered: list[int] = []
    slow.add_done_callback(lambda _call: answered.append(now_ms()))

    # Plain reads see the delayed entry at once, with its deliver_at_ms.
    plain = stub.Read(pb.ReadRequest(stream="s", offset=1))
    assert [(e.payload, e.deliver_at_ms) for e in plain.entries] == [(b"later", due), (b"now", 0)]

    # The group gets the entry after it first; the delayed one when it is due.
    assert [e.payload for e in gread(stub, "s", "g", "a", count=10).entries] == [b"now"]
    later = gread(stub, "s", "g", "a", count=10, block_ms=5000)
    assert [e.payload for e in later.entries] == [b"later"] and now_ms() >= due

    first = slow.result(timeout=5)
    assert [e.payload for e in first.entries] == [b"now"]
    assert answered[0] >= appended.timestamp_ms + 300  # not before its delay had passed
    rest = gread(stub, "s", "slow", "a", count=10, block_ms=5000)
    assert [e.payload for e in rest.entries] == [b"later"]
    assert info(stub, "s", "slow").counters.delivered == 2


def test_nack_with_a_delay_redelivers_after_the_delay(stub: pb_grpc.StreamLogServiceStub) -> None:
    fill(stub, "s", 2)
    create(stub, "s", "g")
    assert offsets(gread(stub, "s", "g", "a", count=2)) == [0, 1]
    nacked = stub.Nack(pb.NackRequest(stream="s", group="g", offsets=[0, 5], delay_ms=300))
    assert (nacked.released, nacked.unknown) == (1, 1)
    rows = {r.offset: r for r in pending(stub, "s", "g").entries}
    assert rows[0].consumer == "" and rows[0].due_ms >= now_ms() + 100  # released, due in ~300 ms
    assert rows[1].consumer == "a"
    started = time.monotonic()
    again = gread(stub, "s", "g", "b", block_ms=5000)
    assert time.monotonic() - started >= 0.2
    assert offsets(again) == [0] and list(again.delivery_counts) == [2]


def test_claim_autoclaim_and_claim_on_read(stub: pb_grpc.StreamLogServiceStub) -> None:
    fill(stub, "s", 6)
    create(stub, "s", "g")
    assert offsets(gread(stub, "s", "g", "a", count=5)) == [0, 1, 2, 3, 4]

    busy = stub.Claim(pb.ClaimRequest(stream="s", group="g", consumer="b", min_idle_ms=60_000, offsets=[0]))
    assert not busy.entries  # not idle long enough
    claimed = stub.Claim(pb.ClaimRequest(stream="s", group="g", consumer="b", offsets=[1, 0, 99]))
    assert offsets(claimed) == [1, 0] and list(claimed.delivery_counts) == [2, 2]
    assert [e.payload for e in claimed.entries] == [b"1", b"0"]

    pages = []
    cursor = 0
    for _ in range(5):  # bound: 5 pending entries, 2 per page
        page = stub.AutoClaim(
            pb.AutoClaimRequest(stream="s", group="g", consumer="c", min_idle_ms=0, cursor=cursor, count=2)
        )
        pages.append((offsets(page), list(page.delivery_counts), page.next_cursor))
        cursor = page.next_cursor
        if not cursor:
            break
    assert pages == [([0, 1], [3, 3], 2), ([2, 3], [2, 2], 4), ([4], [2], 0)]

    # Claim-on-read: pending entries idle long enough come before new ones.
    time.sleep(0.05)
    taken = gread(stub, "s", "g", "d", count=2, claim_idle_ms=20)
    assert offsets(taken) == [0, 1] and list(taken.delivery_counts) == [4, 4]
    summary = pending(stub, "s", "g")
    assert {c.consumer: c.pending for c in summary.consumers} == {"c": 3, "d": 2}

    # Entries the stream no longer has cannot be claimed: they leave the pending list.
    stub.Trim(pb.TrimRequest(stream="s", trim_to_offset=3))
    gone = stub.AutoClaim(pb.AutoClaimRequest(stream="s", group="g", consumer="e", min_idle_ms=0))
    assert offsets(gone) == [3, 4] and list(gone.deleted_offsets) == [0, 1, 2]
    assert pending(stub, "s", "g").count == 2


def test_pending_summary_and_detail(stub: pb_grpc.StreamLogServiceStub) -> None:
    fill(stub, "s", 6)
    create(stub, "s", "g")
    gread(stub, "s", "g", "a", count=3)
    gread(stub, "s", "g", "b", count=3)
    stub.Ack(pb.AckRequest(stream="s", group="g", offsets=[1]))
    stub.Nack(pb.NackRequest(stream="s", group="g", offsets=[4], delay_ms=60_000))

    summary = pending(stub, "s", "g")
    assert (summary.count, summary.lowest_offset, summary.highest_offset, summary.released) == (5, 0, 5, 1)
    assert [(c.consumer, c.pending) for c in summary.consumers] == [("a", 2), ("b", 2)]
    assert [(r.offset, r.consumer, r.delivery_count) for r in summary.entries] == [
        (0, "a", 1),
        (2, "a", 1),
        (3, "b", 1),
        (4, "", 1),
        (5, "b", 1),
    ]
    assert all(0 <= r.idle_ms < 5000 for r in summary.entries)
    assert offsets(pending(stub, "s", "g", consumer="b")) == [3, 5]
    assert offsets(pending(stub, "s", "g", start_offset=2, end_offset=5)) == [2, 3, 4]
    assert offsets(pending(stub, "s", "g", count=2)) == [0, 2]
    idle = pending(stub, "s", "g", min_idle_ms=60_000)
    assert not idle.entries and idle.count == 5  # the summary is of the whole list
    assert pending(stub, "s", "g", consumer="nobody").entries == []


def test_lag_and_stream_info_against_hand_computed_values(stub: pb_grpc.StreamLogServiceStub) -> None:
    fill(stub, "s", 10)
    g = create(stub, "s", "g")
    assert (g.next_offset, g.entries_read, g.lag, g.entries_added) == (0, 0, 10, 10)
    gread(stub, "s", "g", "a", count=4)
    g = info(stub, "s", "g")
    assert (g.next_offset, g.entries_read, g.lag, g.pending) == (4, 4, 6, 4)

    h = create(stub, "s", "h", start=pb.START_POSITION_OFFSET, offset=7)
    assert (h.entries_read, h.lag) == (7, 3)
    # A counter given that disagrees with the position: lag unknown, not wrong...
    x = create(stub, "s", "x", start=pb.START_POSITION_OFFSET, offset=5, entries_read=2)
    assert (x.entries_read, x.HasField("lag")) == (2, False)
    gread(stub, "s", "x", "a", count=3)
    assert not info(stub, "s", "x").HasField("lag")
    # ... until the group reaches the end of the stream.
    gread(stub, "s", "x", "a", count=100)
    x = info(stub, "s", "x")
    assert (x.entries_read, x.lag) == (10, 0)

    fill(stub, "s", 5, start=10)
    assert info(stub, "s", "g").lag == 11  # 15 added, 4 read

    stream = stub.GetStreamInfo(pb.GetStreamInfoRequest(stream="s")).info
    assert stream.groups == 3 and not stream.HasField("retention_holder")
    held = stub.SetGroupConfig(
        pb.SetGroupConfigRequest(stream="s", group="g", config=pb.GroupConfig(retention_hold=True))
    ).group
    assert held.config.retention_hold and held.holds_retention and held.hold_offset == 0
    stream = stub.GetStreamInfo(pb.GetStreamInfoRequest(stream="s")).info
    assert (stream.retention_holder.group, stream.retention_holder.offset) == ("g", 0)
    # Acknowledged entries are no longer needed: the hold moves up to the lowest pending one.
    stub.Ack(pb.AckRequest(stream="s", group="g", ranges=[pb.OffsetRange(start_offset=0, end_offset=3)]))
    stream = stub.GetStreamInfo(pb.GetStreamInfoRequest(stream="s")).info
    assert (stream.retention_holder.group, stream.retention_holder.offset) == ("g", 3)


def test_a_full_pending_list_blocks_a_read_until_an_ack_makes_room(
    server: ServerThread, stub: pb_grpc.StreamLogServiceStub
) -> None:
    fill(stub, "s", 5)
    create(stub, "s", "g", config=pb.GroupConfig(max_pending=2))
    full = gread(stub, "s", "g", "a", count=10)
    assert offsets(full) == [0, 1] and full.pending_full
    blocked = stub.Read.future(
        pb.ReadRequest(stream="s", group="g", consumer="b", count=10, block_ms=5000), timeout=TIMEOUT
    )
    until(lambda: waiting(server, "s", "g") == 1)
    time.sleep(0.1)
    assert not blocked.done()  # entries 2..4 exist, but there is no room
    stub.Ack(pb.AckRequest(stream="s", group="g", offsets=[0]))
    reply = blocked.result(timeout=5)
    assert offsets(reply) == [2] and reply.pending_full


def test_blocked_consumers_are_served_round_robin(
    server: ServerThread, stub: pb_grpc.StreamLogServiceStub
) -> None:
    stub.Append(pb.AppendRequest(stream="s", payloads=[b"seed"]))
    create(stub, "s", "g", start=pb.START_POSITION_LATEST)
    consumers = ["c1", "c2", "c3"]

    def block(consumer: str) -> grpc.Future:
        request = pb.ReadRequest(stream="s", group="g", consumer=consumer, count=1, block_ms=5000)
        return stub.Read.future(request, timeout=TIMEOUT)

    calls = {}
    for n, consumer in enumerate(consumers, start=1):  # they block in this order
        calls[consumer] = block(consumer)
        until(lambda n=n: waiting(server, "s", "g") == n)
    got: dict[str, list[int]] = {c: [] for c in consumers}
    for i in range(9):
        stub.Append(pb.AppendRequest(stream="s", payloads=[b"%d" % i]))
        until(lambda: any(call.done() for call in calls.values()))
        served = [c for c, call in calls.items() if call.done()]
        assert len(served) == 1
        got[served[0]] += offsets(calls[served[0]].result())
        calls[served[0]] = block(served[0])  # back in line, at the end
        until(lambda: waiting(server, "s", "g") == 3)
    assert got == {"c1": [1, 4, 7], "c2": [2, 5, 8], "c3": [3, 6, 9]}
    for call in calls.values():
        call.cancel()


def test_group_subscribers_share_the_entries_and_ack_them(
    server: ServerThread,
    stub: pb_grpc.StreamLogServiceStub,
    stubs: Callable[[], pb_grpc.StreamLogServiceStub],
) -> None:
    stub.Append(pb.AppendRequest(stream="s", payloads=[b"seed"]))
    create(stub, "s", "g", start=pb.START_POSITION_LATEST)
    total = 60
    got: dict[str, list[int]] = {"s1": [], "s2": []}
    done = threading.Event()
    errors: list[BaseException] = []

    def subscribe(consumer: str) -> grpc.Future:
        client = stubs()
        call = client.Subscribe(
            pb.SubscribeRequest(stream="s", group="g", consumer=consumer, count=4), timeout=30
        )

        def run() -> None:
            try:
                for reply in call:
                    batch = offsets(reply)
                    if batch:
                        client.Ack(pb.AckRequest(stream="s", group="g", offsets=batch), timeout=TIMEOUT)
                        got[consumer] += batch
                    if sum(map(len, got.values())) >= total:
                        done.set()
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.CANCELLED:
                    errors.append(exc)

        threading.Thread(target=run, daemon=True).start()
        return call

    calls = [subscribe(name) for name in got]
    until(lambda: waiting(server, "s", "g") == 2)  # both are in line for entries
    for i in range(0, total, 10):
        fill(stub, "s", 10, start=i)
    assert done.wait(10)
    for call in calls:
        call.cancel()
    assert not errors
    seen = sorted(got["s1"] + got["s2"])
    assert seen == list(range(1, total + 1))  # every entry to exactly one subscriber
    assert got["s1"] and got["s2"]
    until(lambda: info(stub, "s", "g").pending == 0)
    assert info(stub, "s", "g").counters.acked == total


def test_noack_reads_deleted_consumers_and_group_offsets(stub: pb_grpc.StreamLogServiceStub) -> None:
    fill(stub, "s", 4)
    create(stub, "s", "g")
    assert offsets(gread(stub, "s", "g", "a", count=2, noack=True)) == [0, 1]
    assert info(stub, "s", "g").pending == 0  # nothing to acknowledge
    assert offsets(gread(stub, "s", "g", "a", count=2)) == [2, 3]
    released = stub.DeleteConsumer(pb.DeleteConsumerRequest(stream="s", group="g", consumer="a")).released
    assert released == 2
    assert [c.name for c in info(stub, "s", "g").consumers] == []
    again = gread(stub, "s", "g", "b", count=10)  # released entries come back at once
    assert offsets(again) == [2, 3] and list(again.delivery_counts) == [2, 2]

    moved = stub.SetGroupOffset(pb.SetGroupOffsetRequest(stream="s", group="g", offset=1)).group
    assert moved.next_offset == 1
    assert offsets(gread(stub, "s", "g", "b", count=1)) == [1]
    latest = stub.SetGroupOffset(
        pb.SetGroupOffsetRequest(stream="s", group="g", start=pb.START_POSITION_LATEST)
    )
    assert latest.group.next_offset == 4 and latest.group.lag == 0
    assert not gread(stub, "s", "g", "b", count=10).entries

    stub.DeleteGroup(pb.DeleteGroupRequest(stream="s", group="g"))
    assert stub.GetStreamInfo(pb.GetStreamInfoRequest(stream="s")).info.groups == 0
    made = stub.CreateGroup(pb.CreateGroupRequest(stream="fresh", group="g", create_stream=True)).group
    assert (made.stream, made.next_offset, made.entries_added) == ("fresh", 0, 0)


def assert_each_offset_once_with_the_pending_counts(
    stub: pb_grpc.StreamLogServiceStub, stream: str, group: str, reply: pb.ReadResponse
) -> None:
    got = offsets(reply)
    assert len(set(got)) == len(got), got
    counts = {r.offset: r.delivery_count for r in pending(stub, stream, group, count=1000).entries}
    assert list(reply.delivery_counts) == [counts[o] for o in got]


def test_one_reply_holds_each_offset_once_after_the_group_offset_moves_back(
    stub: pb_grpc.StreamLogServiceStub,
) -> None:
    """Issue 12's reproductions: a rewind over pending entries, with a nack, then a deleted consumer."""
    fill(stub, "s", 5)
    create(stub, "s", "g")
    assert offsets(gread(stub, "s", "g", "a", count=3)) == [0, 1, 2]
    stub.SetGroupOffset(pb.SetGroupOffsetRequest(stream="s", group="g", start=pb.START_POSITION_OLDEST))
    stub.Nack(pb.NackRequest(stream="s", group="g", offsets=[1]))
    first = gread(stub, "s", "g", "a", count=10)
    assert (offsets(first), list(first.delivery_counts)) == ([1, 0, 2, 3, 4], [2, 2, 2, 1, 1])
    assert_each_offset_once_with_the_pending_counts(stub, "s", "g", first)

    stub.DeleteConsumer(pb.DeleteConsumerRequest(stream="s", group="g", consumer="a"))
    stub.SetGroupOffset(pb.SetGroupOffsetRequest(stream="s", group="g", offset=2))
    second = gread(stub, "s", "g", "b", count=10)
    assert (offsets(second), list(second.delivery_counts)) == ([0, 1, 2, 3, 4], [3, 3, 3, 2, 2])
    assert_each_offset_once_with_the_pending_counts(stub, "s", "g", second)


def test_due_redeliveries_and_a_group_offset_moved_back_give_each_offset_once(
    stub: pb_grpc.StreamLogServiceStub,
) -> None:
    fill(stub, "s", 5)
    create(stub, "s", "g")
    assert offsets(gread(stub, "s", "g", "a", count=3, retry_ms=200)) == [0, 1, 2]
    stub.SetGroupOffset(pb.SetGroupOffsetRequest(stream="s", group="g", offset=0))
    due = max(r.due_ms for r in pending(stub, "s", "g").entries)
    time.sleep(0.3)  # the retries fall due (200 ms)
    assert now_ms() >= due
    reply = gread(stub, "s", "g", "b", count=10)
    assert (offsets(reply), list(reply.delivery_counts)) == ([0, 1, 2, 3, 4], [2, 2, 2, 1, 1])
    assert_each_offset_once_with_the_pending_counts(stub, "s", "g", reply)


def test_a_delayed_entry_trimmed_before_it_fell_due_is_reported_as_a_gap(
    stub: pb_grpc.StreamLogServiceStub,
) -> None:
    later = now_ms() + 60_000
    entries = [pb.Entry(payload=b"0"), pb.Entry(payload=b"1", deliver_at_ms=later), pb.Entry(payload=b"2")]
    stub.Append(pb.AppendRequest(stream="s", entries=entries))
    create(stub, "s", "g")
    assert offsets(gread(stub, "s", "g", "a", count=10)) == [0, 2]
    stub.Trim(pb.TrimRequest(stream="s", trim_to_offset=3))
    reply = gread(stub, "s", "g", "a", count=10)
    assert not reply.entries and reply.HasField("gap")
    assert (reply.gap.start_offset, reply.gap.end_offset, reply.gap.reason) == (1, 2, pb.GAP_REASON_EVICTED)
    described = info(stub, "s", "g")
    assert (described.scheduled, described.counters.evicted) == (0, 1)


def test_durations_past_int64_are_refused_and_get_pending_keeps_answering(
    stub: pb_grpc.StreamLogServiceStub,
) -> None:
    fill(stub, "s", 3)
    create(stub, "s", "g")
    with pytest.raises(grpc.RpcError) as read:
        gread(stub, "s", "g", "a", count=3, retry_ms=2**63 - 1)
    assert read.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert offsets(gread(stub, "s", "g", "a", count=3)) == [0, 1, 2]
    with pytest.raises(grpc.RpcError) as nack:
        stub.Nack(pb.NackRequest(stream="s", group="g", offsets=[0, 1, 2], delay_ms=2**63 - 1))
    assert nack.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [r.consumer for r in pending(stub, "s", "g").entries] == ["a", "a", "a"]  # unchanged, and answered


def test_a_restart_keeps_group_state_and_redelivers_what_was_not_acknowledged(
    start_server: Callable[..., ServerThread], tmp_path: Path
) -> None:
    data = tmp_path / "groups"
    first = start_server(data)
    with grpc.insecure_channel(first.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        fill(stub, "s", 20)
        create(stub, "s", "g", config=pb.GroupConfig(retry_ms=300))
        acks: list[int] = []
        for _ in range(3):  # three batches of 5; the third is never acknowledged
            acks = offsets(gread(stub, "s", "g", "a", count=5, ack_offsets=acks))
        assert acks == [10, 11, 12, 13, 14]
        before = info(stub, "s", "g")
    first.stop()

    second = start_server(data)
    with grpc.insecure_channel(second.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        after = info(stub, "s", "g")
        assert (after.next_offset, after.pending, after.entries_read) == (15, 5, 15)
        assert after.counters == before.counters and after.consumers[0].pending == 5
        rows = pending(stub, "s", "g").entries
        assert [(r.offset, r.consumer, r.delivery_count) for r in rows] == [
            (o, "a", 1) for o in range(10, 15)
        ]
        # The consumer carries on: new entries first, then the unacknowledged batch comes back.
        seen: list[int] = []
        counts: dict[int, int] = {}
        batch: list[int] = []
        for _ in range(20):  # bound
            reply = gread(stub, "s", "g", "b", count=5, block_ms=1000, ack_offsets=batch)
            batch = offsets(reply)
            counts.update(zip(batch, reply.delivery_counts, strict=True))
            if not batch:
                break
            seen += batch
        assert sorted(seen) == list(range(10, 20))
        assert {o: counts[o] for o in range(10, 15)} == dict.fromkeys(range(10, 15), 2)
        final = info(stub, "s", "g")
        assert (final.pending, final.counters.acked) == (0, 20)
