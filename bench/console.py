"""How fast the web console draws its pages at scale, in a real browser.

    python -m bench.console [--streams N] [--pending N] [--rounds R]

Builds a data directory with the storage engine (N streams, 100,000 by default: the
first pages' streams hold entries, the rest are empty; and a stream whose group has
100,000 pending entries), serves it with `streamlog serve` and its console, then
times each page in headless chromium from navigation to the page drawn with its
data: the streams list, a stream's entries, the group (first and a later page of
its pending list) and the cluster page. Prints one JSON line per page (median and
worst of the rounds, in ms).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.browser import browser
from bench.common import emit, free_port
from bench.service import streamlog_server
from storage import AppendBatch, Engine, EngineConfig, GroupReadOptions

GROUP_STREAM, GROUP = "jobs", "workers"
# Small segments: 100,000 streams must fit on a developer's disk.
CONFIG = dict(segment_bytes=1 << 20, max_batch_bytes=256 << 10, max_entry_bytes=64 << 10)
SETTINGS = {
    "segment_bytes": "1MiB",
    "max_batch_bytes": "256KiB",
    "max_entry_bytes": "64KiB",
    "max_read_bytes": "512KiB",
    "default_read_bytes": "256KiB",
    "max_streams": 1_000_000,
}


def build(data: Path, streams: int, pending: int) -> None:
    engine = Engine(data, config=EngineConfig(**CONFIG))
    try:

        def make(i: int) -> None:
            name = f"stream-{i:06d}"
            if i < 100:
                engine.append(name, AppendBatch([b'{"n": %d, "kind": "sample"}' % j for j in range(50)]))
            else:
                engine.create_stream(name)

        # Each new stream waits for its directory's fsync: many at once.
        with ThreadPoolExecutor(max_workers=32) as pool:
            list(pool.map(make, range(streams)))
        for start in range(0, pending, 1000):
            engine.append(
                GROUP_STREAM,
                AppendBatch([b'{"job": %d}' % j for j in range(start, min(start + 1000, pending))]),
            )
        engine.create_group(GROUP_STREAM, GROUP, start="oldest")
        for consumer in range(pending // 10_000 + 1):
            engine.read_group(GROUP_STREAM, GROUP, GroupReadOptions(f"worker-{consumer}", 10_000))
        assert engine.group_info(GROUP_STREAM, GROUP).pending == pending
        engine.sync()
    finally:
        engine.close()


PAGES = {
    "streams": "#/",
    "stream": "#/stream/stream-000000",
    "group": f"#/group/{GROUP_STREAM}/{GROUP}",
    "group_later_page": f"#/group/{GROUP_STREAM}/{GROUP}?pages=50000",
    "cluster": "#/cluster",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=100_000)
    parser.add_argument("--pending", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    # In memory when the machine has /dev/shm: creating 100,000 streams on a disk waits for
    # 100,000 directory syncs, one at a time (an hour on a busy VM); the pages read the same.
    shm = Path("/dev/shm")
    data = Path(tempfile.mkdtemp(prefix="streamlog-console-bench-", dir=shm if shm.is_dir() else None))
    try:
        started = time.monotonic()
        build(data, args.streams, args.pending)
        emit("build_data", time.monotonic() - started, "s", streams=args.streams, pending=args.pending)
        port = free_port()
        with streamlog_server("everysec", data, 900, http_port=port, **SETTINGS), browser() as context:
            page = context.new_page()
            errors: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            base = f"http://127.0.0.1:{port}"
            times: dict[str, list[float]] = {name: [] for name in PAGES}
            for round_ in range(args.rounds + 1):  # the first round warms up
                for name, route in PAGES.items():
                    start = time.perf_counter()
                    page.goto(f"{base}/?round={round_}{route}")
                    page.wait_for_selector("main[aria-busy=false]", timeout=60_000)
                    if round_:
                        times[name].append((time.perf_counter() - start) * 1000)
            if errors:
                raise RuntimeError(f"the console logged errors: {errors}")
            for name, values in times.items():
                emit(
                    f"console_render_{name}",
                    statistics.median(values),
                    "ms",
                    worst_ms=round(max(values), 1),
                    rounds=args.rounds,
                    streams=args.streams,
                    pending=args.pending,
                )
    finally:
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
