"""bench.scrapecost on a few streams: it checks the harness, not the figures (every figure
printed, the trace's too), and that the scrape left one group store: the one stream with a group."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_small_run_prints_every_figure_and_one_group_store() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.scrapecost", "--streams", "40", "--scrapes", "2", "--trace"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    figures = {line["figure"]: line["value"] for line in map(json.loads, done.stdout.splitlines())}
    assert sorted(figures) == [
        "consumer-group stores",
        "first scrape: CPU",
        "first scrape: RssAnon added",
        "first scrape: bytes left allocated",
        "groups' round: CPU",
        "later scrape: CPU (mean)",
    ]
    assert figures["consumer-group stores"] == 1
