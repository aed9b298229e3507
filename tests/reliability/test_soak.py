"""The soak run, short: about 40 s of mixed load, then its checks (bench/soak.py).

The full run (`python -m bench.soak`, 30 minutes by default) is for outside CI;
this one proves the harness and catches what shows in the first minute: a lost
or unredelivered entry, a subscriber seeing offsets out of order, a server that
does not exit cleanly, file descriptors that leak.
"""

from __future__ import annotations

import json

import pytest

from bench import soak


@pytest.mark.timeout(300)
def test_short_soak_loses_nothing_and_leaks_no_descriptors(tmp_path):
    assert soak.run(duration_s=40, out=tmp_path, interval_s=4, seed=7)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["acked_entries"] > 10_000 and report["consumer_crashes"] > 0
    assert report["redelivered_entries"] > 0  # the "crashed" consumers' batches came back
    first_fds, last_fds, _ = report["fds_first_last_max"]
    assert last_fds <= first_fds + 4  # segments may roll; descriptors must not pile up
    assert {"rss_mb.png", "fds.png", "loop_lag_ms.png"} <= set(report["plots"])
    assert all((tmp_path / name).stat().st_size > 1000 for name in report["plots"])
