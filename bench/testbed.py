"""The processes of a fault-injection run: streamlog nodes that can lose power, etcd, a proxy on every link.

Every node runs `streamlog serve` under tests/cluster/powernode.py, so besides
kill -9 and SIGSTOP it can lose power (only what it synced survives), crash with
its page cache kept, or find its disk full. Its port and data directory stay the
same across restarts; its stderr goes to `<dir>/<name>.log`, appended by every run.

Runs from a checkout (like the tests): the launcher, etcd and the proxies are the
test suite's own tools (tests/cluster/, tests/storage/faultfs.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.common import free_port, wait_serving
from tests.cluster.etcd_server import EtcdCluster
from tests.cluster.proxy import FaultProxy

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 60.0
EXIT_TIMEOUT_S = 60.0
# Small segments keep a node's in-memory disk small; batches must still fit one.
NODE_SETTINGS = {
    "segment_bytes": "1MiB",
    "max_batch_bytes": "512KiB",
    "max_entry_bytes": "256KiB",
    "shutdown_grace_ms": "2000",
}
_BIND_ATTEMPTS = 3


class NodeError(RuntimeError):
    """A node did not start, stop or take a fault as it should; the message ends with its log's tail."""


class NodeProcess:
    """One streamlog node: a `streamlog serve` process on FaultFS, started and restarted on one port."""

    def __init__(
        self,
        name: str,
        directory: Path,
        *,
        fsync: str = "always",
        power_mode: str = "lost",
        seed: int = 0,
        args: Callable[[NodeProcess], list[str]] | None = None,
        settings: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.data_dir = directory / name
        self.log_path = directory / f"{name}.log"
        self.fsync = fsync
        self.power_mode = power_mode
        self.seed = seed
        self.args = args  # more flags, made at each start (they may name the node's port)
        self.settings = {**NODE_SETTINGS, **(settings or {})}
        self.port = free_port()
        self.process: subprocess.Popen | None = None
        self.paused = False
        self.starts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def command(self) -> list[str]:
        overrides = [f"--set={key}={value}" for key, value in self.settings.items()]
        return [
            sys.executable,
            "-m",
            "tests.cluster.powernode",
            f"--power-mode={self.power_mode}",
            f"--seed={self.seed + self.starts}",
            "serve",
            f"--data={self.data_dir}",
            "--host=127.0.0.1",
            f"--port={self.port}",
            f"--fsync={self.fsync}",
            *(self.args(self) if self.args is not None else ()),
            *overrides,
        ]

    def start(self) -> None:
        """Start the node and wait until it serves (its port kept; a new one only if the first start
        finds it taken)."""
        for attempt in range(_BIND_ATTEMPTS):
            self.spawn()
            try:
                self.wait_serving()
                return
            except NodeError:
                in_use = "in use" in self.log_tail() and self.starts == 1
                if not in_use or attempt == _BIND_ATTEMPTS - 1:
                    raise
                self.port = free_port()

    def spawn(self) -> None:
        """Start the process without waiting for it to serve."""
        if self.running:
            raise NodeError(f"node {self.name} is running already")
        self.starts += 1
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"--- start {self.starts}: {' '.join(self.command())}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.command(), cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        self.paused = False

    def wait_serving(self, timeout_s: float = START_TIMEOUT_S) -> None:
        assert self.process is not None
        try:
            wait_serving(self.address, self.process, timeout_s)
        except RuntimeError as exc:
            raise NodeError(f"node {self.name} did not start: {exc}\n{self.log_tail()}") from None

    def log_tail(self, size: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-size:]
        return ""

    # ------------------------------------------------------------------ faults

    def _signal(self, signum: int) -> None:
        if not self.running:
            raise NodeError(f"node {self.name} is not running")
        assert self.process is not None
        self.process.send_signal(signum)

    def kill(self) -> None:
        """kill -9: nothing more of the process runs; its page cache survives (written back as the image)."""
        self._crash(signal.SIGUSR2)

    def power_loss(self) -> None:
        """Cut the power: only what the node synced survives (`power_mode`), then the process is gone."""
        self._crash(signal.SIGUSR1)

    def _crash(self, signum: int) -> None:
        self._signal(signum)
        if self.paused:
            self.resume()  # a stopped process takes the signal once it runs again
        self._wait_exit()

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        self._signal(signal.SIGCONT)
        self.paused = False

    def disk_full(self, full: bool) -> None:
        """Make the node's disk full (or give it space again); returns once the node says it switched."""
        mark = self.log_path.stat().st_size
        self._signal(signal.SIGRTMIN if full else signal.SIGRTMIN + 1)
        line = f"powernode: disk full {'on' if full else 'off'}"
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        while time.monotonic() < deadline:
            with self.log_path.open("rb") as log:
                log.seek(mark)
                if line.encode() in log.read():
                    return
            time.sleep(0.02)  # another process's log: nothing here can wake us
        raise NodeError(f"node {self.name} did not confirm '{line}'\n{self.log_tail()}")

    def wipe(self) -> None:
        """Delete the data directory (the node must be down): a replacement disk."""
        if self.running:
            raise NodeError(f"node {self.name} is running: stop it before wiping its data")
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def stop(self) -> None:
        """SIGTERM: the server's clean shutdown, then the node writes its disk out and exits."""
        if not self.running:
            return
        if self.paused:
            self.resume()
        self._signal(signal.SIGTERM)
        self._wait_exit()

    def _wait_exit(self) -> None:
        assert self.process is not None
        try:
            self.process.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            message = f"node {self.name} did not exit within {EXIT_TIMEOUT_S} s"
            raise NodeError(f"{message}\n{self.log_tail()}") from None

    def abandon(self) -> None:
        """Whatever state the node is in, make sure no process of it is left (for cleanup paths)."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()


@dataclass(frozen=True)
class TestbedConfig:
    __test__ = False  # not a pytest class, whatever its name

    nodes: int = 3  # 1: a single server, no etcd (the embedded default); more: a cluster
    etcd_members: int = 3
    fsync: str = "always"
    power_mode: str = "lost"
    replication_factor: int = 1
    lease_ttl_ms: int = 2000
    seed: int = 0


class Testbed:
    """etcd and the nodes, with a fault proxy on every link (started and stopped on the running loop).

    Links, each its own FaultProxy: `client_links[node]` (the workload's clients dial a
    node there), `peer_links[(a, b)]` (node a dials node b there: a's `peer_addresses`),
    `etcd_links[(node, i)]` (the node reaches etcd member i there: its `--cluster`).
    """

    __test__ = False  # not a pytest class, whatever its name

    def __init__(self, directory: Path, config: TestbedConfig) -> None:
        self.directory = directory
        self.config = config
        self.clustered = config.nodes > 1
        names = [f"n{i + 1}" for i in range(config.nodes)]
        self.nodes = {
            name: NodeProcess(
                name,
                directory / "nodes",
                fsync=config.fsync,
                power_mode=config.power_mode,
                seed=config.seed * 1000 + i * 100,
                args=self._cluster_flags if self.clustered else None,
            )
            for i, name in enumerate(names)
        }
        self.etcd = EtcdCluster(directory / "etcd", config.etcd_members) if self.clustered else None
        self.client_links: dict[str, FaultProxy] = {}
        self.peer_links: dict[tuple[str, str], FaultProxy] = {}
        self.etcd_links: dict[tuple[str, int], FaultProxy] = {}

    @property
    def client_addresses(self) -> list[str]:
        return [_address(self.client_links[name].address) for name in self.nodes]

    def links_of(self, name: str) -> list[FaultProxy]:
        """Every link that reaches node `name` or that it dials."""
        peers = [proxy for pair, proxy in self.peer_links.items() if name in pair]
        etcd = [proxy for (node, _), proxy in self.etcd_links.items() if node == name]
        return [self.client_links[name], *peers, *etcd]

    def _cluster_flags(self, node: NodeProcess) -> list[str]:
        cfg = self.config
        etcd = ",".join(_address(self.etcd_links[node.name, i].address) for i in range(cfg.etcd_members))
        peers = ",".join(
            f"{dialed}={_address(proxy.address)}"
            for (dialer, dialed), proxy in self.peer_links.items()
            if dialer == node.name
        )
        return [
            f"--cluster={etcd}",
            f"--node-id={node.name}",
            f"--advertise={node.address}",
            f"--set=peer_addresses={peers}",
            f"--set=lease_ttl_ms={cfg.lease_ttl_ms}",
            f"--set=default_replication_factor={cfg.replication_factor}",
        ]

    async def start(self) -> None:
        await self.open_links()
        await asyncio.gather(*(self.start_node(name) for name in self.nodes))

    async def open_links(self) -> None:
        """Start etcd and every proxy (the nodes' ports are known before they start)."""
        if self.etcd is not None:
            await asyncio.to_thread(self.etcd.start)
        for name, node in self.nodes.items():
            self.client_links[name] = await _proxy(("127.0.0.1", node.port))
            for other, peer in self.nodes.items():
                if other != name:
                    self.peer_links[name, other] = await _proxy(("127.0.0.1", peer.port))
            if self.etcd is not None:
                for i, endpoint in enumerate(self.etcd.endpoints):
                    self.etcd_links[name, i] = await _proxy(endpoint)

    async def start_node(self, name: str) -> None:
        """(Re)start a node and wait until it serves; the proxies follow it if it had to move port."""
        node = self.nodes[name]
        await asyncio.to_thread(node.start)
        for (_, dialed), proxy in self.peer_links.items():
            if dialed == name:
                proxy.target = ("127.0.0.1", node.port)
        self.client_links[name].target = ("127.0.0.1", node.port)

    async def stop(self) -> None:
        """Stop every node cleanly (each writes its disk out), then the proxies and etcd."""
        try:
            await asyncio.gather(*(asyncio.to_thread(node.stop) for node in self.nodes.values()))
        finally:
            for proxy in self.proxies():
                await proxy.stop()
            self.abandon()

    def proxies(self) -> list[FaultProxy]:
        return [*self.client_links.values(), *self.peer_links.values(), *self.etcd_links.values()]

    def abandon(self) -> None:
        """Kill whatever still runs (cleanup after a failure; a node's unsaved disk is lost)."""
        for node in self.nodes.values():
            node.abandon()
        if self.etcd is not None:
            self.etcd.stop()


async def _proxy(target: tuple[str, int]) -> FaultProxy:
    proxy = FaultProxy(target)
    await proxy.start()
    return proxy


def _address(endpoint: tuple[str, int]) -> str:
    return f"{endpoint[0]}:{endpoint[1]}"
