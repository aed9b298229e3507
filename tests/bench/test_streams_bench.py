"""bench.streams: its figures' units, its AppendMany load (requests the server takes, every
entry acknowledged, beside the Publish load), the kill -9 run, and the --direct build's start-up."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench import streams as bench
from bench.streams import _disk_mb
from clients import _convert as convert
from storage import Engine
from storage.groupregistry import GROUPS_DIR
from storage.groupstore import GroupStores


def test_disk_is_in_mb_of_a_million_bytes_as_redis_memory_is(tmp_path: Path) -> None:
    """Redis's `used_memory` is reported divided by 10^6; `du`'s KiB must be too, not by 1024."""
    (tmp_path / "data").write_bytes(os.urandom(500 * 4096))  # 2,048,000 bytes, every block allocated
    assert 2.048 <= _disk_mb(tmp_path) < 2.048 + 0.1  # the file, the directory's block or two


@pytest.mark.parametrize(
    ("batches", "call_batches", "size"),
    [(7, 2_000, 1 << 20), (10_000, 9, 1 << 20), (10_000, 2_000, 5_000), (10_000, 2_000, 1_200)],
)
def test_append_many_calls_stay_within_the_server_bounds(
    monkeypatch: pytest.MonkeyPatch, batches: int, call_batches: int, size: int
) -> None:
    """Each request carries at most MANY_BATCHES (and CALL_BATCHES) batches and MANY_BYTES
    serialized bytes (as the server counts them: the request's ByteSize), fills up to one of
    them, and every stream's entries go exactly once, in order."""
    monkeypatch.setattr(bench, "MANY_BATCHES", batches)
    monkeypatch.setattr(bench, "CALL_BATCHES", call_batches)
    monkeypatch.setattr(bench, "MANY_BYTES", size)
    most = min(batches, call_batches)
    calls = list(bench.append_many_calls(100, 10))
    for call in calls:
        assert len(call) <= most
        assert convert.append_many_request(call).ByteSize() <= size
    for call in calls[:-1]:  # full: one more batch would pass a bound
        one_more = [*call, call[-1]]
        assert len(one_more) > most or convert.append_many_request(one_more).ByteSize() > size
    assert [batch for call in calls for batch in call] == [
        (bench.stream_name(i), bench.payloads(i, 10)) for i in range(100)
    ]


def _figures(out: str) -> dict[str, dict]:
    return {record["figure"]: record for record in map(json.loads, out.splitlines())}


@pytest.mark.parametrize("via", sorted(bench.LOADS))
def test_a_small_load_is_acknowledged_and_reported_by_its_way(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], via: str
) -> None:
    """Both loads (the Publish session, the AppendMany calls) against a real server: every entry
    acknowledged (the load asserts it, and the metrics' count), figures labelled with the way and
    with the `--set` settings, which the server runs with (8 open streams: few descriptors)."""
    (tmp_path / "run").mkdir()
    bench.streamlog_load(tmp_path / "run" / "data", 120, 3, via, {"max_open_streams": "8"})
    figures = _figures(capsys.readouterr().out)
    assert figures["many_streams_load_time"]["via"] == via
    assert figures["many_streams_load_time"]["max_open_streams"] == "8"
    assert figures["many_streams_open_fds"]["value"] < 60  # the default 1,024 would keep 120 streams open
    assert figures["many_streams_load_time"]["streams"] == 120
    assert figures["many_streams_load_server_cpu"]["value"] > 0  # the server wrote 120 streams
    assert figures["many_streams_load_client_cpu"]["value"] > 0
    assert figures["closed_stream_read_p99"]["samples"] == 30
    assert figures["unsynced_after_wait"]["value"] == 0  # the latency calls came after the syncs


@pytest.mark.parametrize(("bound_s", "left"), [(300, 0), (0, 5)])
def test_the_latency_calls_wait_for_the_loads_closes_to_be_synced_within_a_bound(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], bound_s: float, left: int
) -> None:
    """The bench reads the server's unsynced streams (closes waiting, open ones) until they are 0,
    or until the bound, and reports the wait and what was left."""
    gauge = iter([5, 5, 2, 0])
    scrapes: list[int] = []

    def server_metrics(port: int) -> dict[str, float]:
        scrapes.append(port)
        return {"streamlog_closes_waiting": next(gauge), "streamlog_open_streams_unsynced": 0}

    monkeypatch.setattr(bench, "server_metrics", server_metrics)
    monkeypatch.setattr(bench, "ROUND_WAIT_S", bound_s)
    server = bench.Server(Path("unused"), 10, {})
    bench.wait_for_round(server, {"streams": 10})
    figures = _figures(capsys.readouterr().out)
    assert figures["unsynced_after_wait"]["value"] == left
    assert figures["closes_synced_wait"]["unit"] == "s"
    assert scrapes == [server.metrics_port] * (4 if left == 0 else 1)


def test_a_small_million_run_survives_a_kill_with_every_entry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--million's run through AppendMany: load, a kill -9 as it ends, every acknowledged entry back."""
    (tmp_path / "run").mkdir()
    bench.million(tmp_path / "run" / "data", 300, "append_many", {})
    present = _figures(capsys.readouterr().out)["many_streams_acked_present_after_kill"]
    assert (present["value"], present["of"], present["via"]) == (300, 300, "append_many")


def test_scratch_removes_every_data_directory_only_at_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runs' directories stay until the whole run ends (no load follows a big removal)."""
    monkeypatch.setenv("BENCH_DIR", str(tmp_path))
    with bench.scratch(10) as new_data:
        first = new_data()
        first.mkdir()
        second = new_data()
        assert first.is_dir() and second.parent.is_dir() and first.parent != second.parent
    assert list(tmp_path.iterdir()) == []


def test_a_direct_build_starts_without_probing_stream_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The built directory holds the group registry a clean shutdown leaves, so start-up reads it
    and looks into no stream's directory (a probe of a million took minutes)."""
    data = tmp_path / "data"
    bench.build_directly(data, 30)
    assert (data / GROUPS_DIR).is_dir()

    def probe(self: GroupStores) -> list[str]:
        raise AssertionError("start-up probed every stream directory for group files")

    monkeypatch.setattr(GroupStores, "_probe", probe)
    with Engine(data) as engine:
        entries = engine.read(bench.stream_name(29), 0, 10).entries()
    assert [entry.payload for entry in entries] == bench.payloads(0, 1)  # the template's
