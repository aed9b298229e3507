"""The processes of a fault-injection run: streamlog nodes that can lose power, etcd, a proxy on every link.

Every node runs `streamlog serve` under tests/cluster/powernode.py, so besides
kill -9 and SIGSTOP it can lose power (only what it synced survives), crash with
its page cache kept, or find its disk full. Its port and data directory stay the
same across restarts; its stderr goes to `<dir>/<name>.log`, appended by every run.

Runs from a checkout (like the tests): the launcher, etcd and the proxies are the
test suite's own tools (tests/cluster/, tests/storage/faultfs.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.common import free_port, wait_serving

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 60.0
EXIT_TIMEOUT_S = 60.0
# Small segments keep a node's in-memory disk small; batches must still fit one.
NODE_SETTINGS = {"segment_bytes": "2MiB", "max_batch_bytes": "1MiB", "shutdown_grace_ms": "2000"}
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
        args: tuple[str, ...] = (),
        settings: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.data_dir = directory / name
        self.log_path = directory / f"{name}.log"
        self.fsync = fsync
        self.power_mode = power_mode
        self.seed = seed
        self.args = args
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
            *self.args,
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
