"""CPU per AppendMany call of new streams, in-process: the whole process's, the event loop
thread's, and the loop's wake-ups from other threads.

    python -m bench.appendmany_cpu [--calls 6] [--streams 1000] [--entries 1] [--set small_streams=slots]

The servicer is called directly on one event loop (no gRPC), with a real engine under the
server's default settings (fsync everysec, 1,024 open streams) and its append listeners (plain
and group readers). Each call writes one entry of 100 bytes to `--streams` new streams, which
AppendMany writes from a thread (service/appendmany.py); `--entries` entries each, and `--set`
gives the server a setting as `streamlog serve --set` does. After a warm-up call, `--calls` calls;
the process's CPU is taken from 2.5 s after the warm-up to 2.5 s after the last call, so that
the engine's threads' syncs and closes of the calls' streams count, and is given per call.
`loop_hops` counts the loop's `call_soon_threadsafe` calls during a call: each wakes the loop.

One JSON object per line (bench.common.emit). Compare builds by running this in each, alternated.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from streamlog.v1 import streamlog_pb2 as pb

from bench.common import add_setting_option, emit, settings_given
from bench.service import PAYLOAD
from service.config import engine_config, load_settings
from service.servicer import StreamLogServicer
from service.waiters import Waiters
from storage import Engine
from tests.service.helpers import FakeContext

SETTLE_S = 2.5  # the engine's threads finish a call's syncs and closes (everysec rounds)


async def measure(calls: int, streams: int, entries: int, overrides: dict[str, str]) -> None:
    data = Path(tempfile.mkdtemp(prefix="streamlog-bench-"))
    flags = {"data_dir": data, "port": 0}
    batches = {"max_append_many_batches": str(max(streams, 1)), "max_streams": str(10**7)}
    settings = load_settings(env={}, flags=flags, overrides={**batches, **overrides})
    engine = Engine(data, config=engine_config(settings))
    waiters = Waiters()
    engine.add_append_listener(waiters.on_append)
    executor = ThreadPoolExecutor(max_workers=settings.append_threads)
    servicer = StreamLogServicer(settings, waiters, executor)
    servicer.listen_to(engine)
    servicer.attach_engine(engine)
    loop = asyncio.get_running_loop()
    hops = 0
    handoff = loop.call_soon_threadsafe

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal hops
        hops += 1
        return handoff(*args, **kwargs)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign,assignment]
    on_loop: list[float] = []
    hop_counts: list[int] = []
    try:
        started = 0.0
        for call in range(calls + 1):
            if call == 1:
                await asyncio.sleep(SETTLE_S)
                started = time.process_time()
            batches = [
                pb.AppendRequest(stream=f"c{call}-{i:06d}", payloads=[b"x" * PAYLOAD] * entries)
                for i in range(streams)
            ]
            hops = 0
            before = time.thread_time()
            reply = await servicer.AppendMany(pb.AppendManyRequest(batches=batches), FakeContext())
            if call:
                on_loop.append(time.thread_time() - before)
                hop_counts.append(hops)
            if any(r.HasField("error") for r in reply.results):
                raise SystemExit(f"AppendMany: {next(r.error for r in reply.results if r.HasField('error'))}")
        await asyncio.sleep(SETTLE_S)
        per_call = (time.process_time() - started) / calls
    finally:
        del loop.call_soon_threadsafe
        executor.shutdown()
        engine.close()
        shutil.rmtree(data, ignore_errors=True)
    extra = {"streams": streams, "calls": calls, "entries": entries, **overrides}
    emit("append_many_process_cpu_per_call_ms", round(1000 * per_call, 1), "ms", **extra)
    emit("append_many_loop_cpu_per_call_ms", round(1000 * statistics.median(on_loop), 1), "ms", **extra)
    emit("append_many_loop_hops_per_call", max(hop_counts), "hops", **extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument("--streams", type=int, default=1000, help="new streams per call")
    parser.add_argument("--entries", type=int, default=1, help="entries of 100 B per stream")
    add_setting_option(parser)
    args = parser.parse_args()
    overrides = settings_given(parser, args)
    asyncio.run(measure(args.calls, args.streams, args.entries, overrides))


if __name__ == "__main__":
    main()
