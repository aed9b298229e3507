"""Fixtures for the service tests. Every server a fixture starts is stopped at teardown."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from tests.service.helpers import ServerThread, serve_for_test


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., ServerThread]]:
    """Start servers with overrides; every one is stopped at teardown."""
    yield from serve_for_test(tmp_path)


@pytest.fixture
def server(start_server: Callable[..., ServerThread]) -> ServerThread:
    return start_server()


@pytest.fixture
def channel(server: ServerThread) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.target) as chan:
        grpc.channel_ready_future(chan).result(timeout=10)
        yield chan


@pytest.fixture
def stub(channel: grpc.Channel) -> pb_grpc.StreamLogServiceStub:
    return pb_grpc.StreamLogServiceStub(channel)
