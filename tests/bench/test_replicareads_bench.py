"""bench.replicareads on tiny sizes: every route's figure comes out, and the followers' reads are
served where they were sent (the bench asks for a redirect: one not served there fails the run)."""

from __future__ import annotations

import json

import pytest

from bench import replicareads


@pytest.mark.timeout(120)
def test_every_route_gets_its_read_figure(capsys: pytest.CaptureFixture[str]) -> None:
    replicareads.run(entries=3 * replicareads.PAGE, calls=3, seconds=0.5, rounds=1)
    emitted = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    routes = ["leader", "follower", "3 readers on the leader", "3 readers, one per replica"]
    assert [r["route"] for r in emitted] == routes
    for record in emitted:
        assert (record["figure"], record["unit"], record["page"]) == ("read", "entries/s", 1000), record
        assert record["value"] > 0, record
