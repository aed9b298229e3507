"""Clients that stop reading, against a real server: python -m bench.slow_readers [--calls 100]

The attack of issue 13: connections that open many Reads and Subscribes with a
large `max_bytes` on a stream holding enough data, then never read a byte of
the replies. Each connection is a raw socket speaking just enough HTTP/2 to send
gRPC requests (`SlowPeer`): it never calls recv() after the handshake, so the
server's replies stay in its buffers. Without a bound, each such call held two
copies of its reply (the service's and gRPC core's): 100 Reads of 8 MiB took a
server from 59 MB to 1.6 GB.

Starts `streamlog serve` with the reply budget given, fills a stream, measures the
server's resident memory (VmRSS) before and at the plateau of the attack, and
how long another client (its own connection) takes to append, read and get a
subscription's first reply meanwhile. Then closes the attackers and checks that
the server's queued reply bytes and subscriptions return to 0. Prints one JSON
object per figure; `run` returns them for the test (tests/service/test_slow_readers.py).
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from bench.common import emit, free_port, server_metrics, wait_serving

ENTRY_BYTES = 64 << 10
MAX_BYTES = 8 << 20  # the server's default max_read_bytes: the most one reply may carry
SERVICE = "/streamlog.v1.StreamLogService/"
_MAX_WINDOW = 2**31 - 1


def _hpack_int(value: int) -> bytes:
    """An HPACK integer with a 7-bit prefix (RFC 7541 5.1)."""
    if value < 127:
        return bytes([value])
    out = [127]
    value -= 127
    while value >= 128:
        out.append((value & 127) | 128)
        value >>= 7
    out.append(value)
    return bytes(out)


def _frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream_id) + payload


class SlowPeer:
    """One HTTP/2 connection that sends gRPC calls and never reads their replies.

    It announces the largest flow-control windows, so the server may send as much as
    TCP takes, and a small receive buffer, so the kernel holds little of it: the rest
    stays in the server. The only bytes it reads are the server's first SETTINGS frame,
    to acknowledge them as HTTP/2 requires.
    """

    def __init__(self, host: str, port: int) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: it sets the window scale
        sock.settimeout(10)
        sock.connect((host, port))
        self._sock = sock
        self._authority = f"{host}:{port}".encode()
        self._next_stream = 1
        settings = struct.pack(">HI", 4, _MAX_WINDOW)  # SETTINGS_INITIAL_WINDOW_SIZE
        window = struct.pack(">I", _MAX_WINDOW - 65_535)  # the connection's window, to the largest
        preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
        sock.sendall(preface + _frame(4, 0, 0, settings) + _frame(8, 0, 0, window))
        self._acknowledge_settings()

    def _acknowledge_settings(self) -> None:
        buffer = b""
        while True:
            while len(buffer) < 9:
                buffer += self._recv()
            length, kind, flags = int.from_bytes(buffer[:3], "big"), buffer[3], buffer[4]
            while len(buffer) < 9 + length:
                buffer += self._recv()
            buffer = buffer[9 + length :]
            if kind == 4 and not flags & 1:  # SETTINGS, not an ACK
                self._sock.sendall(_frame(4, 1, 0, b""))
                return

    def _recv(self) -> bytes:
        data = self._sock.recv(65_536)
        if not data:
            raise ConnectionError("the server closed the connection during the HTTP/2 handshake")
        return data

    def call(self, method: str, request: bytes) -> None:
        """Open a call to StreamLogService `method` with one serialized request, and half-close it."""
        headers = (
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", (SERVICE + method).encode()),
            (b":authority", self._authority),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        )
        # Literal header fields without indexing, new names (RFC 7541 6.2.2): no HPACK state.
        block = b"".join(b"\x00" + _hpack_int(len(k)) + k + _hpack_int(len(v)) + v for k, v in headers)
        message = b"\x00" + struct.pack(">I", len(request)) + request
        stream_id, self._next_stream = self._next_stream, self._next_stream + 2
        # HEADERS with END_HEADERS, then DATA with END_STREAM.
        self._sock.sendall(_frame(1, 4, stream_id, block) + _frame(0, 1, stream_id, message))

    def close(self) -> None:
        self._sock.close()


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _plateau(pid: int, quiet_s: float = 1.5, limit_s: float = 60) -> float:
    """The server's peak RSS (MB) once it has stopped growing for `quiet_s`."""
    peak = _rss_mb(pid)
    grew_at = time.monotonic()
    deadline = grew_at + limit_s
    while time.monotonic() - grew_at < quiet_s and time.monotonic() < deadline:
        time.sleep(0.1)
        rss = _rss_mb(pid)
        if rss > peak + 2:
            grew_at = time.monotonic()
        peak = max(peak, rss)
    return peak


def _other_client(channel: grpc.Channel) -> float:
    """Seconds another client takes to append, read back and get a subscription's first reply."""
    stub = pb_grpc.StreamLogServiceStub(channel)
    started = time.perf_counter()
    appended = stub.Append(pb.AppendRequest(stream="other", payloads=[b"x" * 100] * 100), timeout=30)
    first = appended.first_offset
    assert len(stub.Read(pb.ReadRequest(stream="other", offset=first), timeout=30).entries) == 100
    subscription = stub.Subscribe(pb.SubscribeRequest(stream="other", offset=first), timeout=30)
    assert len(next(subscription).entries) == 100
    subscription.cancel()
    return time.perf_counter() - started


def _wait_for(condition: Any, what: str, limit_s: float = 60) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench.slow_readers: {what} did not happen in {limit_s:g} s")
        time.sleep(0.1)


def run(
    *, connections: int, calls: int, budget_mib: int, per_connection_mib: int, stream_mib: int = 8
) -> dict[str, float]:
    """The attack with `calls` Reads and `calls` Subscribes spread over `connections`; its figures."""
    streamlog = Path(sys.executable).with_name("streamlog")
    with tempfile.TemporaryDirectory(prefix="streamlog-slow-") as data:
        port, metrics_port = free_port(), free_port()
        server = subprocess.Popen(
            [str(streamlog), "serve", "--data", data, "--host", "127.0.0.1", "--port", str(port)],
            env={
                **os.environ,
                "STREAMLOG_METRICS_PORT": str(metrics_port),
                "STREAMLOG_MAX_QUEUED_REPLY_BYTES": f"{budget_mib}MiB",
                "STREAMLOG_MAX_CONNECTION_QUEUED_REPLY_BYTES": f"{per_connection_mib}MiB",
                "STREAMLOG_QUEUED_REPLY_WAIT_MS": "1000",
                "STREAMLOG_SUBSCRIBER_SEND_TIMEOUT_MS": "1000",
                "STREAMLOG_LOG_LEVEL": "error",
            },
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        peers: list[SlowPeer] = []
        try:
            wait_serving(f"127.0.0.1:{port}", server)
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.StreamLogServiceStub(channel)
                payloads = [os.urandom(ENTRY_BYTES)] * 64  # 4 MiB a batch
                for _ in range(stream_mib // 4):
                    stub.Append(pb.AppendRequest(stream="big", payloads=payloads), timeout=30)
                figures = {"rss_before_mb": _plateau(server.pid, quiet_s=0.5)}
                figures["other_client_idle_s"] = _other_client(channel)

                read = pb.ReadRequest(stream="big", max_bytes=MAX_BYTES, count=100_000).SerializeToString()
                subscribe = pb.SubscribeRequest(
                    stream="big", max_bytes=MAX_BYTES, count=100_000
                ).SerializeToString()
                peers = [SlowPeer("127.0.0.1", port) for _ in range(connections)]
                for i in range(calls):
                    peers[i % connections].call("Read", read)
                    peers[i % connections].call("Subscribe", subscribe)
                figures["rss_attack_mb"] = _plateau(server.pid)
                try:
                    figures["other_client_attack_s"] = _other_client(channel)
                except grpc.RpcError as exc:  # as on a server without the reply budget
                    print(f"bench.slow_readers: the other client failed: {exc.code().name}", file=sys.stderr)
                    figures["other_client_attack_s"] = float("nan")
                queued = server_metrics(metrics_port)["streamlog_queued_reply_bytes"]
                figures["queued_reply_mb"] = queued / 2**20

                for peer in peers:
                    peer.close()
                peers = []
                # Every reply the attackers held is given back once their connections are gone.
                _wait_for(
                    lambda: server_metrics(metrics_port)["streamlog_queued_reply_bytes"] == 0,
                    "queued reply bytes back to 0",
                )
                _wait_for(
                    lambda: server_metrics(metrics_port)["streamlog_active_subscriptions"] == 0,
                    "subscriptions back to 0",
                )
                return figures
        finally:
            for peer in peers:
                peer.close()
            server.terminate()
            server.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--calls", type=int, default=100, help="Reads, and as many Subscribes")
    parser.add_argument("--budget-mib", type=int, default=256, help="max_queued_reply_bytes")
    parser.add_argument("--per-connection-mib", type=int, default=64)
    args = parser.parse_args()
    figures = run(
        connections=args.connections,
        calls=args.calls,
        budget_mib=args.budget_mib,
        per_connection_mib=args.per_connection_mib,
    )
    for name, value in figures.items():
        unit = "MB" if name.endswith("_mb") else "s"
        emit(
            name,
            value,
            unit,
            connections=args.connections,
            calls=args.calls,
            budget_mib=args.budget_mib,
            per_connection_mib=args.per_connection_mib,
        )


if __name__ == "__main__":
    main()
