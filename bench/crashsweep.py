"""The long crash sweep: the pre-merge check for storage changes (docs/DURABILITY.md).

    python -m bench.crashsweep [--points 9000] [--variant always-power ...]

Runs the crash sweep of tests/storage/test_crash_sweep.py with about `--points` crash points
spread over all its variants as `STREAMLOG_CRASH_POINTS` does (CI's run has 1,280), for the
power-loss variants that append, sync and close streams: always-power, everysec-power-synced,
no-power and the small-stream slots' slots-always-power and slots-everysec-power by default
(about 3,400 of the 9,000 points; 5 minutes on two cores). CI's 1,280 points missed a regression
that lost acknowledged entries at 2 of 1,360 always-power points of this run.

One JSON object per variant (bench.common.emit): crash points checked, failed, and the seconds
it took; the failures (variant, seed, crash point: rerun one with `STREAMLOG_CRASH_SEED`) on
stderr, and exit status 1 if there were any.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from bench.common import emit
from tests.storage.test_crash_sweep import VARIANTS, sweep

DEFAULT_VARIANTS = (
    "always-power",
    "everysec-power-synced",
    "no-power",
    "slots-always-power",
    "slots-everysec-power",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=9000, help="crash points spread over every variant")
    parser.add_argument(
        "--variant", action="append", help=f"a variant to run (default: {', '.join(DEFAULT_VARIANTS)})"
    )
    args = parser.parse_args()
    os.environ["STREAMLOG_CRASH_POINTS"] = str(args.points)  # read by points_for, as in a pytest run
    logging.disable(logging.CRITICAL)  # recovery logs each repair it makes: thousands in a sweep
    by_id = {variant.id: variant for variant in VARIANTS}
    wanted = args.variant or list(DEFAULT_VARIANTS)
    unknown = [name for name in wanted if name not in by_id]
    if unknown:
        parser.error(f"unknown variant {', '.join(unknown)} (known: {', '.join(by_id)})")
    failed = 0
    for name in wanted:
        started = time.perf_counter()
        checked, failures, _, growing = sweep(by_id[name])
        elapsed = round(time.perf_counter() - started, 1)
        emit("crash_points_checked", checked, "points", variant=name, total_points=args.points)
        emit(
            "crash_points_failed", len(failures), "points", variant=name, amid_growth=growing, seconds=elapsed
        )
        for failure in failures:
            print(f"{name}: {failure}", file=sys.stderr)
        failed += len(failures)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
