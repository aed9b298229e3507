"""What the server was doing during each slow call to a closed stream: python -m bench.tailtrace

bench.streams' closed-stream phase (a unary Append, then a Read, one at a time, on streams of the
first half of a load, after the load's closes are synced), against a `streamlog serve` run under
this module (`serve`), which timestamps the engine's background work (rounds and their syncs,
the catalog file's rewrite, the closer thread), the calls' opens and closes, lock waits past
LOCK_WAIT_MS and Python's garbage collections, on CLOCK_MONOTONIC, the client's clock too. While
the calls run, a thread here reads each server thread's run time (/proc/PID/task/*/schedstat)
every SAMPLE_S. For every call over --slow-ms it prints the server's events that overlapped it and
what each server thread ran meanwhile; then, per kind of event, how many slow and how many fast
calls it overlapped.

    python -m bench.tailtrace --streams 20000 --load append_many --set small_streams=slots

One JSON object per line (bench.common.emit); the slow calls' reports as plain lines on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import ctypes
import gc
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from bench.common import emit, free_port, percentiles, serve_command, wait_serving
from bench.streams import LOADS, PAYLOAD, stream_name, wait_for_round

LOCK_WAIT_MS = 0.5  # a lock wait recorded past this
SAMPLE_S = 0.001  # the server threads' run times read this often during the calls
EVENTS_ENV = "TAILTRACE_EVENTS"  # where the traced server writes its events at exit
PR_SET_NAME = 15  # prctl(2)

# ---------------------------------------------------------------------- the traced server

_events: list[tuple[float, float, str, str]] = []  # (start, end, thread, what): `Event`s


def _record(start: float, what: str) -> None:
    _events.append((start, time.monotonic(), threading.current_thread().name, what))


def _timed(owner: Any, attr: str, what: str) -> None:
    """Wrap `owner.attr` (a function or method) so each call is recorded as `what`."""
    inner = getattr(owner, attr)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        try:
            return inner(*args, **kwargs)
        finally:
            _record(start, what)

    setattr(owner, attr, wrapper)


class _TimedLock:
    """A lock whose waits past LOCK_WAIT_MS are recorded (as `wait <what>`)."""

    def __init__(self, what: str) -> None:
        self._lock = threading.Lock()
        self._what = f"wait {what}"

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(False):
            return True
        start = time.monotonic()
        got = self._lock.acquire(blocking, timeout)
        if time.monotonic() - start > LOCK_WAIT_MS / 1000:
            _record(start, self._what)
        return got

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def _install() -> None:
    from storage import (
        catalog,
        catalogfiles,
        catalogjournal,
        closer,
        engine,
        groupmanager,
        handoff,
        maintenance,
        openstreams,
        packs,
        slothome,
    )

    for owner, attr, what in (
        (maintenance.Maintenance, "maintain", "round"),
        (handoff.UnsyncedCloses, "finish_all", "round: closes finished"),
        (slothome.SlotSync, "_sync", "slot sync"),
        (packs.Packs, "sync", "packs fdatasync"),
        (catalogjournal.Journal, "sync", "journal fdatasync"),
        (groupmanager.GroupManager, "maintain", "round: groups"),
        (catalogfiles.CatalogFiles, "_save_catalog", "catalog file saved"),
        (catalog.Catalog, "encode", "catalog file encoded"),
        (closer, "_close_all", "files closed"),
        (openstreams.OpenStreams, "_open", "call: open"),
        (openstreams.OpenStreams, "_close", "close"),
        (engine.Engine, "append", "call: append"),
        (engine.Engine, "read", "call: read"),
    ):
        _timed(owner, attr, what)
    catalog_init, cache_init = catalog.Catalog.__init__, openstreams.OpenStreams.__init__

    def traced_catalog(self: Any) -> None:
        catalog_init(self)
        self.lock = _TimedLock("catalog lock")

    def traced_cache(self: Any, *args: Any) -> None:
        cache_init(self, *args)
        self._opening = _TimedLock("cache _opening")

    catalog.Catalog.__init__ = traced_catalog  # type: ignore[method-assign]
    openstreams.OpenStreams.__init__ = traced_cache  # type: ignore[method-assign]
    started: dict[int, float] = {}

    sizes: dict[int, int] = {}

    def collected(phase: str, info: dict[str, int]) -> None:
        generation = info["generation"]
        if phase == "start":
            if generation:  # the objects it traverses, counted before it is timed
                sizes[threading.get_ident()] = sum(len(gc.get_objects(g)) for g in range(generation + 1))
            started[threading.get_ident()] = time.monotonic()
        else:
            start = started.pop(threading.get_ident(), time.monotonic())
            objects = sizes.pop(threading.get_ident(), 0)
            _record(start, f"gc gen {generation}" + (f" ({objects} objects)" if objects else ""))

    gc.callbacks.append(collected)
    # Threads named for the kernel too (schedstat's comm): the event loop's is the main thread.
    prctl = ctypes.CDLL(None).prctl
    boot = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

    def named(thread: threading.Thread) -> None:
        prctl(PR_SET_NAME, thread.name.encode()[:15], 0, 0, 0)
        boot(thread)

    threading.Thread._bootstrap_inner = named  # type: ignore[attr-defined]
    prctl(PR_SET_NAME, b"loop", 0, 0, 0)


def serve(argv: list[str]) -> int:
    """`streamlog serve argv...`, traced; the events written to $TAILTRACE_EVENTS at its end."""
    from service import cli

    _install()
    try:
        return cli.main(["serve", *argv])
    finally:
        with open(os.environ[EVENTS_ENV], "w") as out:
            json.dump(_events, out)


# ---------------------------------------------------------------------- the client


class ThreadSampler:
    """Each thread's run time and run-queue wait (schedstat, ns) in the server and in this process,
    read every SAMPLE_S by a process of its own (a thread here would take this process's GIL
    from the calls it times) while it runs."""

    def __init__(self, pid: int) -> None:
        self._pids = (pid, os.getpid())
        self.samples: list[tuple[float, dict[str, tuple[int, int]]]] = []
        self._stop = multiprocessing.Event()
        self._pipe, child = multiprocessing.Pipe(duplex=False)
        self._process = multiprocessing.Process(
            target=_sample, args=(self._pids, self._stop, child), daemon=True
        )

    def __enter__(self) -> ThreadSampler:
        self._process.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.samples = self._pipe.recv()
        self._process.join()

    def ran(self, start: float, end: float) -> dict[str, tuple[float, float]]:
        """ms each thread ran, and waited to run, between the samples around [start, end]."""
        before = next((s for t, s in reversed(self.samples) if t <= start), None)
        after = next((s for t, s in self.samples if t >= end), None)
        if before is None or after is None:
            return {}
        found = {}
        for name, (ran, waited) in after.items():
            was_ran, was_waited = before.get(name, (0, 0))
            if ran != was_ran or waited != was_waited:
                found[name] = ((ran - was_ran) / 1e6, (waited - was_waited) / 1e6)
        return found


def _sample(pids: tuple[int, int], stop: Any, out: Any) -> None:
    samples = []
    while not stop.is_set():
        seen: dict[str, tuple[int, int]] = {}
        for who, pid in zip(("server", "client"), pids, strict=True):
            root = f"/proc/{pid}/task"
            for tid in os.listdir(root):
                try:
                    with open(f"{root}/{tid}/comm") as f:
                        name = f"{who} {f.read().strip()}"
                    with open(f"{root}/{tid}/schedstat") as f:
                        ran, waited, _ = f.read().split()
                except FileNotFoundError:
                    continue  # the thread ended
                was = seen.get(name, (0, 0))
                seen[name] = (was[0] + int(ran), was[1] + int(waited))
        samples.append((time.monotonic(), seen))
        time.sleep(SAMPLE_S)
    out.send(samples)


def load(address: str, via: str, streams: int, entries: int) -> None:
    acked = asyncio.run(LOADS[via](address, streams, entries))
    assert acked == streams * entries, acked


def calls(address: str, streams: int, samples: int, payload: int) -> list[tuple[str, float, float]]:
    """bench.streams' closed-stream calls: (kind, start, end) each, on CLOCK_MONOTONIC."""
    picks = random.Random(17).sample(range(streams // 2), min(samples, streams // 2))
    half = len(picks) // 2
    timed: list[tuple[str, float, float]] = []
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        for i in picks[:half]:
            start = time.monotonic()
            stub.Append(pb.AppendRequest(stream=stream_name(i), payloads=[b"x" * payload]))
            timed.append(("append", start, time.monotonic()))
        for i in picks[half:]:
            start = time.monotonic()
            stub.Read(pb.ReadRequest(stream=stream_name(i), offset=0, count=100))
            timed.append(("read", start, time.monotonic()))
    return timed


Event = tuple[float, float, str, str]  # (start, end, thread, what): the traced server's


def report(
    timed: list[tuple[str, float, float]],
    events: list[Event],
    ran: Callable[[float, float], dict[str, tuple[float, float]]],
    slow_ms: float,
    shape: dict[str, Any],
) -> None:
    """The percentiles; each slow call's overlapping events and thread run times (stderr); per
    kind of event, the slow and fast calls it overlapped."""
    for kind in ("append", "read"):
        ms = [(end - start) * 1000 for k, start, end in timed if k == kind]
        p50, p99 = percentiles(ms, [50, 99])
        emit(f"closed_stream_{kind}_p50", p50, "ms", **shape)
        emit(f"closed_stream_{kind}_p99", p99, "ms", **shape)
    first = timed[0][1]
    overlaps: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    slow = 0
    for kind, start, end in timed:
        over = [e for e in events if e[0] < end and e[1] > start and not e[3].startswith("call")]
        is_slow = (end - start) * 1000 > slow_ms
        slow += is_slow
        for what in {e[3].split(" (")[0] for e in over}:  # (a collection's object count left out)
            overlaps[what][0 if is_slow else 1] += 1
        if is_slow:
            own = [e for e in events if e[3].startswith("call") and e[0] >= start and e[1] <= end]
            _print_slow(f"{kind} at +{(start - first) * 1000:.1f} ms", start, end, first, over + own, ran)
    emit("slow_calls", slow, "calls", over_ms=slow_ms, of=len(timed), **shape)
    for what, (in_slow, in_fast) in sorted(overlaps.items()):
        emit("calls_overlapping", in_slow, "slow calls", event=what, fast_calls=in_fast, **shape)


def _print_slow(
    call: str,
    start: float,
    end: float,
    first: float,
    events: list[Event],
    ran: Callable[[float, float], dict[str, tuple[float, float]]],
) -> None:
    print(f"{call} took {(end - start) * 1000:.1f} ms", file=sys.stderr)
    for e_start, e_end, thread, what in events:
        at = (e_start - first) * 1000
        print(f"    {what} on {thread}: +{at:.1f}, {(e_end - e_start) * 1000:.2f} ms", file=sys.stderr)
    threads = sorted(ran(start, end).items(), key=lambda item: -item[1][0])
    listed = ", ".join(f"{name} {r:.1f}/{w:.1f}" for name, (r, w) in threads)
    print(f"    ran/waited to run (ms): {listed}", file=sys.stderr)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        sys.exit(serve(sys.argv[2:]))
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=20_000)
    parser.add_argument("--entries", type=int, default=10)
    parser.add_argument("--load", choices=("append_many", "publish"), default="append_many")
    parser.add_argument("--samples", type=int, default=2_000, help="calls, half Appends, half Reads")
    parser.add_argument("--slow-ms", type=float, default=5.0)
    parser.add_argument("--keep", help="a file to write the calls and the server's events to")
    parser.add_argument("--set", action="append", default=[], help="NAME=VALUE, a server setting")
    args = parser.parse_args()
    settings = dict(s.split("=", 1) for s in args.set)
    shape = {"streams": args.streams, "via": args.load, **settings}
    with tempfile.TemporaryDirectory(prefix="tailtrace-", dir=os.environ.get("BENCH_DIR")) as root:
        data, events_file = Path(root) / "data", Path(root) / "events.json"
        port, metrics_port = free_port(), free_port()
        command = serve_command(
            data, port, max_streams=2 * args.streams, metrics_port=metrics_port, **settings
        )
        command[1:4] = ["-m", "bench.tailtrace", "serve"]  # for `-m service.cli serve`
        address = f"127.0.0.1:{port}"
        proc = subprocess.Popen(command, env={**os.environ, EVENTS_ENV: str(events_file)})
        try:
            wait_serving(address, proc, 60)
            load(address, args.load, args.streams, args.entries)
            wait_for_round(SimpleNamespace(metrics_port=metrics_port), shape)  # type: ignore[arg-type]
            with ThreadSampler(proc.pid) as sampler:
                timed = calls(address, args.streams, args.samples, PAYLOAD)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=600)
        events = [tuple(e) for e in json.loads(events_file.read_text())]
        if args.keep:
            Path(args.keep).write_text(json.dumps({"calls": timed, "events": events}))
    report(timed, events, sampler.ran, args.slow_ms, shape)


if __name__ == "__main__":
    main()
