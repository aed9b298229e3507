"""The chaos bench, short (bench/chaos.py): faults every few seconds under load, then the history checked.

The full run (`python -m bench.chaos --duration 1800`) is for outside CI. These
runs prove the harness and the configurations it runs today:

- a single server under every fault it can survive (kill, pause, power loss,
  a full disk, its clients' link cut or reset): nothing acknowledged is lost,
  no offset holds two entries, the group's acks stick and it gets everything;
- the same bench with fsync=no and power losses must fail, and says why: the
  checker is not a rubber stamp;
- a cluster of three nodes (etcd, routing, forwarding, every stream on three
  replicas) under the cluster's faults too: partitions between nodes and from
  etcd, etcd members killed, power loss of one node and of every node at once,
  a node's data directory wiped.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from bench import chaos
from bench.nemesis import kinds_for
from bench.workload import WorkloadConfig

# Bigger entries than the default, so that segments fill within seconds and a full disk bites.
WORKLOAD = WorkloadConfig(payload_bytes=400, seed=1)


def run_chaos(tmp_path, duration_s: float, **options) -> chaos.ChaosRun:
    options.setdefault("workload", WORKLOAD)
    return asyncio.run(chaos.chaos(tmp_path, duration_s, **options))


@pytest.mark.timeout(300)
def test_a_single_server_under_every_fault_it_survives_loses_nothing_acknowledged(tmp_path):
    kinds = kinds_for(nodes=1, replication_factor=1, fsync="always")
    assert kinds == ["kill", "pause", "partition-client", "reset", "power", "disk-full"]
    result = run_chaos(tmp_path, 35, nodes=1, seed=15, min_faults=8, min_acked=2001)
    assert result.ok, result.summary()
    assert set(result.faults) == set(kinds) and sum(result.faults.values()) >= 8
    assert result.report.stats["entries_acked"] > 2000
    counts = result.history.counts()
    assert counts["append"]["unknown"] > 0  # faults cut calls off: the history holds unknown outcomes
    assert counts["drain"] == {"ok": len(WORKLOAD.streams)}


@pytest.mark.timeout(180)
def test_the_bench_fails_and_says_why_when_acknowledged_entries_are_lost(tmp_path, capsys):
    code = chaos.main(["--duration=12", "--nodes=1", "--fsync=no", "--faults=power", f"--out={tmp_path}"])
    assert code == 1
    report = json.loads((tmp_path / "report.json").read_text())
    assert not report["ok"] and report["faults"] == {"power": report["faults"]["power"]}
    assert report["violations"]["lost"] > 0
    out = capsys.readouterr().out
    assert "[a:lost] acknowledged b'p0-chaos-" in out and "since: fault 0 power n1" in out
    assert (tmp_path / "history.jsonl").stat().st_size > 0


@pytest.mark.timeout(400)
def test_a_three_node_cluster_under_every_fault_it_survives_loses_nothing_acknowledged(tmp_path):
    """Streams on three replicas (acks=quorum): a stream whose leader is killed, paused, cut off or
    wiped gets a new leader from its in-sync replicas, and nothing acknowledged is lost. Calls go
    through any node: routed to the stream's leader or forwarded there. Each stream's consumer
    group carries on across failovers (its state replicated): no ack undone, and it drains."""
    kinds = kinds_for(nodes=3, replication_factor=3, fsync="always")
    assert {
        "partition",
        "partition-one-way",
        "partition-etcd",
        "etcd-leader-kill",
        "power-all",
        "wipe",
    } <= set(kinds)
    result = run_chaos(
        tmp_path,
        60,
        nodes=3,
        seed=15,
        interval_s=(0.5, 1.5),
        replication_factor=3,
        min_faults=12,
        min_acked=1001,
    )
    assert result.ok, result.summary()
    assert sum(result.faults.values()) >= 12
    assert result.report.stats["entries_acked"] > 1000
    assert result.history.counts()["drain"] == {"ok": len(WORKLOAD.streams)}  # each group drained
