"""Suite-wide settings and the one SparkSession of the run.

Under CI (the `CI` environment variable, set by the CI runner) hypothesis
derandomizes: every run tries the same examples, so a run's verdict depends on
the change under test, not on the draw. Local runs keep exploring new examples
(and remember failures in .hypothesis/).

The `spark` fixture is a local[2] SparkSession shared by the whole run (the
connector's tests and the documentation's PySpark snippets), started only when a
test asks for it. Spark starts its Python workers with PYSPARK_PYTHON, so that
must be this interpreter (the one with the project installed); SPARK_LOCAL_IP
keeps Spark on loopback. The repository root goes on PYTHONPATH because Spark
looks for `pyspark_*` modules (its data source auto-discovery) with pkgutil,
which sees path entries and not the editable install's import hook.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


REPO = Path(__file__).resolve().parents[1]
# A test that asks for `spark` may start its JVM (the first one to ask does), and Spark's jobs
# are slow on a loaded machine: under a CPU hog the session's start alone passed the suite's
# 120 s per test. Such tests get this long unless they say otherwise.
SPARK_TEST_TIMEOUT_S = 600


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "spark" in getattr(item, "fixturenames", ()) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SPARK_TEST_TIMEOUT_S))


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
