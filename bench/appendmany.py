"""Many small streams loaded by one Python client: AppendMany vs one Append per stream.

    python -m bench.appendmany [--streams 10000] [--entries 10] [--per-call 1000]
        [--fsync everysec] [--modes append_many,append] [--passes new,existing] [--set KEY=VALUE]

A fresh `streamlog serve` (`--fsync`, everysec by default) per mode; each loads `--streams` new
streams with `--entries` entries of 100 bytes each, then appends as much again to
the same streams (pass "existing": no stream is created, so the figure is the
calls' own cost):

- "append_many": AppendMany calls of `--per-call` batches (one batch per stream);
- "append": one unary Append per stream.

One JSON object per line (bench.common.emit): the time and entries/s of each pass. The syncs
of one AppendMany of 1,000 new streams under "always", counted by strace (the server is a child):
`strace -f -c -e trace=fdatasync,fsync python -m bench.appendmany --streams 1000 --fsync always
--modes append_many --passes new`.
"""

from __future__ import annotations

import argparse
import time

from bench.common import add_setting_option, emit, settings_given
from bench.service import PAYLOAD, streamlog_server
from clients import AppendResult, Client


def load(address: str, mode: str, streams: int, entries: int, per_call: int) -> float:
    """Seconds to write every stream's batch; checks each was written whole."""
    batch = [b"x" * PAYLOAD] * entries
    names = [f"s-{i:07d}" for i in range(streams)]
    with Client(address, timeout=600) as client:
        started = time.perf_counter()
        if mode == "append_many":
            for start in range(0, streams, per_call):
                results = client.append_many([(name, batch) for name in names[start : start + per_call]])
                bad = [r for r in results if not isinstance(r, AppendResult) or r.count != entries]
                if bad:
                    raise SystemExit(f"append_many: {bad[0]}")
        else:
            for name in names:
                if client.append(name, batch).count != entries:
                    raise SystemExit(f"append to {name}: not written whole")
        elapsed = time.perf_counter() - started
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=10_000)
    parser.add_argument("--entries", type=int, default=10)
    parser.add_argument("--per-call", type=int, default=1000, help="AppendMany batches per call")
    parser.add_argument("--fsync", default="everysec", choices=("always", "everysec", "no"))
    parser.add_argument("--modes", default="append_many,append", help="of append_many,append")
    parser.add_argument("--passes", default="new,existing", help="of new,existing")
    add_setting_option(parser)
    args = parser.parse_args()
    overrides = settings_given(parser, args)
    for mode in args.modes.split(","):
        with streamlog_server(args.fsync, **overrides) as address:
            for streams in args.passes.split(","):
                elapsed = load(address, mode, args.streams, args.entries, args.per_call)
                extra: dict[str, object] = {
                    "mode": mode,
                    "streams": streams,
                    "stream_count": args.streams,
                    "entries": args.entries,
                    "payload_bytes": PAYLOAD,
                    "fsync": args.fsync,
                    **overrides,
                }
                if mode == "append_many":
                    extra["per_call"] = args.per_call
                emit("many_streams_load_s", round(elapsed, 3), "s", **extra)
                rate = round(args.streams * args.entries / elapsed)
                emit("many_streams_entries_per_s", rate, "entries/s", **extra)


if __name__ == "__main__":
    main()
