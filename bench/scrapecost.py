"""What a metrics scrape costs in-process: python -m bench.scrapecost [--streams 20000] [--trace]

Appends one entry to each of `--streams` streams (all held open: max_open_streams above it, as
streams a server's scrapes saw over time), one with a consumer group, then runs the engine's
collector (service/metrics.py) `--scrapes` times and a maintenance round of the groups. Prints,
one JSON line each: the CPU (process time) of the first scrape, of a later one (mean), of the
groups' round, the resident memory (RssAnon) the first scrape added, and the consumer-group
stores the engine then holds. `--trace`: the bytes the first scrape left allocated
(tracemalloc: its CPU figures are then inflated by the tracing).
"""

from __future__ import annotations

import argparse
import tempfile
import time
import tracemalloc
from pathlib import Path

from bench.common import emit
from service.metrics import EngineCollector
from storage import AppendBatch, Engine, EngineConfig


def rss_anon_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def scrape(collector: EngineCollector) -> float:
    """One scrape, every family read out; returns its CPU seconds."""
    start = time.process_time()
    for family in collector.collect():
        list(family.samples)
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=20_000)
    parser.add_argument("--scrapes", type=int, default=5)
    parser.add_argument("--set", dest="small_streams", default="slots", help="small_streams")
    parser.add_argument("--trace", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="scrapecost-") as tmp:
        config = EngineConfig(
            background=False, max_open_streams=args.streams + 16, small_streams=args.small_streams
        )
        engine = Engine(Path(tmp) / "data", config)
        try:
            for i in range(args.streams):
                engine.append(f"s-{i}", AppendBatch([b"x"]))
            engine.create_group("s-0", "readers", start=0)
            collector = EngineCollector(lambda: engine, lambda: 0, lambda: 0)
            context = {"streams": args.streams, "small_streams": args.small_streams}
            if args.trace:
                tracemalloc.start()
            rss = rss_anon_bytes()
            first = scrape(collector)
            if args.trace:
                emit("first scrape: bytes left allocated", tracemalloc.get_traced_memory()[0], "B", **context)
                tracemalloc.stop()
            emit("first scrape: RssAnon added", rss_anon_bytes() - rss, "B", **context)
            emit("first scrape: CPU", first * 1000, "ms", **context)
            later = [scrape(collector) for _ in range(args.scrapes - 1)]
            emit("later scrape: CPU (mean)", sum(later) / len(later) * 1000, "ms", **context)
            start = time.process_time()
            engine._groups.maintain()
            emit("groups' round: CPU", (time.process_time() - start) * 1000, "ms", **context)
            emit("consumer-group stores", len(engine._groups.stores.all()), "stores", **context)
        finally:
            engine.close()


if __name__ == "__main__":
    main()
