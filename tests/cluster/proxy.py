"""A TCP proxy for fault injection, on the test's own event loop (no tc/iptables here).

`block()` stops forwarding both ways and holds the bytes, as a partition that TCP rides
out does: the peers see silence, not a reset. `unblock()` lets everything through
again, late bytes included.
"""

from __future__ import annotations

import asyncio
import contextlib


class FaultProxy:
    def __init__(self, target: tuple[str, int]) -> None:
        self._target = target
        self._open = asyncio.Event()
        self._open.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    @property
    def address(self) -> tuple[str, int]:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[:2]

    async def start(self) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self.address

    def block(self) -> None:
        self._open.clear()

    def unblock(self) -> None:
        self._open.set()

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            target_reader, target_writer = await asyncio.open_connection(*self._target)
        except OSError:
            client_writer.close()
            return
        self._writers += [client_writer, target_writer]
        for reader, writer in ((client_reader, target_writer), (target_reader, client_writer)):
            task = asyncio.get_running_loop().create_task(self._pump(reader, writer))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(1 << 16):
                await self._open.wait()
                writer.write(data)
                await writer.drain()
        writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for writer in self._writers:
            writer.close()
        if self._server is not None:
            await self._server.wait_closed()
