"""Fixtures for the Spark connector tests: one local[2] SparkSession for the whole run, real servers.

Spark starts its Python workers with PYSPARK_PYTHON, so that must be this
interpreter (the one with the project installed); SPARK_LOCAL_IP keeps Spark
on loopback. The repository root goes on PYTHONPATH because Spark looks for
`pyspark_*` modules (its data source auto-discovery) with pkgutil, which sees
path entries and not the editable install's import hook.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from tests.service.helpers import ServerThread, serve_for_test
from tests.spark.helpers import settings

REPO = Path(__file__).resolve().parents[2]


def spark_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARK_LOCAL_IP", "127.0.0.1")
    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)
    monkeypatch.setenv("PYSPARK_DRIVER_PYTHON", sys.executable)
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", f"{REPO}{os.pathsep}{path}" if path else str(REPO))


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from pyspark.errors import PySparkRuntimeError
    from pyspark.sql import SparkSession

    patch = pytest.MonkeyPatch()
    spark_environment(patch)
    warehouse = tmp_path_factory.mktemp("warehouse")
    builder = (
        SparkSession.builder.master("local[2]")
        .appName("streamlog-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.warehouse.dir", str(warehouse))
        .config("spark.ui.showConsoleProgress", "false")
    )
    try:
        session = builder.getOrCreate()
    except PySparkRuntimeError as exc:
        # The JVM launcher occasionally exits at start-up on a loaded machine; one retry.
        if "JAVA_GATEWAY_EXITED" not in str(exc):
            raise
        session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()
        patch.undo()


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
