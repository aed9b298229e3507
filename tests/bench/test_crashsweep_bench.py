"""bench.crashsweep on a few crash points: the harness, not the figures (the sweep's own checks
are tests/storage/test_crash_sweep.py's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import crashsweep

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_sweep_reports_each_variant_it_ran_and_exits_0() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.crashsweep", "--points", "100", "--variant", "no-power"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["figure"], r["variant"]) for r in records] == [
        ("crash_points_checked", "no-power"),
        ("crash_points_failed", "no-power"),
    ]
    assert records[0]["value"] >= 1 and records[1]["value"] == 0


def run_here(monkeypatch, *args: str) -> None:
    """bench.crashsweep's main in this process, its global settings undone afterwards."""
    monkeypatch.setenv("STREAMLOG_CRASH_POINTS", "1")  # main sets it: restored at teardown
    monkeypatch.setattr(crashsweep.logging, "disable", lambda level: None)
    monkeypatch.setattr(sys, "argv", ["crashsweep", *args])
    crashsweep.main()


def test_a_failed_crash_point_is_named_on_stderr_and_fails_the_run(monkeypatch, capsys) -> None:
    failures = ["seed 7 point 2: lost"]
    monkeypatch.setattr(crashsweep, "sweep", lambda variant: (3, failures, 0, 1))
    with pytest.raises(SystemExit) as ended:
        run_here(monkeypatch, "--variant", "always-power")
    assert ended.value.code == 1
    assert "always-power: seed 7 point 2: lost" in capsys.readouterr().err


def test_an_unknown_variant_is_refused(monkeypatch) -> None:
    with pytest.raises(SystemExit) as ended:
        run_here(monkeypatch, "--variant", "nope")
    assert ended.value.code == 2
