"""Chaos run: a workload under injected faults, then every replica's log checked against what clients saw.

    python -m bench.chaos --duration S [--nodes 1|3|5] [--seed N] [--faults KIND,...]
                          [--replication-factor R] [--fsync always|everysec|no] [--out DIR]

Starts the processes (bench/testbed.py: etcd and the nodes, a fault proxy on every
link; `--nodes 1` is a single server without etcd), the workload (bench/workload.py:
idempotent producers retrying through failures, readers, a consumer group) and the
nemesis (bench/nemesis.py: a fault every few seconds) for S seconds. Then it heals
everything, waits for the cluster to settle (every node alive, every stream led,
every replica in sync once replication reports it), drains the consumer group,
stops the nodes, reads each node's data directory offline and checks the history
(bench/checker.py). `--faults` defaults to the kinds the configuration survives
without losing an acknowledged entry (nemesis.kinds_for).

Prints the operations, the faults by kind and the checker's verdict (each
violation with the operation that broke it and the faults before it), then one
JSON line (bench.common.emit). Writes history.jsonl and report.json into the
output directory, beside the nodes' logs and data directories (a temporary
directory when --out is not given, kept when the run fails). Exit status 1 on
any violation or if the run could not finish cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.checker import FinalStream, Report, check
from bench.common import emit
from bench.history import History
from bench.nemesis import KINDS, Nemesis, kinds_for
from bench.replicalogs import cluster_streams, read_replica, single_server_streams
from bench.testbed import Testbed, TestbedConfig
from bench.workload import Workload, WorkloadConfig
from clients import AsyncClient
from clients.errors import StreamlogError

SETTLE_TIMEOUT_S = 60.0
DRAIN_TIMEOUT_S = 120.0


@dataclass
class ChaosRun:
    """What a run produced: the history, the checker's report, the faults, and anything that kept it
    from finishing cleanly (`problems`: a stream not settled, a group not drained, storage damage)."""

    history: History
    report: Report
    faults: dict[str, int]
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.report.ok and not self.problems

    def summary(self) -> str:
        lines = []
        for kind, statuses in sorted(self.history.counts().items()):
            lines.append(
                f"{kind:>10}: " + ", ".join(f"{status} {n}" for status, n in sorted(statuses.items()))
            )
        total = sum(self.faults.values())
        lines.append(f"faults ({total}): " + ", ".join(f"{k} {n}" for k, n in sorted(self.faults.items())))
        lines.append("checker: " + ", ".join(f"{k} {v}" for k, v in self.report.stats.items()))
        lines += [f"note: {note}" for note in self.notes]
        lines += [f"PROBLEM: {problem}" for problem in self.problems]
        lines.append(self.report.text(self.history))
        return "\n".join(lines)


async def _describe(testbed: Testbed):
    """DescribeCluster from the first node that answers (called directly, not through a proxy)."""
    for node in testbed.nodes.values():
        try:
            async with AsyncClient(node.address) as client:
                return await client.describe_cluster(timeout=5)
        except StreamlogError:
            continue
    return None


def _settled(description, testbed: Testbed, streams: tuple[str, ...]) -> list[str]:
    """Why the cluster is not settled yet (empty: settled)."""
    if description is None:
        return ["no node answers DescribeCluster"]
    alive = {node.id for node in description.nodes if node.alive}
    waiting = [f"node {name} is not alive" for name in testbed.nodes if name not in alive]
    placements = {placement.name: placement for placement in description.streams}
    for stream in streams:
        placement = placements.get(stream)
        if placement is None or placement.leader not in alive:
            waiting.append(f"stream {stream} has no live leader")
        elif placement.progress and set(placement.in_sync_replicas) != set(placement.replicas):
            # Replication reports progress: every replica must be back in sync.
            waiting.append(f"stream {stream}: in sync {placement.in_sync_replicas} of {placement.replicas}")
    return waiting


async def settle(
    testbed: Testbed, streams: tuple[str, ...], timeout_s: float = SETTLE_TIMEOUT_S
) -> list[str]:
    """Wait until the cluster is settled; what was still wrong if it never was (empty: settled)."""
    deadline = time.monotonic() + timeout_s
    while True:
        waiting = _settled(await _describe(testbed), testbed, streams)
        if not waiting or time.monotonic() > deadline:
            return waiting
        await asyncio.sleep(0.25)  # other processes' state: nothing here is told when it changes


async def chaos(
    directory: Path,
    duration_s: float,
    *,
    nodes: int = 3,
    seed: int = 0,
    faults: list[str] | None = None,
    replication_factor: int = 1,
    fsync: str = "always",
    interval_s: tuple[float, float] = (1.0, 3.0),
    workload: WorkloadConfig | None = None,
    min_faults: int = 0,
    min_acked: int = 0,
) -> ChaosRun:
    """Run the workload under faults for `duration_s`, and on until at least `min_faults` faults
    were injected and `min_acked` entries acknowledged (the tests' bounds on a loaded machine)."""
    rng = random.Random(seed)
    bed_config = TestbedConfig(nodes=nodes, fsync=fsync, replication_factor=replication_factor, seed=seed)
    kinds = faults or kinds_for(nodes, replication_factor, fsync, bed_config.etcd_members)
    work_config = workload or WorkloadConfig(seed=seed)
    history = History()
    testbed = Testbed(directory, bed_config)
    problems: list[str] = []
    notes: list[str] = []
    try:
        await testbed.start()
        load = Workload(history, testbed.client_addresses, work_config)
        await load.setup()
        nemesis = Nemesis(testbed, history, kinds, rng, interval_s=interval_s)
        stop = asyncio.Event()
        load.start()
        injecting = asyncio.ensure_future(nemesis.run(stop, min_faults))
        await asyncio.sleep(duration_s)
        await load.wait_acked(min_acked, timeout_s=300)
        stop.set()
        await injecting  # the fault under way is healed: every node runs, every link is open
        placements = None
        if testbed.clustered:
            waiting = await settle(testbed, work_config.streams)
            problems += [f"not settled after {SETTLE_TIMEOUT_S} s: {why}" for why in waiting]
        await load.stop()
        if not await load.drain(DRAIN_TIMEOUT_S):
            problems.append(f"the consumer group did not drain within {DRAIN_TIMEOUT_S} s")
        await load.close()
        if testbed.clustered:
            description = await _describe(testbed)
            placements = {p.name: p for p in description.streams} if description is not None else {}
        await testbed.stop()
    finally:
        testbed.abandon()
    streams, storage_problems, stray = final_state(testbed, placements)
    problems += storage_problems
    notes += [f"stream {stream} has a copy on {node}, not one of its replicas" for stream, node in stray]
    return ChaosRun(history, check(history, streams), dict(nemesis.injected), problems, notes)


def final_state(
    testbed: Testbed, placements
) -> tuple[dict[str, FinalStream], list[str], list[tuple[str, str]]]:
    """Every stream's final state from the stopped nodes' data directories, the storage problems found,
    and the (stream, node) copies held outside the stream's replicas."""
    logs_by_node = {}
    problems = []
    for name, node in testbed.nodes.items():
        logs, found = read_replica(node.data_dir, name)
        logs_by_node[name] = logs
        problems += [f"node {name}: {problem}" for problem in found]
    if placements is None:
        (logs,) = logs_by_node.values()
        return single_server_streams(logs), problems, []
    streams, stray = cluster_streams(logs_by_node, placements)
    return streams, problems, stray


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--duration", type=float, default=300, help="seconds of load and faults (default 300)"
    )
    parser.add_argument(
        "--nodes", type=int, default=3, help="1: a single server; 3 or 5: a cluster (default 3)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--faults",
        help=f"comma-separated kinds among {', '.join(KINDS)} (default: all the configuration survives)",
    )
    parser.add_argument("--replication-factor", type=int, default=1)
    parser.add_argument("--fsync", choices=("always", "everysec", "no"), default="always")
    parser.add_argument(
        "--group-workers",
        type=int,
        default=WorkloadConfig.workers_per_stream,
        help="consumer-group workers per stream (0: no group; default %(default)s)",
    )
    parser.add_argument("--out", type=Path, help="directory for the run's files (default: a temporary one)")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="streamlog-chaos-"))
    out.mkdir(parents=True, exist_ok=True)
    faults = args.faults.split(",") if args.faults else None
    print(
        f"chaos: {args.nodes} nodes, replication factor {args.replication_factor}, fsync {args.fsync}, "
        f"seed {args.seed}, {args.group_workers} group workers per stream, {args.duration:g} s; "
        f"files in {out}",
        flush=True,
    )
    started = time.monotonic()
    result = asyncio.run(
        chaos(
            out,
            args.duration,
            nodes=args.nodes,
            seed=args.seed,
            faults=faults,
            replication_factor=args.replication_factor,
            fsync=args.fsync,
            workload=WorkloadConfig(seed=args.seed, workers_per_stream=args.group_workers),
        )
    )
    result.history.save(out / "history.jsonl")
    report = {
        "ok": result.ok,
        "operations": result.history.counts(),
        "faults": result.faults,
        "violations": result.report.by_rule(),
        "stats": result.report.stats,
        "problems": result.problems,
        "notes": result.notes,
    }
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(result.summary())
    emit(
        "chaos_violations",
        len(result.report.violations),
        "violations",
        nodes=args.nodes,
        seed=args.seed,
        duration_s=round(time.monotonic() - started, 1),
        faults=sum(result.faults.values()),
        entries_acked=result.report.stats.get("entries_acked", 0),
        problems=len(result.problems),
    )
    if result.ok and args.out is None:
        shutil.rmtree(out, ignore_errors=True)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
