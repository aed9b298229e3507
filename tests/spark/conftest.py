"""Fixtures for the Spark connector tests: real servers (the SparkSession, `spark`, is suite-wide:
tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from tests.service.helpers import ServerThread, serve_for_test
from tests.spark.helpers import settings


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., ServerThread]]:
    """Start servers with overrides; every one is stopped at teardown."""
    yield from serve_for_test(tmp_path, settings)


@pytest.fixture
def server(start_server: Callable[..., ServerThread]) -> ServerThread:
    return start_server()


@pytest.fixture
def stub(server: ServerThread) -> Iterator[pb_grpc.StreamLogServiceStub]:
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.StreamLogServiceStub(channel)
