"""Fixtures for the client tests: real servers on loopback (stopped at teardown) and clients."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from clients import Client
from tests.service.helpers import ServerThread, small_settings


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., ServerThread]]:
    """Start servers with the service tests' small settings; every one is stopped at teardown."""
    servers: list[ServerThread] = []

    def start(data_dir: Path | None = None, **overrides: Any) -> ServerThread:
        server = ServerThread(small_settings(data_dir or tmp_path / "data", **overrides))
        servers.append(server)
        return server.start()

    yield start
    for server in reversed(servers):
        server.stop()


@pytest.fixture
def server(start_server: Callable[..., ServerThread]) -> ServerThread:
    return start_server()


@pytest.fixture
def client(server: ServerThread) -> Iterator[Client]:
    with Client(server.target, timeout=10) as c:
        yield c
