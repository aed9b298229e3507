"""bench.cluster's parts on tiny sizes: each figure comes out well-formed, and each check runs and can fail.

These check the harness, not the speed: the Redis anchor (a primary and its replica, every XADD
pipeline followed by WAIT 1 0, the replica's XLEN checked), the append routes of both clusters,
1 member vs 2 (both figures, not their ratio), and the failover run (one kill, 2 s leases, every
acknowledged entry read back). Bounded by
timeouts; about half a minute in all on an idle machine.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import cluster, failover, members
from bench import redis_baseline as rb
from tests.clients.nodejs import needs_node, npm_install
from tests.cluster.etcd_server import EtcdCluster
from tests.cluster.helpers import TEST_TTL_MS


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdCluster]:
    with cluster.etcd(tmp_path / "etcd") as running:
        yield running


def records(capsys: pytest.CaptureFixture[str]) -> list[dict]:
    """The figures emitted so far (one JSON object per stdout line)."""
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def by_figure(emitted: list[dict], figure: str, **labels: object) -> list[dict]:
    return [r for r in emitted if r["figure"] == figure and all(r.get(k) == v for k, v in labels.items())]


def positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.timeout(60)
def test_redis_with_a_replica_waits_for_it_and_the_replica_holds_every_entry(
    redis_exe: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with rb.primary_with_replica("everysec", executable=redis_exe) as (primary, replica):
        assert replica.client().info("replication")["role"] == "slave"
        assert replica.client().config_get("appendfsync")["appendfsync"] == "everysec"
        redis_wait = cluster.RedisWait(primary, replica)
        unary, batched = redis_wait.call([b"x" * 100]), redis_wait.call([b"y" * 100] * 1000)
        cluster.measure({cluster.REDIS_ROUTE: unary}, {cluster.REDIS_ROUTE: batched}, calls=30, batches=3)
        redis_wait.close()
        assert redis_wait.check() == 30 + 3 + 3 * 1000  # warm-up, unary calls, batches
        emitted = records(capsys)
        for percentile in ("50", "99"):
            [latency] = by_figure(emitted, "append_latency", route=cluster.REDIS_ROUTE, percentile=percentile)
            assert latency["unit"] == "us" and 0 < latency["value"] < 1e6
        [calls] = by_figure(emitted, "append_calls", route=cluster.REDIS_ROUTE)
        [append] = by_figure(emitted, "append", route=cluster.REDIS_ROUTE)
        assert positive(calls["value"]) and positive(append["value"]) and append["batch"] == 1000

        # A "replica" that is not one does not hold the entries: the check refuses the figure.
        with (
            rb.RedisServer("everysec", executable=redis_exe) as stranger,
            pytest.raises(AssertionError, match="XLEN on the primary, the replica"),
        ):
            cluster.RedisWait(primary, stranger).check()


@pytest.mark.timeout(120)
def test_every_route_of_both_clusters_and_redis_gets_its_figures(
    etcd: EtcdCluster, redis_exe: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster.figures(etcd, calls=20, batches=2)
    emitted = records(capsys)
    routes = ("single server", "leader", "forwarded", "leader rf3", cluster.REDIS_ROUTE)
    for route in routes:
        assert [r["percentile"] for r in by_figure(emitted, "append_latency", route=route)] == ["50", "99"]
        assert len(by_figure(emitted, "append_calls", route=route)) == 1
        assert len(by_figure(emitted, "append", route=route, batch=1000, payload_bytes=100)) == 1
    [replica] = by_figure(emitted, "redis_replica_entries")
    assert replica["value"] == 2 + 20 + 2 * 1000 and replica["aof"] == "everysec"
    for record in emitted:
        assert positive(record["value"]), record


@needs_node
@pytest.mark.timeout(300)
def test_one_member_and_two_each_get_a_figure_per_load_and_their_ratio(
    etcd: EtcdCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    npm_install()
    # Pinned (each member on a core of its own): the unpinned run differs only in not pinning.
    ratios = cluster.member_counts(etcd, rounds=1, seconds=1.0, in_flight=8, pinned=True)
    emitted = records(capsys)
    assert set(ratios) == set(members.RPCS) == {"Append", "Publish", "Append/h2load"}
    for rpc in members.RPCS:
        one, two = (by_figure(emitted, "members_appends", members=count, rpc=rpc) for count in (1, 2))
        assert len(one) == len(two) == 1
        # The two-member cluster placed the streams on both members.
        assert one[0]["streams_led"] == {"m1": members.STREAMS}
        led = two[0]["streams_led"]
        assert set(led) == {"m1", "m2"} and sum(led.values()) == members.STREAMS
        # Member i on the i-th core the test may use (its own: a core listed alone).
        cores = sorted(os.sched_getaffinity(0))
        assert sorted(one[0]["cores"].values()) == [str(cores[0])]
        assert sorted(two[0]["cores"].values()) == sorted(str(cores[i % len(cores)]) for i in range(2))
        for figure in (one[0], two[0]):
            assert figure["unit"] == "calls/s" and positive(figure["value"]) and figure["pinned"] is True
            assert positive(figure["server_cpu_us_per_call"]) and positive(figure["client_cpu_us_per_call"])
        [ratio] = by_figure(emitted, "members_ratio", rpc=rpc)
        assert ratio["value"] == pytest.approx(two[0]["value"] / one[0]["value"])
        assert ratio["value"] == pytest.approx(ratios[rpc])


def test_the_loss_check_finds_a_lost_a_moved_and_a_doubled_entry() -> None:
    acks = [failover.Ack(sequence, sequence, 0.0, 0.0) for sequence in range(4)]
    stored = {offset: failover.payload(offset) for offset in range(4)}
    assert failover.check_nothing_lost(acks, stored) == failover.LossCheck(4, 4, [], [])
    stored[1] = failover.payload(2)  # offset 1 holds another entry, which is now there twice
    del stored[3]
    checked = failover.check_nothing_lost(acks, stored)
    assert checked.lost == [acks[1], acks[3]] and checked.duplicated == [failover.payload(2)]
    with pytest.raises(AssertionError, match=r"2 acknowledged entries lost.*1 payloads stored twice"):
        checked.raise_if_broken()


@pytest.mark.timeout(120)
def test_a_killed_leader_is_timed_replaced_and_rejoins_and_nothing_acknowledged_is_lost(
    etcd: EtcdCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plot = tmp_path / "plots" / "failover.png"
    summary = failover.run(
        etcd.endpoints, tmp_path / "nodes", failovers=1, lease_ttl_ms=TEST_TTL_MS, plot=plot
    )
    emitted = records(capsys)
    [kill] = by_figure(emitted, "failover", kill=1)
    assert kill["killed"] in failover.NODES and kill["new_leader"] in failover.NODES
    assert kill["new_leader"] != kill["killed"] and kill["leader_epoch"] >= 2
    # The new leader waits for the dead one's lease to expire: it cannot answer sooner.
    assert TEST_TTL_MS / 1000 / 2 < kill["value"] < failover.FAILOVER_LIMIT_S
    assert kill["rejoin_s"] >= 0 and kill["lease_ttl_ms"] == TEST_TTL_MS
    assert summary == {"50": kill["value"], "99": kill["value"], "max": kill["value"]}
    assert {r["percentile"]: r["value"] for r in by_figure(emitted, "failover", kills=1)} == summary
    [checked] = by_figure(emitted, "failover_acknowledged_entries")
    assert checked["value"] > 0 and checked["lost"] == checked["duplicated"] == 0
    assert checked["stream_entries"] >= checked["value"]
    # The throughput plot: a PNG of the whole run, one bin per 100 ms.
    [drawn] = by_figure(emitted, "failover_plot")
    assert drawn["path"] == str(plot) and drawn["bin_ms"] == 100 and drawn["value"] > kill["value"] * 10
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000


def test_acknowledged_appends_are_counted_in_the_100_ms_bin_they_came_in() -> None:
    acks = [failover.Ack(i, i, 0.0, at) for i, at in enumerate([10.0, 10.05, 10.31, 10.99, 11.2])]
    assert failover.acknowledged_per_bin(acks, 10.0, 11.0) == [2, 0, 0, 1, 0, 0, 0, 0, 0, 1]
    assert failover.acknowledged_per_bin(acks, 10.3, 10.45) == [1, 0]
