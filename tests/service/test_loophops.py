"""The listeners' hops to the event loop: one per call, one per thread batch (AppendMany), none lost.

The servicer-level tests call the handlers directly on one loop with a real engine
(test_servicer.Harness, which registers the server's append listeners: plain readers' and
group readers'), and count the loop's `call_soon_threadsafe` calls: each is a wake-up of it.
The interleaving tests hold the loop's thread at the points where a reader could lose its
wake-up, so that the order of the read, the batch's appends, its end and the reader's
registration is the one written, not the scheduler's.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from streamlog.v1 import streamlog_pb2 as pb

from cluster.replication.leader import StreamLeader
from cluster.replication.manager import ReplicaManager
from service.loophops import LoopHops
from service.waiters import Waiters, Wake
from storage import AppendBatch, Engine, EngineConfig, StreamConfig
from tests.service.helpers import FakeContext
from tests.service.test_group_servicer import create_group, until
from tests.service.test_group_servicer import read as read_group
from tests.service.test_servicer import Harness, read, run


@contextmanager
def counted_hops(loop: asyncio.AbstractEventLoop) -> Iterator[list[str]]:
    """The names of the callbacks other threads hand `loop` (call_soon_threadsafe) meanwhile."""
    hops: list[str] = []
    handoff = loop.call_soon_threadsafe

    def counting(callback: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        hops.append(getattr(callback, "__name__", repr(callback)))
        return handoff(callback, *args, **kwargs)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign,assignment]
    try:
        yield hops
    finally:
        del loop.call_soon_threadsafe


def append_many(h: Harness, streams: list[str]) -> Awaitable[pb.AppendManyResponse]:
    batches = [pb.AppendRequest(stream=name, payloads=[name.encode()]) for name in streams]
    return h.servicer.AppendMany(pb.AppendManyRequest(batches=batches), FakeContext())


def in_loop(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())  # type: ignore[arg-type]


def test_a_thread_side_append_many_of_many_new_streams_wakes_the_loop_once(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        for count in (10, 400):
            with counted_hops(asyncio.get_running_loop()) as hops:
                reply = await append_many(h, [f"new-{count}-{i}" for i in range(count)])
            assert not any(r.HasField("error") for r in reply.results)
            # One for the thread's result (run_in_executor), one for the listeners' batch: not
            # one per stream and listener (801 for 400 streams before).
            assert sorted(hops) == ["_deliver", "_set_state"], hops
        assert h.executor.submitted == 2  # each call's new streams went to one thread

    run(tmp_path, scenario, max_append_many_batches=1000, max_append_many_bytes=1 << 20)


def test_an_append_many_from_a_thread_wakes_plain_and_group_readers_of_its_streams(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        # "always" streams are written from the thread even though they are open.
        for name in ("plain", "grouped"):
            h.engine.create_stream(name, StreamConfig(fsync="always"))
        await create_group(h, "grouped", "g")
        plain = asyncio.create_task(read(h, stream="plain", offset=0, block_ms=5000))
        grouped = asyncio.create_task(read_group(h, stream="grouped", group="g", consumer="c", block_ms=5000))
        far = asyncio.create_task(read(h, stream="plain", offset=5, block_ms=5000))
        group_waits = h.servicer.group_waits
        await until(lambda: h.waiters.count("plain") == 2 and group_waits.count("grouped", "g") == 1)
        streams = [f"new-{i}" for i in range(100)]
        streams[30:30] = ["plain"]
        streams[70:70] = ["grouped"]
        with counted_hops(asyncio.get_running_loop()) as hops:
            await append_many(h, streams)
            assert [e.payload for e in (await asyncio.wait_for(plain, 2)).entries] == [b"plain"]
            assert [e.payload for e in (await asyncio.wait_for(grouped, 2)).entries] == [b"grouped"]
        # One per thread part (append_threads=2: one of each kind): the new streams' and the
        # "always" streams' (service/appendmany.py), not one per stream.
        assert hops.count("_deliver") == 2
        assert not far.done() and h.waiters.count("plain") == 1  # offset 5 is not reached
        far.cancel()

    run(tmp_path, scenario, max_append_many_batches=1000, max_append_many_bytes=1 << 20)


def test_a_reader_whose_read_came_before_the_batch_and_registration_after_it_is_woken() -> None:
    async def scenario() -> None:
        waiters = Waiters()
        hops = waiters.hops
        end = 1  # the stream holds one entry: the reader looks at offset 1 and finds nothing

        def batch() -> None:
            nonlocal end
            with hops.batch():
                for stream in ("a", "s", "z"):
                    if stream == "s":
                        end = 2
                    waiters.on_append(stream, 2)

        assert end == 1  # the reader's read: nothing at offset 1
        # The whole batch, its end and its hop, between the read and the registration (the loop's
        # thread waits for it: no step of the loop runs in between, as none runs within a handler).
        thread = threading.Thread(target=batch)
        thread.start()
        thread.join()
        assert end == 2  # visible now, but the reader read before
        assert await waiters.wait("s", 1, 2) is Wake.APPENDED  # woken by the hop, not lost

    in_loop(scenario)


def test_a_reader_registering_while_a_batch_is_open_is_woken_when_it_ends() -> None:
    async def scenario() -> None:
        waiters = Waiters()
        appended, go = threading.Event(), threading.Event()

        def batch() -> None:
            with waiters.hops.batch():
                waiters.on_append("s", 2)
                appended.set()
                assert go.wait(5)
                waiters.on_append("t", 1)

        thread = threading.Thread(target=batch)
        thread.start()
        assert appended.wait(5)  # the batch wrote "s" and holds its news
        waiting = asyncio.create_task(waiters.wait("s", 1, 5))
        for _ in range(5):
            await asyncio.sleep(0)
        assert waiters.count("s") == 1 and not waiting.done()  # held until the batch ends
        go.set()
        await asyncio.to_thread(thread.join)
        assert await asyncio.wait_for(waiting, 2) is Wake.APPENDED
        assert waiters.count() == 0

    in_loop(scenario)


def test_a_batch_gathers_each_receivers_news_keeps_the_last_value_and_joins_an_open_batch() -> None:
    async def scenario() -> None:
        hops = LoopHops()
        got: list[tuple[str, dict[Any, Any]]] = []

        def ends(news: dict[Any, Any]) -> None:
            got.append(("ends", news))

        def groups(news: dict[Any, Any]) -> None:
            got.append(("groups", news))

        def batch() -> None:
            with hops.batch():
                hops.tell(ends, "s", 1)
                hops.tell(groups, ("s", "g"), None)
                with hops.batch():  # joins the open one: nothing leaves before the outer ends
                    hops.tell(ends, "t", 7)
                hops.tell(ends, "s", 3)

        def single() -> None:
            hops.tell(ends, "u", 5)  # no batch open: a hop of its own

        with counted_hops(asyncio.get_running_loop()) as counted:
            await asyncio.to_thread(batch)
            await asyncio.to_thread(single)
            for _ in range(3):
                await asyncio.sleep(0)
        assert got == [("ends", {"s": 3, "t": 7}), ("groups", {("s", "g"): None}), ("ends", {"u": 5})]
        assert counted.count("_deliver") == 2
        got.clear()
        hops.tell(ends, "v", 1)  # on the loop's thread: later, without a wake-up
        assert got == []
        await asyncio.sleep(0)
        assert got == [("ends", {"v": 1})]

    in_loop(scenario)


def test_an_append_from_a_thread_outside_a_batch_still_hops_at_once(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        waiting = asyncio.create_task(read(h, stream="s", offset=0, block_ms=5000))
        await until(lambda: h.waiters.count("s") == 1)
        with counted_hops(asyncio.get_running_loop()) as hops:
            await asyncio.to_thread(h.engine.append, "s", AppendBatch([b"x"]))  # an "always" Append's way
            assert [e.payload for e in (await asyncio.wait_for(waiting, 2)).entries] == [b"x"]
        # The plain readers' and the group readers' hops, and the thread's result.
        assert sorted(hops) == ["_deliver", "_deliver", "_set_state"], hops

    run(tmp_path, scenario)


def test_a_leaders_log_news_from_a_thread_batch_reaches_the_loop_in_one_hop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    told: list[object] = []
    monkeypatch.setattr(StreamLeader, "on_log", told.append)  # what each led stream is told
    engine = Engine(tmp_path / "data", EngineConfig(background=False))
    names = [f"s{i}" for i in range(50)]
    for name in names:
        engine.create_stream(name)
        engine.set_commit(name, 0)  # a replicated copy: appends tell the log listeners

    async def scenario() -> None:
        hops = LoopHops()
        manager = ReplicaManager(
            "a",
            engine,
            placement=None,  # type: ignore[arg-type]  # (not consulted for the log's news)
            lease_valid_until=lambda: 0.0,
            connect=lambda _node: None,
            to_loop=hops.tell,
        )
        manager.start()
        led = {name: f"leader of {name}" for name in names[:40]}  # the other ten are followed
        manager.leaders.update(led)  # type: ignore[arg-type]

        def write() -> None:
            with hops.batch():  # as AppendMany's thread does
                for name in names:
                    engine.append(name, AppendBatch([b"x"]))

        with counted_hops(asyncio.get_running_loop()) as counted:
            await asyncio.to_thread(write)
            for _ in range(3):
                await asyncio.sleep(0)
        assert sorted(told) == sorted(led.values())  # type: ignore[type-var]
        assert counted.count("_deliver") == 1

    try:
        in_loop(scenario)
    finally:
        engine.close()
