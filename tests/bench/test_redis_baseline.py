"""The Redis baseline harness against a real redis-server, on tiny sizes.

These check the harness, not Redis' speed: that a server starts with the asked
durability, stops without leaving a process or a directory behind, and that
every workload moves the entries it claims and reports plausible figures.
Skipped only when redis-server is neither installed nor installable.
"""

from __future__ import annotations

import json
import math
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis

from bench import common, debian
from bench import redis_baseline as rb
from bench.common import Timer, emit, free_port, percentile, percentiles

# Every server these tests start, to check afterwards that none survived.
_STARTED: list[tuple[int, int]] = []  # (pid, port)


def _live_redis_servers() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every running (non-zombie) redis-server."""
    found: dict[int, tuple[int, str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
            # After the ")" closing the name: state, ppid, ...
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # exited while we looked
        if comm.startswith("redis-server") and state != "Z":
            found[int(entry.name)] = (int(ppid), cmdline)
    return found


def _our_redis_servers() -> dict[int, tuple[int, str]]:
    """The running redis-servers this test process started (its children)."""
    return {pid: v for pid, v in _live_redis_servers().items() if v[0] == os.getpid()}


def _assert_gone(pid: int, port: int) -> None:
    """Neither our pid nor any redis-server on our port is still running."""
    live = _live_redis_servers()
    assert pid not in live, f"redis-server pid {pid} still running: {live[pid]}"
    # redis-server retitles itself "redis-server 127.0.0.1:PORT".
    on_port = {p: v for p, v in live.items() if f"127.0.0.1:{port}" in v[1] or f"--port {port} " in v[1]}
    assert not on_port, f"redis-server still running on port {port}: {on_port}"
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass


@pytest.fixture(scope="module", autouse=True)
def _no_server_left_behind() -> Iterator[None]:
    yield
    for pid, port in _STARTED:
        _assert_gone(pid, port)
    assert _our_redis_servers() == {}, "a redis-server started by these tests is still running"


@pytest.fixture(scope="module")
def server(redis_exe: str) -> Iterator[rb.RedisServer]:
    with rb.RedisServer(None, executable=redis_exe) as srv:
        assert srv.pid is not None and srv.port is not None
        _STARTED.append((srv.pid, srv.port))
        yield srv


@pytest.fixture
def r(server: rb.RedisServer) -> Iterator[redis.Redis]:
    client = server.client()
    client.flushall()
    yield client


# ---------------------------------------------------------------------------
# bench.common


def test_emit_prints_one_flushed_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    record = emit("x.entries_per_s", 12.5, "entries/s", system="redis", batch=1000)
    line = capsys.readouterr().out
    assert line.endswith("\n") and line.count("\n") == 1
    assert (
        json.loads(line)
        == record
        == {
            "figure": "x.entries_per_s",
            "value": 12.5,
            "unit": "entries/s",
            "system": "redis",
            "batch": 1000,
        }
    )


def test_percentile_interpolates_like_numpy() -> None:
    data = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(data, 0) == 1.0
    assert percentile(data, 50) == 3.0
    assert percentile(data, 100) == 5.0
    assert percentile(data, 90) == pytest.approx(4.6)  # numpy.percentile(data, 90)
    assert percentiles(range(101), (1, 99)) == [1.0, 99.0]
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_timer_and_free_port() -> None:
    with Timer() as t:
        sum(range(1000))
    assert 0 < t.elapsed < 1
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # free right after: bindable


def test_free_port_hands_a_port_out_once_though_it_is_still_unbound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server's port and metrics port, picked one after the other: never the same."""
    picks = iter([23_456, 23_456, 23_457])
    monkeypatch.setattr(common, "_PORTS", SimpleNamespace(randrange=lambda low, high: next(picks)))
    monkeypatch.setattr(common, "_ISSUED", set())
    assert (free_port(), free_port()) == (23_456, 23_457)


# ---------------------------------------------------------------------------
# RedisServer


def test_ensure_redis_server_explains_when_it_cannot_install(monkeypatch: pytest.MonkeyPatch) -> None:
    # Not found and not root: a clear error naming the fix, and no apt-get run.
    monkeypatch.setattr(debian, "find_executable", lambda name: None)
    monkeypatch.setattr(debian.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(debian.subprocess, "run", lambda *a, **k: pytest.fail("must not run apt-get"))
    with pytest.raises(rb.RedisUnavailable, match="apt-get install -y redis-server"):
        rb.ensure_redis_server()
    with pytest.raises(rb.RedisUnavailable, match="not found"):
        rb.ensure_redis_server(install=False)


@pytest.mark.parametrize("policy", [None, "everysec", "always"])
def test_server_starts_with_the_durability_asked_and_stops_clean(redis_exe: str, policy: str | None) -> None:
    with rb.RedisServer(policy, executable=redis_exe) as srv:
        assert srv.pid is not None and srv.port is not None and srv.data_dir is not None
        pid, port, data_dir = srv.pid, srv.port, srv.data_dir
        _STARTED.append((pid, port))
        assert pid in _live_redis_servers()
        r = srv.client()
        assert r.ping()
        assert srv.version and srv.version[0].isdigit()
        assert r.info("persistence")["aof_enabled"] == (1 if policy else 0)
        assert r.config_get("save")["save"] == ""  # no RDB snapshots mid-run
        if policy:
            assert r.config_get("appendfsync")["appendfsync"] == policy
        assert r.config_get("bind")["bind"] == "127.0.0.1"
        assert os.path.isdir(data_dir)
        assert srv.aof == (policy or "off")
    _assert_gone(pid, port)
    assert not os.path.exists(data_dir)
    assert srv.proc is None and srv.port is None


def test_stop_terminates_a_server_that_refuses_shutdown(redis_exe: str) -> None:
    # SHUTDOWN renamed away: stop() must fall back to SIGTERM, and quickly.
    srv = rb.RedisServer(None, executable=redis_exe, extra_args=["--rename-command", "SHUTDOWN", ""])
    srv.start()
    assert srv.pid is not None and srv.port is not None
    pid, port = srv.pid, srv.port
    _STARTED.append((pid, port))
    with Timer() as t:
        srv.stop()
    _assert_gone(pid, port)
    assert t.elapsed < 3


def test_bad_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="appendfsync"):
        rb.RedisServer("sometimes")


# ---------------------------------------------------------------------------
# Workloads on tiny sizes


def _sane_rate(value: float) -> bool:
    return math.isfinite(value) and 100 < value < 1e9


def test_xadd_then_xrange_read_move_every_entry(r: redis.Redis) -> None:
    fig = rb.xadd_pipelined(r, "s", total=2500, batch=1000, payload_size=100)
    assert r.xlen("s") == 2500
    first = r.xrange("s", count=1)[0][1]
    assert set(first) == {b"p"} and len(first[b"p"]) == 100
    assert fig["entries"] == 2500 and _sane_rate(fig["entries_per_s"])
    assert fig["mb_per_s"] == pytest.approx(fig["entries_per_s"] * 100 / 1e6)
    assert 0 < fig["batch_ms_p50"] <= fig["batch_ms_p99"]

    read = rb.xrange_read(r, "s", batch=1000)
    assert read["entries"] == 2500 and read["pages"] == 3  # 1000, 1000, 500
    assert _sane_rate(read["entries_per_s"])

    seek = rb.xrange_seek_latency(r, "s", samples=50, count=10)
    assert 0 < seek["p50_us"] <= seek["p99_us"] < 1e6


def test_xread_block_latency_receives_every_entry(r: redis.Redis) -> None:
    fig = rb.xread_block_latency(r, rate=500, seconds=0.4)
    assert fig["sent"] == fig["received"] == 200
    assert 0 < fig["p50_us"] <= fig["p90_us"] <= fig["p99_us"] <= fig["max_us"] < 1e6
    assert 250 < fig["achieved_rate"] < 1000  # the schedule held, roughly
    assert r.dbsize() == 0  # its stream is removed


@pytest.mark.parametrize(
    ("pipelined", "one_at_a_time", "mode"),
    [(True, False, "pipelined"), (False, False, "batch"), (False, True, "one_at_a_time")],
)
def test_xreadgroup_consume_drains_and_acks(
    r: redis.Redis, pipelined: bool, one_at_a_time: bool, mode: str
) -> None:
    fig = rb.xreadgroup_consume(
        r, total=400, count=50, pipelined=pipelined, one_at_a_time=one_at_a_time, stream_len=200
    )
    assert fig["mode"] == mode
    assert fig["rounds"] == 2 and fig["entries"] == 400
    assert _sane_rate(fig["entries_per_s"])
    assert fig["ms_per_batch"] == pytest.approx(fig["seconds"] * 1e3 / 8)
    assert r.dbsize() == 0


def test_memory_per_entry_is_above_the_payload(r: redis.Redis) -> None:
    fig = rb.memory_per_entry(r, entries=3000, payload_size=100)
    # Each entry holds its 100-byte payload plus listpack/radix overhead.
    assert 100 < fig["memory_usage_per_entry"] < 1000
    assert 50 < fig["used_memory_per_entry"] < 2000
    assert r.dbsize() == 0


def test_run_reports_every_figure(server: rb.RedisServer) -> None:
    records: list[dict[str, object]] = []

    def collect(figure: str, value: float, unit: str, **extra: object) -> None:
        records.append({"figure": figure, "value": value, "unit": unit, **extra})

    assert set(_our_redis_servers()) == {server.pid}  # only the module fixture's server
    rb.run(
        total=2000,
        latency_seconds=0.3,
        group_total=1000,
        memory_entries=2000,
        seek_samples=50,
        repeat=2,
        durability=(None, "always"),
        out=collect,
    )
    assert set(_our_redis_servers()) == {server.pid}  # run() stopped both of its own servers
    steal = [rec for rec in records if rec["figure"] == "redis.run.cpu_steal_pct"]
    assert len(steal) == 1 and 0 <= steal[0]["value"] <= 100
    records = [rec for rec in records if rec not in steal]
    names = {(rec["figure"], rec["aof"], rec.get("mode")) for rec in records}
    assert ("redis.xadd_pipelined.entries_per_s", "off", None) in names
    assert ("redis.xadd_pipelined.entries_per_s", "always", None) in names
    assert ("redis.xrange_read.entries_per_s", "off", None) in names
    assert ("redis.xrange_seek.p99_us", "off", None) in names
    assert ("redis.xread_block.p99_us", "off", None) in names
    assert ("redis.memory.memory_usage_per_entry", "off", None) in names
    for mode in ("pipelined", "batch", "one_at_a_time"):
        assert ("redis.xreadgroup.ms_per_batch", "off", mode) in names
    # Only appends are repeated under fsync: reads do not pay for it.
    assert {rec["figure"] for rec in records if rec["aof"] == "always"} == {
        "redis.xadd_pipelined.entries_per_s",
        "redis.xadd_pipelined.mb_per_s",
        "redis.xadd_pipelined.batch_ms_p99",
    }
    for rec in records:
        value = rec["value"]
        assert isinstance(value, float) and math.isfinite(value) and value > 0, rec
        assert rec["system"] == "redis" and rec["redis_version"]
        if "runs" in rec:  # a median of the repeats, which are all listed
            runs = rec["runs"]
            assert isinstance(runs, list) and len(runs) == 2 and runs == sorted(runs)
            assert min(runs) <= round(value, 3) <= max(runs)
        json.dumps(rec)  # every record is one JSON line
