"""A TCP proxy for fault injection, on the test's own event loop (no tc/iptables here).

`block()` stops forwarding and holds the bytes, as a partition that TCP rides out
does: the peers see silence, not a reset. It blocks both ways, or one way only:
`block(TO_TARGET)` holds what the dialing side sends (its requests never arrive)
while replies still flow, `block(FROM_TARGET)` the reverse. `unblock()` lets
everything through again, late bytes included. `reset()` aborts every open
connection at once (both sides see a reset, as when a middlebox drops the
connection's state) and keeps accepting new ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct

TO_TARGET = "to-target"  # from the side that dials the proxy to the proxied server
FROM_TARGET = "from-target"
BOTH = "both"
DIRECTIONS = (TO_TARGET, FROM_TARGET, BOTH)
_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST


class FaultProxy:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target  # where new connections go (settable: a server that moved to another port)
        self._open = {TO_TARGET: asyncio.Event(), FROM_TARGET: asyncio.Event()}
        for gate in self._open.values():
            gate.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._connections: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()

    @property
    def address(self) -> tuple[str, int]:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[:2]

    @property
    def blocked(self) -> set[str]:
        """The directions held now: TO_TARGET and/or FROM_TARGET."""
        return {way for way, gate in self._open.items() if not gate.is_set()}

    @property
    def connections(self) -> int:
        """Connections open through the proxy now."""
        return len(self._connections)

    async def start(self) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self.address

    def block(self, direction: str = BOTH) -> None:
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, not {direction!r}")
        for way, gate in self._open.items():
            if direction in (way, BOTH):
                gate.clear()

    def unblock(self) -> None:
        for gate in self._open.values():
            gate.set()

    def reset(self) -> None:
        """Abort every connection open now; both of its sides see a connection reset."""
        for connection in list(self._connections):
            for writer in connection:
                sock = writer.get_extra_info("socket")
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
                writer.transport.abort()
            self._connections.discard(connection)

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            target_reader, target_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.close()
            return
        connection = (client_writer, target_writer)
        self._connections.add(connection)
        pumps = (
            (client_reader, target_writer, self._open[TO_TARGET]),
            (target_reader, client_writer, self._open[FROM_TARGET]),
        )
        for reader, writer, gate in pumps:
            task = asyncio.get_running_loop().create_task(self._pump(reader, writer, gate, connection))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        gate: asyncio.Event,
        connection: tuple[asyncio.StreamWriter, asyncio.StreamWriter],
    ) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(1 << 16):
                await gate.wait()
                writer.write(data)
                await writer.drain()
        writer.close()
        self._connections.discard(connection)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for connection in self._connections:
            for writer in connection:
                writer.close()
        self._connections.clear()
        if self._server is not None:
            await self._server.wait_closed()
