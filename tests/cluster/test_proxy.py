"""The fault proxy: it forwards, holds bytes both ways or one way only, and resets connections.

Absence is shown the only way it can be, by a short bounded wait (HOLD_S) that must
see nothing; every presence is waited for as an event.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.cluster.helpers import run
from tests.cluster.proxy import FROM_TARGET, TO_TARGET, FaultProxy

HOLD_S = 0.3


class Target:
    """A server that queues what each connection sends and can write to the latest connection."""

    def __init__(self) -> None:
        self.received: asyncio.Queue[bytes] = asyncio.Queue()
        self.writers: list[asyncio.StreamWriter] = []
        self.ended: asyncio.Queue[type[BaseException] | None] = asyncio.Queue()
        self.server: asyncio.Server | None = None

    async def start(self) -> tuple[str, int]:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[:2]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        try:
            while data := await reader.read(1024):
                await self.received.put(data)
            await self.ended.put(None)
        except OSError as exc:
            await self.ended.put(type(exc))

    def send(self, data: bytes) -> None:
        self.writers[-1].write(data)

    async def stop(self) -> None:
        for writer in self.writers:
            writer.close()
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


async def nothing_within(queue: asyncio.Queue[bytes]) -> bool:
    try:
        await asyncio.wait_for(queue.get(), HOLD_S)
    except TimeoutError:
        return True
    return False


async def setup() -> tuple[Target, FaultProxy, asyncio.StreamReader, asyncio.StreamWriter]:
    target = Target()
    proxy = FaultProxy(await target.start())
    reader, writer = await asyncio.open_connection(*await proxy.start())
    writer.write(b"hello")
    assert await target.received.get() == b"hello"
    assert proxy.connections == 1
    return target, proxy, reader, writer


async def teardown(target: Target, proxy: FaultProxy, writer: asyncio.StreamWriter) -> None:
    writer.close()
    await proxy.stop()
    await target.stop()


def test_one_way_block_holds_requests_and_lets_replies_through():
    async def scenario() -> None:
        target, proxy, reader, writer = await setup()
        proxy.block(TO_TARGET)
        writer.write(b"request")
        target.send(b"reply")
        assert await reader.readexactly(5) == b"reply"
        assert await nothing_within(target.received)
        proxy.unblock()
        assert await target.received.get() == b"request"  # late, not lost
        await teardown(target, proxy, writer)

    run(scenario())


def test_the_other_way_holds_replies_and_lets_requests_through():
    async def scenario() -> None:
        target, proxy, reader, writer = await setup()
        proxy.block(FROM_TARGET)
        target.send(b"reply")
        writer.write(b"request")
        assert await target.received.get() == b"request"
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.readexactly(5), HOLD_S)
        proxy.unblock()
        assert await reader.readexactly(5) == b"reply"
        await teardown(target, proxy, writer)

    run(scenario())


def test_block_both_ways_is_silence():
    async def scenario() -> None:
        target, proxy, reader, writer = await setup()
        proxy.block()
        writer.write(b"request")
        target.send(b"reply")
        assert await nothing_within(target.received)
        proxy.unblock()
        assert await target.received.get() == b"request"
        assert await reader.readexactly(5) == b"reply"
        with pytest.raises(ValueError, match="direction"):
            proxy.block("sideways")
        await teardown(target, proxy, writer)

    run(scenario())


def test_reset_aborts_open_connections_and_new_ones_still_pass():
    async def scenario() -> None:
        target, proxy, reader, writer = await setup()
        proxy.reset()
        with pytest.raises(ConnectionResetError):
            await reader.read(1)
        assert await target.ended.get() is ConnectionResetError
        assert proxy.connections == 0
        writer.close()
        reader, writer = await asyncio.open_connection(*proxy.address)
        writer.write(b"again")
        assert await target.received.get() == b"again"
        await teardown(target, proxy, writer)

    run(scenario())
