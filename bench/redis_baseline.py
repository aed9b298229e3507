"""Redis Streams baseline: the figures streamlog is compared with.

DESIGN.md asks every performance figure to be set beside Redis Streams
(Debian's ``redis-server``) measured on the same machine in the same run, on
the same workload: 100-byte payloads, batches of 1000, one stream. This module
provides

* :func:`ensure_redis_server`: the path of ``redis-server``, installing
  Debian's package when it is missing and we are root;
* :class:`RedisServer`: a throw-away server on 127.0.0.1 with a chosen AOF
  policy, in its own temporary directory, always stopped on exit;
* workload functions (redis-py + hiredis) that each return a dict of figures,
  for other bench scripts to call next to their streamlog counterparts;
* ``python -m bench.redis_baseline``: runs them all and prints JSON lines.

Workloads verify their own results (entry counts, empty pending lists) and
raise on a mismatch: a fast wrong answer is not a figure.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import redis
import redis.utils
from redis.backoff import NoBackoff
from redis.retry import Retry

from bench.common import Timer, cpu_steal_ticks, emit, free_port, percentiles
from bench.debian import PackageUnavailable, ensure_package, find_executable

__all__ = [
    "RedisServer",
    "RedisUnavailable",
    "ensure_redis_server",
    "find_redis_server",
    "hiredis_in_use",
    "memory_per_entry",
    "primary_with_replica",
    "run",
    "xadd_pipelined",
    "xrange_read",
    "xrange_seek_latency",
    "xread_block_latency",
    "xreadgroup_consume",
]

APPENDFSYNC_POLICIES = ("always", "everysec", "no")
PAYLOAD_FIELD = "p"

_STOP_WAIT_S = 5.0


class RedisUnavailable(PackageUnavailable):
    """redis-server is not installed and could not be installed here."""


# --------------------------------------------------------------------------
# Finding / installing redis-server


def find_redis_server() -> str | None:
    """Path of an executable ``redis-server``, or None."""
    return find_executable("redis-server")


def ensure_redis_server(install: bool = True) -> str:
    """Return the path of ``redis-server``, installing Debian's package if needed.

    Installs only as root (``apt-get update`` then ``apt-get install -y
    redis-server``): a bench must not prompt for a password. apt's output goes
    to stderr so stdout stays pure JSON lines.
    """
    try:
        return ensure_package("redis-server", "redis-server", install)
    except PackageUnavailable as exc:
        raise RedisUnavailable(str(exc)) from exc


def hiredis_in_use() -> bool:
    """True if redis-py parses replies with hiredis (C), as the figures assume."""
    return bool(redis.utils.HIREDIS_AVAILABLE)


def filesystem_type(path: str | os.PathLike[str]) -> str:
    """File system type holding ``path`` (from /proc/self/mounts), or "unknown".

    Recorded with durability figures: on tmpfs fsync is free and an
    ``appendfsync always`` figure would mean nothing.
    """
    target = os.path.realpath(path)
    best, best_type = "", "unknown"
    try:
        with open("/proc/self/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount_point = fields[1].replace("\\040", " ")
                inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best):
                    best, best_type = mount_point, fields[2]
    except OSError:
        pass
    return best_type


# --------------------------------------------------------------------------
# A throw-away server


def _no_retry() -> Retry:
    """redis-py retries failed commands by default (with backoff): not here."""
    return Retry(NoBackoff(), 0)


def _die_with_parent() -> None:
    """preexec_fn: have the kernel SIGTERM redis-server when we die.

    A bench killed by a timeout or SIGKILL never runs ``__exit__``; without
    this the server would outlive it. Linux only, best effort. Note the
    signal fires when the *thread* that started the server exits, so start
    servers from a long-lived thread (or pass ``die_with_parent=False``).
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    except Exception:  # no prctl (not Linux): rely on __exit__ alone
        return


class RedisServer:
    """A ``redis-server`` on 127.0.0.1, free port, own temp dir; a context manager.

    ``appendfsync`` None turns the AOF off; "always", "everysec" or "no"
    turns it on with that fsync policy. RDB snapshots are always off
    (``--save ''``) so no background save disturbs a measurement.

    >>> with RedisServer("everysec") as srv:
    ...     r = srv.client()
    """

    host = "127.0.0.1"

    def __init__(
        self,
        appendfsync: str | None = None,
        *,
        executable: str | None = None,
        parent_dir: str | os.PathLike[str] | None = None,
        startup_timeout: float = 10.0,
        extra_args: Sequence[str] = (),
        die_with_parent: bool = True,
    ) -> None:
        if appendfsync is not None and appendfsync not in APPENDFSYNC_POLICIES:
            raise ValueError(
                f"appendfsync must be None or one of {APPENDFSYNC_POLICIES}, not {appendfsync!r}"
            )
        self.appendfsync = appendfsync
        self._executable = executable
        self._parent_dir = parent_dir
        self._startup_timeout = startup_timeout
        self._extra_args = list(extra_args)
        self._die_with_parent = die_with_parent
        self.port: int | None = None
        self.data_dir: str | None = None
        self.version: str | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_path: str | None = None
        self._log_file: Any = None
        self._clients: list[redis.Redis] = []

    # -- lifecycle ---------------------------------------------------------

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def aof(self) -> str:
        """The durability mode as one word, for figure labels: off/always/everysec/no."""
        return self.appendfsync or "off"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def _command(self, executable: str, port: int) -> list[str]:
        assert self.data_dir is not None
        args = [
            executable,
            "--port", str(port),
            "--bind", self.host,
            "--protected-mode", "yes",
            "--dir", self.data_dir,
            "--save", "",
            "--appendonly", "yes" if self.appendfsync else "no",
            "--daemonize", "no",
            "--logfile", "",  # to stdout, which goes to redis.log in data_dir
        ]  # fmt: skip
        if self.appendfsync:
            args += ["--appendfsync", self.appendfsync]
        return args + self._extra_args

    def start(self) -> None:
        if self.proc is not None:
            raise RuntimeError("server already started")
        executable = self._executable or ensure_redis_server()
        self.data_dir = tempfile.mkdtemp(prefix="streamlog-redis-", dir=self._parent_dir)
        self._log_path = os.path.join(self.data_dir, "redis.log")
        try:
            # free_port() can race with another process taking the port:
            # retry a couple of times on "Address already in use".
            for _attempt in range(3):
                port = free_port()
                if self._spawn(executable, port):
                    self.port = port
                    info = self.client().info("server")
                    self.version = str(info.get("redis_version", "unknown"))
                    return
                if "already in use" not in self._log_tail():
                    break
            raise RuntimeError(f"redis-server did not start; log tail:\n{self._log_tail()}")
        except BaseException:
            self.stop()
            raise

    def _spawn(self, executable: str, port: int) -> bool:
        """Start the process and wait (bounded) until it answers PING."""
        assert self._log_path is not None
        if self._log_file is not None:
            self._log_file.close()
        self._log_file = open(self._log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self._command(executable, port),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            cwd=self.data_dir,
            preexec_fn=_die_with_parent if self._die_with_parent else None,
        )
        probe = redis.Redis(
            host=self.host, port=port, socket_connect_timeout=0.5, socket_timeout=1.0, retry=_no_retry()
        )
        deadline = time.monotonic() + self._startup_timeout
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    self.proc = None
                    return False
                try:
                    if probe.ping():
                        return True
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                    pass
                time.sleep(0.02)
        finally:
            probe.close()
        self._terminate()
        raise RuntimeError(
            f"redis-server did not answer PING within {self._startup_timeout}s; log tail:\n{self._log_tail()}"
        )

    def _log_tail(self, lines: int = 20) -> str:
        if not self._log_path:
            return ""
        try:
            text = Path(self._log_path).read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _terminate(self) -> None:
        """SIGTERM, wait, SIGKILL, wait: every path ends with a reaped process."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(_STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(_STOP_WAIT_S)
        self.proc = None

    def stop(self) -> None:
        """SHUTDOWN NOSAVE, then terminate/kill if needed; remove the temp dir."""
        for client in self._clients:
            client.close()
        self._clients.clear()
        try:
            proc = self.proc
            if proc is not None and proc.poll() is None and self.port is not None:
                # No retry: the server dropping the connection is the success
                # case, and redis-py's default retries would add seconds.
                closer = redis.Redis(
                    host=self.host,
                    port=self.port,
                    socket_connect_timeout=1.0,
                    socket_timeout=2.0,
                    retry=_no_retry(),
                )
                try:
                    # redis-py returns when the server drops the connection
                    # (it is exiting) and raises if SHUTDOWN got a reply.
                    closer.shutdown(nosave=True)
                    exiting = True
                except redis.RedisError:
                    exiting = False  # refused (renamed, busy script...): terminate below
                finally:
                    closer.close()
                if exiting:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(_STOP_WAIT_S)  # else terminate/kill below
            self._terminate()
        finally:
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None
            if self.data_dir is not None:
                shutil.rmtree(self.data_dir, ignore_errors=True)
                self.data_dir = None
            self.port = None

    # -- use ---------------------------------------------------------------

    def client(self, **kwargs: Any) -> redis.Redis:
        """A redis-py client for this server (hiredis parser when installed).

        Closed by :meth:`stop`. socket_timeout is generous because pipelines
        of 1000 commands under ``appendfsync always`` take a while.
        """
        if self.port is None:
            raise RuntimeError("server not started")
        kwargs.setdefault("socket_timeout", 30.0)
        # A silently retried command would distort a figure: fail instead.
        kwargs.setdefault("retry", _no_retry())
        kwargs.setdefault("socket_connect_timeout", 2.0)
        client = redis.Redis(host=self.host, port=self.port, **kwargs)
        self._clients.append(client)
        return client


@contextlib.contextmanager
def primary_with_replica(
    appendfsync: str | None, link_timeout_s: float = 30.0, **kwargs: Any
) -> Iterator[tuple[RedisServer, RedisServer]]:
    """Two servers with the same AOF policy: a primary and a ``--replicaof`` replica of it,
    yielded once the replica's link is up and the primary counts it (so ``WAIT 1`` can be
    answered). The replica stops first."""
    extra_args = list(kwargs.pop("extra_args", ()))
    # The primary would wait 5 s for more replicas to share one sync: there is only one.
    primary_args = [*extra_args, "--repl-diskless-sync-delay", "0"]
    with RedisServer(appendfsync, extra_args=primary_args, **kwargs) as primary:
        assert primary.port is not None
        replica_args = [*extra_args, "--replicaof", primary.host, str(primary.port)]
        with RedisServer(appendfsync, extra_args=replica_args, **kwargs) as replica:
            on_replica, on_primary = replica.client(), primary.client()
            deadline = time.monotonic() + link_timeout_s
            while (
                on_replica.info("replication").get("master_link_status") != "up"
                or int(on_primary.info("replication").get("connected_slaves", 0)) < 1
            ):
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the replica did not link to its primary within {link_timeout_s} s; "
                        f"replica log tail:\n{replica._log_tail()}"
                    )
                time.sleep(0.05)  # another process's state: nothing here can wake us
            yield primary, replica


# --------------------------------------------------------------------------
# Workloads


def _random_payloads(count: int, size: int) -> list[bytes]:
    """``count`` distinct random payloads, made before any timing starts."""
    blob = os.urandom(count * size)
    return [blob[i : i + size] for i in range(0, count * size, size)]


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")


def _stream_entries(reply: Any) -> list[Any]:
    """Entries of the first stream in an XREAD/XREADGROUP reply (RESP2 or RESP3)."""
    if not reply:
        return []
    if isinstance(reply, dict):  # RESP3: {stream: [entries]} or {stream: [[entries]]}
        value = next(iter(reply.values()))
        return value[0] if value and isinstance(value[0], list) else value
    return reply[0][1]


def xadd_pipelined(
    r: redis.Redis,
    stream: str,
    total: int = 200_000,
    batch: int = 1000,
    payload_size: int = 100,
) -> dict[str, float]:
    """Append ``total`` entries in pipelines of ``batch`` XADD, field ``p`` = random bytes.

    Times the client building the commands too: that is what a Python
    producer pays, and what streamlog's Python client pays as well.
    """
    _check_positive(total=total, batch=batch, payload_size=payload_size)
    payloads = _random_payloads(total, payload_size)
    start_len = r.xlen(stream)
    pipe = r.pipeline(transaction=False)  # no MULTI/EXEC: plain pipelining
    batch_times: list[float] = []
    with Timer() as t:
        for lo in range(0, total, batch):
            t_batch = time.perf_counter()
            for payload in payloads[lo : lo + batch]:
                pipe.xadd(stream, {PAYLOAD_FIELD: payload})
            pipe.execute()  # raises on any error reply; resets the pipeline
            batch_times.append(time.perf_counter() - t_batch)
    added = r.xlen(stream) - start_len
    if added != total:
        raise AssertionError(f"XADD added {added} entries, expected {total}")
    p50, p99 = percentiles(batch_times, (50, 99))
    return {
        "entries": total,
        "seconds": t.elapsed,
        "entries_per_s": total / t.elapsed,
        "mb_per_s": total * payload_size / t.elapsed / 1e6,
        "batch_ms_p50": p50 * 1e3,
        "batch_ms_p99": p99 * 1e3,
    }


def xrange_read(r: redis.Redis, stream: str, batch: int = 1000) -> dict[str, float]:
    """Read the whole stream in pages of XRANGE COUNT ``batch``; entries/s.

    Each page starts just after the last id seen (exclusive ``(`` range,
    Redis >= 6.2), as a client resuming from a checkpoint would.
    """
    _check_positive(batch=batch)
    expected = r.xlen(stream)
    max_pages = expected // batch + 2  # bound: one more page sees the end
    start: bytes | str = "-"
    count = pages = 0
    with Timer() as t:
        while pages < max_pages:
            page = r.xrange(stream, min=start, max="+", count=batch)
            pages += 1
            if not page:
                break
            count += len(page)
            start = b"(" + page[-1][0]
            if len(page) < batch:
                break
    if count != expected:
        raise AssertionError(f"XRANGE read {count} entries, stream holds {expected}")
    return {
        "entries": count,
        "pages": pages,
        "seconds": t.elapsed,
        "entries_per_s": count / t.elapsed if t.elapsed > 0 else float("inf"),
    }


def xrange_seek_latency(
    r: redis.Redis, stream: str, samples: int = 2000, count: int = 10, seed: int = 1
) -> dict[str, float]:
    """XRANGE ``count`` entries from a random point of the stream; p50/p99 µs.

    The start is a random millisecond between the first and last ids: a seek
    by time, the Redis analogue of a streamlog seek by offset or timestamp.
    """
    _check_positive(samples=samples, count=count)
    first = r.xrange(stream, count=1)
    last = r.xrevrange(stream, count=1)
    if not first:
        raise ValueError(f"stream {stream!r} is empty")
    lo_ms = int(first[0][0].split(b"-")[0])
    hi_ms = int(last[0][0].split(b"-")[0])
    rng = random.Random(seed)
    starts = [str(rng.randint(lo_ms, hi_ms)) for _ in range(samples)]  # made before timing
    lat_us: list[float] = []
    got = 0
    for start in starts:
        t0 = time.perf_counter_ns()
        page = r.xrange(stream, min=start, max="+", count=count)
        lat_us.append((time.perf_counter_ns() - t0) / 1e3)
        got += len(page)
    if got == 0:
        raise AssertionError("random XRANGE seeks returned no entries")
    p50, p99 = percentiles(lat_us, (50, 99))
    return {"samples": samples, "count": count, "p50_us": p50, "p99_us": p99}


def xread_block_latency(
    r: redis.Redis,
    rate: float = 1000,
    seconds: float = 5,
    payload_size: int = 100,
    stream: str | None = None,
    block_ms: int = 200,
) -> dict[str, float]:
    """Append->receive latency of XREAD BLOCK at a steady append rate; p50/p99 µs.

    A producer thread XADDs ``rate`` entries/s on an absolute schedule (so a
    late send does not lower the rate), the first 8 payload bytes holding its
    CLOCK_MONOTONIC send time in ns. The calling thread blocks on XREAD from
    the last id seen and records receive time minus send time per entry.
    Both share one process (and its GIL), as a Python client would.
    ``block_ms`` must stay below the client's socket_timeout.
    """
    _check_positive(rate=rate, seconds=seconds)
    if payload_size < 8:
        raise ValueError("payload_size must hold the 8-byte send time")
    stream = stream or f"bench:latency:{uuid.uuid4().hex}"
    r.delete(stream)
    n = max(1, int(rate * seconds))
    filler = os.urandom(payload_size - 8)
    clock = time.monotonic_ns  # CLOCK_MONOTONIC: same clock in both threads
    stop = threading.Event()
    xadd_us: list[float] = []
    span: dict[str, int] = {}  # first and last send times, for the achieved rate
    errors: list[BaseException] = []
    # Start the schedule a little later so the consumer is already blocked.
    t_start = clock() + 50_000_000
    interval_ns = 1e9 / rate

    def produce() -> None:
        try:
            for i in range(n):
                if stop.is_set():
                    return
                delay = (t_start + i * interval_ns - clock()) / 1e9
                if delay > 0:
                    time.sleep(delay)
                sent = clock()
                r.xadd(stream, {PAYLOAD_FIELD: struct.pack("<q", sent) + filler})
                xadd_us.append((clock() - sent) / 1e3)
                span.setdefault("first", sent)
                span["last"] = sent
        except BaseException as exc:  # re-raised by the consumer side
            errors.append(exc)

    producer = threading.Thread(target=produce, name="xadd-producer", daemon=True)
    lat_us: list[float] = []
    last_id: bytes | str = "0-0"  # from the start: nothing is missed, however the threads race
    deadline = time.monotonic() + seconds + 10  # bound: a stuck producer ends the run
    producer.start()
    try:
        while len(lat_us) < n and time.monotonic() < deadline and not errors:
            reply = r.xread({stream: last_id}, count=1000, block=block_ms)
            now = clock()
            entries = _stream_entries(reply)
            for _entry_id, fields in entries:
                (sent,) = struct.unpack_from("<q", fields[PAYLOAD_FIELD.encode()])
                lat_us.append((now - sent) / 1e3)
            if entries:
                last_id = entries[-1][0]
    finally:
        stop.set()
        producer.join(timeout=5)
        r.delete(stream)
    if errors:
        raise RuntimeError("producer thread failed") from errors[0]
    if not lat_us:
        raise AssertionError("XREAD BLOCK received nothing")
    span_s = (span["last"] - span["first"]) / 1e9 if span else 0.0
    p50, p90, p99 = percentiles(lat_us, (50, 90, 99))
    x50, x99 = percentiles(xadd_us or [0.0], (50, 99))
    return {
        "sent": len(xadd_us),
        "received": len(lat_us),
        "target_rate": rate,
        "achieved_rate": (len(xadd_us) - 1) / span_s if span_s > 0 else 0.0,
        "p50_us": p50,
        "p90_us": p90,
        "p99_us": p99,
        "max_us": max(lat_us),
        "xadd_rtt_p50_us": x50,
        "xadd_rtt_p99_us": x99,
    }


def xreadgroup_consume(
    r: redis.Redis,
    total: int = 10_000,
    count: int = 50,
    pipelined: bool = True,
    *,
    one_at_a_time: bool = True,
    stream_len: int = 1000,
    payload_size: int = 100,
) -> dict[str, Any]:
    """Seed 004's queue workload on a consumer group: drain, acknowledge, repeat.

    Each round fills a fresh stream with ``stream_len`` entries (untimed),
    creates one group at 0 and consumes until XREADGROUP returns nothing,
    acknowledging everything; ``total // stream_len`` rounds. Modes:

    * ``pipelined=True``: one round trip per batch, carrying XACK of the
      previous batch and XREADGROUP COUNT ``count`` for the next.
    * ``pipelined=False, one_at_a_time=True`` (seed 004's "consecutive"):
      XREADGROUP COUNT 1 then XACK, two round trips per entry.
    * ``pipelined=False, one_at_a_time=False``: XREADGROUP COUNT ``count``
      then XACK of its ids, two round trips per batch.

    ``ms_per_batch`` is the time per ``count`` entries in every mode, so the
    modes compare directly (seed 004 reports per 50 messages).
    """
    _check_positive(total=total, count=count, stream_len=stream_len, payload_size=payload_size)
    if pipelined:
        mode = "pipelined"
    elif one_at_a_time:
        mode = "one_at_a_time"
    else:
        mode = "batch"
    rounds = max(1, total // stream_len)
    group, consumer = "g", "c1"
    key = f"bench:group:{uuid.uuid4().hex}"
    elapsed = 0.0
    consumed_total = 0
    payloads = _random_payloads(stream_len, payload_size)
    for _round in range(rounds):
        r.delete(key)
        seed = r.pipeline(transaction=False)
        for payload in payloads:
            seed.xadd(key, {PAYLOAD_FIELD: payload})
        seed.execute()
        r.xgroup_create(key, group, id="0")
        consumed = 0
        # bound: a correct run needs stream_len/count (+1 empty) reads.
        max_reads = stream_len + 2
        with Timer() as t:
            if mode == "pipelined":
                prev_ids: list[bytes] = []
                pipe = r.pipeline(transaction=False)
                for _ in range(max_reads):
                    if prev_ids:
                        pipe.xack(key, group, *prev_ids)
                    pipe.xreadgroup(group, consumer, {key: ">"}, count=count)
                    entries = _stream_entries(pipe.execute()[-1])
                    if not entries:
                        break  # this last round trip also acked the final batch
                    prev_ids = [entry_id for entry_id, _fields in entries]
                    consumed += len(entries)
            elif mode == "batch":
                for _ in range(max_reads):
                    entries = _stream_entries(r.xreadgroup(group, consumer, {key: ">"}, count=count))
                    if not entries:
                        break
                    r.xack(key, group, *[entry_id for entry_id, _fields in entries])
                    consumed += len(entries)
            else:
                for _ in range(max_reads):
                    entries = _stream_entries(r.xreadgroup(group, consumer, {key: ">"}, count=1))
                    if not entries:
                        break
                    r.xack(key, group, entries[0][0])
                    consumed += 1
        elapsed += t.elapsed
        pending = r.xpending(key, group)["pending"]
        if consumed != stream_len or pending != 0:
            raise AssertionError(f"{mode}: consumed {consumed}/{stream_len}, {pending} left pending")
        consumed_total += consumed
    r.delete(key)
    return {
        "mode": mode,
        "rounds": rounds,
        "entries": consumed_total,
        "count": count,
        "seconds": elapsed,
        "ms_per_batch": elapsed * 1e3 / (consumed_total / count),
        "entries_per_s": consumed_total / elapsed,
    }


def memory_per_entry(r: redis.Redis, entries: int = 100_000, payload_size: int = 100) -> dict[str, float]:
    """Server memory per stream entry: used_memory growth and MEMORY USAGE.

    MEMORY USAGE ... SAMPLES 0 walks the whole key (exact); the used_memory
    delta also counts allocator overhead, the figure an operator sees.
    """
    _check_positive(entries=entries, payload_size=payload_size)
    key = f"bench:memory:{uuid.uuid4().hex}"
    r.delete(key)
    before = int(r.info("memory")["used_memory"])
    xadd_pipelined(r, key, total=entries, batch=1000, payload_size=payload_size)
    after = int(r.info("memory")["used_memory"])
    usage = int(r.memory_usage(key, samples=0) or 0)
    r.delete(key)
    return {
        "entries": entries,
        "payload_size": payload_size,
        "used_memory_per_entry": (after - before) / entries,
        "memory_usage_per_entry": usage / entries,
    }


# --------------------------------------------------------------------------
# The runner


Emit = Callable[..., Any]


def _median_of(
    repeat: int, key: str, measure: Callable[[int], dict[str, Any]]
) -> tuple[dict[str, Any], list[float]]:
    """Run ``measure(i)`` ``repeat`` times: the run with the median ``key``, and every ``key`` value.

    Loopback round trips on a small VM vary 2-4x from second to second (CPU
    steal, idle wake-ups): one sample is noise, the median of a few is less so.
    """
    figs = sorted((measure(i) for i in range(max(1, repeat))), key=lambda f: f[key])
    return figs[len(figs) // 2], [round(f[key], 3) for f in figs]


def _append_figures(r: redis.Redis, out: Emit, labels: dict[str, Any], total: int, repeat: int) -> str:
    """Pipelined XADD figures; returns the name of the last stream, left in place for reads."""
    streams = [f"bench:append:{uuid.uuid4().hex}:{i}" for i in range(max(1, repeat))]

    def append(i: int) -> dict[str, Any]:
        if i > 0:
            r.delete(streams[i - 1])  # hold one stream at a time in memory
        return xadd_pipelined(r, streams[i], total=total, batch=1000, payload_size=100)

    fig, runs = _median_of(repeat, "entries_per_s", append)
    wl = {"workload": "xadd_pipelined", "entries": total, "batch": 1000, "payload_size": 100}
    out("redis.xadd_pipelined.entries_per_s", fig["entries_per_s"], "entries/s", **labels, **wl, runs=runs)
    out("redis.xadd_pipelined.mb_per_s", fig["mb_per_s"], "MB/s", **labels, **wl)
    out("redis.xadd_pipelined.batch_ms_p99", fig["batch_ms_p99"], "ms", **labels, **wl)
    return streams[-1]


def _read_figures(
    r: redis.Redis,
    out: Emit,
    labels: dict[str, Any],
    stream: str,
    *,
    latency_seconds: float,
    group_total: int,
    memory_entries: int,
    seek_samples: int,
    repeat: int,
) -> None:
    """Every figure that does not depend on the fsync policy (run with the AOF off)."""
    fig, runs = _median_of(repeat, "entries_per_s", lambda _i: xrange_read(r, stream, batch=1000))
    wl: dict[str, Any] = {"workload": "xrange_read", "entries": fig["entries"], "batch": 1000}
    out("redis.xrange_read.entries_per_s", fig["entries_per_s"], "entries/s", **labels, **wl, runs=runs)

    stream_entries = r.xlen(stream)
    fig = xrange_seek_latency(r, stream, samples=seek_samples, count=10)
    wl = {"workload": "xrange_seek", "stream_entries": stream_entries, "count": 10, "samples": seek_samples}
    out("redis.xrange_seek.p50_us", fig["p50_us"], "us", **labels, **wl)
    out("redis.xrange_seek.p99_us", fig["p99_us"], "us", **labels, **wl)
    r.delete(stream)

    fig = xread_block_latency(r, rate=1000, seconds=latency_seconds)
    wl = {"workload": "xread_block", "rate": 1000, "seconds": latency_seconds, "received": fig["received"]}
    for name in ("p50_us", "p99_us", "max_us", "xadd_rtt_p50_us"):
        out(f"redis.xread_block.{name}", fig[name], "us", **labels, **wl)

    def consume(pipelined: bool, one_at_a_time: bool) -> None:
        fig, runs = _median_of(
            repeat,
            "entries_per_s",
            lambda _i: xreadgroup_consume(
                r, total=group_total, count=50, pipelined=pipelined, one_at_a_time=one_at_a_time
            ),
        )
        wl = {"workload": "xreadgroup_consume", "mode": fig["mode"], "entries": fig["entries"], "count": 50}
        out("redis.xreadgroup.ms_per_batch", fig["ms_per_batch"], "ms", **labels, **wl)
        out("redis.xreadgroup.entries_per_s", fig["entries_per_s"], "entries/s", **labels, **wl, runs=runs)

    consume(pipelined=True, one_at_a_time=False)
    consume(pipelined=False, one_at_a_time=False)
    consume(pipelined=False, one_at_a_time=True)

    fig = memory_per_entry(r, entries=memory_entries, payload_size=100)
    wl = {"workload": "memory", "entries": memory_entries, "payload_size": 100}
    out("redis.memory.used_memory_per_entry", fig["used_memory_per_entry"], "B", **labels, **wl)
    out("redis.memory.memory_usage_per_entry", fig["memory_usage_per_entry"], "B", **labels, **wl)


def run(
    *,
    total: int = 200_000,
    latency_seconds: float = 5.0,
    group_total: int = 10_000,
    memory_entries: int = 100_000,
    seek_samples: int = 2000,
    repeat: int = 3,
    durability: Sequence[str | None] = (None, "everysec", "always"),
    out: Emit = emit,
) -> None:
    """Run every workload and report each figure through ``out`` (``emit``).

    The full set runs on an AOF-off server; the append figure is repeated
    under each other durability policy, since only appends pay for fsync.
    Throughput figures are the median of ``repeat`` runs, all of them listed
    in the ``runs`` extra; latency figures come from one run's distribution.
    """
    common: dict[str, Any] = {"system": "redis", "hiredis": hiredis_in_use()}
    if not common["hiredis"]:
        print("bench: warning: hiredis not installed, redis-py parses in Python", file=sys.stderr)
    steal_before = cpu_steal_ticks()

    for policy in durability:
        with RedisServer(policy) as srv:
            r = srv.client()
            labels = {
                **common,
                "redis_version": srv.version,
                "aof": srv.aof,
                "fs": filesystem_type(srv.data_dir or "."),
            }
            stream = _append_figures(r, out, labels, total, repeat)
            if policy is None:
                _read_figures(
                    r,
                    out,
                    labels,
                    stream,
                    latency_seconds=latency_seconds,
                    group_total=group_total,
                    memory_entries=memory_entries,
                    seek_samples=seek_samples,
                    repeat=repeat,
                )
            r.delete(stream)

    steal_after = cpu_steal_ticks()
    if steal_before and steal_after and steal_after[1] > steal_before[1]:
        # Share of CPU time the hypervisor took from this VM during the run:
        # when it is high, that, not the code, explains a noisy figure.
        steal_pct = 100 * (steal_after[0] - steal_before[0]) / (steal_after[1] - steal_before[1])
        out("redis.run.cpu_steal_pct", float(steal_pct), "%", **common)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.redis_baseline",
        description="Redis Streams baseline figures as JSON lines (one per figure) on stdout.",
    )
    parser.add_argument("--total", type=int, default=200_000, help="entries appended per durability mode")
    parser.add_argument("--latency-seconds", type=float, default=5.0, help="XREAD BLOCK run length")
    parser.add_argument("--group-total", type=int, default=10_000, help="entries consumed per group mode")
    parser.add_argument("--memory-entries", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3, help="runs per throughput figure (median reported)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of a few seconds")
    args = parser.parse_args(argv)
    if args.quick:
        args.total, args.latency_seconds, args.group_total, args.memory_entries = 10_000, 1.0, 2_000, 10_000
    try:
        run(
            total=args.total,
            latency_seconds=args.latency_seconds,
            group_total=args.group_total,
            memory_entries=args.memory_entries,
            repeat=args.repeat,
        )
    except RedisUnavailable as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
