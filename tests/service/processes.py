"""`streamlog serve` as a real process for tests: started, watched through its log, killed."""

from __future__ import annotations

import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

STREAMLOG = shutil.which("streamlog", path=str(Path(sys.executable).parent))
START_TIMEOUT_S = 60  # a loaded machine has taken more than 30 s to start a node
LISTENING = re.compile(r"listening on 127\.0\.0\.1:(\d+)")


class ServerProcess:
    """`streamlog serve` in a subprocess; its stderr is collected line by line by a thread."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        assert STREAMLOG is not None, "the streamlog console script is not installed (pip install -e .)"
        self.process = subprocess.Popen(
            [STREAMLOG, "serve", "--host", "127.0.0.1", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.port: int | None = None

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.put(line)

    def wait_for(self, pattern: str | re.Pattern[str], timeout_s: float = START_TIMEOUT_S) -> re.Match[str]:
        """Wait for a log line matching `pattern`; fail with the log so far if it does not come."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=min(0.5, max(deadline - time.monotonic(), 0.01)))
            except queue.Empty:
                if self.process.poll() is not None and self.lines.empty():
                    break
                continue
            self.log.append(line)
            match = re.search(pattern, line)
            if match:
                return match
        pytest.fail(f"no log line matching {pattern!r}; log:\n{''.join(self.log)}")

    def wait_ready(self) -> ServerProcess:
        self.port = int(self.wait_for(LISTENING).group(1))
        self.wait_for("serving")
        return self

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def finish(self, timeout_s: float = 90) -> tuple[int, str]:
        """Wait for the exit; return the exit code and the whole log. (A fresh interpreter importing
        the server took over 20 s to refuse a taken port under a CPU hog.)"""
        code = self.process.wait(timeout=timeout_s)
        self._reader.join(timeout=5)
        while not self.lines.empty():
            self.log.append(self.lines.get())
        return code, "".join(self.log)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
