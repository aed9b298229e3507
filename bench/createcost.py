"""Engine CPU to create a slot stream, in-process:

    python -m bench.createcost [--rounds 6] [--streams 2000] [--profile [--sort tottime]]

Issue 17's load (100,000 streams x 10 entries x 100 B through AppendMany) with the service left
out: each round appends one batch of 10 entries of 100 bytes to `--streams` new names through
`Engine.append_many`, under the engine's default config (slots, fsync everysec, 1,024 open
streams: the closes of the streams it evicts are in the figure). The figure is the calling
thread's CPU (`time.thread_time`) per new stream, each round's and their median: the
maintenance thread's syncs are not in it. `--profile` runs one more round under cProfile and
prints its top functions by cumulative time (profiled times are ~2.4x real ones).

One JSON object per line (bench.common.emit). Compare builds by running this in each, alternated.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import emit
from storage import AppendBatch, Engine

ENTRIES = 10
PAYLOAD = b"x" * 100


def create_round(engine: Engine, names: list[str]) -> float:
    """Create the streams `names` (one batch each); the thread CPU it took, in seconds."""
    appends = [(AppendBatch(payloads=[PAYLOAD] * ENTRIES), None)]
    cpu = time.thread_time()
    for name in names:
        engine.append_many(name, appends)
    return time.thread_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--streams", type=int, default=2000, help="new streams per round")
    parser.add_argument("--profile", action="store_true", help="one more round under cProfile")
    parser.add_argument("--sort", default="cumulative", help="the profile's order (pstats: tottime, ...)")
    args = parser.parse_args()
    data = Path(tempfile.mkdtemp(prefix="streamlog-createcost-"))
    try:
        with Engine(data) as engine:
            create_round(engine, [f"warm-{i}" for i in range(args.streams)])
            per_stream = []
            for r in range(args.rounds):
                cpu = create_round(engine, [f"r{r}-{i}" for i in range(args.streams)])
                per_stream.append(cpu / args.streams * 1e6)
                emit("create_round", round(per_stream[-1], 1), "us/stream", round=r, streams=args.streams)
            emit(
                "create_cpu",
                round(statistics.median(per_stream), 1),
                "us/stream",
                rounds=args.rounds,
                least=round(min(per_stream), 1),
            )
            if args.profile:
                profile = cProfile.Profile()
                profile.enable()
                create_round(engine, [f"profiled-{i}" for i in range(args.streams)])
                profile.disable()
                pstats.Stats(profile).sort_stats(args.sort).print_stats(40)
    finally:
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
