"""kill -9 of a real `streamlog serve` under concurrent producers, a group consumer and a subscriber.

Twenty times per run, at a random moment, the server process is killed with
SIGKILL while two producers append, a consumer-group reader takes and acks
entries, and a subscriber follows the stream. After each restart:

- every acknowledged append is present, byte for byte, at the offsets its reply gave;
- offsets are contiguous from 0 (nothing missing, nothing extra in between);
- every entry the group delivered and whose ack never got a reply is still pending
  (or was acked): a delivered-but-unacknowledged entry is never lost;
- the subscriber only ever saw entries that are in the stream as they are now.

The server runs with fsync=always, the policy under which all of this is promised
for power loss too; a process crash keeps the page cache, so it would hold with
everysec as well.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench.common import free_port
from clients import Client
from clients.errors import StreamlogError

KILLS = int(os.environ.get("STREAMLOG_KILLS", "20"))
STREAM = "events"
GROUP = "workers"


class Server:
    """A `streamlog serve` process on a loopback port over one data directory."""

    def __init__(self, data: Path) -> None:
        self.data = data
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        command = [
            sys.executable,
            "-m",
            "service.cli",
            "serve",
            "--data",
            str(self.data),
            "--port",
            str(self.port),
            "--fsync",
            "always",
            "--log-level",
            "error",
        ]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        with Client(self.address) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise AssertionError(
                        f"server exited at start-up: {self.proc.stderr.read().decode()[-2000:]}"
                    )
                try:
                    if client.health(timeout=1) == "SERVING":
                        return
                except StreamlogError:
                    pass
                time.sleep(0.05)  # start-up: the port is not open yet, nothing can wake us
        raise AssertionError("server did not become SERVING in 30 s")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


class Load:
    """The clients of one life of the server; records what the server acknowledged."""

    def __init__(self, address: str, rng: random.Random, life: int) -> None:
        self.address = address
        self.rng = rng
        self.life = life
        self.stop = threading.Event()
        self.acked: dict[int, bytes] = {}  # offset -> payload, from Append replies
        self.delivered: set[int] = set()  # group deliveries whose ack got no reply
        self.seen: dict[int, bytes] = {}  # what the subscriber received
        self.lock = threading.Lock()

    def produce(self, worker: int) -> None:
        with Client(self.address) as client:
            batch_no = 0
            while not self.stop.is_set():
                n = self.rng.randint(1, 50)
                payloads = [f"l{self.life}-w{worker}-b{batch_no}-{i}".encode() for i in range(n)]
                batch_no += 1
                try:
                    reply = client.append(STREAM, payloads, timeout=5)
                except StreamlogError:
                    return  # the server is gone
                with self.lock:
                    for i, payload in enumerate(payloads):
                        self.acked[reply.first_offset + i] = payload

    def consume(self) -> None:
        with Client(self.address) as client:
            to_ack: list[int] = []
            while not self.stop.is_set():
                try:
                    result = client.read_group(
                        STREAM, GROUP, "c1", count=20, ack=to_ack, block_ms=50, timeout=5
                    )
                except StreamlogError:
                    with self.lock:
                        self.delivered.difference_update(to_ack)  # their ack may have landed: unknown
                    return
                with self.lock:
                    self.delivered.difference_update(to_ack)  # their ack got its reply
                    self.delivered.update(e.offset for e in result.entries)
                # Ack about half of what arrived, in the next call: the rest stays pending.
                to_ack = [e.offset for e in result.entries if self.rng.random() < 0.5]

    def follow(self) -> None:
        with Client(self.address) as client:
            try:
                for entry in client.subscribe(STREAM, "oldest").entries():
                    with self.lock:
                        self.seen[entry.offset] = entry.payload
                    if self.stop.is_set():
                        return
            except StreamlogError:
                return


def _check(address: str, everything: dict[int, bytes], load: Load) -> None:
    with Client(address) as client:
        info = client.info(STREAM)
        stored: dict[int, bytes] = {}
        offset = 0
        while offset < info.next_offset:
            page = client.read(STREAM, offset, count=5000, timeout=30)
            for entry in page.entries:
                stored[entry.offset] = entry.payload
            offset = page.next_offset
        assert sorted(stored) == list(range(info.next_offset)), "offsets are not contiguous from 0"
        for off, payload in everything.items():
            assert stored.get(off) == payload, f"acknowledged entry {off} lost or changed"
        for off, payload in load.seen.items():
            assert stored.get(off) == payload, f"the subscriber saw entry {off} which is not in the stream"
        still_pending: set[int] = set()
        start = 0
        while True:  # page through the detail rows (a reply holds a bounded number)
            rows = client.pending(STREAM, GROUP, start_offset=start, count=1000).entries
            still_pending.update(row.offset for row in rows)
            if not rows:
                break
            start = rows[-1].offset + 1
        assert load.delivered <= still_pending, "a delivered, unacknowledged entry left the pending list"


@pytest.mark.timeout(600)
def test_kill9_under_load_loses_nothing_acknowledged(tmp_path):
    rng = random.Random(int(os.environ.get("STREAMLOG_KILL_SEED", "20261122")))
    server = Server(tmp_path / "data")
    everything: dict[int, bytes] = {}
    try:
        server.start()
        with Client(server.address) as client:
            client.create_group(STREAM, GROUP, "oldest", create_stream=True)
        for life in range(KILLS):
            load = Load(server.address, rng, life)
            threads = [threading.Thread(target=load.produce, args=(w,)) for w in range(2)]
            threads += [
                threading.Thread(target=load.consume),
                threading.Thread(target=load.follow, daemon=True),
            ]
            for thread in threads:
                thread.start()
            time.sleep(rng.uniform(0.2, 0.8))
            server.kill()
            load.stop.set()
            for thread in threads[:3]:
                thread.join(timeout=30)
            everything.update(load.acked)
            server.start()
            _check(server.address, everything, load)
        assert len(everything) > KILLS * 50, "the load was too light to prove anything"
    finally:
        server.stop()
