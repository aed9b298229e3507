"""Helpers for the service tests: settings, a fake servicer context, real servers.

A real server runs in its own thread with its own event loop, on 127.0.0.1 and a
port the OS picks, so tests talk to it over real gRPC with ordinary (blocking)
clients, or with grpc.aio clients on the test's own loop, as separate processes
would.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import grpc
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from service.config import Settings
from service.server import StreamLogServer

# Small enough that tests seal nodes, roll segments and hit every limit quickly.
SMALL = dict(
    segment_bytes=1 << 20,
    node_entries=16,
    max_entry_bytes=4 << 10,
    max_batch_entries=100,
    max_batch_bytes=64 << 10,
    max_message_bytes=1 << 20,
    max_append_many_batches=20,
    max_append_many_bytes=128 << 10,
    max_read_bytes=256 << 10,
    default_read_bytes=64 << 10,
    max_read_entries=500,
    subscribe_batch_entries=200,
    max_block_ms=10_000,
    max_ack_offsets=10,
    default_page_size=3,
    max_page_size=5,
    shutdown_grace_ms=2_000,
    append_threads=2,
)


def small_settings(data_dir: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {**SMALL, "data_dir": data_dir, "port": 0, "log_level": "warning"}
    values.update(overrides)
    return Settings(**values)


class Aborted(Exception):
    """What FakeContext.abort raises: the status a real server would send."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: tuple = ()) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.trailing_metadata = trailing_metadata


class FakeContext:
    """The parts of grpc.aio.ServicerContext the servicer uses, for calling it directly.

    grpcio-testing cannot drive grpc.aio servicers (grpc/grpc#24942), so servicer
    tests call the handlers with this instead.
    """

    def __init__(self, timeout_s: float | None = None) -> None:
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.done_callbacks: list[Callable[[FakeContext], None]] = []

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def add_done_callback(self, callback: Callable[[FakeContext], None]) -> None:
        self.done_callbacks.append(callback)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: tuple = ()) -> None:
        raise Aborted(code, details, trailing_metadata)

    def time_remaining(self) -> float | None:
        if self._deadline is None:
            return None
        return max(self._deadline - time.monotonic(), 0.0)


class ServerThread:
    """A StreamLogServer on its own event loop in a background thread."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-server", daemon=True)
        self.server = StreamLogServer(settings)
        self.stopped = False

    def start(self) -> ServerThread:
        self._thread.start()
        self.run(self.server.start(), timeout_s=30)
        return self

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float = 10) -> Any:
        """Run a coroutine on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def call(self, function: Callable[[], Any], timeout_s: float = 10) -> Any:
        """Run a plain function on the server's loop thread (to look at loop-owned state)."""

        async def wrapper() -> Any:
            return function()

        return self.run(wrapper(), timeout_s)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        try:
            self.run(self.server.stop(), timeout_s=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            self.loop.close()


def append(
    stub: pb_grpc.StreamLogServiceStub, stream: str, *payloads: bytes, **entry: Any
) -> pb.AppendResponse:
    """Append payloads (each entry also gets the `entry` fields) and return the reply."""
    entries = [pb.Entry(payload=p, **entry) for p in payloads]
    return stub.Append(pb.AppendRequest(stream=stream, entries=entries), timeout=10)


def payloads_of(reply: pb.ReadResponse | pb.SubscribeResponse) -> list[bytes]:
    return [e.payload for e in reply.entries]


def serve_for_test(
    tmp_path: Path, make_settings: Callable[..., Settings] | None = None
) -> Iterator[Callable[..., ServerThread]]:
    """The body of a `start_server` fixture: start servers (settings from `make_settings`, by
    default the small ones) with overrides; every one is stopped at teardown."""
    make_settings = make_settings or small_settings
    servers: list[ServerThread] = []

    def start(data_dir: Path | None = None, **overrides: Any) -> ServerThread:
        server = ServerThread(make_settings(data_dir or tmp_path / "data", **overrides))
        servers.append(server)
        return server.start()

    yield start
    for server in reversed(servers):
        server.stop()
