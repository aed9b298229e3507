"""Prometheus metrics: present on the HTTP port, and moving with traffic."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from prometheus_client import Counter
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from bench.common import free_port
from service.config import Settings
from service.metrics import Metrics, MetricsInterceptor
from service.server import SERVICE
from storage import AppendBatch
from tests.service.helpers import ServerThread, append
from tests.service.processes import ServerProcess

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(server: ServerThread, token: str | None = None, query: str = "") -> Samples:
    return scrape_port(server.server.ops.metrics_server.port, token, query)


def scrape_port(port: int, token: str | None = None, query: str = "") -> Samples:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics{query}")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def scrape_when(
    server: ServerThread | int, condition: Callable[[Samples], bool], timeout_s: float = 10
) -> Samples:
    """The first scrape (of a server, or of a metrics port) that meets `condition`."""
    port = server if isinstance(server, int) else server.server.ops.metrics_server.port
    deadline = time.monotonic() + timeout_s
    while not condition(samples := scrape_port(port)):
        assert time.monotonic() < deadline, "the metrics did not get there in time"
        time.sleep(0.01)
    return samples


@pytest.fixture
def metered(start_server: Callable[..., ServerThread]) -> ServerThread:
    return start_server(metrics_port=free_port(), fsync="always", max_streams=3)


def test_metrics_are_served_and_follow_traffic(metered: ServerThread) -> None:
    before = scrape(metered)
    assert value(before, "streamlog_ready") == 1
    assert value(before, "streamlog_streams") == 0
    with grpc.insecure_channel(metered.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        for _ in range(3):
            append(stub, "rides", *[b"x" * 100] * 10)
        stub.Read(pb.ReadRequest(stream="rides", offset=0, count=5), timeout=5)
        with pytest.raises(grpc.RpcError):
            stub.GetStreamInfo(pb.GetStreamInfoRequest(stream="missing"), timeout=5)
        subscription = stub.Subscribe(pb.SubscribeRequest(stream="rides"), timeout=30)
        first = next(subscription)
        assert len(first.entries) == 30
        during = scrape(metered)
        subscription.cancel()

    assert value(during, "streamlog_appended_entries_total", stream="rides") == 30
    assert value(during, "streamlog_append_requests_total", stream="rides") == 3
    assert value(during, "streamlog_append_request_bytes_total", stream="rides") > 3000
    assert value(during, "streamlog_read_requests_total", stream="rides", mode="plain") == 1
    assert value(during, "streamlog_read_reply_bytes_total", stream="rides") > 500
    assert value(during, "streamlog_subscriptions_started_total", stream="rides", mode="plain") == 1
    assert value(during, "streamlog_subscribe_replies_total", stream="rides") >= 1
    assert value(during, "streamlog_active_subscriptions") == 1
    # RPC latency per method and code.
    assert value(during, "streamlog_rpc_duration_seconds_count", method="Append", code="OK") == 3
    assert (
        value(during, "streamlog_rpc_duration_seconds_count", method="GetStreamInfo", code="NOT_FOUND") == 1
    )
    # Appends to an fsync=always stream are timed with their fdatasync.
    assert value(during, "streamlog_durable_append_seconds_count") == 3
    assert value(during, "streamlog_durable_append_seconds_sum") > 0
    # Engine state, sampled at scrape time.
    assert value(during, "streamlog_streams") == 1
    assert value(during, "streamlog_entries") == 30
    assert value(during, "streamlog_segments") >= 1 and value(during, "streamlog_bytes_on_disk") > 0
    assert value(during, "streamlog_stream_entries", stream="rides") == 30
    assert value(during, "streamlog_stream_next_offset", stream="rides") == 30
    assert value(during, "streamlog_stream_entries_added_total", stream="rides") == 30


def test_refusals_are_counted_by_limit(metered: ServerThread) -> None:
    with grpc.insecure_channel(metered.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        for name in ("a", "b", "c"):
            append(stub, name, b"x")
        with pytest.raises(grpc.RpcError):
            append(stub, "d", b"x")
    # A refused call is timed once its status is sent (gRPC's abort sends it, then raises): wait
    # for that, not for the client's error.
    samples = scrape_when(
        metered,
        lambda samples: (
            value(samples, "streamlog_rpc_duration_seconds_count", method="Append", code="RESOURCE_EXHAUSTED")
            > 0
        ),
    )
    assert value(samples, "streamlog_refusals_total", kind="limit", reason="max_streams") == 1
    assert (
        value(samples, "streamlog_rpc_duration_seconds_count", method="Append", code="RESOURCE_EXHAUSTED")
        == 1
    )


def test_calls_ended_from_outside_are_counted_with_the_status_they_end_with(metered: ServerThread) -> None:
    calls = metered.server.ops.open_calls
    with grpc.insecure_channel(metered.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        subscription = stub.Subscribe(pb.SubscribeRequest(stream="s"), timeout=30)
        blocked = stub.Read.future(pb.ReadRequest(stream="s", block_ms=9000), timeout=30)
        next(subscription)
        deadline = time.monotonic() + 10
        while metered.call(lambda: len(calls)) != 2:
            assert time.monotonic() < deadline, "the blocking read did not start waiting"
            time.sleep(0.01)
        ended = metered.call(
            lambda: calls.end_where(lambda call: True, grpc.StatusCode.PERMISSION_DENIED, "revoked")
        )
        assert ended == 2
        with pytest.raises(grpc.RpcError) as info:
            next(subscription)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as info:
            blocked.result()
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    samples = scrape(metered)
    for method in ("Subscribe", "Read"):
        labels = {"method": method, "code": "PERMISSION_DENIED"}
        assert value(samples, "streamlog_rpc_duration_seconds_count", **labels) == 1
        assert value(samples, "streamlog_rpc_duration_seconds_count", method=method, code="CANCELLED") == 0


def test_deleted_streams_leave_no_series(metered: ServerThread) -> None:
    with grpc.insecure_channel(metered.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        append(stub, "gone", b"x")
        assert value(scrape(metered), "streamlog_appended_entries_total", stream="gone") == 1
        stub.DeleteStream(pb.DeleteStreamRequest(stream="gone"), timeout=5)
    samples = scrape(metered)
    assert not [key for key in samples if ("stream", "gone") in key[1]]


def test_streams_past_metrics_stream_series_share_one_series_and_a_deleted_one_gives_its_place_back(
    start_server: Callable[..., ServerThread],
) -> None:
    server = start_server(metrics_port=free_port(), metrics_stream_series=2)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        for stream in ("s1", "s2", "s3", "s4"):
            append(stub, stream, b"x")
        samples = scrape(server)
        streams = {
            dict(labels).get("stream")
            for name, labels in samples
            if name == "streamlog_appended_entries_total"
        }
        assert streams == {"s1", "s2", ""}  # the streams past the first two share stream=""
        assert value(samples, "streamlog_appended_entries_total", stream="") == 2  # s3 and s4
        stub.DeleteStream(pb.DeleteStreamRequest(stream="s1"), timeout=5)
        append(stub, "s5", b"x")  # takes the place s1 gave back
        append(stub, "s3", b"x")  # still counted where it began
        samples = scrape(server)
    assert value(samples, "streamlog_appended_entries_total", stream="s5") == 1
    assert value(samples, "streamlog_appended_entries_total", stream="") == 3
    assert value(samples, "streamlog_appended_entries_total", stream="s1") == 0


def test_a_stream_named_like_a_label_keeps_its_series_apart_from_the_streams_past_the_limit(
    start_server: Callable[..., ServerThread],
) -> None:
    server = start_server(metrics_port=free_port(), metrics_stream_series=1)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        append(stub, "(other)", b"x", b"y")  # any UTF-8 is a name: this one has a series of its own
        append(stub, "past", b"x")  # past the limit of 1
        samples = scrape(server)
        assert value(samples, "streamlog_appended_entries_total", stream="(other)") == 2
        assert value(samples, "streamlog_appended_entries_total", stream="") == 1
        stub.DeleteStream(pb.DeleteStreamRequest(stream="(other)"), timeout=5)
        samples = scrape(server)
    # The deleted stream's series is gone; the calls counted past the limit stay.
    assert not [key for key in samples if ("stream", "(other)") in key[1]]
    assert value(samples, "streamlog_appended_entries_total", stream="") == 1


def test_an_append_many_past_metrics_stream_series_counts_without_a_series_lookup_or_step_per_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    steps = {"labels": 0, "inc": 0}
    for cls, name in ((MetricWrapperBase, "labels"), (Counter, "inc")):
        original = getattr(cls, name)

        def counted(self: Any, *args: Any, _original: Any = original, _name: str = name) -> Any:
            steps[_name] += 1
            return _original(self, *args)

        monkeypatch.setattr(cls, name, counted)
    metrics = Metrics(stream_series=2)
    engine = SimpleNamespace(exists=lambda name: name != "gone")  # deleted since it was written
    written = [f"s{i}" for i in range(500)]
    request = pb.AppendManyRequest(
        batches=[pb.AppendRequest(stream=name, payloads=[b"xy"]) for name in [*written, "gone", "refused"]]
    )
    reply = pb.AppendManyResponse(
        results=[pb.AppendManyResult(first_offset=0, last_offset=1) for _ in [*written, "gone"]]
        + [pb.AppendManyResult(error=pb.PublishError(code=8, message="no"))]
    )

    async def served(request: Any, context: Any) -> Any:
        return reply

    measured = MetricsInterceptor(SERVICE.full_name, metrics, lambda: engine).wrap_unary("AppendMany", served)
    seen = []
    for _ in range(2):
        steps.update(labels=0, inc=0)
        asyncio.run(measured(request, SimpleNamespace(code=lambda: None)))
        seen.append(dict(steps))
    # Per call, s0, s1 and stream="" (s2 to s499) are counted once each: three counters, one step
    # each. The first call looks their series up, once each.
    assert seen == [{"labels": 9, "inc": 9}, {"labels": 0, "inc": 9}]
    sample = metrics.registry.get_sample_value
    assert sample("streamlog_append_requests_total", {"stream": ""}) == 2 * 498
    assert sample("streamlog_appended_entries_total", {"stream": ""}) == 2 * 2 * 498
    assert sample("streamlog_appended_entries_total", {"stream": "s0"}) == 2 * 2
    assert (
        sample("streamlog_append_request_bytes_total", {"stream": "s1"}) == 2 * request.batches[1].ByteSize()
    )
    assert sample("streamlog_append_requests_total", {"stream": "gone"}) is None
    assert sample("streamlog_append_requests_total", {"stream": "refused"}) is None


def names_in(samples: Samples) -> set[str]:
    return {value for _, labels in samples for key, value in labels if key in ("stream", "group")}


def test_calls_on_streams_that_do_not_exist_leave_no_series(metered: ServerThread) -> None:
    with grpc.insecure_channel(metered.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        for number in range(20):  # blocking reads of names that do not exist answer empty, OK
            reply = stub.Read(pb.ReadRequest(stream=f"ghost-{number}", block_ms=1), timeout=5)
            assert not reply.entries
        ghost = stub.Subscribe(pb.SubscribeRequest(stream="ghost-subscribed"), timeout=30)
        next(ghost)
        ghost.cancel()
        # A subscription waiting for its stream is counted from the stream's first entries on.
        later = stub.Subscribe(pb.SubscribeRequest(stream="later"), timeout=30)
        assert not next(later).entries
        append(stub, "later", b"x")
        assert len(next(later).entries) == 1
        samples = scrape(metered)
        later.cancel()
    assert names_in(samples) == {"later"}
    assert value(samples, "streamlog_subscriptions_started_total", stream="later", mode="plain") == 1
    assert value(samples, "streamlog_subscribe_replies_total", stream="later") == 1


@pytest.mark.skipif("CreateGroup" not in SERVICE.methods_by_name, reason="this proto has no consumer groups")
def test_deleted_groups_leave_no_series(metered: ServerThread) -> None:
    with grpc.insecure_channel(metered.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        append(stub, "orders", b"o")
        for group in ("billing", "audit"):
            stub.CreateGroup(pb.CreateGroupRequest(stream="orders", group=group), timeout=5)
        stub.Read(pb.ReadRequest(stream="orders", group="audit", consumer="c1"), timeout=5)
        assert {"billing", "audit"} <= names_in(scrape(metered))
        stub.DeleteGroup(pb.DeleteGroupRequest(stream="orders", group="audit"), timeout=5)
    assert names_in(scrape(metered)) == {"orders", "billing"}


@pytest.mark.skipif("CreateGroup" not in SERVICE.methods_by_name, reason="this proto has no consumer groups")
def test_group_lag_pending_and_redeliveries(metered: ServerThread) -> None:
    with grpc.insecure_channel(metered.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        append(stub, "orders", *[b"o"] * 10)
        stub.CreateGroup(pb.CreateGroupRequest(stream="orders", group="billing"), timeout=5)
        before = scrape(metered)
        got = stub.Read(pb.ReadRequest(stream="orders", group="billing", consumer="c1", count=4), timeout=5)
        stub.Ack(pb.AckRequest(stream="orders", group="billing", offsets=[got.entries[0].offset]), timeout=5)
        stub.Nack(
            pb.NackRequest(stream="orders", group="billing", offsets=[got.entries[1].offset]), timeout=5
        )
        stub.Read(pb.ReadRequest(stream="orders", group="billing", consumer="c2", count=1), timeout=5)
        after = scrape(metered)
    key = {"stream": "orders", "group": "billing"}
    assert value(before, "streamlog_group_lag", **key) == 10
    assert value(before, "streamlog_group_pending", **key) == 0
    assert value(after, "streamlog_group_lag", **key) == 6
    assert value(after, "streamlog_group_pending", **key) == 3  # 4 read, 1 acked; the nacked one redelivered
    assert value(after, "streamlog_group_delivered_total", **key) == 4
    assert value(after, "streamlog_group_redelivered_total", **key) == 1
    assert value(after, "streamlog_group_acked_total", **key) == 1
    assert value(after, "streamlog_group_consumers", **key) == 2
    assert value(after, "streamlog_group_dead_lettered_total", **key) == 0
    assert value(after, "streamlog_read_requests_total", stream="orders", mode="group") == 2


def test_metrics_listen_on_the_loopback_whatever_the_server_host(
    start_server: Callable[..., ServerThread],
) -> None:
    assert Settings().metrics_host == "127.0.0.1"
    server = start_server(host="127.0.0.2", metrics_port=free_port())  # the gRPC port elsewhere
    assert server.server.ops.metrics_server.host == "127.0.0.1"
    assert value(scrape(server), "streamlog_ready") == 1


METRICS_TOKENS = {"prometheus": "prometheus-token-0123456789", "reader": "reader-token-0123456789"}
METRICS_ACL = """
[[rules]]  # sees every stream and group, reads no entry (read on groups: GetGroupInfo, GetPending)
principals = ["prometheus"]
streams = ["*"]
groups = ["*"]
permissions = ["read"]

[[rules]]
principals = ["reader"]
streams = ["a*"]
permissions = ["read"]
"""


def test_with_authorization_on_only_token_holders_see_names_and_only_theirs(
    start_server: Callable[..., ServerThread], tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(
        "".join(f'[[tokens]]\nprincipal = "{p}"\ntoken = "{t}"\n' for p, t in METRICS_TOKENS.items())
    )
    rules = tmp_path / "acl.toml"
    rules.write_text(METRICS_ACL)
    server = start_server(metrics_port=free_port(), tokens_file=str(tokens), acl_file=str(rules))
    engine = server.server.engine
    engine.append("alpha", AppendBatch([b"a"]))
    engine.append("beta", AppendBatch([b"b"]))
    engine.create_group("beta", "billing")

    anonymous = scrape(server)
    assert names_in(anonymous) == set()
    assert value(anonymous, "streamlog_streams") == 2 and value(anonymous, "streamlog_ready") == 1
    assert names_in(scrape(server, METRICS_TOKENS["reader"])) == {"alpha"}
    assert names_in(scrape(server, METRICS_TOKENS["prometheus"])) == {"alpha", "beta", "billing"}
    # A scrape may name the metrics it wants.
    with grpc.insecure_channel(server.target) as channel, pytest.raises(grpc.RpcError):
        pb_grpc.StreamLogServiceStub(channel).GetStreamInfo(
            pb.GetStreamInfoRequest(stream="alpha"), timeout=5
        )
    named = scrape(server, METRICS_TOKENS["reader"], "?name[]=streamlog_refusals_total")
    assert value(named, "streamlog_refusals_total", kind="auth", reason="missing") == 1
    assert {key[0] for key in named} <= {"streamlog_refusals_total", "streamlog_refusals_created"}
    with pytest.raises(urllib.error.HTTPError) as info:
        scrape(server, "not-a-known-token-at-all")
    assert info.value.code == 401 and info.value.headers["WWW-Authenticate"].startswith("Bearer")


def test_no_metrics_port_means_no_endpoint(server: ServerThread) -> None:
    assert server.server.ops.metrics is None and server.server.ops.metrics_server is None


def test_event_loop_lag_is_measured_at_each_scrape(metered: ServerThread) -> None:
    idle = value(scrape(metered), "streamlog_event_loop_lag_seconds")
    assert 0 < idle < 1
    blocked = threading.Event()

    def block_the_loop() -> None:
        blocked.set()
        time.sleep(0.3)  # a handler that forgot to await: the loop can run nothing else

    metered.loop.call_soon_threadsafe(block_the_loop)
    assert blocked.wait(5)
    assert value(scrape(metered), "streamlog_event_loop_lag_seconds") >= 0.1


def test_fsync_latency_histogram_counts_the_syncs_of_always_appends(metered: ServerThread) -> None:
    before = value(scrape(metered), "streamlog_fsync_seconds_count")
    with grpc.insecure_channel(metered.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        for _ in range(5):
            append(stub, "synced", b"x")  # fsync=always: each append waits for a sync
    after = scrape(metered)
    assert value(after, "streamlog_fsync_seconds_count") >= before + 5
    assert value(after, "streamlog_fsync_seconds_sum") > 0
    assert value(after, "streamlog_fsync_seconds_bucket", le="+Inf") == value(
        after, "streamlog_fsync_seconds_count"
    )


def test_totals_cover_streams_the_cache_closed(start_server: Callable[..., ServerThread]) -> None:
    """A scrape opens no stream, yet the totals count every stream (closed ones as of their close)."""
    server = start_server(metrics_port=free_port(), max_open_streams=2)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        for i in range(6):
            stub.Append(pb.AppendRequest(stream=f"room-{i}", payloads=[b"x"] * (i + 1)), timeout=5)
    samples = scrape(server)
    assert value(samples, "streamlog_open_streams") == 2
    assert (value(samples, "streamlog_streams"), value(samples, "streamlog_entries")) == (6, 21)
    assert value(samples, "streamlog_segments") == 6
    # The engine's per-stream series are the open streams' only: no stream was opened for the scrape.
    assert {dict(labels)["stream"] for name, labels in samples if name == "streamlog_stream_entries"} == {
        "room-4",
        "room-5",
    }


@pytest.mark.parametrize("small_streams", ["off", "slots"])
def test_streams_waiting_for_the_rounds_sync_are_gauges_that_fall_to_zero_once_synced(
    start_server: Callable[..., ServerThread], monkeypatch: pytest.MonkeyPatch, small_streams: str
) -> None:
    """Under everysec the streams the cache closes, and the open ones written, wait for the
    maintenance round's sync: the gauges count them (bench.streams waits for 0 before it times
    calls to closed streams). A stream in a slot hands its close nothing to sync (its pack's
    pages are the round's anyway)."""
    server = start_server(metrics_port=free_port(), max_open_streams=2, small_streams=small_streams)
    engine = server.server.engine
    rounds = threading.Event()
    monkeypatch.setattr(engine, "maintain", rounds.set)  # the rounds do nothing from now on
    assert rounds.wait(30)  # the loop has come to one: no real round is under way any more
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        for i in range(6):
            stub.Append(pb.AppendRequest(stream=f"room-{i}", payloads=[b"x"]), timeout=5)
    samples = scrape(server)
    closed = 4 if small_streams == "off" else 0  # 6 streams, 2 open
    assert value(samples, "streamlog_closes_waiting") == closed
    assert value(samples, "streamlog_open_streams_unsynced") == 2  # written, created, not synced
    engine.sync()  # finishes them as a round would, and syncs the open ones
    samples = scrape(server)
    assert (
        value(samples, "streamlog_closes_waiting") == value(samples, "streamlog_open_streams_unsynced") == 0
    )


@pytest.mark.parametrize("small_streams", ["off", "slots"])
def test_entries_count_every_stream_after_a_kill_9_and_a_clean_restart(
    tmp_path: Path, small_streams: str
) -> None:
    """Issue 17's case: streams loaded through AppendMany, the server killed -9. With directory
    streams the restarted server counts at once the entries of every stream the cache closed
    (their closes were journaled); streams in slots journal no close, so theirs count once
    maintenance has read them from their slots; the few open at the crash once it has recovered
    them. A clean restart after that counts them all at once."""
    streams, cache = 400, 4
    counts = {f"room-{i:03d}": 1 + i % 3 for i in range(streams)}
    total = sum(counts.values())
    processes: list[tuple[ServerProcess, int]] = []

    def start() -> tuple[ServerProcess, int]:
        port = free_port()
        env = {
            "STREAMLOG_METRICS_PORT": str(port),
            "STREAMLOG_MAX_OPEN_STREAMS": str(cache),
            "STREAMLOG_SMALL_STREAMS": small_streams,
        }
        server = ServerProcess("--data", str(tmp_path / "data"), "--port", "0", env=env)
        processes.append((server, port))
        return server.wait_ready(), port

    try:
        server, port = start()
        batches = [pb.AppendRequest(stream=name, payloads=[b"x"] * n) for name, n in counts.items()]
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.StreamLogServiceStub(channel)
            for first in range(0, streams, 100):
                stub.AppendMany(pb.AppendManyRequest(batches=batches[first : first + 100]), timeout=30)
        assert value(scrape_port(port), "streamlog_entries") == total
        server.kill()  # SIGKILL

        server, port = start()
        # At most the `cache` streams open at the crash (3 entries at most each) wait for recovery.
        counted_at_once = total - 3 * cache if small_streams == "off" else 0
        assert counted_at_once <= value(scrape_port(port), "streamlog_entries") <= total
        scrape_when(port, lambda samples: value(samples, "streamlog_entries") == total, timeout_s=60)
        server.process.send_signal(signal.SIGTERM)
        assert server.finish()[0] == 0

        server, port = start()
        assert value(scrape_port(port), "streamlog_entries") == total
    finally:
        for process, _ in processes:
            process.kill()
