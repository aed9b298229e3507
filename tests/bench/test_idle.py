"""bench.idle against a real `streamlog serve`, on small counts.

These check the harness, not the figures: every subscriber it counts is open
and idle on the server (by the server's own metrics), and once the clients are
gone the server holds no subscription and no file descriptor more than at start.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _idle(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench.idle", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_subscribers_opened_in_batches_are_all_open_and_idle_then_leave_nothing_behind() -> None:
    # 1,200 subscribers: more than one batch and more than one connection (500 each).
    done = _idle("--connections", "4", "--subscribers", "1200", "--batch", "300")
    assert done.returncode == 0, done.stderr
    figures = {}
    for line in done.stdout.splitlines():
        record = json.loads(line)
        figures.setdefault(record["figure"], []).append(record)
    value = {name: records[-1]["value"] for name, records in figures.items()}

    assert value["idle_subscribers_open_on_server"] == 1200
    assert figures["idle_subscriber_memory"][0]["subscribers"] == 1200
    assert value["idle_subscriber_memory"] > 0
    assert value["idle_subscriber_fds"] == 0  # they share the connections
    assert value["idle_connection_fds"] == 1
    assert value["idle_fds_left_behind"] == 0
    assert value["idle_subscriptions_left_behind"] == 0
    assert "idle_subscribe_failures" not in value


def test_too_few_connections_for_the_subscribers_is_refused() -> None:
    done = _idle("--connections", "1", "--subscribers", "501")
    assert done.returncode == 2
    assert "--connections must be at least 2" in done.stderr
