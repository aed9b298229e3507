"""streamlog over gRPC vs Redis Streams, side by side in one run: python -m bench.service [--quick]

Starts its own `streamlog serve` (a subprocess on a loopback port, temp data
directory) and its own redis-server (Debian's package, installed if missing),
then measures with one Python client in this process:

- append throughput, batches of 1000 x 100-byte payloads: streamlog fsync
  everysec vs Redis AOF everysec, and streamlog fsync always vs Redis
  appendfsync always (redis-py + hiredis pipelining 1000 XADDs);
- read throughput: Read pages of 1000 (and 10,000) vs XRANGE COUNT 1000; each is
  read whole `READ_PASSES` times and the median pass reported (one pass is well under a
  second, and a single one varied by 15% between idle runs);
- append -> subscriber latency at 1000 entries/s: Subscribe vs XREAD BLOCK.

One JSON object per line (bench.common.emit), about 2-3 minutes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from bench import redis_baseline
from bench.common import Timer, emit, free_port, percentiles, serve_command, wait_serving

BATCH = 1000
READ_PASSES = 5
PAYLOAD = 100


@contextmanager
def streamlog_server(
    fsync: str,
    data: Path | None = None,
    start_timeout_s: float = 30,
    port: int | None = None,
    cpus: set[int] | None = None,
    **settings: Any,
):
    """A `streamlog serve` subprocess on a loopback port (free, unless given); yields its
    address. `data`: an existing data directory (kept), else a temporary one, which start-up
    recovers within `start_timeout_s`; `cpus`: the cores it may run on (every thread of it:
    set before exec), all when None; `settings`: more `--set` values."""
    keep = data is not None
    data = data or Path(tempfile.mkdtemp(prefix="streamlog-bench-"))
    port = port or free_port()
    command = serve_command(data, port, fsync, **settings)
    pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=pin)
    address = f"127.0.0.1:{port}"
    try:
        wait_serving(address, proc, start_timeout_s)
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if not keep:
            shutil.rmtree(data, ignore_errors=True)


def _channel(address: str) -> grpc.Channel:
    limit = 64 << 20
    return grpc.insecure_channel(
        address, options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
    )


def append_throughput(stub: pb_grpc.StreamLogServiceStub, stream: str, total: int) -> dict[str, float]:
    payloads = [os.urandom(PAYLOAD) for _ in range(BATCH)]
    request = pb.AppendRequest(stream=stream, payloads=payloads)  # the fast form for payload-only batches
    with Timer() as t:
        for _ in range(total // BATCH):
            stub.Append(request)
    return {"entries_per_s": total / t.elapsed, "mb_per_s": total * PAYLOAD / t.elapsed / 1e6}


def read_throughput(stub: pb_grpc.StreamLogServiceStub, stream: str, total: int, page: int) -> float:
    offset = taken = 0
    with Timer() as t:
        while taken < total:
            reply = stub.Read(pb.ReadRequest(stream=stream, offset=offset, count=page))
            if not reply.entries:
                break
            taken += len(reply.entries)
            offset = reply.next_offset
    if taken != total:
        raise AssertionError(f"read {taken} entries, expected {total}")
    return total / t.elapsed


def subscribe_latency(address: str, stub: pb_grpc.StreamLogServiceStub, seconds: float, rate: int) -> dict:
    """A producer thread appends one entry per 1/rate s carrying its send time; a Subscribe receives."""
    stream = "latency"
    stub.Append(pb.AppendRequest(stream=stream, entries=[pb.Entry(payload=b"x" * PAYLOAD)]))
    latencies: list[float] = []
    total = int(seconds * rate)
    with _channel(address) as channel:
        calls = pb_grpc.StreamLogServiceStub(channel).Subscribe(
            pb.SubscribeRequest(stream=stream, start=pb.START_POSITION_LATEST), timeout=seconds + 30
        )
        started = threading.Event()

        def produce() -> None:
            started.wait(10)
            t0 = time.perf_counter()
            for i in range(total):
                delay = t0 + i / rate - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)  # the producer's schedule, not a wait for data
                sent = time.perf_counter_ns().to_bytes(8, "little")
                stub.Append(
                    pb.AppendRequest(stream=stream, entries=[pb.Entry(payload=sent + b"x" * (PAYLOAD - 8))])
                )

        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        started.set()
        for reply in calls:
            now = time.perf_counter_ns()
            for entry in reply.entries:
                latencies.append((now - int.from_bytes(entry.payload[:8], "little")) / 1000)
            if len(latencies) >= total:
                break
        calls.cancel()
        producer.join(timeout=30)
    p50, p99 = percentiles(latencies, (50, 99))
    return {"p50_us": p50, "p99_us": p99, "received": len(latencies)}


def emit_latencies(latency: dict, **labels: Any) -> None:
    """The p50 and p99 of an append-to-subscriber latency measurement at 1,000 entries/s."""
    for p in ("p50_us", "p99_us"):
        emit("append_to_subscriber_latency", latency[p], "us", percentile=p[1:3], rate_per_s=1000, **labels)


def run(quick: bool) -> None:
    total = 100_000 if quick else 500_000
    always_total = total // 5
    seconds = 3 if quick else 10
    common = {"batch": BATCH, "payload_bytes": PAYLOAD}

    for fsync, n in (("everysec", total), ("always", always_total)):
        with streamlog_server(fsync) as address, _channel(address) as channel:
            stub = pb_grpc.StreamLogServiceStub(channel)
            ours = append_throughput(stub, "bench", n)
            emit(
                "append",
                ours["entries_per_s"],
                "entries/s",
                system="streamlog",
                fsync=fsync,
                entries=n,
                **common,
            )
            if fsync == "everysec":
                for page in (1000, 10_000):
                    rates = [read_throughput(stub, "bench", n, page) for _ in range(READ_PASSES)]
                    emit(
                        "read",
                        statistics.median(rates),
                        "entries/s",
                        system="streamlog",
                        page=page,
                        entries=n,
                        passes=[round(r) for r in rates],
                    )
                emit_latencies(subscribe_latency(address, stub, seconds, 1000), system="streamlog")
        with redis_baseline.RedisServer(fsync) as server:
            r = server.client()
            theirs = redis_baseline.xadd_pipelined(r, "bench", total=n, batch=BATCH, payload_size=PAYLOAD)
            emit(
                "append",
                theirs["entries_per_s"],
                "entries/s",
                system="redis",
                appendfsync=fsync,
                entries=n,
                **common,
            )
            emit(
                "append_ratio",
                ours["entries_per_s"] / theirs["entries_per_s"],
                "x",
                compared=f"streamlog fsync={fsync} vs redis appendfsync={fsync}",
            )
            if fsync == "everysec":
                passes = [redis_baseline.xrange_read(r, "bench", batch=1000) for _ in range(READ_PASSES)]
                rates = [got["entries_per_s"] for got in passes]
                emit(
                    "read",
                    statistics.median(rates),
                    "entries/s",
                    system="redis",
                    page=1000,
                    entries=passes[0]["entries"],
                    passes=[round(r) for r in rates],
                )
                lat = redis_baseline.xread_block_latency(r, rate=1000, seconds=seconds, payload_size=PAYLOAD)
                emit_latencies(lat, system="redis")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    run(parser.parse_args().quick)


if __name__ == "__main__":
    main()
