"""How soon the totals are right after a kill -9 with many slot streams, in-process (issue 17).

    python -m bench.recount [--streams 100000] [--calls 400] [--slice-ms MS --pause-ms MS] [--dir PATH]

Builds `--streams` slot streams of one 100-byte entry (bench.slotstartup's load), writes the
catalog file, then appends one more entry to each: each reopening is a catalog-journal record
and no close journals a slot stream's figures, so after the kill -9 the engine leaves (no
close) every stream's figures are unknown until maintenance reads them from its slot. Then an
engine starts on it with its background thread, as a server runs it (switch interval 0.5 ms,
service/server.py), and this thread times `--calls` calls to closed streams, an Append and a
Read in turn, 5 ms apart, while it looks at the totals every 0.1 s until they count every entry.

One JSON object per figure (bench.common.emit): the streams uncounted at start-up (the gauge
`streamlog_streams_uncounted`, where the build has it), the seconds until the totals were
right, the CPU the engine took meanwhile, and the calls' p50 / p99 (wall time) during the
recount and, as a reference in the same minutes, after it. `--slice-ms` and `--pause-ms` try
other recount slices than storage/maintenance.py's.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.common import emit
from bench.slotstartup import ROUND_EVERY, release
from storage import AppendBatch, Engine, EngineConfig, maintenance

PAYLOAD = b"p" * 100
CALL_GAP_S = 0.005
POLL_EVERY = 20  # calls' gaps between two looks at the totals (engine.stats(): per open stream)
GIVE_UP_S = 600.0


def name(i: int) -> str:
    return f"stream-{i:08d}"


def build(data: Path, streams: int) -> None:
    """Every stream with two entries, the second appended after the catalog file was written,
    left as a kill -9 would."""
    engine = Engine(data, EngineConfig(background=False, small_streams="slots"))
    for second in (False, True):
        for i in range(streams):
            engine.append(name(i), AppendBatch([PAYLOAD]))
            if i % ROUND_EVERY == ROUND_EVERY - 1:
                engine.maintain()
        if not second:
            engine.maintain()
            engine._save_catalog()  # the figures of the first entries, in the file
    release(engine)


def timed_call(engine: Engine, rng: random.Random, streams: int, append: bool) -> float:
    stream = name(rng.randrange(streams))
    started = time.perf_counter()
    if append:
        engine.append(stream, AppendBatch([PAYLOAD]))
    else:
        engine.read(stream, 0, 10)
    return time.perf_counter() - started


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def emit_latency(label: str, times: list[float], streams: int) -> None:
    if times:
        for fraction in (0.5, 0.99):
            emit(
                f"closed_call_p{round(fraction * 100)}_{label}",
                round(percentile(times, fraction) * 1e3, 2),
                "ms",
                calls=len(times),
                streams=streams,
            )


def recover(data: Path, streams: int, calls: int) -> None:
    sys.setswitchinterval(0.0005)  # as the server sets it (service/server.py)
    rng = random.Random(17)
    cpu, started = time.process_time(), time.perf_counter()
    engine = Engine(data, EngineConfig(small_streams="slots"))
    ready = time.perf_counter()
    emit("startup_wall", round(ready - started, 3), "s", streams=streams)
    uncounted = getattr(engine, "uncounted_streams", None)  # None: a build before the gauge
    if uncounted is not None:
        emit("uncounted_at_start", uncounted(), "streams", streams=streams)
    expected, during, after = 2 * streams, [], []
    try:
        gaps = 0
        while gaps % POLL_EVERY or engine.stats()["entries"] < expected:
            gaps += 1
            if time.perf_counter() - ready > GIVE_UP_S:
                emit("totals_right_after", None, "s", streams=streams, gave_up_at_s=GIVE_UP_S)
                return
            if len(during) < calls:
                append = len(during) % 2 == 0
                during.append(timed_call(engine, rng, streams, append))
                expected += append
            time.sleep(CALL_GAP_S)
        right = time.perf_counter() - ready
        emit("totals_right_after", round(right, 2), "s", streams=streams, calls_during=len(during))
        emit("engine_cpu_until_right", round(time.process_time() - cpu, 2), "s", streams=streams)
        if uncounted is not None:
            emit("uncounted_when_right", uncounted(), "streams", streams=streams)
        for i in range(min(calls, len(during) or calls)):
            after.append(timed_call(engine, rng, streams, i % 2 == 0))
            time.sleep(CALL_GAP_S)
        emit_latency("during", during, streams)
        emit_latency("after", after, streams)
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=100_000)
    parser.add_argument("--calls", type=int, default=400, help="closed-stream calls timed during the recount")
    parser.add_argument("--dir", type=Path, help="where to build it (default: a temporary directory)")
    parser.add_argument("--slice-ms", type=float, help="CPU of a recount slice between rounds")
    parser.add_argument("--pause-ms", type=float, help="the pause after each slice")
    args = parser.parse_args()
    if args.slice_ms is not None:
        maintenance.RECOUNT_SLICE_S = args.slice_ms / 1000
    if args.pause_ms is not None:
        maintenance.RECOUNT_PAUSE_S = args.pause_ms / 1000
    root = Path(tempfile.mkdtemp(prefix="recount-", dir=args.dir))
    try:
        build(root / "data", args.streams)
        recover(root / "data", args.streams, args.calls)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
