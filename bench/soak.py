"""Soak run: mixed load on a real server for a while, sampled, checked, plotted.

    python -m bench.soak [--duration 1800] [--out DIR]

Starts `streamlog serve` (fsync everysec) and, in this process:
- 2 idempotent Producers appending batches to stream `soak` (their acks recorded);
- 2 consumer-group workers on `soak` (group `g`, retry_ms 2000, holding retention),
  each "crashing" now and then: it drops a batch without acking it and is replaced
  by a fresh consumer, so the group must redeliver;
- 2 subscribers following `soak`;
- a keyed stream `kv` with compaction on, and retention (max_entries) on `soak`.

Every few seconds it samples the server's RSS and open file descriptors
(/proc), the event-loop lag (the server's `streamlog_event_loop_lag_seconds`
metric, measured at each scrape) and client-side append latency percentiles.
At the end it checks that every acknowledged entry reached the group at least
once (at-least-once: duplicates only from redelivery) and that subscribers saw
the stream in order; it writes `report.json`, `samples.jsonl` and PNG plots to
the output directory and prints one JSON object per line, as the other benches.
Exit status 1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path

from bench.common import emit, free_port, percentiles, serve_command
from clients import Client, GroupConfig, Producer, Record, StreamConfig
from clients.errors import StreamlogError

STREAM = "soak"
GROUP = "g"


class SoakServer:
    def __init__(self, data: Path) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        command = serve_command(data, self.port, metrics_port=self.metrics_port)
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.address = f"127.0.0.1:{self.port}"
        deadline = time.monotonic() + 30
        with Client(self.address) as client:
            while True:
                try:
                    if client.health(timeout=1) == "SERVING":
                        break
                except StreamlogError:
                    if time.monotonic() > deadline or self.proc.poll() is not None:
                        raise RuntimeError("streamlog serve did not start") from None
                time.sleep(0.05)  # start-up only: nothing listens yet to wake us

    def sample(self) -> dict:
        pid = self.proc.pid
        with open(f"/proc/{pid}/status") as f:
            status = {line.split(":")[0]: line.split()[1] for line in f if line.startswith(("VmRSS", "Rss"))}
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        lag = None
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as reply:
            for line in reply.read().decode().splitlines():
                if line.startswith("streamlog_event_loop_lag_seconds "):
                    lag = float(line.split()[1])
        # RssFile is mapped segment pages (the page cache, reclaimable); RssAnon is the heap.
        return {
            "rss_mb": int(status["VmRSS"]) / 1024,
            "rss_anon_mb": int(status["RssAnon"]) / 1024,
            "rss_file_mb": int(status["RssFile"]) / 1024,
            "fds": fds,
            "loop_lag_ms": None if lag is None else lag * 1000,
        }

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


_SEEN = bytes([0] + [1] * 255)  # a count -> 1 if seen at all


class OffsetCounts:
    """How often each offset was seen (saturating at 255), one byte per offset in a bytearray.

    Tens of millions of offsets in a set or a dict would be walked by the garbage collector
    at every full collection, stalling this process's load threads for longer and longer:
    a growing send latency that is the bench's, not the server's.
    """

    def __init__(self) -> None:
        self._counts = bytearray()

    def add(self, offsets: Iterable[int]) -> None:
        counts = self._counts
        for offset in offsets:
            if offset >= len(counts):
                counts.extend(bytes(max(offset + 1 - len(counts), len(counts) // 2)))
            if counts[offset] < 255:
                counts[offset] += 1

    def __len__(self) -> int:
        """Offsets seen at least once."""
        return len(self._counts) - self._counts.count(0)

    def seen_more_than_once(self) -> int:
        return len(self) - self._counts.count(1)

    def missing_from(self, other: OffsetCounts, limit: int = 20) -> list[int]:
        """Up to `limit` offsets seen here and never in `other` (whole-array operations first:
        the usual answer, none, costs no loop over the offsets)."""
        size = len(self._counts)
        mine = self._counts.translate(_SEEN)
        theirs = bytes(other._counts[:size]).ljust(size, b"\0").translate(_SEEN)
        if not int.from_bytes(mine, "big") & ~int.from_bytes(theirs, "big"):
            return []
        return [o for o in range(size) if mine[o] and not theirs[o]][:limit]


class Soak:
    def __init__(self, address: str, seed: int) -> None:
        self.address = address
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.acked = OffsetCounts()
        self.delivered = OffsetCounts()  # times each offset was delivered to the group
        self.latencies_ms: list[float] = []  # append latency since the last sample
        self.crashes = 0
        self.subscriber_errors: list[str] = []
        self.errors: list[str] = []

    def produce(self, worker: int) -> None:
        with Client(self.address) as client, Producer(client, STREAM, linger_ms=2) as producer:
            n = 0
            while not self.stop.is_set():
                started = time.perf_counter()
                futures = [producer.send(b"w%d-%d" % (worker, n + i) + b"x" * 90) for i in range(200)]
                offsets = [f.result(timeout=60) for f in futures]
                elapsed_ms = (time.perf_counter() - started) * 1000
                n += len(futures)
                with self.lock:
                    self.acked.add(offsets)
                    self.latencies_ms.append(elapsed_ms)
                time.sleep(self.rng.uniform(0, 0.02))  # a steady, not a saturating, load

    def consume(self, worker: int) -> None:
        generation = 0
        with Client(self.address) as client:
            while not self.stop.is_set():
                name = f"worker{worker}-{generation}"
                to_ack: list[int] = []
                try:
                    while not self.stop.is_set():
                        result = client.read_group(
                            STREAM,
                            GROUP,
                            name,
                            count=100,
                            block_ms=200,
                            ack=to_ack,
                            retry_ms=2000,
                            timeout=30,
                        )
                        with self.lock:
                            self.delivered.add(entry.offset for entry in result.entries)
                        to_ack = [e.offset for e in result.entries]
                        if to_ack and self.rng.random() < 0.01:
                            with self.lock:
                                self.crashes += 1
                            break  # "crash": this batch is never acked; the group must redeliver it
                except StreamlogError as exc:
                    self.errors.append(f"consumer {name}: {exc}")
                    return
                generation += 1
            if to_ack:
                client.ack(STREAM, GROUP, to_ack, timeout=30)

    def follow(self, worker: int) -> None:
        with Client(self.address) as client:
            last = None
            subscription = client.subscribe(STREAM, "latest")
            try:
                for batch in subscription:
                    for entry in batch.entries:
                        if last is not None and entry.offset != last + 1 and batch.gap is None:
                            self.subscriber_errors.append(f"subscriber {worker}: {last} then {entry.offset}")
                        last = entry.offset
                    if self.stop.is_set():
                        return
            except StreamlogError as exc:
                if not self.stop.is_set():
                    self.subscriber_errors.append(f"subscriber {worker}: {exc}")
            finally:
                subscription.cancel()

    def keyed(self) -> None:
        with Client(self.address) as client:
            i = 0
            while not self.stop.is_set():
                client.append("kv", [Record(b"v%d" % (i + j), tag=f"k{(i + j) % 50}") for j in range(100)])
                i += 100
                time.sleep(0.05)


def _plots(samples: list[dict], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t_s"] for s in samples]
    series = [
        ("rss_mb", "server RSS (MB)"),
        ("rss_anon_mb", "server heap: RssAnon (MB)"),
        ("rss_file_mb", "server mapped segments: RssFile (MB)"),
        ("fds", "server open file descriptors"),
        ("loop_lag_ms", "event-loop lag (ms)"),
        ("append_p99_ms", "append batch latency p99 (ms)"),
    ]
    names = []
    for key, title in series:
        values = [s.get(key) for s in samples]
        if all(v is None for v in values):
            continue
        fig, ax = plt.subplots(figsize=(7, 3))
        ax.plot(t, [v if v is not None else float("nan") for v in values])
        ax.set_title(title)
        ax.set_xlabel("seconds")
        fig.tight_layout()
        name = f"{key}.png"
        fig.savefig(out / name)
        plt.close(fig)
        names.append(name)
    return names


def run(duration_s: float, out: Path, interval_s: float, seed: int) -> bool:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="streamlog-soak-") as data:
        server = SoakServer(Path(data))
        try:
            with Client(server.address) as client:
                client.append(STREAM, [b"start"])
                client.set_config(STREAM, StreamConfig(max_entries=200_000))
                client.create_group(STREAM, GROUP, "latest", config=GroupConfig(retention_hold=True))
                client.append("kv", [b"start"])
                client.set_config("kv", StreamConfig(compaction=True))
            soak = Soak(server.address, seed)
            threads = [threading.Thread(target=soak.produce, args=(w,)) for w in range(2)]
            threads += [threading.Thread(target=soak.consume, args=(w,)) for w in range(2)]
            threads += [threading.Thread(target=soak.follow, args=(w,), daemon=True) for w in range(2)]
            threads.append(threading.Thread(target=soak.keyed))
            for thread in threads:
                thread.start()
            samples = []
            started = time.monotonic()
            while time.monotonic() - started < duration_s:
                time.sleep(interval_s)  # the sampling period itself
                with soak.lock:
                    latencies, soak.latencies_ms = soak.latencies_ms, []
                    acked = len(soak.acked)
                sample = {"t_s": round(time.monotonic() - started, 1), "acked": acked, **server.sample()}
                if latencies:
                    sample["append_p50_ms"], sample["append_p99_ms"] = percentiles(latencies, (50, 99))
                samples.append(sample)
            soak.stop.set()
            for thread in threads:
                if not thread.daemon:
                    thread.join(timeout=120)
            # Let the group drain what was acknowledged, then check at-least-once.
            _drain(server.address, soak)
            exit_code = server.stop()
        finally:
            if server.proc.poll() is None:
                server.stop()
    missing = soak.acked.missing_from(soak.delivered)
    duplicates = soak.delivered.seen_more_than_once()
    verdict = not missing and not soak.subscriber_errors and not soak.errors and exit_code == 0
    report = {
        "duration_s": duration_s,
        "acked_entries": len(soak.acked),
        "delivered_entries": len(soak.delivered),
        "missing": missing[:20],
        "redelivered_entries": duplicates,
        "consumer_crashes": soak.crashes,
        "subscriber_errors": soak.subscriber_errors[:20],
        "errors": soak.errors[:20],
        "server_exit_code": exit_code,
        "rss_mb_first_last_max": _first_last_max(samples, "rss_mb"),
        "rss_anon_mb_first_last_max": _first_last_max(samples, "rss_anon_mb"),
        "fds_first_last_max": _first_last_max(samples, "fds"),
        "loop_lag_ms_max": max((s["loop_lag_ms"] or 0 for s in samples), default=None),
        "ok": verdict,
    }
    (out / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    report["plots"] = _plots(samples, out)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    for key in ("acked_entries", "redelivered_entries", "consumer_crashes"):
        emit(f"soak_{key}", report[key], "entries" if "entries" in key else "count", duration_s=duration_s)
    emit("soak_rss_mb_max", report["rss_mb_first_last_max"][2], "MB", duration_s=duration_s)
    emit("soak_heap_mb_max", report["rss_anon_mb_first_last_max"][2], "MB", duration_s=duration_s)
    emit("soak_fds_max", report["fds_first_last_max"][2], "fds", duration_s=duration_s)
    emit("soak_loop_lag_ms_max", report["loop_lag_ms_max"] or 0, "ms", duration_s=duration_s)
    emit("soak_ok", int(verdict), "bool", report=str(out / "report.json"))
    return verdict


def _drain(address: str, soak: Soak) -> None:
    """Read the group until every acked entry was delivered or nothing more comes for a while."""
    with Client(address) as client:
        deadline = time.monotonic() + 60
        to_ack: list[int] = []
        while time.monotonic() < deadline and soak.acked.missing_from(soak.delivered):
            result = client.read_group(
                STREAM, GROUP, "drain", count=1000, block_ms=500, ack=to_ack, claim_idle_ms=0, timeout=30
            )
            soak.delivered.add(entry.offset for entry in result.entries)
            to_ack = [e.offset for e in result.entries]
        if to_ack:
            client.ack(STREAM, GROUP, to_ack, timeout=30)


def _first_last_max(samples: list[dict], key: str) -> list[float | None]:
    values = [s[key] for s in samples if s.get(key) is not None]
    return [values[0], values[-1], max(values)] if values else [None, None, None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=1800, help="seconds of load (default 1800)")
    parser.add_argument("--interval", type=float, default=5, help="seconds between samples")
    parser.add_argument("--out", type=Path, default=Path("bench/out/soak"), help="report directory")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    sys.exit(0 if run(args.duration, args.out, args.interval, args.seed) else 1)


if __name__ == "__main__":
    main()
