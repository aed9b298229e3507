"""Fixtures for the client tests: real servers on loopback (stopped at teardown) and clients."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from clients import Client
from tests.service.helpers import ServerThread, serve_for_test


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., ServerThread]]:
    """Start servers with overrides; every one is stopped at teardown."""
    yield from serve_for_test(tmp_path)


@pytest.fixture
def server(start_server: Callable[..., ServerThread]) -> ServerThread:
    return start_server()


@pytest.fixture
def client(server: ServerThread) -> Iterator[Client]:
    with Client(server.target, timeout=10) as c:
        yield c
