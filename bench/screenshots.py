"""Screenshots of the web console's pages, with realistic data, for the documentation.

    python -m bench.screenshots [--out docs] [--seconds 45]

Starts `streamlog serve` with its console, fills a few streams the way services
would (JSON orders with tags and headers, text logs, binary clicks, a trimmed
stream), keeps appending and consuming for a while so the charts have history,
then saves a PNG of each page in `--out`: console-streams.png, console-stream.png,
console-group.png. console-cluster.png is a cluster's page: etcd (the binary the tests
use) and three `streamlog serve --cluster` nodes holding three replicas of each
stream, under the same traffic, with one node stopped for the last seconds (it drops
out of the in-sync sets and its progress stays behind).
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import grpc
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from bench.browser import browser
from bench.cluster import etcd
from bench.common import free_port
from bench.service import streamlog_server

PAGES = {
    "console-streams.png": "#/",
    "console-stream.png": "#/stream/orders?offset=40",
    "console-group.png": "#/group/orders/billing",
}


def order(n: int) -> pb.Entry:
    body = {"order": 10_000 + n, "customer": f"c-{n % 37:03d}", "total": round(5 + (n * 7.3) % 200, 2)}
    return pb.Entry(
        payload=json.dumps(body).encode(),
        tag=f"customer-{n % 37:03d}",
        headers={"source": b"checkout", "trace-id": b"%016x" % (n * 2654435761 % 2**64)},
    )


def seed(stub: pb_grpc.StreamLogServiceStub) -> None:
    stub.Append(pb.AppendRequest(stream="orders", entries=[order(n) for n in range(60)]))
    stub.Append(pb.AppendRequest(stream="app-logs", payloads=[b"GET /health 200 1ms"] * 40))
    stub.Append(pb.AppendRequest(stream="clicks", payloads=[random.randbytes(24) for _ in range(500)]))
    stub.Trim(pb.TrimRequest(stream="clicks", trim_to_offset=120))
    stub.Append(pb.AppendRequest(stream="payments", payloads=[b'{"status": "settled"}'] * 25))
    stub.CreateGroup(pb.CreateGroupRequest(stream="orders", group="billing", start=pb.START_POSITION_OLDEST))
    stub.CreateGroup(pb.CreateGroupRequest(stream="orders", group="shipping", start=pb.START_POSITION_LATEST))
    stub.SetStreamConfig(
        pb.SetStreamConfigRequest(stream="app-logs", config=pb.StreamConfig(max_age_ms=86_400_000))
    )


def traffic(address: str, seconds: float, stop: threading.Event) -> None:
    """Appends at a rate that rises and falls; billing consumes a little slower, acks most."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        n, started = 60, time.monotonic()
        while not stop.is_set() and time.monotonic() - started < seconds:
            phase = (time.monotonic() - started) / seconds
            burst = int(5 + 40 * (1 - abs(2 * phase - 1)))
            stub.Append(pb.AppendRequest(stream="orders", entries=[order(n + i) for i in range(burst)]))
            stub.Append(
                pb.AppendRequest(stream="clicks", payloads=[random.randbytes(24) for _ in range(burst * 3)])
            )
            n += burst
            read = stub.Read(
                pb.ReadRequest(stream="orders", group="billing", consumer=f"worker-{n % 3}", count=burst - 3)
            )
            done = [e.offset for e in read.entries][:-2]  # a couple stay pending
            if done:
                stub.Ack(pb.AckRequest(stream="orders", group="billing", offsets=done))
            stop.wait(0.5)


def run_traffic(address: str, seconds: float) -> None:
    stop = threading.Event()
    producer = threading.Thread(target=traffic, args=(address, seconds, stop))
    producer.start()
    producer.join()


def save(port: int, pages: dict[str, str], out: Path) -> None:
    with browser(width=1280, height=900) as context:
        page = context.new_page()
        for name, route in pages.items():
            page.goto(f"http://127.0.0.1:{port}/{route}")
            page.wait_for_selector("main[aria-busy=false]")
            page.screenshot(path=str(out / name), full_page=name != "console-stream.png")
            print(out / name)


def cluster_page(out: Path, seconds: float) -> None:
    """The cluster page of three nodes, the last one stopped for the last seconds."""
    http_port = free_port()
    with ExitStack() as stack:
        endpoint = stack.enter_context(etcd())

        def node(node_id: str, **settings: object) -> tuple[str, ExitStack]:
            """Start a node; its address, and what stops it (it stops with the rest otherwise)."""
            port = free_port()
            running = stack.enter_context(ExitStack())
            running.enter_context(
                streamlog_server(
                    "everysec",
                    port=port,
                    cluster=endpoint,
                    node_id=node_id,
                    advertise=f"127.0.0.1:{port}",
                    default_replication_factor=3,
                    replica_lag_ms=2000,
                    **settings,
                )
            )
            return f"127.0.0.1:{port}", running

        address, _ = node("n1", http_port=http_port)  # the first node leads the first streams
        node("n2")
        _, last = node("n3")
        with grpc.insecure_channel(address) as channel:
            seed(pb_grpc.StreamLogServiceStub(channel))
        run_traffic(address, seconds)
        last.close()  # n3 stops: the streams go on with n1 and n2
        run_traffic(address, 5)
        save(http_port, {"console-cluster.png": "#/cluster"}, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs"))
    parser.add_argument("--seconds", type=float, default=45)
    args = parser.parse_args()
    port = free_port()
    with streamlog_server("everysec", http_port=port) as address:
        with grpc.insecure_channel(address) as channel:
            seed(pb_grpc.StreamLogServiceStub(channel))
        run_traffic(address, args.seconds)
        save(port, PAGES, args.out)
    cluster_page(args.out, 10)


if __name__ == "__main__":
    main()
