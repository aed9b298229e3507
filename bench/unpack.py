"""CPU, wall time and file syncs a stream of `python -m storage.inspect unpack DATA`
(storage/unpack.py), in-process.

    python -m bench.unpack [--streams 1000] [--entries 10] [--size 100] [--dir PARENT]

Makes `--streams` streams in slots of pack files (`small_streams = "slots"`), each of one append
of `--entries` payloads of `--size` bytes, in a new directory under `--dir` (default: the
system's temporary directory: give one on the disk a server's data would be on), shuts the
engine down cleanly, then times what the command does: the engine opened on the directory,
`unpack`, the engine closed. CPU is the process's (`time.process_time`: every thread's), syncs
are the engine's file, directory and file-system syncs (storage/fs.py's `sync_times`). Checks
that every stream moved and no pack is left. One JSON line (bench.common.emit): the CPU a
stream, with the wall time and syncs a stream beside it.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import tempfile
import time
from pathlib import Path

from bench.common import emit
from storage import AppendBatch, Engine, EngineConfig
from storage.layout import PACKS_DIR


def fill(data: Path, streams: int, entries: int, size: int) -> None:
    payloads = [bytes(size)] * entries
    with Engine(data, EngineConfig(background=False, small_streams="slots")) as engine:
        for i in range(streams):
            engine.append(f"stream-{i}", AppendBatch(payloads))
        placed = len(engine._catalog.placed())
    if placed != streams:
        raise SystemExit(f"only {placed} of {streams} streams went to slots")


def measure(data: Path, streams: int) -> dict:
    wall, cpu = time.perf_counter(), time.process_time()
    engine = Engine(data, EngineConfig(background=False))
    try:
        done = engine.unpack()
    finally:
        engine.close()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    if len(done.promoted) != streams or done.kept or (data / PACKS_DIR).exists():
        raise SystemExit(f"unpack left streams in slots: {len(done.promoted)} moved, kept {done.kept}")
    return {
        "cpu_ms_per_stream": round(1000 * cpu / streams, 3),
        "wall_ms_per_stream": round(1000 * wall / streams, 3),
        "syncs_per_stream": round(engine._fs.sync_times.count / streams, 3),
        "cpu_s": round(cpu, 2),
        "wall_s": round(wall, 2),
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,  # (the fill's too)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--entries", type=int, default=10)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--dir", type=Path, default=None, help="where to make the data directory")
    args = parser.parse_args()
    parent = Path(tempfile.mkdtemp(prefix="streamlog-unpack-", dir=args.dir))
    try:
        data = parent / "data"
        fill(data, args.streams, args.entries, args.size)
        figures = measure(data, args.streams)
        cpu = figures.pop("cpu_ms_per_stream")
        sizes = {"streams": args.streams, "entries": args.entries, "size": args.size}
        emit("unpack_cpu_per_stream", cpu, "ms", **sizes, **figures)
    finally:
        shutil.rmtree(parent, ignore_errors=True)


if __name__ == "__main__":
    main()
