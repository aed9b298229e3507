"""Consumer groups at the servicer level: blocked group readers, their wake-ups, fairness, threads.

Handlers are called directly on one event loop with a real engine (see
test_servicer.Harness), so the order in which readers block is exact.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from streamlog.v1 import streamlog_pb2 as pb

from service.groupwaits import GroupWaits
from service.waiters import Wake
from storage import AppendBatch, GroupReadOptions, GroupReadResult, StreamConfig
from tests.service.helpers import Aborted, FakeContext
from tests.service.test_servicer import Harness, append, run


async def read(h: Harness, timeout_s: float | None = None, **fields: Any) -> pb.ReadResponse:
    raw = await h.servicer.Read(pb.ReadRequest(**fields), FakeContext(timeout_s))
    return pb.ReadResponse.FromString(raw)


async def until(condition: Callable[[], bool], timeout_s: float = 5) -> None:
    """Let other tasks run until `condition` holds (bounded: fails after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.001)


async def create_group(h: Harness, stream: str, group: str, **fields: Any) -> pb.GroupInfo:
    request = pb.CreateGroupRequest(stream=stream, group=group, **fields)
    return (await h.servicer.CreateGroup(request, FakeContext())).group


class CountingEngine:
    """The real engine, counting read_group calls (a waiting reader must not poll)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.group_reads = 0

    def read_group(self, *args: Any, **kwargs: Any) -> GroupReadResult:
        self.group_reads += 1
        return self._engine.read_group(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def test_blocked_consumers_are_served_round_robin_in_arrival_order(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        h.engine.create_stream("s")
        await create_group(h, "s", "g")
        waits = h.servicer.group_waits
        got: dict[str, list[int]] = {"c1": [], "c2": [], "c3": []}

        async def consumer(name: str, reads: int) -> None:
            for _ in range(reads):
                reply = await read(h, stream="s", group="g", consumer=name, count=1, block_ms=5000)
                got[name] += [e.offset for e in reply.entries]

        tasks = []
        for n, name in enumerate(got, start=1):  # they block in this order
            tasks.append(asyncio.create_task(consumer(name, 3)))
            await until(lambda n=n: waits.count("s", "g") == n)
        for i in range(9):
            await append(h, "s", b"%d" % i)
            # The one served reads again at once and joins the back of the queue.
            await until(
                lambda i=i: sum(map(len, got.values())) == i + 1 and waits.count("s", "g") == min(3, 8 - i)
            )
        await asyncio.gather(*tasks)
        assert got == {"c1": [0, 3, 6], "c2": [1, 4, 7], "c3": [2, 5, 8]}

    run(tmp_path, scenario)


def test_one_append_is_shared_among_blocked_consumers_in_arrival_order(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        h.engine.create_stream("s")
        await create_group(h, "s", "g")
        tasks = []
        for n, name in enumerate(("a", "b", "c", "d"), start=1):
            tasks.append(
                asyncio.create_task(read(h, stream="s", group="g", consumer=name, count=2, block_ms=5000))
            )
            await until(lambda n=n: h.servicer.group_waits.count("s", "g") == n)
        await append(h, "s", *[b"x"] * 7)
        replies = await asyncio.wait_for(asyncio.gather(*tasks[:3]), 2)
        assert [[e.offset for e in r.entries] for r in replies] == [[0, 1], [2, 3], [4, 5]]
        last = await asyncio.wait_for(tasks[3], 2)
        assert [e.offset for e in last.entries] == [6] and list(last.delivery_counts) == [1]

    run(tmp_path, scenario)


def test_a_full_pending_list_blocks_new_entries_until_an_ack_makes_room(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        await append(h, "s", *[b"%d" % i for i in range(5)])
        await create_group(h, "s", "g", config=pb.GroupConfig(max_pending=2))
        first = await read(h, stream="s", group="g", consumer="a", count=10)
        assert [e.offset for e in first.entries] == [0, 1] and first.pending_full
        # Entries exist, but the pending list is full: a blocking read waits for room.
        blocked = asyncio.create_task(read(h, stream="s", group="g", consumer="b", count=10, block_ms=5000))
        await until(lambda: h.servicer.group_waits.count("s", "g") == 1)
        await asyncio.sleep(0.05)
        assert not blocked.done()
        acked = await h.servicer.Ack(pb.AckRequest(stream="s", group="g", offsets=[1]), FakeContext())
        assert (acked.acknowledged, acked.unknown) == (1, 0)
        reply = await asyncio.wait_for(blocked, 2)
        assert [e.offset for e in reply.entries] == [2] and reply.pending_full

    run(tmp_path, scenario)


def test_a_redelivery_falling_due_wakes_a_blocked_reader_without_polling(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        counting = CountingEngine(h.engine)
        h.servicer.attach_engine(counting)
        await append(h, "s", b"job")
        await create_group(h, "s", "g", config=pb.GroupConfig(retry_ms=300))
        taken = await read(h, stream="s", group="g", consumer="a")
        assert [e.offset for e in taken.entries] == [0]
        counting.group_reads = 0
        started = time.monotonic()
        reply = await read(h, stream="s", group="g", consumer="b", block_ms=5000)
        waited = time.monotonic() - started
        assert [e.offset for e in reply.entries] == [0] and list(reply.delivery_counts) == [2]
        assert 0.25 <= waited < 2
        # One read when the call came, one when the timer fired (one more if the wall clock and the
        # loop's clock disagree by a hair and it fired a little early): a poller would read dozens.
        assert counting.group_reads in (2, 3)

    run(tmp_path, scenario)


def test_a_delayed_entry_wakes_a_blocked_reader_when_due(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        h.engine.create_stream("s")
        await create_group(h, "s", "g")
        due = int(time.time() * 1000) + 300
        h.engine.append("s", AppendBatch([b"later"], deliver_at_ms=[due]))
        h.engine.append("s", AppendBatch([b"now"]))
        first = await read(h, stream="s", group="g", consumer="a", count=10)
        assert [e.payload for e in first.entries] == [b"now"]  # the delayed one holds nothing back
        reply = await read(h, stream="s", group="g", consumer="a", count=10, block_ms=5000)
        assert [(e.payload, e.deliver_at_ms) for e in reply.entries] == [(b"later", due)]
        assert time.time() * 1000 >= due

    run(tmp_path, scenario)


def test_deleting_the_group_ends_its_blocked_readers_with_not_found(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        h.engine.create_stream("s")
        await create_group(h, "s", "g")
        blocked = asyncio.create_task(read(h, stream="s", group="g", consumer="a", block_ms=5000))
        await until(lambda: h.servicer.group_waits.count("s", "g") == 1)
        await h.servicer.DeleteGroup(pb.DeleteGroupRequest(stream="s", group="g"), FakeContext())
        with pytest.raises(Aborted) as caught:
            await asyncio.wait_for(blocked, 2)
        assert caught.value.code == grpc.StatusCode.NOT_FOUND and "group 'g'" in caught.value.details
        assert h.servicer.group_waits.count() == 0

    run(tmp_path, scenario)


def test_deleting_the_stream_ends_blocked_group_readers_with_not_found(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        h.engine.create_stream("s")
        await create_group(h, "s", "g")
        blocked = asyncio.create_task(read(h, stream="s", group="g", consumer="a", block_ms=5000))
        await until(lambda: h.servicer.group_waits.count("s") == 1)
        await h.servicer.DeleteStream(pb.DeleteStreamRequest(stream="s"), FakeContext())
        with pytest.raises(Aborted) as caught:
            await asyncio.wait_for(blocked, 2)
        assert caught.value.code == grpc.StatusCode.NOT_FOUND and "deleted" in caught.value.details

    run(tmp_path, scenario)


def test_a_blocked_group_read_times_out_empty_with_the_stream_bounds(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        await append(h, "s", b"a", b"b")
        await create_group(h, "s", "g", start=pb.START_POSITION_LATEST)
        started = time.monotonic()
        reply = await read(h, stream="s", group="g", consumer="a", block_ms=200)
        assert 0.19 <= time.monotonic() - started < 1
        assert not reply.entries and (reply.first_offset, reply.end_offset) == (0, 2)
        assert h.servicer.group_waits.count() == 0

    run(tmp_path, scenario)


def test_group_subscribe_sends_at_once_then_assigned_batches_then_ends_on_close(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        h.engine.create_stream("s")
        await create_group(h, "s", "g")
        request = pb.SubscribeRequest(stream="s", group="g", consumer="sub", count=2)
        replies = h.servicer.Subscribe(request, FakeContext())
        first = pb.SubscribeResponse.FromString(await anext(replies))
        assert not first.entries and h.servicer.subscriptions == 1
        pending = asyncio.ensure_future(anext(replies))
        await until(lambda: h.servicer.group_waits.count("s", "g") == 1)
        await append(h, "s", b"0", b"1", b"2")
        live = pb.SubscribeResponse.FromString(await asyncio.wait_for(pending, 2))
        assert [e.offset for e in live.entries] == [0, 1] and list(live.delivery_counts) == [1, 1]
        more = pb.SubscribeResponse.FromString(await asyncio.wait_for(anext(replies), 2))
        assert [e.offset for e in more.entries] == [2]
        pending = asyncio.ensure_future(anext(replies))
        await until(lambda: h.servicer.group_waits.count("s", "g") == 1)
        h.servicer.start_draining()
        h.servicer.group_waits.close()
        with pytest.raises(Aborted) as caught:
            await asyncio.wait_for(pending, 2)
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE
        assert h.servicer.subscriptions == 0

    run(tmp_path, scenario)


def test_group_calls_use_a_thread_only_for_always_fsync_streams(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        await append(h, "fast", b"a", b"b")
        await create_group(h, "fast", "g")
        submitted = h.executor.submitted  # CreateGroup writes files: always in a thread
        assert submitted == 1
        await read(h, stream="fast", group="g", consumer="c", count=1)
        await read(h, stream="fast", group="g", consumer="c", count=1, ack_offsets=[0])
        await h.servicer.Ack(pb.AckRequest(stream="fast", group="g", offsets=[1]), FakeContext())
        assert h.executor.submitted == submitted

        h.engine.create_stream("safe", StreamConfig(fsync="always"))
        h.engine.append("safe", AppendBatch([b"a"]))
        await create_group(h, "safe", "g")
        submitted = h.executor.submitted
        reply = await read(h, stream="safe", group="g", consumer="c")
        assert [e.offset for e in reply.entries] == [0]
        await h.servicer.Ack(pb.AckRequest(stream="safe", group="g", offsets=[0]), FakeContext())
        assert h.executor.submitted == submitted + 2

    run(tmp_path, scenario)


def test_a_blocked_group_read_on_an_always_stream_is_woken_by_an_append(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        h.engine.create_stream("safe", StreamConfig(fsync="always"))
        await create_group(h, "safe", "g")
        blocked = asyncio.create_task(read(h, stream="safe", group="g", consumer="a", block_ms=5000))
        await until(lambda: h.servicer.group_waits.count("safe", "g") == 1)
        await asyncio.to_thread(h.engine.append, "safe", AppendBatch([b"x"]))  # as an "always" Append does
        reply = await asyncio.wait_for(blocked, 2)
        assert [e.payload for e in reply.entries] == [b"x"]

    run(tmp_path, scenario)


def test_a_waiter_whose_read_is_under_way_gets_its_entries_even_past_its_timeout() -> None:
    """Entries a read hands to a consumer become pending for it: they must reach it, not be dropped."""

    async def main() -> None:
        release = asyncio.Event()
        served = GroupReadResult(records=[b""], offsets=[7], delivery_counts=[1])

        async def slow_read(
            stream: str, group: str, options: GroupReadOptions, charge: object
        ) -> GroupReadResult:
            await release.wait()  # as a read in a thread, waiting for a journal sync
            return served

        waits = GroupWaits(slow_read)
        waiting = asyncio.create_task(waits.wait("s", "g", GroupReadOptions("c", 1), 0.05))
        await asyncio.sleep(0.2)  # well past the waiter's timeout
        assert not waiting.done()
        release.set()
        assert await asyncio.wait_for(waiting, 2) is served
        # Without a read under way, the timeout ends the wait.
        assert await waits.wait("s", "g", GroupReadOptions("c", 1), 0.05, read_first=False) is Wake.TIMEOUT
        assert waits.count() == 0

    asyncio.run(main())


def test_a_wait_ended_by_its_event_still_gets_the_entries_of_a_read_under_way() -> None:
    """A Consume session that ends while a read for it runs (in a thread, on an "always" stream)
    must still send what that read assigned to its consumer, not leave it pending unseen."""

    async def main() -> None:
        release = asyncio.Event()
        served = GroupReadResult(records=[b""], offsets=[7], delivery_counts=[1])

        async def slow_read(
            stream: str, group: str, options: GroupReadOptions, charge: object
        ) -> GroupReadResult:
            await release.wait()
            return served

        waits = GroupWaits(slow_read)
        until_ended = asyncio.Event()
        waiting = asyncio.create_task(waits.wait("s", "g", GroupReadOptions("c", 1), None, until=until_ended))
        await asyncio.sleep(0.05)
        until_ended.set()  # the client closed its side while the read runs
        await asyncio.sleep(0.1)
        assert not waiting.done()
        release.set()
        assert await asyncio.wait_for(waiting, 2) is served
        # Without a read under way, the event ends the wait at once.
        idle = asyncio.Event()
        idle.set()
        assert (
            await waits.wait("s", "g", GroupReadOptions("c", 1), None, read_first=False, until=idle)
            is Wake.TIMEOUT
        )
        assert waits.count() == 0

    asyncio.run(main())
