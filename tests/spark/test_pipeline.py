"""The Rocket Rides pipeline end to end: double sends and crashing workers, yet every total is exact."""

from __future__ import annotations

import re
import tempfile
from decimal import Decimal
from pathlib import Path

import pytest

from examples.rides import pipeline, worker


@pytest.mark.timeout(420)
def test_workers_and_spark_agree_exactly_with_the_ground_truth(spark, tmp_path) -> None:
    # Seed 3 makes both workers' first processes crash within their first three batches
    # and the API send some batches twice: the failures below are certain, not likely.
    progress: list[str] = []
    report = pipeline.run(
        1000, tmp_path / "rides", spark=spark, seed=3, progress=progress.append, progress_every_s=0.5
    )
    assert report.double_sent_batches >= 1
    assert report.entries == 1000 + 20 * report.double_sent_batches
    assert all(crashes >= 1 for crashes in report.worker_crashes.values()), report.worker_crashes
    assert report.workers == {"consumer0": report.truth, "consumer1": report.truth}
    assert report.spark == {"total_distance": report.truth, "rides": 1000, "last_ride_id": 1000}
    assert report.agreed
    # Totals so far, every half second while it ran: the log, each worker, and Spark once it had read.
    assert progress, "no progress was reported"
    line = re.compile(
        r"\[\d+s\] log [\d,]+ entries; consumer0 [\d,]+ handled \(\d+ crash(es)?\); "
        r"consumer1 [\d,]+ handled \(\d+ crash(es)?\)(; spark [\d,]+ read)?$"
    )
    assert all(line.match(text) for text in progress), progress
    assert any("spark" in text for text in progress), progress


@pytest.mark.timeout(600)
def test_on_a_cluster_the_totals_agree_after_the_leader_is_killed(spark, tmp_path) -> None:
    # python -m examples.rides --cluster, shorter: 600 rides, 2 s leases for a quicker failover.
    report = pipeline.run(600, tmp_path / "rides", spark=spark, seed=3, cluster={"lease_ttl_ms": "2000"})
    assert re.fullmatch(
        r"killed n[123] \(kill -9\), the leader of rocket-rides-log, after 300 rides", report.failover
    )
    assert report.workers == {"consumer0": report.truth, "consumer1": report.truth}
    assert report.spark == {"total_distance": report.truth, "rides": 600, "last_ride_id": 600}
    assert report.agreed


@pytest.mark.parametrize("agreed", [True, False])
def test_main_removes_its_temporary_directory_unless_the_run_failed(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, agreed: bool
) -> None:
    """The pipeline itself is the test above; here `run` is replaced to check what main leaves behind."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen: list[Path] = []

    def run(rides: int, data_dir: Path, **options: object) -> pipeline.Report:
        (data_dir / "server").mkdir()  # what a run leaves: the server's data, databases, checkpoints
        seen.append(data_dir)
        truth = Decimal("1.5")
        spark = {"total_distance": truth if agreed else Decimal(0), "rides": rides, "last_ride_id": rides}
        return pipeline.Report(rides, rides, 0, truth, {"consumer0": truth}, {"consumer0": 0}, spark)

    monkeypatch.setattr(pipeline, "run", run)
    assert pipeline.main(["--rides", "3"]) == (0 if agreed else 1)
    [data_dir] = seen
    assert data_dir.parent == tmp_path
    err = capsys.readouterr().err
    if agreed:
        assert not data_dir.exists() and err == ""
    else:
        assert data_dir.exists() and f"working directory kept for inspection: {data_dir}" in err


def test_a_worker_crashes_as_its_seed_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """The supervisor's --crash-seed reaches the worker, so the crashes of the test above are certain."""
    seen: dict[str, object] = {}
    monkeypatch.setattr(worker, "run", lambda *args, **options: seen.update(options) or 0)
    argv = ["--endpoint", "127.0.0.1:1", "--name", "consumer0", "--db", "x.db"]
    argv += ["--crash-seed", "3-consumer0-0"]
    assert worker.main(argv) == 0
    assert seen["crash_seed"] == "3-consumer0-0"
