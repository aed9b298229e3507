"""Helpers shared by the benchmark scripts.

Every script prints its figures through :func:`emit`, one JSON object per
line, so a run can be piped into a file and compared or tabulated later
without parsing prose.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TextIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

__all__ = [
    "Timer",
    "cpu_steal_ticks",
    "emit",
    "free_port",
    "node_load",
    "percentile",
    "percentiles",
    "process_cpu_seconds",
    "server_cpu_seconds",
    "server_metrics",
    "wait_serving",
]


def emit(figure: str, value: float, unit: str, **extra: Any) -> dict[str, Any]:
    """Print one figure as a JSON line on stdout and flush; return the record.

    ``extra`` holds context (workload sizes, durability mode, system name).
    The line is flushed at once so a figure survives a later crash or timeout
    of the same run.
    """
    # The core keys are parameters, so an extra can never overwrite them.
    record: dict[str, Any] = {"figure": figure, "value": value, "unit": unit, **extra}
    _write_line(record, sys.stdout)
    return record


def _write_line(record: dict[str, Any], out: TextIO) -> None:
    # default=str: a Path or an enum in the extras must not kill a long run.
    out.write(json.dumps(record, default=str) + "\n")
    out.flush()


def percentile(values: Iterable[float], p: float) -> float:
    """The ``p``-th percentile (0..100) with linear interpolation.

    Same definition as numpy's default ("linear"), so figures match what a
    notebook would compute from the raw samples. Raises on no samples: a
    percentile of nothing is a bug in the caller, not a zero.
    """
    return percentiles(values, (p,))[0]


def percentiles(values: Iterable[float], ps: Sequence[float]) -> list[float]:
    """Several percentiles from one sort (latency runs hold many samples)."""
    data = sorted(values)
    if not data:
        raise ValueError("percentile of an empty sample")
    out = []
    last = len(data) - 1
    for p in ps:
        if not 0 <= p <= 100:
            raise ValueError(f"percentile {p} outside 0..100")
        rank = p / 100 * last
        lo = math.floor(rank)
        hi = min(lo + 1, last)
        frac = rank - lo
        out.append(data[lo] + (data[hi] - data[lo]) * frac)
    return out


class Timer:
    """Wall-clock timer on ``perf_counter`` (monotonic, highest resolution).

    ``with Timer() as t: ...`` then ``t.elapsed`` in seconds; reading
    ``elapsed`` inside the block gives the time so far.
    """

    __slots__ = ("_end", "_start")

    def __init__(self) -> None:
        self._start: float | None = None
        self._end: float | None = None

    def __enter__(self) -> Timer:
        self._end = None
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._end = time.perf_counter()

    @property
    def elapsed(self) -> float:
        if self._start is None:
            raise RuntimeError("timer was never started")
        end = self._end if self._end is not None else time.perf_counter()
        return end - self._start


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for a server to bind.

    Taken at random below the kernel's ephemeral range (ip_local_port_range), not from it: the
    kernel hands ports in that range to every outgoing connection of every process (and to
    binds of port 0), so a port picked there can be taken by some client's connection before
    the server binds it (seen under load: a node "in use by another process"). Below it, only
    a server binding that same port could collide, and the bind check here rules out those
    already bound. A port is handed out once per process: two picks for one server (its port and
    its metrics port) came out equal before either was bound (a test's server refused to start).
    """
    low = _ephemeral_ports()[0]
    for _ in range(100):
        port = _PORTS.randrange(_LOWEST_PORT, low)
        if port in _ISSUED:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            _ISSUED.add(port)
            return port
    raise RuntimeError(f"no free port found between {_LOWEST_PORT} and {low}")


_PORTS = random.SystemRandom()  # not the random module's: a test may seed that, in every process alike
_LOWEST_PORT = 10_000
_ISSUED: set[int] = set()  # the ports free_port gave in this process (a suite takes some thousands)


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections (Linux's default when unreadable)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def cpu_steal_ticks() -> tuple[int, int] | None:
    """(steal, total) CPU ticks since boot from /proc/stat, or None off Linux.

    Two readings around a run give the share of CPU the hypervisor took:
    on a shared VM that, not the code, is often why a figure moved.
    """
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    ticks = [int(v) for v in fields[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice]:
    # guest time is already counted in user/nice, so only the first 8 add up.
    return ticks[7], sum(ticks[:8])


def add_setting_option(parser: argparse.ArgumentParser) -> None:
    """A repeatable `--set KEY=VALUE`: a server setting, as `streamlog serve --set` takes it."""
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a server setting")


def settings_given(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, str]:
    """The `--set` settings of `args` by name (a parser error for one without `=`)."""
    settings = dict(item.split("=", 1) for item in args.set if "=" in item)
    if len(settings) != len(args.set):
        parser.error("--set: KEY=VALUE")
    return settings


def serve_command(data: Path, port: int, fsync: str = "everysec", **settings: Any) -> list[str]:
    """The command line of a `streamlog serve` on `data` at a loopback `port`, warnings only."""
    return [
        sys.executable,
        "-m",
        "service.cli",
        "serve",
        "--data",
        str(data),
        "--port",
        str(port),
        "--fsync",
        fsync,
        "--log-level",
        "warning",
        *(f"--set={name}={value}" for name, value in settings.items()),
    ]


def wait_serving(address: str, proc: subprocess.Popen, timeout_s: float = 30) -> None:
    """Wait until the `streamlog serve` process `proc` answers SERVING at `address`."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                stderr = proc.stderr.read().decode()[-2000:] if proc.stderr else ""
                raise RuntimeError(f"streamlog serve exited: {stderr}")
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)  # start-up only: the server is not listening yet, nothing to wake us
    raise RuntimeError(f"streamlog serve did not become SERVING within {timeout_s} s")


def server_metrics(port: int) -> dict[str, float]:
    """A server's Prometheus samples (its metrics_port), summed over labels: name -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    values: dict[str, float] = collections.defaultdict(float)
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] += float(value)
    return values


NODE_LOAD = Path(__file__).with_name("publish_load.js")


def node_load(*args: Any) -> dict[str, float]:
    """One run of bench/publish_load.js (load from Node.js, which costs the machine's cores little
    per call); its JSON result."""
    node = shutil.which("node")
    if node is None:
        raise SystemExit("this bench needs Node.js (and `npm install` in clients/node)")
    command = [node, str(NODE_LOAD), *map(str, args)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"publish_load.js {args} failed: {done.stderr.strip()}")
    return json.loads(done.stdout)


def server_process(port: int) -> Path:
    """The /proc directory of the `streamlog serve` process listening on loopback `port` (its
    command line says `--port PORT`)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            arguments = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if "service.cli" in arguments and ("--port", str(port)) in itertools.pairwise(arguments):
            return entry
    raise LookupError(f"no streamlog serve process on port {port}")


def server_cpu_seconds(port: int) -> float:
    """The CPU time (user + system) used so far by the `streamlog serve` process on `port`."""
    return process_cpu_seconds(int(server_process(port).name))


def process_cpu_seconds(pid: int) -> float:
    """The CPU time (user + system) used so far by process `pid`, all its threads."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    # Fields after the command name (which may hold spaces): utime and stime are 14 and 15.
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_cores(port: int) -> str:
    """The cores the `streamlog serve` process on `port` may run on, as Linux lists them ("0-1")."""
    for line in (server_process(port) / "status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise LookupError(f"no Cpus_allowed_list for the server on port {port}")
