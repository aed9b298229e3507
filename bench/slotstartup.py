"""Start-up over many small streams in slots, in-process (docs/design/small-streams.md §5, §7).

    python -m bench.slotstartup [--streams 100000] [--dir PATH] [--fresh]

Builds `--streams` streams of one 100-byte entry each with the engine directly (small_streams
"slots", fsync everysec, 1,024 open streams, a maintenance round every 1,000 creations as the
background thread would make about once a second at the load's pace), then leaves it as a
kill -9 would: no close. Then, each from that same state (the catalog file and journals put
back before each; the packs are not changed by a start-up that finds nothing to repair):

- `kill9`: the same boot id: the catalog file and its journals replayed;
- `power`: another boot id (a power loss or an OS crash): the journals' synced prefix trusted,
  the records past it checked against their slots, `streams/` listed;
- `scan`: another boot id with the journals gone: every slot header read (the fallback).

One JSON object per figure (bench.common.emit): the load's CPU per stream, the journal's records
at the crash, and each start-up's CPU (process_time: every thread) and wall time, in this process
or (`--fresh`) each in a new one, as a server's. Run it in each build to compare, in the same
minutes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import emit
from storage import AppendBatch, Engine, EngineConfig
from storage.catalogjournal import journal_generations
from storage.fs import FileSystem

ROUND_EVERY = 1000


class OtherBoot(FileSystem):
    """The file system after a reboot: another kernel boot id."""

    def boot_id(self) -> str:
        return "00000000-0000-0000-0000-000000000000"


def build(data: Path, streams: int) -> tuple[float, int]:
    """The directory, left as a kill -9 would; the load's CPU per stream (µs) and the records in
    the journal at the end."""
    engine = Engine(data, EngineConfig(background=False, small_streams="slots"))
    payload = [b"p" * 100]
    started = time.process_time()
    for i in range(streams):
        engine.append(f"stream-{i:08d}", AppendBatch(payload))
        if i % ROUND_EVERY == ROUND_EVERY - 1:
            engine.maintain()
    cpu = (time.process_time() - started) / streams * 1e6
    records = engine._catalog._journal.records if engine._catalog._journal is not None else 0
    release(engine)
    return cpu, records


def release(engine: Engine) -> None:
    """Let another engine open the directory, as if this process had died (nothing closed)."""
    if engine._lock_fd is not None:
        os.close(engine._lock_fd)
        engine._lock_fd = None


def start(data: Path, fs: FileSystem) -> tuple[float, float, int]:
    wall, cpu = time.perf_counter(), time.process_time()
    engine = Engine(data, EngineConfig(background=False, small_streams="slots"), fs=fs)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    count = engine.stream_count()
    release(engine)
    return cpu, wall, count


def start_fresh(data: Path, kind: str) -> tuple[float, float, int]:
    """`start` in a new process, as a server's start-up runs (`--fresh`): in this one the load's
    heap is there to reuse, and a start-up's first allocations (its page faults) cost less."""
    code = "import sys; from bench.slotstartup import print_start; print_start(sys.argv[1], sys.argv[2])"
    done = subprocess.run(
        [sys.executable, "-c", code, str(data), kind], capture_output=True, text=True, check=True
    )
    cpu, wall, count = done.stdout.split()
    return float(cpu), float(wall), int(count)


def print_start(data: str, kind: str) -> None:
    print(*start(Path(data), file_system(kind)))


def file_system(kind: str) -> FileSystem:
    """A start-up's file system: the same boot after a kill -9, another one otherwise."""
    return FileSystem() if kind == "kill9" else OtherBoot()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=100_000)
    parser.add_argument("--dir", type=Path, help="where to build it (default: a temporary directory)")
    parser.add_argument("--fresh", action="store_true", help="each start-up in a new process, as a server's")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="slotstartup-", dir=args.dir))
    try:
        data = root / "data"
        load_cpu, records = build(data, args.streams)
        emit("load_cpu_per_stream", round(load_cpu, 1), "us", streams=args.streams)
        emit("journal_records_at_crash", records, "records", streams=args.streams)
        saved = root / "saved"
        saved.mkdir()
        small = [p for p in data.iterdir() if p.is_file() and p.name.startswith("catalog")]
        for path in small:
            shutil.copy2(path, saved / path.name)
        for kind in ("kill9", "power", "scan"):
            for path in data.iterdir():
                if path.is_file() and path.name.startswith("catalog"):
                    path.unlink()
            for path in saved.iterdir():
                shutil.copy2(path, data / path.name)
            if kind == "scan":
                for generation in journal_generations(os.listdir(data)):
                    (data / f"catalog.{generation}.log").unlink()
            if args.fresh:
                cpu, wall, count = start_fresh(data, kind)
            else:
                cpu, wall, count = start(data, file_system(kind))
            emit("startup_cpu", round(cpu, 3), "s", kind=kind, streams=args.streams, found=count)
            emit("startup_wall", round(wall, 3), "s", kind=kind, streams=args.streams)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
