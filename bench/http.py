"""HTTP/JSON API figures: appends of one entry per call, HTTP beside gRPC unary, on one server.

    python -m bench.http [--calls N] [--clients C]

Starts its own `streamlog serve` (fsync everysec, HTTP API on) and appends 100-byte
entries one per call: over gRPC (a blocking stub's unary Append) and over HTTP
(`POST /v1/Append` with a JSON body, on a kept-alive connection), each from C
client threads for N calls in all. Prints one JSON line per figure.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import threading
from collections.abc import Callable

import grpc
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from bench.common import Timer, emit, free_port
from bench.service import PAYLOAD, streamlog_server


def _threads(clients: int, calls: int, make: Callable[[], Callable[[], None]]) -> float:
    """Calls per second of `clients` threads making `calls` calls in all."""
    per_client = calls // clients
    ready = threading.Barrier(clients + 1)

    def work() -> None:
        call = make()
        ready.wait()
        for _ in range(per_client):
            call()

    threads = [threading.Thread(target=work) for _ in range(clients)]
    for thread in threads:
        thread.start()
    ready.wait()
    with Timer() as timer:
        for thread in threads:
            thread.join()
    return per_client * clients / timer.elapsed


def grpc_appends(address: str, clients: int, calls: int) -> float:
    request = pb.AppendRequest(stream="grpc-unary", payloads=[os.urandom(PAYLOAD)])

    def make() -> Callable[[], None]:
        stub = pb_grpc.StreamLogServiceStub(grpc.insecure_channel(address))
        return lambda: stub.Append(request, timeout=10)

    return _threads(clients, calls, make)


def http_appends(port: int, clients: int, calls: int) -> float:
    body = json.dumps({"stream": "http-unary", "payloads": [base64.b64encode(os.urandom(PAYLOAD)).decode()]})
    headers = {"Content-Type": "application/json"}

    def make() -> Callable[[], None]:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)

        def call() -> None:
            connection.request("POST", "/v1/Append", body=body, headers=headers)
            reply = connection.getresponse()
            reply.read()
            if reply.status != 200:
                raise RuntimeError(f"HTTP Append answered {reply.status}")

        return call

    return _threads(clients, calls, make)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--clients", type=int, default=1)
    args = parser.parse_args()
    port = free_port()
    with streamlog_server("everysec", http_port=port) as address:
        for clients in sorted({1, args.clients}):
            grpc_appends(address, clients, 1000)  # warm-up: connections, caches
            http_appends(port, clients, 1000)
            rates = {
                "grpc": grpc_appends(address, clients, args.calls),
                "http": http_appends(port, clients, args.calls),
            }
            for transport, rate in rates.items():
                emit(f"append_one_entry_{transport}", rate, "calls/s", clients=clients, payload_bytes=PAYLOAD)


if __name__ == "__main__":
    main()
