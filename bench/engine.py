"""Storage engine figures, in-process (no network): python -m bench.engine [--quick] [--dir DIR] [--only ...]

Prints one JSON object per line. Workload: 100-byte payloads in batches of
1000 on one stream, as DESIGN.md's performance section asks. `--quick`
shrinks the sizes for a smoke run; `--only` runs some of the figures.

Group reads (`group_read`, entries/s through Engine.read_group and ack, fsync
`no` so the figure is the CPU cost of the group code): `batch` reads 50 at a
time and acknowledges each batch as one range, `one` reads and acknowledges
one entry at a time, `redeliver` reads 50, nacks them and reads them again
(the redelivery path) before acknowledging them. One-entry appends
(`append_one`, appends/s and CPU µs per append, fsync `no`) are the engine's
share of a unary Append.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

from bench.common import Timer, emit, percentiles
from storage import AppendBatch, Engine, EngineConfig, GroupReadOptions
from storage.inspect import inspect_segment

BATCH = 1000
PAYLOAD = 100


def _payloads(n: int) -> list[bytes]:
    return [os.urandom(PAYLOAD) for _ in range(n)]


def _rides(n: int) -> list[bytes]:
    rng = random.Random(7)
    cities = ["San Francisco", "Oakland", "Berkeley", "San Jose"]
    return [
        json.dumps(
            {
                "id": 12_345 + i,
                "distance": round(rng.uniform(0.5, 900), 1),
                "rider": f"user-{rng.randrange(1000)}",
                "city": rng.choice(cities),
            }
        ).encode()
        for i in range(n)
    ]


def _fill(engine: Engine, stream: str, total: int, batch: list[bytes]) -> float:
    with Timer() as t:
        for _ in range(total // BATCH):
            engine.append(stream, AppendBatch(batch))
    return t.elapsed


def bench_append_one(root: Path, n: int) -> None:
    """One-entry appends, the engine's share of a unary Append: appends/s and CPU per append
    (fsync no, so the figure is the Python cost of the path, not the disk's)."""
    payload = _payloads(1)[0]
    with Engine(root / "append-one", EngineConfig(fsync="no", background=False)) as engine:
        engine.append("s", AppendBatch([payload]))  # created and open
        cpu = time.thread_time()
        with Timer() as t:
            for _ in range(n):
                engine.append("s", AppendBatch([payload]))
        cpu = time.thread_time() - cpu
    emit("append_one", n / t.elapsed, "appends/s", fsync="no", cpu_us=round(cpu / n * 1e6, 2), appends=n)


def bench_append(root: Path, total: int) -> None:
    batch = _payloads(BATCH)
    for fsync in ("no", "always"):
        n = total if fsync == "no" else total // 10
        with Engine(root / f"append-{fsync}", EngineConfig(fsync=fsync, background=False)) as engine:
            elapsed = _fill(engine, "s", n, batch)
        emit("append", n / elapsed, "entries/s", fsync=fsync, batch=BATCH, payload_bytes=PAYLOAD, entries=n)
        emit(
            "append_bytes",
            n * PAYLOAD / elapsed / 1e6,
            "MB/s",
            fsync=fsync,
            batch=BATCH,
            payload_bytes=PAYLOAD,
        )


def bench_sequential_read(engine: Engine, stream: str, total: int, packed: bool) -> None:
    offset = taken = 0
    with Timer() as t:
        while True:
            result = engine.read(stream, offset, 10_000)
            if not result.count:
                break
            taken += result.count
            offset = result.last_offset + 1
    assert taken == total, (taken, total)
    emit(
        "sequential_read", taken / t.elapsed, "entries/s", entries=taken, packed=packed, count_per_read=10_000
    )


def bench_seek(engine: Engine, stream: str, size: int, samples: int, label: str) -> dict[str, float]:
    rng = random.Random(size)
    hot, cold = [], []
    cache = engine._ctx.cache
    for _ in range(samples):
        offset = rng.randrange(size - 10)
        start = time.perf_counter_ns()
        result = engine.read(stream, offset, 10)
        hot.append((time.perf_counter_ns() - start) / 1000)
        assert result.count == 10
    for _ in range(samples):
        offset = rng.randrange(size - 10)
        cache.drop_all()
        start = time.perf_counter_ns()
        engine.read(stream, offset, 10)
        cold.append((time.perf_counter_ns() - start) / 1000)
    figures = {}
    for name, values in (("warm_cache", hot), ("cold_node", cold)):
        p50, p99 = percentiles(values, (50, 99))
        emit("seek_read_10", p50, "us", percentile=50, entries=size, cache=name, layout=label)
        emit("seek_read_10", p99, "us", percentile=99, entries=size, cache=name, layout=label)
        figures[name] = p50
    return figures


def bench_bytes_per_entry(root: Path, total: int) -> None:
    for kind, batch in (("random_100B", _payloads(BATCH)), ("json_ride", _rides(BATCH))):
        raw_payload = sum(map(len, batch)) / BATCH
        for compression in (False, True):
            config = EngineConfig(
                segment_bytes=2 << 20, max_batch_bytes=1 << 20, compression=compression, background=False
            )
            directory = root / f"size-{kind}-{compression}"
            with Engine(directory, config) as engine:
                _fill(engine, "s", total, batch)
                engine.maintain()
                info = engine.info("s")
            if compression:
                # Packed segments only: the growing tail is not compressed until it fills.
                reports = [inspect_segment(p) for p in sorted((directory / "streams").rglob("*.seg"))]
                packed = [r for r in reports if r.packed]
                per_entry = sum(r.file_bytes for r in packed) / sum(n.count for r in packed for n in r.nodes)
            else:
                per_entry = info.used_bytes / info.entries
            emit(
                "bytes_per_entry",
                per_entry,
                "bytes",
                payload=kind,
                payload_bytes=raw_payload,
                compressed=compression,
                ratio_to_payload=per_entry / raw_payload,
            )


def bench_group_reads(root: Path, total: int) -> None:
    batch = _payloads(BATCH)
    modes = (("batch", total, 50), ("one", total // 10, 1), ("redeliver", total, 50))
    with Engine(root / "groups", EngineConfig(fsync="no", background=False)) as engine:
        _fill(engine, "s", total, batch)
        for mode, n, count in modes:
            engine.create_group("s", mode)
            options = GroupReadOptions("c", count)
            taken = 0
            with Timer() as t:
                while taken < n:
                    result = engine.read_group("s", mode, options)
                    offsets = result.offsets
                    if mode == "redeliver":
                        engine.nack("s", mode, offsets)
                        assert engine.read_group("s", mode, options).offsets == offsets
                    engine.ack("s", mode, ranges=[(offsets[0], offsets[-1] + 1)])
                    taken += len(offsets)
            assert engine.group_info("s", mode).pending == 0
            emit("group_read", taken / t.elapsed, "entries/s", mode=mode, count=count, entries=taken)


def bench_seeks(root: Path, sizes: tuple[int, ...]) -> None:
    """Seek reads on streams of growing size (their time must not grow with it), and startup."""
    batch = _payloads(BATCH)
    seek = {}
    for size in sizes:
        directory = root / f"seek-{size}"
        with Engine(directory, EngineConfig(background=False)) as engine:
            _fill(engine, "s", size, batch)
            engine.maintain()  # pack full segments, as the server's maintenance thread does
            if size == sizes[-1]:
                bench_sequential_read(engine, "s", size, packed=True)
            seek[size] = bench_seek(engine, "s", size, 2000, "packed")
        if size == sizes[-1]:
            with Timer() as t:
                engine = Engine(directory, EngineConfig(background=False))
            emit("startup", t.elapsed * 1000, "ms", entries=size, nodes=engine.info("s").nodes, clean=True)
            engine.close()
        shutil.rmtree(directory)
    small, big = sizes[0], sizes[-1]
    for cache in ("warm_cache", "cold_node"):
        emit(
            "seek_ratio",
            seek[big][cache] / seek[small][cache],
            "x",
            cache=cache,
            compared=f"{big} vs {small} entries",
        )


FIGURES = ("append", "size", "seek", "groups")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--dir", help="scratch directory (default: a temp dir, removed at the end)")
    parser.add_argument(
        "--only", nargs="+", choices=FIGURES, default=FIGURES, help="figures to run (default: all)"
    )
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="streamlog-bench-"))
    sizes = (10_000, 100_000, 1_000_000) if args.quick else (10_000, 1_000_000, 10_000_000)
    append_total = 200_000 if args.quick else 2_000_000
    try:
        if "append" in args.only:
            bench_append(root, append_total)
            bench_append_one(root, append_total // 10)
        if "size" in args.only:
            bench_bytes_per_entry(root, 50_000 if args.quick else 200_000)
        if "seek" in args.only:
            bench_seeks(root, sizes)
        if "groups" in args.only:
            bench_group_reads(root, 100_000 if args.quick else 1_000_000)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
