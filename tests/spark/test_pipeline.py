"""The Rocket Rides pipeline end to end: double sends and crashing workers, yet every total is exact."""

from __future__ import annotations

import pytest

from examples.rides import pipeline


@pytest.mark.timeout(420)
def test_workers_and_spark_agree_exactly_with_the_ground_truth(spark, tmp_path) -> None:
    # Seed 3 makes both workers' first processes crash within their first three batches
    # and the API send some batches twice: the failures below are certain, not likely.
    report = pipeline.run(1000, tmp_path / "rides", spark=spark, seed=3)
    assert report.double_sent_batches >= 1
    assert report.entries == 1000 + 20 * report.double_sent_batches
    assert all(crashes >= 1 for crashes in report.worker_crashes.values()), report.worker_crashes
    assert report.workers == {"consumer0": report.truth, "consumer1": report.truth}
    assert report.spark == {"total_distance": report.truth, "rides": 1000, "last_ride_id": 1000}
    assert report.agreed
