"""The node cache's CPU per call, in-process:

    python -m bench.nodecache [--calls 20000] [--repeat 3]

A `NodeCache` of the default 256 nodes kept full (128 segments of 2 nodes each), then, `--calls`
times each: `drop_segment` of a segment it holds nothing of (a closed stream's, the usual case),
`drop_segment` of a segment of 2 cached nodes (a stream whose sealed nodes were read; the 2
`get`s that cache them are not timed), a `get` that hits, and a `get` that misses and evicts the
oldest node (its load returns a body at once: a real miss also decodes the node). The figure
is the process CPU (`time.process_time`) per call in microseconds, each repeat's.

One JSON object per line (bench.common.emit). Compare builds by running this in each, alternated.
"""

from __future__ import annotations

import argparse
import time
from array import array
from collections.abc import Callable

from bench.common import emit
from storage.cache import NodeCache
from storage.format import NodeBody

CAPACITY = 256
BODY = NodeBody(0, array("I", [0, 1]), b"x")


def _load() -> NodeBody:
    return BODY


def full_cache() -> NodeCache:
    cache = NodeCache(CAPACITY)
    for uid in range(CAPACITY // 2):
        for pos in (0, 1):
            cache.get((uid, pos), _load)
    return cache


def drop_uncached(cache: NodeCache, calls: int) -> float:
    cpu = time.process_time()
    for i in range(calls):
        cache.drop_segment(-1 - i)
    return time.process_time() - cpu


def drop_two(cache: NodeCache, calls: int) -> float:
    taken = 0.0
    for i in range(calls):
        uid = 1_000_000 + i
        cache.get((uid, 0), _load)
        cache.get((uid, 1), _load)
        cpu = time.process_time()
        cache.drop_segment(uid)
        taken += time.process_time() - cpu
        cpu = time.process_time()
        taken -= time.process_time() - cpu  # the clock's own cost out
    return taken


def hit(cache: NodeCache, calls: int) -> float:
    cpu = time.process_time()
    for i in range(calls):
        cache.get((i % (CAPACITY // 2), i & 1), _load)
    return time.process_time() - cpu


def miss(cache: NodeCache, calls: int) -> float:
    cpu = time.process_time()
    for i in range(calls):
        cache.get((2_000_000 + i, 0), _load)
    return time.process_time() - cpu


CASES: dict[str, Callable[[NodeCache, int], float]] = {
    "drop_uncached_segment": drop_uncached,
    "drop_segment_of_2": drop_two,
    "get_hit": hit,
    "get_miss_evicting": miss,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    for name, case in CASES.items():
        runs = [case(full_cache(), args.calls) / args.calls * 1e6 for _ in range(args.repeat)]
        emit(f"node_cache_{name}_cpu", min(runs), "us", runs=[round(r, 3) for r in runs], calls=args.calls)


if __name__ == "__main__":
    main()
