"""How long moving a big stream to another node takes (`streamlog cluster rebalance`'s unit of work).
python -m bench.rebalance [--entries N] [--quick]

Starts its own etcd and one `streamlog serve --cluster` node n1, fills one stream on it
(one replica) with N entries of 100 bytes in appends of 10,000, starts a second node n2,
then moves the stream to n2 with ReassignReplicas and times it: from the call until
DescribeCluster shows the move done (n2 copied the whole log from n1, joined the in-sync
set, became the leader, and n1 dropped its copy). Then checks that n2 serves all N
entries, the last one's payload included.

One JSON object per line (bench.common.emit): the fill rate, the move's time, entries/s
and payload MB/s (the stream's bytes on disk, compressed, are given beside them).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import grpc
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from bench.cluster import etcd, node
from bench.common import emit

STREAM = "big"
PAYLOAD = 100
BATCH = 10_000
_POLL_S = 0.05


def payloads(start: int, count: int) -> list[bytes]:
    return [b"%010d" % i + b"." * (PAYLOAD - 10) for i in range(start, start + count)]


def placement(stub: pb_grpc.StreamLogServiceStub) -> pb.StreamPlacement:
    [found] = stub.DescribeCluster(pb.DescribeClusterRequest(prefix=STREAM), timeout=30).streams
    return found


def run(entries: int) -> None:
    directory = Path(tempfile.mkdtemp(prefix="streamlog-bench-rebalance-"))
    try:
        with etcd(directory / "etcd") as cluster, ExitStack() as stack:
            first = stack.enter_context(node(cluster, "n1"))
            channel = stack.enter_context(grpc.insecure_channel(first))
            stub = pb_grpc.StreamLogServiceStub(channel)
            started = time.perf_counter()
            for start in range(0, entries, BATCH):
                batch = payloads(start, min(BATCH, entries - start))
                stub.Append(pb.AppendRequest(stream=STREAM, payloads=batch), timeout=120)
            filled = time.perf_counter() - started
            emit("fill", entries / filled, "entries/s", entries=entries, payload_bytes=PAYLOAD)
            size = stub.GetStreamInfo(pb.GetStreamInfoRequest(stream=STREAM), timeout=30).info.bytes_on_disk
            second = stack.enter_context(node(cluster, "n2"))
            started = time.perf_counter()
            stub.ReassignReplicas(pb.ReassignReplicasRequest(stream=STREAM, replicas=["n2"]), timeout=30)
            while (found := placement(stub)).target_replicas:
                time.sleep(_POLL_S)
            moved = time.perf_counter() - started
            assert list(found.replicas) == ["n2"] and found.leader == "n2", found
            with grpc.insecure_channel(second) as to_second:
                there = pb_grpc.StreamLogServiceStub(to_second)
                count = there.CountRange(pb.CountRangeRequest(stream=STREAM), timeout=60).count
                last = there.Read(pb.ReadRequest(stream=STREAM, offset=entries - 1, count=1), timeout=30)
            assert count == entries and last.entries[0].payload == payloads(entries - 1, 1)[0], (count, last)
            extra = {"entries": entries, "payload_bytes": PAYLOAD, "bytes_on_disk": size}
            emit("move_seconds", moved, "s", **extra)
            emit("move_rate", entries / moved, "entries/s", **extra)
            emit("move_payload_bandwidth", entries * PAYLOAD / moved / 1e6, "MB/s", **extra)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=10_000_000, help="(default: 10000000)")
    parser.add_argument("--quick", action="store_true", help="100,000 entries, for a smoke run")
    args = parser.parse_args()
    run(100_000 if args.quick else args.entries)


if __name__ == "__main__":
    main()
