"""What idle clients cost a server: python -m bench.idle [--connections 10000] [--subscribers 2000]

Starts `streamlog serve`, measures its resident memory (RssAnon: heap, not
mapped segments), then opens idle connections (each a separate HTTP/2
connection that made one call), then idle subscribers (Subscribe calls on a
stream nobody appends to, spread over connections as the per-connection limit
allows). Prints the memory per connection and per subscriber, one JSON object
per line; then closes everything and checks the server returns to about its
starting memory and file descriptors (a vanished client leaves nothing behind).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from bench.common import emit, free_port

SUBSCRIBERS_PER_CONNECTION = 500


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


def _wait_serving(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            reply = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.05)  # start-up only: the port opens and recovery ends without telling us
    raise RuntimeError("streamlog serve did not become SERVING in 30 s")


def _settle(pid: int, seconds: float = 2.0) -> dict[str, int]:
    time.sleep(seconds)  # let the server finish accepting before reading its memory
    return _status(pid)


def run(connections: int, subscribers: int) -> None:
    with tempfile.TemporaryDirectory(prefix="streamlog-idle-") as data:
        port = free_port()
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
            ],
            stdout=subprocess.DEVNULL,
        )
        address = f"127.0.0.1:{port}"
        try:
            with grpc.insecure_channel(address) as probe:
                _wait_serving(probe)
                pb_grpc.StreamLogServiceStub(probe).Append(pb.AppendRequest(stream="idle", payloads=[b"x"]))
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

            calls = []
            for i in range(subscribers):
                stub = pb_grpc.StreamLogServiceStub(channels[i // SUBSCRIBERS_PER_CONNECTION])
                call = stub.Subscribe(pb.SubscribeRequest(stream="idle", start=pb.START_POSITION_LATEST))
                calls.append(call)
            for call in calls:
                next(call)  # each subscription's first reply: it is open on the server
            with_subscribers = _settle(server.pid)
            per_subscriber = (with_subscribers["RssAnon"] - with_connections["RssAnon"]) * 1024 / subscribers
            emit("idle_subscriber_memory", per_subscriber, "bytes", subscribers=subscribers)

            for call in calls:
                call.cancel()
            for channel in channels:
                channel.close()
            after = _settle(server.pid, 5.0)
            emit("idle_server_heap", after["RssAnon"] / 1024, "MB", state="all clients gone")
            emit("idle_fds_left_behind", after["fds"] - base["fds"], "fds")
        finally:
            server.terminate()
            server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=10_000)
    parser.add_argument("--subscribers", type=int, default=2_000)
    args = parser.parse_args()
    run(args.connections, args.subscribers)


if __name__ == "__main__":
    main()
