"""What idle clients cost a server: python -m bench.idle [--connections 10000] [--subscribers 5000]

Starts `streamlog serve`, measures its resident memory (RssAnon: heap, not
mapped segments), then opens idle connections (each a separate HTTP/2
connection that made one call), then idle subscribers (Subscribe calls on a
stream nobody appends to, spread over those connections as the per-connection
limit allows). The server's own metrics must show every subscriber open and
idle (one reply each: its starting position). Prints the memory and file
descriptors per connection and per subscriber, one JSON object per line; then
closes everything and checks the server returns to its starting file
descriptors and to no subscriptions (a vanished client leaves nothing behind).
All clients are in this one process.

Subscribers are opened `--batch` at a time, each batch's first replies read
before the next is opened. A server takes calls off gRPC's queue one at a time
from its event loop; calls arriving faster wait in a queue of calls not yet
taken, and gRPC cancels new ones once that queue holds 1,000 (some) or 3,000
(all): the client gets CANCELLED and the server logs nothing
(`grpc.server.max_pending_requests` and `..._hard_limit`). `--batch` equal to
`--subscribers` sends them all at once and shows this.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from bench.common import emit, free_port, server_metrics, wait_serving

SUBSCRIBERS_PER_CONNECTION = 500
# Below gRPC's 1,000 calls waiting for the server to take them (see the module docstring).
DEFAULT_BATCH = 500


def _status(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        fields = {
            line.split(":")[0]: int(line.split()[1]) for line in f if line.startswith(("RssAnon", "VmRSS"))
        }
    fields["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return fields


def _channel(address: str) -> grpc.Channel:
    # A local subchannel pool: each channel gets its own connection instead of sharing one.
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def _settle(pid: int, seconds: float = 2.0) -> dict[str, int]:
    time.sleep(seconds)  # let the server finish accepting before reading its memory
    return _status(pid)


def _subscribe(
    channels: list[grpc.Channel], subscribers: int, batch: int
) -> tuple[list, collections.Counter]:
    """Open the subscriptions `batch` at a time; return the calls and the failures by status."""
    calls = []
    failures: collections.Counter[str] = collections.Counter()
    for first in range(0, subscribers, batch):
        opened = []
        for i in range(first, min(first + batch, subscribers)):
            stub = pb_grpc.StreamLogServiceStub(channels[i // SUBSCRIBERS_PER_CONNECTION])
            opened.append(stub.Subscribe(pb.SubscribeRequest(stream="idle", start=pb.START_POSITION_LATEST)))
        for call in opened:
            try:
                next(call)  # each subscription's first reply: it is open on the server
            except grpc.RpcError as exc:
                failures[exc.code().name] += 1
        calls.extend(opened)
    return calls, failures


def _check(what: str, actual: float, expected: float) -> None:
    if actual != expected:
        raise SystemExit(f"bench.idle: {what}: the server says {actual:g}, expected {expected:g}")


def run(connections: int, subscribers: int, batch: int) -> None:
    with tempfile.TemporaryDirectory(prefix="streamlog-idle-") as data:
        port, metrics_port = free_port(), free_port()
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "service.cli",
                "serve",
                "--data",
                str(Path(data)),
                "--port",
                str(port),
                "--log-level",
                "warning",
                "--set",
                f"max_subscriptions={subscribers + 10}",
                "--set",
                f"metrics_port={metrics_port}",
            ],
            stdout=subprocess.DEVNULL,
        )
        address = f"127.0.0.1:{port}"
        try:
            wait_serving(address, server)
            with grpc.insecure_channel(address) as probe:
                pb_grpc.StreamLogServiceStub(probe).Append(pb.AppendRequest(stream="idle", payloads=[b"x"]))
            server_metrics(metrics_port)  # a first scrape, so its allocations are in the baseline
            base = _settle(server.pid)
            emit("idle_server_heap", base["RssAnon"] / 1024, "MB", state="started")

            channels = []
            for _ in range(connections):
                channel = _channel(address)
                pb_grpc.StreamLogServiceStub(channel).ListStreams(pb.ListStreamsRequest(), timeout=30)
                channels.append(channel)
            with_connections = _settle(server.pid)
            per_connection = (with_connections["RssAnon"] - base["RssAnon"]) * 1024 / connections
            emit("idle_connection_memory", per_connection, "bytes", connections=connections)
            emit("idle_connection_fds", (with_connections["fds"] - base["fds"]) / connections, "fds")

            before = server_metrics(metrics_port)
            started = time.monotonic()
            calls, failures = _subscribe(channels, subscribers, batch)
            emit("idle_subscribe_time", time.monotonic() - started, "s", subscribers=subscribers, batch=batch)
            if failures:
                emit("idle_subscribe_failures", sum(failures.values()), "calls", by_status=dict(failures))
                raise SystemExit(
                    f"bench.idle: {sum(failures.values())} of {subscribers} Subscribe calls failed"
                )
            with_subscribers = _settle(server.pid)
            # Every subscriber open on the server, and idle: its one reply is its starting position.
            seen = server_metrics(metrics_port)
            _check("open subscriptions", seen["streamlog_active_subscriptions"], subscribers)
            started_total = seen["streamlog_subscriptions_started_total"]
            _check(
                "subscriptions started",
                started_total - before["streamlog_subscriptions_started_total"],
                subscribers,
            )
            replies = seen["streamlog_subscribe_replies_total"] - before["streamlog_subscribe_replies_total"]
            _check("replies sent to subscribers", replies, subscribers)
            emit("idle_subscribers_open_on_server", seen["streamlog_active_subscriptions"], "subscriptions")
            per_subscriber = (with_subscribers["RssAnon"] - with_connections["RssAnon"]) * 1024 / subscribers
            emit("idle_subscriber_memory", per_subscriber, "bytes", subscribers=subscribers)
            emit(
                "idle_subscriber_fds",
                (with_subscribers["fds"] - with_connections["fds"]) / subscribers,
                "fds",
            )

            for call in calls:
                call.cancel()
            for channel in channels:
                channel.close()
            after = _settle(server.pid, 5.0)
            emit("idle_server_heap", after["RssAnon"] / 1024, "MB", state="all clients gone")
            emit("idle_fds_left_behind", after["fds"] - base["fds"], "fds")
            emit(
                "idle_subscriptions_left_behind",
                server_metrics(metrics_port)["streamlog_active_subscriptions"],
                "subscriptions",
            )
        finally:
            server.terminate()
            server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=10_000)
    parser.add_argument("--subscribers", type=int, default=5_000)
    parser.add_argument(
        "--batch",
        type=int,
        default=DEFAULT_BATCH,
        help=f"Subscribe calls opened before their first replies are read (default {DEFAULT_BATCH})",
    )
    args = parser.parse_args()
    needed = math.ceil(args.subscribers / SUBSCRIBERS_PER_CONNECTION)
    if args.connections < max(1, needed):
        parser.error(
            f"--connections must be at least {max(1, needed)}: "
            f"the subscribers go {SUBSCRIBERS_PER_CONNECTION} to a connection"
        )
    if args.subscribers < 1 or args.batch < 1:
        parser.error("--subscribers and --batch must be at least 1")
    run(args.connections, args.subscribers, args.batch)


if __name__ == "__main__":
    main()
