"""Clustered `streamlog serve` processes for tests: on 127.0.0.1, each advertising its real address.

A node gets a free port picked here (a process that finds it taken meanwhile exits, and
the node is started again on another), its own data directory, and the settings that
keep tests short (2 s leases, one replica per stream unless told otherwise). `stop`
ends every process the set started, however the test ended.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from bench.common import free_port
from tests.cluster.helpers import TEST_TTL_MS
from tests.service.processes import ServerProcess

_ATTEMPTS = 3
SETTINGS = {
    "lease_ttl_ms": str(TEST_TTL_MS),
    "default_replication_factor": "1",
    "shutdown_grace_ms": "1000",
}


class ClusterNodes:
    """Nodes of one cluster (etcd `endpoints`), by name (their id, unless given another)."""

    def __init__(self, endpoints: list[tuple[str, int]], directory: Path, **settings: str) -> None:
        self.endpoints = ",".join(f"{host}:{port}" for host, port in endpoints)
        self.directory = directory
        self.settings = {**SETTINGS, **settings}
        self.processes: dict[str, ServerProcess] = {}
        self.ports: dict[str, int] = {}
        self.paused: set[str] = set()  # stopped with SIGSTOP: they answer nothing
        self.node_ids: dict[str, str] = {}  # a node's id, by its name here
        self._all: list[ServerProcess] = []

    def start(self, *names: str, **settings: str) -> None:
        """Start these nodes (at once) and wait until each serves and every running node sees them
        live; `settings` for them all."""
        for name in names:
            self.spawn(name, **settings)
        self._wait_for_serving(names, settings)
        self._wait_until_seen(names)

    def _wait_for_serving(self, names: tuple[str, ...], settings: dict[str, str]) -> None:
        for name in names:
            for attempt in range(_ATTEMPTS):
                outcome = self.processes[name].wait_for(r"serving \d+ streams|cannot run the server")
                if outcome.group(0).startswith("serving"):
                    break
                code, log = self.processes[name].finish()
                if "failed to bind" not in log.lower() or attempt == _ATTEMPTS - 1:
                    raise AssertionError(f"node {name} did not start (exit {code}):\n{log}")
                del self.ports[name]
                self.spawn(name, **settings)

    def _wait_until_seen(self, names: tuple[str, ...]) -> None:
        """Wait until every running node (but a paused one) sees `names` live: a node places a new
        stream on the members it sees, so one that has not yet seen the others would give a stream
        fewer replicas than its replication factor."""
        for watcher, process in self.processes.items():
            if process.process.poll() is not None or watcher in self.paused:
                continue
            with grpc.insecure_channel(self.target(watcher)) as channel:
                stub = pb_grpc.StreamLogServiceStub(channel)

                def sees_them(stub: pb_grpc.StreamLogServiceStub = stub) -> bool:
                    reply = stub.DescribeCluster(pb.DescribeClusterRequest(), timeout=10)
                    live = {node.id for node in reply.nodes if node.alive}
                    return {self.node_ids[name] for name in names} <= live

                eventually(sees_them, timeout_s=60)

    def spawn(self, name: str, node_id: str | None = None, **settings: str) -> ServerProcess:
        """Start node `name` (its id: `node_id`, default the name) without waiting; it keeps its
        port and data directory across restarts."""
        port = self.ports.setdefault(name, free_port())
        self.node_ids[name] = node_id or name
        overrides = [f"--set={key}={value}" for key, value in {**self.settings, **settings}.items()]
        process = ServerProcess(
            f"--port={port}",
            f"--data={self.directory / name}",
            f"--cluster={self.endpoints}",
            f"--node-id={node_id or name}",
            f"--advertise=127.0.0.1:{port}",
            *overrides,
        )
        process.port = port
        self.processes[name] = process
        self._all.append(process)
        return process

    def target(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def stub(self, name: str, channels: list[grpc.Channel]) -> pb_grpc.StreamLogServiceStub:
        channel = grpc.insecure_channel(self.target(name))
        channels.append(channel)
        return pb_grpc.StreamLogServiceStub(channel)

    def kill(self, name: str) -> None:
        """SIGKILL: no lease revoked, no shutdown; the data directory stays for a restart."""
        self.processes[name].kill()

    def signal(self, name: str, signum: signal.Signals) -> None:
        self.processes[name].process.send_signal(signum)
        if signum == signal.SIGSTOP:
            self.paused.add(name)
        elif signum in (signal.SIGCONT, signal.SIGTERM, signal.SIGKILL):
            self.paused.discard(name)

    def stop(self, name: str) -> tuple[int, str]:
        self.signal(name, signal.SIGTERM)
        return self.processes[name].finish()

    def stop_all(self) -> None:
        for process in self._all:
            if process.process.poll() is None:
                process.process.send_signal(signal.SIGCONT)  # a test may have paused it
                process.process.send_signal(signal.SIGTERM)
        for process in self._all:
            with contextlib.suppress(Exception):
                process.finish(timeout_s=10)
            process.kill()

    def print_logs(self, lines: int = 200) -> None:
        """The end of every node's log, on stdout: pytest shows it when the test failed."""
        for name, process in self.processes.items():
            print(f"--- node {name} (port {process.port}), last {lines} log lines:")
            print("".join(process.log[-lines:]), end="")


def eventually(condition: Callable[[], object], timeout_s: float = 10) -> None:
    """Wait (bounded) until `condition()` holds: the state moves in other processes, so poll."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the cluster did not get there in time"
        time.sleep(0.05)


def leader_of(stub: pb_grpc.StreamLogServiceStub, stream: str, timeout_s: float = 10) -> pb.StreamPlacement:
    """The stream's placement as the node `stub` calls sees it, once it sees the stream (a node
    learns of a stream created elsewhere from its watch, a moment later: poll, bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        reply = stub.DescribeCluster(pb.DescribeClusterRequest(prefix=stream), timeout=10)
        found = [placement for placement in reply.streams if placement.name == stream]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"stream {stream!r} is not in placement"
        time.sleep(0.05)
