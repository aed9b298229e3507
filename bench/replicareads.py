"""Reads from in-sync replicas vs from the leader: Read throughput of a three-node cluster.
python -m bench.replicareads [--quick]

Starts its own etcd and three `streamlog serve --cluster` processes (three replicas per
stream), fills one stream led by n1 with 200,000 entries of 100 bytes, waits until both
followers serve all of them, then measures plain Reads of 1000 entries (pages in turn
over the whole stream):

- one reader (this process): to the leader, and to a follower with
  `streamlog-read-from: replica`, call by call in turn, so that load from elsewhere
  falls on both alike: entries/s of each;
- three reader processes at once, each for --seconds: all to the leader, then one per
  replica (the leader and both followers), the two layouts in turn --rounds times:
  entries/s of the three together, per round.

Every replica read also asks for a redirect, so a follower that would not serve it
itself fails the run instead of forwarding it. One JSON object per line
(bench.common.emit); about a minute (--quick: a few seconds of each).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import grpc
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from bench.cluster import STREAM, create, etcd, node
from bench.common import emit

PAYLOAD = 100
PAGE = 1000
REPLICA = (("streamlog-read-from", "replica"), ("streamlog-route", "redirect"))
Target = tuple[str, tuple[tuple[str, str], ...]]  # an address, and the metadata to read there with


def fill(address: str, entries: int) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        batch = pb.AppendRequest(stream=STREAM, payloads=[os.urandom(PAYLOAD)] * PAGE)
        for _ in range(entries // PAGE):
            stub.Append(batch, timeout=30)


def wait_served(address: str, end: int, timeout_s: float = 60) -> None:
    """Until the follower at `address` serves the stream's entry `end - 1` as an in-sync replica."""
    deadline = time.monotonic() + timeout_s
    request = pb.ReadRequest(stream=STREAM, offset=end - 1)
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        while True:
            try:
                if stub.Read(request, metadata=REPLICA, timeout=10).entries:
                    return
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
            time.sleep(0.05)


def pages(stub: pb_grpc.StreamLogServiceStub, metadata: tuple, entries: int) -> Callable[[], int]:
    """A callable reading the next page of the stream (wrapping around), returning its size."""
    offset = 0

    def read() -> int:
        nonlocal offset
        reply = stub.Read(
            pb.ReadRequest(stream=STREAM, offset=offset, count=PAGE), metadata=metadata, timeout=30
        )
        offset = (offset + PAGE) % entries
        return len(reply.entries)

    return read


def one_reader(targets: dict[str, Target], entries: int, calls: int) -> None:
    with ExitStack() as stack:
        readers = {
            route: pages(
                pb_grpc.StreamLogServiceStub(stack.enter_context(grpc.insecure_channel(a))), m, entries
            )
            for route, (a, m) in targets.items()
        }
        got = dict.fromkeys(readers, 0)
        seconds = dict.fromkeys(readers, 0.0)
        for _ in range(calls):
            for route, read in readers.items():
                start = time.perf_counter()
                got[route] += read()
                seconds[route] += time.perf_counter() - start
    for route in readers:
        emit("read", got[route] / seconds[route], "entries/s", route=route, readers=1, page=PAGE)


def _reader(target: Target, entries: int, seconds: float, results: multiprocessing.Queue) -> None:
    address, metadata = target
    with grpc.insecure_channel(address) as channel:
        read = pages(pb_grpc.StreamLogServiceStub(channel), metadata, entries)
        read()  # connected
        got, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            got += read()
    results.put(got / seconds)


def together(targets: list[Target], entries: int, seconds: float) -> float:
    """Entries/s of one reader process per target, all at once."""
    results: multiprocessing.Queue = multiprocessing.Queue()
    processes = [
        multiprocessing.Process(target=_reader, args=(t, entries, seconds, results)) for t in targets
    ]
    for process in processes:
        process.start()
    rates = [results.get(timeout=seconds + 60) for _ in processes]
    for process in processes:
        process.join()
    return sum(rates)


def run(entries: int, calls: int, seconds: float, rounds: int) -> None:
    directory = Path(tempfile.mkdtemp(prefix="streamlog-bench-replicareads-"))
    try:
        with etcd(directory / "etcd") as cluster, ExitStack() as stack:
            leader, *followers = [stack.enter_context(node(cluster, f"n{i}", 3)) for i in (1, 2, 3)]
            create(leader, 3)  # n1 leads, all three in sync
            fill(leader, entries)
            for follower in followers:
                wait_served(follower, entries)
            one_reader({"leader": (leader, ()), "follower": (followers[0], REPLICA)}, entries, calls)
            layouts = {
                "3 readers on the leader": [(leader, ())] * 3,
                "3 readers, one per replica": [(leader, REPLICA)] + [(f, REPLICA) for f in followers],
            }
            for round_ in range(rounds):
                for route, targets in layouts.items():
                    rate = together(targets, entries, seconds)
                    emit("read", rate, "entries/s", route=route, readers=3, page=PAGE, round=round_)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    parser.add_argument("--seconds", type=float, default=5.0, help="each concurrent measurement (default 5)")
    parser.add_argument("--rounds", type=int, default=3, help="turns of the two layouts (default 3)")
    args = parser.parse_args()
    if args.quick:
        run(entries=20 * PAGE, calls=20, seconds=1.0, rounds=1)
    else:
        run(entries=200 * PAGE, calls=300, seconds=args.seconds, rounds=args.rounds)


if __name__ == "__main__":
    main()
