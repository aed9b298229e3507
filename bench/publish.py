"""One small append per message: Publish sessions vs unary Append vs Redis XADD, in one run.

    python -m bench.publish [--quick]

Load comes from Node.js (bench/publish_load.js, clients/node's Client and Publisher;
`npm install` in clients/node first), so that the client is not the bottleneck:
one-entry messages of 100 bytes,

- over Publish sessions (64 messages in flight each) and over unary Append calls,
  at 1 and 16 publishers/callers (each on its own connection), against
  `streamlog serve` at fsync everysec and always;
- unary Append and Publish sessions at 1 and 16 callers against a bare grpc.aio
  server whose Append and Publish answer at once, as the simplest handlers a user
  would write (`bare_handler`: Append parses its request and answers an empty
  AppendResponse; Publish an empty answer with the message's request_id; no
  interceptors, no engine; system "bare"): the ceiling of a unary call and of a
  session's message here; its Subscribe relays each published message's entries
  to the stream's subscribers, so the Python Publish -> Subscribe latency against it
  is grpc.aio's own floor for the latency target;
- append-to-subscriber latency at 1,000 entries/s (Publish and Append, a Subscribe
  on the same connection: grpc-js shares one between clients of an address), everysec,
  with what the Node process spent (its event loop's delay, its CPU per entry, the
  Publish messages it had unanswered when it sent one); and the same Publish ->
  Subscribe latency from a Python grpc.aio publisher and subscriber (one process,
  a connection each), to tell the client's share from the server's;
- Redis side by side: `redis-benchmark` XADD at 1 and 16 clients (AOF everysec
  and always), and XADD to XREAD BLOCK latency at 1,000 entries/s
  (bench.redis_baseline, a Python client).

Every calls/s figure has the server's CPU per call or message ("server_cpu_us": its
process's utime + stime over the run, /proc/PID/stat, divided by the calls answered)
and the Node client's ("client_cpu_us"). One JSON object per line (bench.common.emit).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import HealthServicer
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from bench import redis_baseline
from bench.common import (
    emit,
    free_port,
    node_load,
    percentiles,
    process_cpu_seconds,
    server_process,
    wait_serving,
)
from bench.service import PAYLOAD, emit_latencies, streamlog_server
from service.server import GenericHandlersOnly

IN_FLIGHT = 64
SERVICE = "streamlog.v1.StreamLogService"


def bare_handler() -> grpc.GenericRpcHandler:
    """StreamLogService's Append and Publish doing nothing, as the simplest handlers a user would
    write: Append gets its request parsed and answers an AppendResponse (as every handler must:
    one that skipped the parse could not know its stream), from a generic handler (registered
    methods cost every call more: service/server.py's GenericHandlersOnly). No interceptor,
    no engine."""

    async def append(request: pb.AppendRequest, context: Any) -> pb.AppendResponse:
        return pb.AppendResponse()

    subscribers: dict[str, set[asyncio.Queue[list[bytes]]]] = {}

    async def publish(requests: AsyncIterator[pb.PublishRequest], context: Any) -> AsyncIterator[bytes]:
        async for request in requests:  # (parsed: the client checks the request_id of each answer)
            for queue in subscribers.get(request.stream, ()):
                queue.put_nowait(list(request.payloads))
            yield pb.PublishResponse(request_id=request.request_id).SerializeToString()

    async def subscribe(request: pb.SubscribeRequest, context: Any) -> AsyncIterator[bytes]:
        """Relays what Publish gets for the stream, as it gets it: no storage, no offsets."""
        queue: asyncio.Queue[list[bytes]] = asyncio.Queue()
        subscribers.setdefault(request.stream, set()).add(queue)
        try:
            yield pb.SubscribeResponse().SerializeToString()  # registered: as streamlog's first reply
            while True:
                entries = [pb.Entry(payload=payload) for payload in await queue.get()]
                yield pb.SubscribeResponse(entries=entries).SerializeToString()
        finally:
            subscribers[request.stream].discard(queue)

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Append": grpc.unary_unary_rpc_method_handler(
                append,
                request_deserializer=pb.AppendRequest.FromString,
                response_serializer=pb.AppendResponse.SerializeToString,
            ),
            "Publish": grpc.stream_stream_rpc_method_handler(
                publish, request_deserializer=pb.PublishRequest.FromString
            ),
            "Subscribe": grpc.unary_stream_rpc_method_handler(
                subscribe, request_deserializer=pb.SubscribeRequest.FromString
            ),
        },
    )


async def _serve_bare(port: int) -> None:
    """A grpc.aio server with the bare handlers, nothing else in the way."""
    handler = bare_handler()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    health = HealthServicer()  # for bench.common.wait_serving
    health.set("", health_pb2.HealthCheckResponse.SERVING)
    # Registered, health's 3 methods would cost every call (as they would streamlog's).
    health_pb2_grpc.add_HealthServicer_to_server(health, GenericHandlersOnly(server))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


@contextmanager
def bare_server() -> Iterator[tuple[str, int]]:
    """The bare server in a process of its own: its address and process id."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bench.publish", "--bare-server", str(port)])
    address = f"127.0.0.1:{port}"
    try:
        wait_serving(address, proc)
        yield address, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def python_publish_latency(address: str, rate: int, seconds: float) -> dict[str, float]:
    """Publish -> Subscribe latency from Python: a grpc.aio Publish session sends one entry every
    1/rate s (absolute schedule, its send time in its first 8 bytes), a Subscribe on a connection
    of its own receives; p50/p99 µs."""
    stream = f"latency-python-{time.monotonic_ns()}"
    total = int(rate * seconds)
    own = [("grpc.use_local_subchannel_pool", 1)]  # a connection each (not one shared)
    async with (
        grpc.aio.insecure_channel(address, options=own) as producer,
        grpc.aio.insecure_channel(address, options=own) as reader,
    ):
        publish = pb_grpc.StreamLogServiceStub(producer).Publish()
        await publish.write(pb.PublishRequest(stream=stream, request_id=1, payloads=[bytes(PAYLOAD)]))
        await publish.read()  # the stream exists, the session is open
        subscription = pb_grpc.StreamLogServiceStub(reader).Subscribe(
            pb.SubscribeRequest(stream=stream, start=pb.START_POSITION_LATEST)
        )
        await subscription.read()  # the first reply says where it starts: it is registered
        micros: list[float] = []

        async def receive() -> None:
            while (reply := await subscription.read()) is not grpc.aio.EOF:
                now = time.perf_counter_ns()
                micros.extend((now - int.from_bytes(e.payload[:8], "little")) / 1000 for e in reply.entries)
                if len(micros) >= total:
                    return

        async def drain_answers() -> None:
            while await publish.read() is not grpc.aio.EOF:
                pass

        receiving = asyncio.create_task(receive())
        answers = asyncio.create_task(drain_answers())
        filler = bytes(PAYLOAD - 8)
        t0 = time.perf_counter_ns()
        for i in range(total):
            wait_ns = t0 + i * 1_000_000_000 // rate - time.perf_counter_ns()
            if wait_ns > 0:
                await asyncio.sleep(wait_ns / 1e9)  # the schedule, not a wait for data
            sent = time.perf_counter_ns().to_bytes(8, "little")
            await publish.write(pb.PublishRequest(stream=stream, request_id=i + 2, payloads=[sent + filler]))
        await publish.done_writing()
        await asyncio.wait_for(receiving, timeout=60)
        await answers
        subscription.cancel()
    p50, p99 = percentiles(micros, (50, 99))
    return {"p50_us": p50, "p99_us": p99, "received": len(micros)}


def redis_benchmark_xadd(port: int, clients: int, requests: int) -> float:
    """XADD calls/s of redis-benchmark (one 100-byte field per entry, no pipelining)."""
    executable = shutil.which("redis-benchmark")
    if executable is None:
        raise SystemExit("redis-benchmark not found (Debian's redis-tools)")
    command = [executable, "-h", "127.0.0.1", "-p", str(port), "-c", str(clients), "-n", str(requests)]
    command += ["-q", "XADD", "bench:publish", "*", "payload", "x" * PAYLOAD]
    out = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True).stdout
    found = re.findall(r"([\d.]+) requests per second", out)
    if not found:
        raise RuntimeError(f"redis-benchmark printed no rate: {out!r}")
    return float(found[-1])


def rate(address: str, pid: int, rpc: str, callers: int, seconds: int) -> dict[str, Any]:
    """Node's `rate` load on the server at `address` (process `pid`), with the server's and the
    client's CPU per call or message."""
    before = process_cpu_seconds(pid)
    got = node_load("rate", address, rpc, callers, seconds, IN_FLIGHT)
    return {
        "value": got["calls_per_s"],
        "p50_ms": got["p50_ms"],
        "p99_ms": got["p99_ms"],
        "server_cpu_us": round((process_cpu_seconds(pid) - before) / got["calls"] * 1e6, 1),
        "client_cpu_us": round(got["cpu_us_per_call"], 1),
        **({"in_flight": IN_FLIGHT} if rpc == "publish" else {}),
    }


def _rpc_name(rpc: str) -> str:
    return "Publish" if rpc == "publish" else "Append"


def run(quick: bool) -> None:
    seconds = 3 if quick else 8
    latency_s = 3 if quick else 10
    common = {"payload_bytes": PAYLOAD, "entries_per_message": 1, "seconds": seconds}
    with bare_server() as (address, pid):
        for callers in (1, 16):
            for rpc in ("append", "publish"):
                got = rate(address, pid, rpc, callers, seconds)
                value = got.pop("value")
                emit("calls", value, "calls/s", system="bare", rpc=_rpc_name(rpc), callers=callers, **got)
        got = asyncio.run(python_publish_latency(address, 1000, latency_s))
        emit_latencies(got, system="bare", rpc="Publish", client="python grpc.aio")
    for fsync in ("everysec", "always"):
        with streamlog_server(fsync) as address:
            pid = int(server_process(int(address.rsplit(":", 1)[1])).name)
            for callers in (1, 16):
                for rpc in ("append", "publish"):
                    got = rate(address, pid, rpc, callers, seconds)
                    emit(
                        "calls",
                        got.pop("value"),
                        "calls/s",
                        system="streamlog",
                        rpc=_rpc_name(rpc),
                        callers=callers,
                        fsync=fsync,
                        **got,
                        **common,
                    )
            if fsync == "everysec":
                for rpc in ("publish", "append"):
                    got = node_load("latency", address, rpc, 1000, latency_s)
                    client = {key: got[key] for key in got if key.startswith("node_")}
                    emit_latencies(got, system="streamlog", rpc=_rpc_name(rpc), **client)
                got = asyncio.run(python_publish_latency(address, 1000, latency_s))
                emit_latencies(got, system="streamlog", rpc="Publish", client="python grpc.aio")
        with redis_baseline.RedisServer(fsync) as server:
            assert server.port is not None
            for clients in (1, 16):
                xadds = redis_benchmark_xadd(server.port, clients, 20_000 if quick else 100_000)
                emit(
                    "calls", xadds, "calls/s", system="redis", rpc="XADD", callers=clients, appendfsync=fsync
                )
            if fsync == "everysec":
                lat = redis_baseline.xread_block_latency(
                    server.client(), rate=1000, seconds=latency_s, payload_size=PAYLOAD
                )
                emit_latencies(lat, system="redis", rpc="XADD/XREAD BLOCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs, for a smoke run")
    parser.add_argument("--bare-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare_server:
        asyncio.run(_serve_bare(args.bare_server))
        return
    run(args.quick)


if __name__ == "__main__":
    main()
