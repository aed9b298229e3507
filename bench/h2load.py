"""Unary Append load from h2load (nghttp2's HTTP/2 benchmark, in C), which costs the cores little.

A gRPC unary call is an HTTP/2 POST of one length-prefixed message with two headers, which
h2load sends as it sends any request body; it reports what the server answered. A client
written in C spends a few tens of microseconds of CPU per call, where grpc-js and grpc-python
spend about as much as the server does, so on a machine whose cores the clients share with the
servers, this is the load that leaves the servers the cores (as redis-benchmark does for Redis).

h2load counts HTTP statuses, not gRPC's (a refused call is still HTTP 200 with a grpc-status
trailer), so `append_load` checks the calls against the streams' ends before and after.
"""

from __future__ import annotations

import re
import resource
import struct
import subprocess
import tempfile
from pathlib import Path

from streamlog.v1 import streamlog_pb2 as pb

from bench.debian import ensure_package
from clients import Client

APPEND_PATH = "/streamlog.v1.StreamLogService/Append"
_SUCCEEDED = re.compile(r"requests: \d+ total, \d+ started, \d+ done, (\d+) succeeded")


def grpc_frame(message: bytes) -> bytes:
    """A gRPC message on the wire: not compressed, its length, the message."""
    return b"\x00" + struct.pack(">I", len(message)) + message


def _ends(addresses: list[str], streams: list[str]) -> int:
    with Client(addresses) as client:
        return sum(client.info(stream).next_offset for stream in streams)


def append_load(
    leaders: dict[str, str], payload: bytes, in_flight: int, seconds: float
) -> tuple[float, float, int]:
    """One h2load process per stream (`leaders`: stream -> its leader's address), each sending
    one-entry Appends to that leader with `in_flight // len(leaders)` calls unanswered, all at
    once for `seconds` (after a one-second warm-up). Returns calls/s, the clients' CPU
    microseconds per call, and the calls made (the warm-up's included)."""
    h2load = ensure_package("nghttp2-client", "h2load")
    addresses = sorted(set(leaders.values()))
    per_stream = max(1, in_flight // len(leaders))
    before = _ends(addresses, list(leaders))
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory() as scratch:
        runs = []
        for stream, address in leaders.items():
            body = Path(scratch) / f"{stream}.bin"
            request = pb.AppendRequest(stream=stream, payloads=[payload])
            body.write_bytes(grpc_frame(request.SerializeToString()))
            command = [
                h2load, "-c", "1", "-m", str(per_stream), "-D", f"{seconds:g}", "--warm-up-time", "1",
                "-H", "content-type: application/grpc", "-H", "te: trailers",
                "-d", str(body), f"http://{address}{APPEND_PATH}",
            ]  # fmt: skip
            runs.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outputs = [run.communicate(timeout=seconds + 60) for run in runs]
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    counted = 0
    for run, (out, err) in zip(runs, outputs, strict=True):
        found = _SUCCEEDED.search(out)
        if run.returncode != 0 or found is None:
            raise RuntimeError(f"h2load failed ({run.returncode}): {err.strip() or out.strip()}")
        counted += int(found.group(1))
    appended = _ends(addresses, list(leaders)) - before
    # Every counted call appended its entry (a refused one would not have); the warm-up's calls
    # and those in flight at the end are appended and not counted.
    if not counted <= appended <= counted * (1 + 2 / seconds) + len(leaders) * per_stream:
        raise RuntimeError(f"h2load counted {counted} calls but the streams grew by {appended}")
    client_s = (used.ru_utime - cpu.ru_utime) + (used.ru_stime - cpu.ru_stime)
    return counted / seconds, client_s / appended * 1e6, appended
