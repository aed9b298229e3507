"""Many small streams on one node, beside Redis, in one run: python -m bench.streams [--quick]

Issue 17's targets, measured with one Python client each:

- `--streams` streams of `--entries` entries of 100 bytes (100,000 x 10 by default).
  Redis (Debian's redis-server, AOF everysec): XADD through redis-py pipelines of
  1,000 commands; load time, `used_memory`, server RSS. streamlog (`streamlog serve`,
  fsync everysec, the default `max_open_streams`), loaded each way the Python client
  writes to many streams (`--loads`, each on a fresh server and directory): `publish`,
  one Publish session, one message per stream holding its entries, 1,000 in flight;
  `append_many`, AsyncClient.append_many calls each carrying as many streams' batches
  as the server takes (max_append_many_batches and _bytes) up to CALL_BATCHES (a call
  holds the server's event loop while it creates its streams), CALLS_IN_FLIGHT in flight.
  Each: load time, disk used (`du` of the data directory), server RSS, open file
  descriptors, a metrics scrape, a ListStreams page.
- Appending to and reading from streams the cache closed: one unary Append or Read
  at a time on streams loaded first (long closed); p50 and p99. First the bench waits
  (at most ROUND_WAIT_S) until the server's maintenance rounds have synced what the
  load wrote (`streamlog_closes_waiting` and `streamlog_open_streams_unsynced` 0), so
  the calls time closed streams, not the load's tail of syncs; that wait is reported
  on its own.
- `--million` streams of 1 entry (1,000,000 by default): load (`--million-via`, the
  AppendMany calls by default, the faster way), a kill -9 as the load ends and a
  restart (time until the server answers SERVING) with every acknowledged entry read
  back (each stream reopened), then a clean stop and restart. With `--direct` the directory is built
  in this process instead, for a size a load through one client would take hours
  for: one stream is written by the engine in a directory of its own (small_streams
  off: a slot stream has no files to copy) and closed cleanly, and its files are
  copied under each name by `BUILDERS` processes (its segment as it is: the
  entry's bytes are the template's; no meta file, as the engine writes none for
  these names), with the SYNCED marker a clean close leaves in its slot, and the catalog
  file (and `catalog.clean`) a clean shutdown would write; the group registry
  (`groups/`, empty) is the template engine's, so start-up looks into no stream's
  directory for group files. Then a start-up (with the
  HTTP console on: its history opens no stream; the server's CPU time until
  SERVING is reported beside the wall-clock time), one more
  entry appended through the server to
  `DIRECT_APPENDS` streams, a kill -9, a restart, and those entries and as many
  untouched streams read back.

Data directories: the free disk is checked once, for every run (about 16 KiB a
stream), and every directory is removed only at the end, after the last load. On
an ext4 without a journal (this project's test machine) inode allocation skips the
inodes freed in the last 5 s, and for up to 300 s while their inode-table block is
dirty: after a removal of 100,000 directories every mkdir costs 10-20 times its
usual kernel time for minutes, so a load timed after a big removal measures the
removal. For the same reason, wait 5 minutes after removing a big data directory
(this bench's or any other) before a run. One JSON object per line (bench.common.emit).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from bench.common import Timer, emit, free_port, percentiles, serve_command, server_metrics, wait_serving
from bench.redis_baseline import RedisServer
from clients.aio import AsyncClient
from service.config import Settings
from storage import AppendBatch, Engine, EngineConfig
from storage.catalog import CATALOG_CLEAN, CATALOG_FILE, Catalog, StreamSummary
from storage.layout import stream_directory, streams_root

PAYLOAD = 100
PIPELINE = 1_000  # Redis commands per pipeline
IN_FLIGHT = 1_000  # Publish messages in flight
# The server's bounds on one AppendMany request (it runs with the default settings).
MANY_BATCHES = Settings().max_append_many_batches
MANY_BYTES = Settings().max_append_many_bytes
# Streams per AppendMany call, below MANY_BATCHES: the server writes a call's new streams on its
# event loop, one call at a time, and gRPC drops a call left waiting 30 s for the loop (CANCELLED,
# nothing logged). At 1.5 ms a new stream idle, and several times that under load, a call of
# 10,000 held the loop past 30 s and the call behind it ended so.
CALL_BATCHES = 2_000
CALLS_IN_FLIGHT = 2  # one written by the server while the next is sent and read
BYTES_PER_STREAM = 16 << 10  # disk a one-entry stream may take (directory, one page, slack)
LATENCY_SAMPLES = 2_000
ROUND_WAIT_S = 300  # the longest wait for the load's closes to be synced before the latency calls
BUILDERS = 2  # processes copying the template stream (--direct)
DIRECT_APPENDS = 10_000  # streams appended to through the server before the kill -9 (--direct)


def stream_name(i: int) -> str:
    return f"room-{i:07d}"


def payloads(i: int, entries: int) -> list[bytes]:
    return [f"{i:07d}/{j:03d}".encode().ljust(PAYLOAD, b".") for j in range(entries)]


# ---------------------------------------------------------------------- Redis


def redis_load(streams: int, entries: int) -> None:
    with RedisServer("everysec") as server:
        client = server.client()
        with Timer() as t:
            for first in range(0, streams, PIPELINE // entries or 1):
                pipe = client.pipeline(transaction=False)
                for i in range(first, min(streams, first + (PIPELINE // entries or 1))):
                    for payload in payloads(i, entries):
                        pipe.xadd(stream_name(i), {"p": payload})
                pipe.execute()
        assert client.xlen(stream_name(streams - 1)) == entries
        memory = client.info("memory")["used_memory"]
        shape = {"system": "redis", "streams": streams, "entries": entries, "aof": "everysec"}
        emit("many_streams_load_time", t.elapsed, "s", **shape)
        emit("many_streams_memory", memory / 1e6, "MB", **shape)
        emit("many_streams_server_rss", _rss_mb(server.pid), "MB", **shape)


# ---------------------------------------------------------------------- streamlog


class Server:
    """`streamlog serve` on a data directory; its log beside it."""

    def __init__(
        self, data: Path, max_streams: int, settings: dict[str, str], *, console: bool = False
    ) -> None:
        """`settings`: more server settings (`--set`); `console`: the HTTP API and console on too
        (their start-up is measured with the rest)."""
        self.data = data
        self.port, self.metrics_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._settings: dict[str, object] = {
            **settings,
            "max_streams": max_streams,
            "metrics_port": self.metrics_port,
        }
        if console:
            self._settings["http_port"] = free_port()
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 600) -> float:
        """Start it; the seconds until it answers SERVING."""
        log = open(self.data.parent / "server.log", "ab")  # noqa: SIM115 - the process keeps it
        command = serve_command(self.data, self.port, **self._settings)
        started = time.monotonic()
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
        log.close()
        wait_serving(self.address, self.proc, timeout_s)
        return time.monotonic() - started

    def stop(self, how: signal.Signals = signal.SIGTERM) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(how)
        try:
            self.proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def fds(self) -> int:
        assert self.proc is not None
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def rss_mb(self) -> float:
        assert self.proc is not None
        return _rss_mb(self.proc.pid)

    def cpu_s(self) -> float:
        """The CPU time (user and system, every thread) the server has used: what its start-up
        costs when read at SERVING, whatever the machine's load does to the wall-clock time."""
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int | None) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def _disk_mb(path: Path) -> float:
    """`du` of `path` in MB of 10^6 bytes, the unit of Redis's memory figure (redis_load)."""
    out = subprocess.run(["du", "-sk", str(path)], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0]) * 1024 / 1e6


@contextlib.contextmanager
def scratch(streams: int) -> Iterator[Callable[[], Path]]:
    """A maker of data directories for runs of `streams` streams in all: the free disk is checked
    for all of them first, and they are removed together at the end (see the module doc)."""
    root = Path(tempfile.mkdtemp(prefix="streamlog-streams-", dir=os.environ.get("BENCH_DIR")))
    made = 0

    def new() -> Path:
        nonlocal made
        made += 1
        run = root / f"run-{made}"
        run.mkdir()
        return run / "data"

    try:
        need = streams * BYTES_PER_STREAM
        free = shutil.disk_usage(root).free
        if free < 2 * need:
            raise SystemExit(f"bench.streams: {free >> 20} MiB free, {2 * need >> 20} MiB wanted")
        yield new
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def publish_all(address: str, streams: int, entries: int) -> int:
    """Append every stream's entries over one Publish session; the acknowledged entries."""
    async with (
        AsyncClient(address, timeout=None) as client,
        client.publisher(max_in_flight=IN_FLIGHT) as session,
    ):
        futures = [await session.publish(stream_name(i), payloads(i, entries)) for i in range(streams)]
        results = await asyncio.gather(*futures)
    return sum(r.last_offset - r.first_offset + 1 for r in results)


def append_many_calls(streams: int, entries: int) -> Iterator[list[tuple[str, list[bytes]]]]:
    """Every stream's entries as one batch, grouped into AppendMany requests as large as the
    server takes: at most MANY_BATCHES batches (and CALL_BATCHES) and MANY_BYTES bytes (a batch's
    serialized size counted high: its name, and each payload with 4 bytes for its tag and length,
    plus 8)."""
    most = min(MANY_BATCHES, CALL_BATCHES)
    call: list[tuple[str, list[bytes]]] = []
    size = 0
    for i in range(streams):
        batch = (stream_name(i), payloads(i, entries))
        batch_size = len(batch[0]) + sum(len(p) + 4 for p in batch[1]) + 8
        if call and (len(call) == most or size + batch_size > MANY_BYTES):
            yield call
            call, size = [], 0
        call.append(batch)
        size += batch_size
    if call:
        yield call


async def append_many_all(address: str, streams: int, entries: int) -> int:
    """Append every stream's entries by AppendMany calls (append_many_calls), CALLS_IN_FLIGHT of
    them in flight; the acknowledged entries (a batch refused raises its error)."""
    calls = append_many_calls(streams, entries)
    acked = 0
    async with AsyncClient(address, timeout=None) as client:

        async def caller() -> None:
            nonlocal acked
            for call in calls:
                for result in await client.append_many(call):
                    if isinstance(result, Exception):
                        raise result
                    acked += result.last_offset - result.first_offset + 1

        await asyncio.gather(*(caller() for _ in range(CALLS_IN_FLIGHT)))
    return acked


# How a load writes: a Publish session (one message per stream), or AppendMany calls.
LOADS = {"publish": publish_all, "append_many": append_many_all}


async def read_all(
    address: str, streams: int | list[int], entries: int, extra: int = 0, template: bool = False
) -> int:
    """Read the streams (a count: the first ones; or their numbers) back, 256 reads in flight;
    the streams whose entries are all there (`extra`: the appends of `million_direct` after them;
    `template`: each holds the template stream's entries, as `build_directly` copied them)."""
    good = 0
    async with AsyncClient(address, timeout=None) as client:
        queue = iter(range(streams) if isinstance(streams, int) else streams)

        async def worker() -> None:
            nonlocal good
            for i in queue:
                got = [e.payload for e in (await client.read(stream_name(i), 0, count=entries + 2)).entries]
                good += got == payloads(0 if template else i, entries) + [b"after"] * extra

        await asyncio.gather(*(worker() for _ in range(256)))
    return good


def unsynced(server: Server) -> float:
    """The server's streams whose writes its rounds have not synced yet: closed ones, open ones."""
    seen = server_metrics(server.metrics_port)
    return seen["streamlog_closes_waiting"] + seen["streamlog_open_streams_unsynced"]


def wait_for_round(server: Server, shape: dict) -> None:
    """Wait until the server has synced what the load wrote, the closes it handed to the rounds
    and its open streams (at most ROUND_WAIT_S); the wait, and the streams still unsynced at its
    end (0 unless it timed out)."""
    with Timer() as t:
        deadline = time.monotonic() + ROUND_WAIT_S
        while (waiting := unsynced(server)) and time.monotonic() < deadline:
            time.sleep(0.05)  # another process's state: read through its metrics
    emit("closes_synced_wait", t.elapsed, "s", **shape)
    emit("unsynced_after_wait", waiting, "streams", **shape)


def closed_latency(server: Server, streams: int, shape: dict) -> None:
    """Append to and read from streams the cache closed (the first ones loaded), one at a time,
    once the load's closes are synced."""
    wait_for_round(server, shape)
    picks = random.Random(17).sample(range(streams // 2), min(LATENCY_SAMPLES, streams // 2))
    half = len(picks) // 2
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        appends, reads = [], []
        for i in picks[:half]:
            started = time.perf_counter()
            stub.Append(pb.AppendRequest(stream=stream_name(i), payloads=[b"x" * PAYLOAD]))
            appends.append(time.perf_counter() - started)
        for i in picks[half:]:
            started = time.perf_counter()
            stub.Read(pb.ReadRequest(stream=stream_name(i), offset=0, count=100))
            reads.append(time.perf_counter() - started)
    for what, samples in (("append", appends), ("read", reads)):
        p50, p99 = percentiles(samples, [50, 99])
        emit(f"closed_stream_{what}_p50", p50 * 1000, "ms", samples=len(samples), **shape)
        emit(f"closed_stream_{what}_p99", p99 * 1000, "ms", samples=len(samples), **shape)


def timed_load(server: Server, streams: int, entries: int, via: str, shape: dict) -> None:
    """Load the streams `via` a way of LOADS, every entry acknowledged; its wall-clock time, and
    the CPU time the server and this client spent on it (the load's cost, whatever the machine's
    load does to the wall clock)."""
    server_cpu, client_cpu = server.cpu_s(), time.process_time()
    with Timer() as t:
        acked = asyncio.run(LOADS[via](server.address, streams, entries))
    assert acked == streams * entries, acked
    emit("many_streams_load_time", t.elapsed, "s", **shape)
    emit("many_streams_load_server_cpu", server.cpu_s() - server_cpu, "s", **shape)
    emit("many_streams_load_client_cpu", time.process_time() - client_cpu, "s", **shape)


def streamlog_load(data: Path, streams: int, entries: int, via: str, settings: dict[str, str]) -> None:
    shape = {"system": "streamlog", "streams": streams, "entries": entries, "fsync": "everysec", "via": via}
    shape |= settings
    server = Server(data, 2 * streams, settings)
    server.start()
    try:
        timed_load(server, streams, entries, via, shape)
        emit("many_streams_server_rss", server.rss_mb(), "MB", **shape)
        emit("many_streams_open_fds", server.fds(), "fds", **shape)
        with Timer() as t:
            seen = server_metrics(server.metrics_port)
        assert seen["streamlog_entries"] == streams * entries, seen["streamlog_entries"]
        emit("many_streams_metrics_scrape", t.elapsed * 1000, "ms", **shape)
        with grpc.insecure_channel(server.address) as channel, Timer() as t:
            page = pb_grpc.StreamLogServiceStub(channel).ListStreams(
                pb.ListStreamsRequest(prefix=stream_name(streams // 2)[:-2], page_size=100)
            )
        assert len(page.streams) == 100, len(page.streams)
        emit("many_streams_list_page", t.elapsed * 1000, "ms", **shape)
        closed_latency(server, streams, shape)
    finally:
        server.stop()
    emit("many_streams_disk", _disk_mb(data), "MB", **shape)


def million(data: Path, streams: int, via: str, settings: dict[str, str]) -> None:
    shape = {"system": "streamlog", "streams": streams, "entries": 1, "fsync": "everysec", "via": via}
    shape |= settings
    server = Server(data, 2 * streams, settings)
    server.start()
    try:
        timed_load(server, streams, 1, via, shape)
        emit("many_streams_open_fds", server.fds(), "fds", **shape)
        emit("many_streams_server_rss", server.rss_mb(), "MB", **shape)
        # Killed as the load ends: the last streams' entries are in the page cache only (everysec),
        # and the closes handed to the everysec round are not all finished.
        server.stop(signal.SIGKILL)
        emit("many_streams_start_up_after_kill", server.start(), "s", **shape)
        emit("many_streams_start_up_after_kill_cpu", server.cpu_s(), "s", **shape)
        with Timer() as t:
            good = asyncio.run(read_all(server.address, streams, 1))
        emit("many_streams_acked_present_after_kill", good, "streams", of=streams, **shape)
        emit("many_streams_read_back", t.elapsed, "s", **shape)
        if good != streams:
            raise SystemExit(f"bench.streams: {streams - good} streams lost entries after kill -9")
        server.stop()
        emit("many_streams_disk", _disk_mb(data), "MB", **shape)
        emit("many_streams_restart_start_up", server.start(), "s", **shape)
        emit("many_streams_start_up_cpu", server.cpu_s(), "s", **shape)
        emit("many_streams_restarted_rss", server.rss_mb(), "MB", **shape)
    finally:
        server.stop()


def build_directly(data: Path, streams: int) -> None:
    """`streams` one-entry streams: the first written by the engine and closed cleanly, its files
    copied under every other name, and the catalog (see the module doc); then one `sync`."""
    # In a directory of its own, whose files are copied: a stream in a slot has none.
    with Engine(data, EngineConfig(background=False, small_streams="off")) as engine:
        engine.append(stream_name(0), AppendBatch(payloads(0, 1)))
        summary = engine.stats()["per_stream"][stream_name(0)]
    with multiprocessing.Pool(BUILDERS) as pool:
        chunks = [(data, first, min(streams, first + 10_000)) for first in range(1, streams, 10_000)]
        pool.starmap(_copy_template, chunks)
    catalog = Catalog()
    for i in range(streams):
        catalog.add_closed(stream_name(i), StreamSummary(1, summary.bytes_on_disk, 1, 1))
    (data / CATALOG_FILE).write_bytes(catalog.encode(set(), {}))
    (data / CATALOG_CLEAN).touch()  # the file is complete, as after a clean shutdown
    os.sync()


def _copy_template(data: Path, first: int, stop: int) -> None:
    """Streams first..stop-1 as copies of the template's files: each a mkdir and, per file, one
    open, write and close, relative to the streams directory's descriptor (no path walked)."""
    template = stream_directory(data, stream_name(0))
    # No meta file: a stream whose directory gives its name back has none (storage/creation.py).
    files = [(f.name, f.read_bytes()) for f in template.iterdir()]
    root = os.open(streams_root(data), os.O_RDONLY | os.O_DIRECTORY)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    try:
        for i in range(first, stop):
            dirname = stream_name(i)
            os.mkdir(dirname, 0o755, dir_fd=root)
            directory = os.open(dirname, os.O_RDONLY | os.O_DIRECTORY, dir_fd=root)
            try:
                for name, raw in files:
                    fd = os.open(name, flags, 0o644, dir_fd=directory)
                    os.write(fd, raw)
                    os.close(fd)
            finally:
                os.close(directory)
    finally:
        os.close(root)


async def append_after(address: str, picks: list[int]) -> int:
    """One more entry to each picked stream through the server; the acknowledged appends."""
    async with AsyncClient(address, timeout=None) as client:
        queue = iter(picks)
        acked = 0

        async def worker() -> None:
            nonlocal acked
            for i in queue:
                await client.append(stream_name(i), [b"after"])
                acked += 1

        await asyncio.gather(*(worker() for _ in range(64)))
    return acked


def million_direct(data: Path, streams: int, settings: dict[str, str]) -> None:
    shape = {"system": "streamlog", "streams": streams, "entries": 1, "fsync": "everysec", "built": "direct"}
    shape |= settings
    with Timer() as t:
        build_directly(data, streams)
    emit("many_streams_direct_build", t.elapsed, "s", **shape)
    emit("many_streams_disk", _disk_mb(data), "MB", **shape)
    server = Server(data, 2 * streams, settings, console=True)
    try:
        emit("many_streams_start_up", server.start(), "s", **shape)
        emit("many_streams_start_up_cpu", server.cpu_s(), "s", **shape)
        emit("many_streams_restarted_rss", server.rss_mb(), "MB", **shape)
        emit("many_streams_open_fds", server.fds(), "fds", **shape)
        rng = random.Random(17)
        picked = rng.sample(range(streams), 2 * min(DIRECT_APPENDS, streams // 2))
        appended, others = picked[: len(picked) // 2], picked[len(picked) // 2 :]
        acked = asyncio.run(append_after(server.address, appended))
        server.stop(signal.SIGKILL)
        emit("many_streams_start_up_after_kill", server.start(), "s", **shape)
        emit("many_streams_start_up_after_kill_cpu", server.cpu_s(), "s", **shape)
        emit("many_streams_rss_after_kill", server.rss_mb(), "MB", **shape)
        good = asyncio.run(read_all(server.address, appended, 1, extra=1, template=True))
        emit("many_streams_acked_present_after_kill", good, "streams", of=acked, **shape)
        untouched = asyncio.run(read_all(server.address, others, 1, template=True))
        emit("many_streams_untouched_present_after_kill", untouched, "streams", of=len(others), **shape)
        if good != acked or untouched != len(others):
            raise SystemExit("bench.streams: entries missing after kill -9")
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2,000 x 10 and 5,000 x 1: a smoke run")
    parser.add_argument("--streams", type=int, default=100_000)
    parser.add_argument("--entries", type=int, default=10)
    parser.add_argument("--million", type=int, default=1_000_000, help="streams of one entry")
    parser.add_argument("--skip-redis", action="store_true")
    parser.add_argument("--skip-load", action="store_true", help="no --streams run (Redis's nor streamlog's)")
    parser.add_argument(
        "--loads",
        default=",".join(LOADS),
        help=f"the --streams loads, comma-separated (of {', '.join(LOADS)})",
    )
    parser.add_argument(
        "--million-via", choices=list(LOADS), default="append_many", help="how --million loads (the fastest)"
    )
    parser.add_argument("--direct", action="store_true", help="--million's directory written in-process")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting of every streamlog server of the run (as `streamlog serve --set`); repeatable",
    )
    args = parser.parse_args()
    settings = dict(item.split("=", 1) for item in args.set if "=" in item)
    if len(settings) != len(args.set):
        parser.error("--set: KEY=VALUE")
    if args.quick:
        args.streams, args.million = 2_000, 5_000
    loads = [] if args.skip_load else args.loads.split(",")
    if unknown := set(loads) - set(LOADS):
        parser.error(f"--loads: no such load: {', '.join(sorted(unknown))}")
    with scratch(args.streams * len(loads) + args.million) as new_data:
        if loads and not args.skip_redis:
            redis_load(args.streams, args.entries)
        for via in loads:
            streamlog_load(new_data(), args.streams, args.entries, via, settings)
        if args.million and args.direct:
            million_direct(new_data(), args.million, settings)
        elif args.million:
            million(new_data(), args.million, args.million_via, settings)


if __name__ == "__main__":
    main()
