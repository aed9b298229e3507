"""Servicer-level tests: handlers called directly with a fake context and a real engine."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from streamlog.v1 import streamlog_pb2 as pb

from service.config import engine_config
from service.servicer import StreamLogServicer
from service.waiters import Waiters
from storage import (
    AppendBatch,
    CorruptionError,
    DiskFullError,
    DurabilityError,
    Engine,
    LimitExceededError,
    PreconditionError,
    StreamConfig,
)
from tests.service.helpers import Aborted, FakeContext, small_settings


class CountingExecutor(ThreadPoolExecutor):
    """Counts the calls handed to threads."""

    def __init__(self) -> None:
        super().__init__(max_workers=2)
        self.submitted = 0

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        self.submitted += 1
        return super().submit(*args, **kwargs)


class Harness:
    def __init__(self, data_dir: Path, engine: Any = None, **settings: Any) -> None:
        self.settings = small_settings(data_dir, **settings)
        self.engine = Engine(data_dir, config=engine_config(self.settings, background=False))
        self.waiters = Waiters()
        self.engine.add_append_listener(self.waiters.on_append)
        self.executor = CountingExecutor()
        self.servicer = StreamLogServicer(self.settings, self.waiters, self.executor)
        self.servicer.listen_to(self.engine)
        self.servicer.attach_engine(engine or self.engine)

    def close(self) -> None:
        self.executor.shutdown()
        self.engine.close()


def run(tmp_path: Path, scenario: Callable[[Harness], Awaitable[None]], **settings: Any) -> None:
    """Run `scenario` on a fresh event loop with a fresh servicer and engine (`settings`: the
    server's, over tests.service.helpers.SMALL)."""

    async def main() -> None:
        harness = Harness(tmp_path / "data", **settings)
        try:
            await scenario(harness)
        finally:
            harness.close()

    asyncio.run(main())


async def append(h: Harness, stream: str, *payloads: bytes) -> pb.AppendResponse:
    request = pb.AppendRequest(stream=stream, entries=[pb.Entry(payload=p) for p in payloads])
    return await h.servicer.Append(request, FakeContext())


async def read(h: Harness, timeout_s: float | None = None, **fields: Any) -> pb.ReadResponse:
    raw = await h.servicer.Read(pb.ReadRequest(**fields), FakeContext(timeout_s))
    assert isinstance(raw, bytes)  # sent as is by the pass-through serializer
    return pb.ReadResponse.FromString(raw)


def test_read_reply_bytes_are_a_valid_read_response(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        await h.servicer.Append(
            pb.AppendRequest(
                stream="s",
                entries=[pb.Entry(payload=b"a", tag="t", headers={"k": b"v"}), pb.Entry(payload=b"b")],
            ),
            FakeContext(),
        )
        reply = await read(h, stream="s", offset=0)
        expected = pb.ReadResponse(
            entries=[
                pb.Entry(
                    offset=0,
                    timestamp_ms=reply.entries[0].timestamp_ms,
                    tag="t",
                    payload=b"a",
                    headers={"k": b"v"},
                ),
                pb.Entry(offset=1, timestamp_ms=reply.entries[1].timestamp_ms, payload=b"b"),
            ],
            first_offset=0,
            next_offset=2,
            end_offset=2,
        )
        assert reply == expected

    run(tmp_path, scenario)


def test_appends_go_to_a_thread_only_for_always_fsync_streams(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        await append(h, "fast", b"a")
        assert h.executor.submitted == 0  # "everysec": a memcpy, done on the loop
        h.engine.create_stream("safe", StreamConfig(fsync="always"))
        await append(h, "safe", b"a")
        assert h.executor.submitted == 1

    run(tmp_path, scenario)


def test_blocking_read_is_woken_by_an_append_from_another_thread(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        waiting = asyncio.create_task(read(h, stream="s", offset=0, block_ms=5000))
        await asyncio.sleep(0.05)
        assert not waiting.done() and h.waiters.count("s") == 1
        # An append made off the loop, as "always" appends are: the wake-up hops threads.
        await asyncio.to_thread(h.engine.append, "s", AppendBatch([b"x"]))
        reply = await asyncio.wait_for(waiting, 2)
        assert [e.payload for e in reply.entries] == [b"x"]
        assert h.waiters.count() == 0

    run(tmp_path, scenario)


def test_blocking_read_respects_block_ms_and_the_deadline(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        await append(h, "s", b"a")
        loop = asyncio.get_running_loop()
        started = loop.time()
        reply = await read(h, stream="s", offset=1, block_ms=200)
        assert 0.19 <= loop.time() - started < 1 and not reply.entries and reply.next_offset == 1
        started = loop.time()
        reply = await read(h, timeout_s=0.3, stream="s", offset=1, block_ms=10_000)
        assert 0.2 <= loop.time() - started < 0.3 and not reply.entries
        assert h.waiters.count() == 0

    run(tmp_path, scenario)


def test_subscribe_yields_start_then_live_batches_then_ends_unavailable_on_close(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        await append(h, "s", b"0", b"1")
        replies = h.servicer.Subscribe(pb.SubscribeRequest(stream="s", offset=0), FakeContext())
        first = pb.SubscribeResponse.FromString(await anext(replies))
        assert [e.offset for e in first.entries] == [0, 1] and first.next_offset == 2
        pending = asyncio.ensure_future(anext(replies))
        await asyncio.sleep(0.05)
        assert not pending.done() and h.servicer.subscriptions == 1
        await append(h, "s", b"2")
        live = pb.SubscribeResponse.FromString(await asyncio.wait_for(pending, 2))
        assert [e.payload for e in live.entries] == [b"2"]
        pending = asyncio.ensure_future(anext(replies))
        await asyncio.sleep(0.05)
        h.servicer.start_draining()
        h.waiters.close()
        with pytest.raises(Aborted) as caught:
            await asyncio.wait_for(pending, 2)
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE
        assert "resubscribe from offset 3" in caught.value.details
        assert h.servicer.subscriptions == 0

    run(tmp_path, scenario)


def test_calls_before_recovery_and_while_draining_are_unavailable(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        fresh = StreamLogServicer(h.settings, h.waiters, h.executor)
        with pytest.raises(Aborted) as caught:
            await fresh.Append(pb.AppendRequest(stream="s", entries=[pb.Entry()]), FakeContext())
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE and "recovering" in caught.value.details
        h.servicer.start_draining()
        with pytest.raises(Aborted) as caught:
            await read(h, stream="s")
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE and "shutting down" in caught.value.details

    run(tmp_path, scenario)


class FailingEngine:
    """The real engine, except that `method` raises `error`."""

    def __init__(self, engine: Engine, method: str, error: BaseException) -> None:
        self._engine, self._method, self._error = engine, method, error

    def __getattr__(self, name: str) -> Any:
        if name == self._method:

            def fail(*args: Any, **kwargs: Any) -> Any:
                raise self._error

            return fail
        return getattr(self._engine, name)


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (DurabilityError("fdatasync failed: EIO"), grpc.StatusCode.UNAVAILABLE),
        (DiskFullError("no space left"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (LimitExceededError("max_batch_bytes", 10, "batch too big"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (PreconditionError("not now"), grpc.StatusCode.FAILED_PRECONDITION),
        (CorruptionError("bad crc"), grpc.StatusCode.DATA_LOSS),
        (RuntimeError("a bug"), grpc.StatusCode.INTERNAL),
    ],
)
def test_engine_errors_map_to_status_codes(tmp_path: Path, error: Exception, code: grpc.StatusCode) -> None:
    async def scenario(h: Harness) -> None:
        h.servicer.attach_engine(FailingEngine(h.engine, "append", error))
        with pytest.raises(Aborted) as caught:
            await append(h, "s", b"a")
        assert caught.value.code == code
        if code == grpc.StatusCode.INTERNAL:
            assert "a bug" not in caught.value.details  # no Python internals leak to clients
        else:
            assert str(error) in caught.value.details

    run(tmp_path, scenario)


def test_read_errors_reach_subscribers_as_statuses(tmp_path: Path) -> None:
    async def scenario(h: Harness) -> None:
        await append(h, "s", b"a")
        h.servicer.attach_engine(FailingEngine(h.engine, "read", CorruptionError("node 3 failed its CRC")))
        replies = h.servicer.Subscribe(pb.SubscribeRequest(stream="s"), FakeContext())
        with pytest.raises(Aborted) as caught:
            await anext(replies)
        assert caught.value.code == grpc.StatusCode.DATA_LOSS
        assert h.servicer.subscriptions == 0

    run(tmp_path, scenario)
