"""Screenshots of the web console's pages, with realistic data, for the documentation.

    python -m bench.screenshots [--out docs] [--seconds 45]

Starts `streamlog serve` with its console, fills a few streams the way services
would (JSON orders with tags and headers, text logs, binary clicks, a trimmed
stream), keeps appending and consuming for a while so the charts have history,
then saves a PNG of each page in `--out`: console-streams.png, console-stream.png,
console-group.png, console-cluster.png.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from pathlib import Path

import grpc
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from bench.browser import browser
from bench.common import free_port
from bench.service import streamlog_server

PAGES = {
    "console-streams.png": "#/",
    "console-stream.png": "#/stream/orders?offset=40",
    "console-group.png": "#/group/orders/billing",
    "console-cluster.png": "#/cluster",
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs"))
    parser.add_argument("--seconds", type=float, default=45)
    args = parser.parse_args()
    port = free_port()
    with streamlog_server("everysec", http_port=port) as address:
        with grpc.insecure_channel(address) as channel:
            seed(pb_grpc.StreamLogServiceStub(channel))
        stop = threading.Event()
        producer = threading.Thread(target=traffic, args=(address, args.seconds, stop))
        producer.start()
        producer.join()
        with browser(width=1280, height=900) as context:
            page = context.new_page()
            for name, route in PAGES.items():
                page.goto(f"http://127.0.0.1:{port}/{route}")
                page.wait_for_selector("main[aria-busy=false]")
                page.screenshot(path=str(args.out / name), full_page=name != "console-stream.png")
                print(args.out / name)


if __name__ == "__main__":
    main()
