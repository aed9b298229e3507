"""A real server's CPU per stream during an AppendMany load of new streams, by thread:
python -m bench.server_cpu [--streams 20000] [--entries 10] [--set small_streams=slots]

`streamlog serve` (as bench.streams starts it: fsync everysec, a metrics port) is loaded by one
Python client as bench.streams' `append_many` load does (AppendMany calls of up to 2,000 streams'
batches, two in flight), after a warm-up of `--warm-up` streams. The server's CPU is read from
/proc/PID/task/*/stat before the load and `--settle` seconds after it (the everysec rounds' syncs
and closes of the load's streams count, as in bench.appendmany_cpu), and given in µs per stream:
the process's, and each thread's, named by its kind (the event loop, the append threads, the
engine's maintenance and closer threads, gRPC's own threads: named by `py-spy dump` when py-spy
is installed beside this Python, else all "python" but gRPC's); then the server's RSS. Compare
it with `python -m bench.appendmany_cpu --entries 10 --set small_streams=slots`, the servicer's
work alone. `--pause` waits (printing the server's pid) before the load, so a profiler can attach.

One JSON object per line (bench.common.emit).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import add_setting_option, emit, settings_given
from bench.streams import CALL_BATCHES, CALLS_IN_FLIGHT, Server, payloads
from clients.aio import AsyncClient

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """Each live thread of `pid`: its kernel name and its CPU seconds (user and system)."""
    seen = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except FileNotFoundError:
            continue  # ended since the listing
        name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat.rsplit(")", 1)[1].split()
        seen[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / CLOCK_TICKS)
    return seen


def thread_kinds(pid: int) -> dict[int, str]:
    """Python threads' names by native id, from `py-spy dump` (the kernel names them all "python");
    {} when py-spy cannot attach."""
    spy = Path(sys.executable).with_name("py-spy")
    try:
        out = subprocess.run(
            [str(spy), "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    kinds = {}
    for line in out.splitlines():
        # Thread 12345 (idle): "streamlog-io_0"
        if line.startswith("Thread ") and '"' in line:
            tid = line.split()[1]
            if tid.isdigit():
                kinds[int(tid)] = line.split('"')[1]
    return kinds


def kind_of(name: str) -> str:
    """A thread's group: append threads numbered apart are one kind."""
    return name.rstrip("0123456789").rstrip("_-") or name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=20_000)
    parser.add_argument("--entries", type=int, default=10)
    parser.add_argument("--warm-up", type=int, default=2_000, help="streams loaded before the measure")
    parser.add_argument("--settle", type=float, default=2.5, help="seconds counted after the load")
    parser.add_argument("--pause", type=float, default=0, help="seconds to wait before the load")
    add_setting_option(parser)
    args = parser.parse_args()
    settings = settings_given(parser, args)
    root = Path(tempfile.mkdtemp(prefix="streamlog-servercpu-", dir=os.environ.get("BENCH_DIR")))
    server = Server(root / "data", 2 * (args.streams + args.warm_up), settings)
    try:
        server.start()
        assert server.proc is not None
        pid = server.proc.pid
        asyncio.run(_load(server.address, "warm", args.warm_up, args.entries))
        time.sleep(args.settle)
        if args.pause:
            print(f"server pid {pid}; the load starts in {args.pause} s", file=sys.stderr, flush=True)
            time.sleep(args.pause)
        before, process_before = thread_cpu(pid), server.cpu_s()
        started = time.monotonic()
        asyncio.run(_load(server.address, "room", args.streams, args.entries))
        elapsed = time.monotonic() - started
        time.sleep(args.settle)
        after, process = thread_cpu(pid), server.cpu_s() - process_before
        rss = server.rss_mb()
        kinds = thread_kinds(pid)  # after the load: the executor starts its threads as calls need them
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    shape = {"streams": args.streams, "entries": args.entries, **settings}
    per_kind: dict[str, float] = {}
    for tid, (name, cpu) in after.items():
        kind = kind_of(kinds.get(tid, name))
        per_kind[kind] = per_kind.get(kind, 0.0) + cpu - before.get(tid, (name, 0.0))[1]
    # Threads that ended during the load are in the process's figure only.
    per_kind["(ended threads)"] = process - sum(per_kind.values())
    emit("server_cpu_per_stream_us", round(1e6 * process / args.streams), "us", **shape)
    emit("load_time", round(elapsed, 2), "s", **shape)
    emit("server_rss", round(rss, 1), "MB", **shape)
    for kind, cpu in sorted(per_kind.items(), key=lambda item: -item[1]):
        if cpu:
            emit(
                "server_thread_cpu_per_stream_us", round(1e6 * cpu / args.streams), "us", thread=kind, **shape
            )


async def _load(address: str, prefix: str, streams: int, entries: int) -> None:
    """bench.streams' append_many load (its calls' sizes, two in flight), of streams named `prefix`-i."""
    calls = [
        [
            (f"{prefix}-{i:07d}", payloads(i, entries))
            for i in range(first, min(streams, first + CALL_BATCHES))
        ]
        for first in range(0, streams, CALL_BATCHES)
    ]
    async with AsyncClient(address, timeout=None) as client:

        async def caller() -> None:
            while calls:
                for result in await client.append_many(calls.pop(0)):
                    if isinstance(result, Exception):
                        raise result

        await asyncio.gather(*(caller() for _ in range(CALLS_IN_FLIGHT)))


if __name__ == "__main__":
    main()
