"""Limits across calls (service/limits.py) and gRPC connection limits: each one hit, and answered
RESOURCE_EXHAUSTED with the limit's name and value (the request-size limits are in test_bad_input)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from service import limits, opencalls
from service.server import SERVICE
from storage import AppendBatch, Engine, EngineConfig, GroupReadOptions
from tests.service.helpers import ServerThread, append, small_settings

EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
HAS_GROUPS = "CreateGroup" in SERVICE.methods_by_name
needs_groups = pytest.mark.skipif(not HAS_GROUPS, reason="this proto has no consumer groups")


def refused(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def own_connection(target: str, **options: object) -> grpc.Channel:
    """A channel with its own TCP connection (channels otherwise share one per target)."""
    return grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1), *options.items()])


def test_max_streams(start_server: Callable[..., ServerThread]) -> None:
    server = start_server(max_streams=3)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        for name in ("a", "b", "c"):
            append(stub, name, b"x")
        error = refused(lambda: append(stub, "d", b"x"))
        assert error.code() == EXHAUSTED and "max_streams=3" in error.details()
        append(stub, "a", b"more")  # existing streams take appends as before
        stub.DeleteStream(pb.DeleteStreamRequest(stream="c"), timeout=5)
        # The count is refreshed at most once a second; a freed slot is usable once it is.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                append(stub, "d", b"x")
                break
            except grpc.RpcError as exc:
                assert exc.code() == EXHAUSTED
                time.sleep(0.2)
        else:
            pytest.fail("a deleted stream did not free its slot")


def test_max_subscriptions_per_connection(start_server: Callable[..., ServerThread]) -> None:
    server = start_server(max_subscriptions_per_connection=2)
    with own_connection(server.target) as first, own_connection(server.target) as second:
        stub = pb_grpc.StreamLogServiceStub(first)
        calls = [stub.Subscribe(pb.SubscribeRequest(stream=f"s{i}"), timeout=30) for i in range(2)]
        for subscription in calls:
            next(subscription)  # the first reply: the subscription is open
        error = refused(lambda: next(stub.Subscribe(pb.SubscribeRequest(stream="s9"), timeout=30)))
        assert error.code() == EXHAUSTED and "max_subscriptions_per_connection=2" in error.details()
        # Another connection has its own allowance.
        other = pb_grpc.StreamLogServiceStub(second).Subscribe(pb.SubscribeRequest(stream="s9"), timeout=30)
        next(other)
        other.cancel()
        # A subscription that ends frees its place on the connection.
        calls[0].cancel()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            again = stub.Subscribe(pb.SubscribeRequest(stream="s9"), timeout=30)
            try:
                next(again)
                again.cancel()
                break
            except grpc.RpcError as exc:
                assert exc.code() == EXHAUSTED
                time.sleep(0.05)
        else:
            pytest.fail("the cancelled subscription kept its place")
        calls[1].cancel()


def test_max_blocked_reads(start_server: Callable[..., ServerThread]) -> None:
    server = start_server(max_blocked_reads=1)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        append(stub, "t", b"t0")
        waiting = stub.Read.future(pb.ReadRequest(stream="s", offset=0, block_ms=5_000), timeout=10)
        deadline = time.monotonic() + 5
        while server.call(lambda: server.server.ops.limits.blocked_reads) < 1:
            assert time.monotonic() < deadline, "the blocking read never started waiting"
            time.sleep(0.01)
        error = refused(lambda: stub.Read(pb.ReadRequest(stream="s", offset=0, block_ms=100), timeout=5))
        assert error.code() == EXHAUSTED and "max_blocked_reads=1" in error.details()
        # Reads that do not block are not counted.
        assert [e.payload for e in stub.Read(pb.ReadRequest(stream="t", offset=0), timeout=5).entries] == [
            b"t0"
        ]
        append(stub, "s", b"wake")
        assert [e.payload for e in waiting.result(timeout=5).entries] == [b"wake"]


def test_a_subscriber_that_stops_reading_is_cut_off(start_server: Callable[..., ServerThread]) -> None:
    server = start_server(subscriber_send_timeout_ms=300)
    with own_connection(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        subscription = stub.Subscribe(pb.SubscribeRequest(stream="s"), timeout=60)
        next(subscription)
        # ~8 MiB of replies: far more than the connection's flow-control windows and socket buffers.
        payload = b"p" * 4000
        for _ in range(130):
            append(stub, "s", *[payload] * 16)
        deadline = time.monotonic() + 15
        while server.call(lambda: server.server.ops.send_timeout.cut_off) == 0:
            assert time.monotonic() < deadline, "the stalled subscriber was not cut off"
            time.sleep(0.05)
        servicer = server.server.servicer
        # The subscription has ended on the server (no reads, no slot), with the client still not
        # reading; gRPC keeps the unsent reply, still counted in the reply budget, until it is taken.
        while server.call(lambda: (servicer.subscriptions, len(server.server.ops.open_calls))) != (0, 0):
            assert time.monotonic() < deadline, "the cut-off subscription is still open on the server"
            time.sleep(0.05)
        assert server.call(lambda: servicer.replies.queued) > 0
        received = 0
        with pytest.raises(grpc.RpcError) as info:
            for reply in subscription:  # what was sent before the cut arrives, then the status
                received += len(reply.entries)
        assert info.value.code() == EXHAUSTED
        assert "subscriber_send_timeout_ms=300" in info.value.details()
        assert "resubscribe" in info.value.details()
        assert 0 < received < 130 * 16
        # The call is over: what it held is given back.
        while server.call(lambda: servicer.replies.queued) != 0:
            assert time.monotonic() < deadline, "the ended call's reply is still counted"
            time.sleep(0.05)


def test_a_compressed_message_is_limited_by_its_decompressed_size(stub: pb_grpc.StreamLogServiceStub) -> None:
    # 1.6 MB of zeros gzip to a few KB: the 1 MiB max_message_bytes applies to what it expands to.
    request = pb.AppendRequest(stream="s", payloads=[bytes(4000)] * 400)
    error = refused(lambda: stub.Append(request, compression=grpc.Compression.Gzip, timeout=5))
    assert error.code() == EXHAUSTED and "larger than max" in error.details()
    small = pb.AppendRequest(stream="s", payloads=[bytes(4000)] * 10)
    assert stub.Append(small, compression=grpc.Compression.Gzip, timeout=5).last_offset == 9


def test_keepalive_enforcement_closes_connections_that_ping_too_often(
    start_server: Callable[..., ServerThread],
) -> None:
    server = start_server(min_client_ping_interval_ms=5_000)
    # A client pinging every 200 ms, also when no data flows (a subscription waiting for appends).
    pings = {
        "grpc.keepalive_time_ms": 200,
        "grpc.keepalive_permit_without_calls": 1,
        "grpc.http2.max_pings_without_data": 0,
    }
    with own_connection(server.target, **pings) as channel:
        started = time.monotonic()
        subscription = pb_grpc.StreamLogServiceStub(channel).Subscribe(
            pb.SubscribeRequest(stream="s"), timeout=20
        )
        with pytest.raises(grpc.RpcError) as info:
            for _ in subscription:
                pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "too many pings" in info.value.details().lower()
        assert time.monotonic() - started < 15


# ---------------------------------------------------------------------------- consumer groups


@needs_groups
def test_max_groups_per_stream(start_server: Callable[..., ServerThread]) -> None:
    server = start_server(max_groups_per_stream=2)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        append(stub, "s", b"x")
        for group in ("g1", "g2"):
            stub.CreateGroup(pb.CreateGroupRequest(stream="s", group=group), timeout=5)
        error = refused(lambda: stub.CreateGroup(pb.CreateGroupRequest(stream="s", group="g3"), timeout=5))
        assert error.code() == EXHAUSTED and "max_groups_per_stream=2" in error.details()
        # An existing name still gets its usual answer, not the limit.
        error = refused(lambda: stub.CreateGroup(pb.CreateGroupRequest(stream="s", group="g1"), timeout=5))
        assert error.code() == grpc.StatusCode.ALREADY_EXISTS


@needs_groups
def test_max_consumers_per_group(start_server: Callable[..., ServerThread]) -> None:
    server = start_server(max_consumers_per_group=2)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        append(stub, "s", *[b"x"] * 10)
        stub.CreateGroup(pb.CreateGroupRequest(stream="s", group="g"), timeout=5)

        def read(consumer: str) -> pb.ReadResponse:
            return stub.Read(pb.ReadRequest(stream="s", group="g", consumer=consumer, count=1), timeout=5)

        read("c1")
        read("c2")
        error = refused(lambda: read("c3"))
        assert error.code() == EXHAUSTED and "max_consumers_per_group=2" in error.details()
        claim = pb.ClaimRequest(stream="s", group="g", consumer="c3", offsets=[0])
        assert refused(lambda: stub.Claim(claim, timeout=5)).code() == EXHAUSTED
        read("c1")  # known consumers go on
        stub.DeleteConsumer(pb.DeleteConsumerRequest(stream="s", group="g", consumer="c2"), timeout=5)
        read("c3")


@needs_groups
def test_max_pending_per_group_bounds_group_configs(start_server: Callable[..., ServerThread]) -> None:
    server = start_server(max_pending_per_group=5)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        append(stub, "s", *[b"x"] * 20)
        created = stub.CreateGroup(pb.CreateGroupRequest(stream="s", group="g"), timeout=5)
        assert created.group.config.max_pending == 5
        too_many = pb.CreateGroupRequest(stream="s", group="h", config=pb.GroupConfig(max_pending=6))
        error = refused(lambda: stub.CreateGroup(too_many, timeout=5))
        assert error.code() == EXHAUSTED and "max_pending_per_group=5" in error.details()
        error = refused(
            lambda: stub.SetGroupConfig(
                pb.SetGroupConfigRequest(stream="s", group="g", config=pb.GroupConfig(max_pending=100)),
                timeout=5,
            )
        )
        assert error.code() == EXHAUSTED
        # The bound holds: a consumer that never acknowledges gets 5 entries, then no new ones.
        got = stub.Read(pb.ReadRequest(stream="s", group="g", consumer="c", count=20), timeout=5)
        assert len(got.entries) == 5
        assert not stub.Read(pb.ReadRequest(stream="s", group="g", consumer="c", count=20), timeout=5).entries


def test_limits_are_reported_by_name_in_the_log(
    start_server: Callable[..., ServerThread], caplog: pytest.LogCaptureFixture
) -> None:
    server = start_server(max_streams=1)
    with grpc.insecure_channel(server.target) as channel, caplog.at_level("INFO", logger="service.limits"):
        stub = pb_grpc.StreamLogServiceStub(channel)
        append(stub, "a", b"x")
        refused(lambda: append(stub, "b", b"x"))
    records = [r for r in caplog.records if r.name == "service.limits"]
    assert len(records) == 1
    record = records[0]
    assert (record.limit, record.stream, record.method) == ("max_streams", "b", "Append")  # type: ignore[attr-defined]
    assert record.peer.startswith("ipv4:127.0.0.1:")  # type: ignore[attr-defined]


def test_concurrent_new_streams_do_not_pass_max_streams(start_server: Callable[..., ServerThread]) -> None:
    server = start_server(max_streams=5, fsync="always", append_threads=4)
    results: list[grpc.StatusCode] = []
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)

        def create(name: str) -> None:
            try:
                append(stub, name, b"x")
                results.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                results.append(exc.code())

        threads = [threading.Thread(target=create, args=(f"n{i}",)) for i in range(12)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
    assert results.count(grpc.StatusCode.OK) == 5 and results.count(EXHAUSTED) == 7
    assert len(server.server.engine.list_streams()) == 5


class _Aborted(Exception):
    pass


class _Context:
    """What the limits' Append wrapper asks of a call's context (it refuses with `abort`)."""

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise _Aborted(code, details)


def test_streams_still_being_created_count_across_a_refresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Appends to new streams in flight (fsync=always runs them in threads) are counted even when
    the cached stream count is refreshed before the engine shows their streams; one that fails
    gives its slot back, one still in flight does not."""
    clock = [0.0]
    monkeypatch.setattr(limits.time, "monotonic", lambda: clock[0])
    engine = Engine(tmp_path / "data")
    try:
        engine.append("existing", AppendBatch([b"x"]))
        guard = limits.LimitsInterceptor(
            SERVICE.full_name, small_settings(tmp_path, max_streams=3), lambda: engine
        )

        async def scenario() -> list[str]:
            # Each Append stays in flight, without writing, until its gate opens; then it fails.
            gates = {name: asyncio.Event() for name in ("a", "b", "c")}

            async def append(request: pb.AppendRequest, context: object) -> None:
                await gates[request.stream].wait()
                raise RuntimeError("the append failed")

            limited = guard.wrap_unary("Append", append)

            async def call(name: str) -> str:
                clock[0] += 5  # every check refreshes the count from the engine
                try:
                    await limited(pb.AppendRequest(stream=name, payloads=[b"x"]), _Context())
                except _Aborted as exc:
                    return exc.args[1]
                except RuntimeError:
                    return "failed"
                return "ok"

            # "a" and "b" pass and stay in flight: "c" would be the fourth stream.
            a = asyncio.create_task(call("a"))
            b = asyncio.create_task(call("b"))
            await asyncio.sleep(0)
            outcomes = [await call("c")]
            gates["a"].set()  # "a" fails: its slot comes back
            outcomes.append(await a)
            c = asyncio.create_task(call("c"))  # now passes, and stays in flight
            await asyncio.sleep(0)
            outcomes.append(await call("d"))  # "b" and "c" still count
            gates["b"].set()
            gates["c"].set()
            outcomes += [await b, await c]
            return outcomes

        refused_c, a, refused_d, b, c = asyncio.run(scenario())
        assert "max_streams=3" in refused_c and "max_streams=3" in refused_d
        assert (a, b, c) == ("failed", "failed", "failed")
    finally:
        engine.close()


def _register_timing(engine: Engine, guard: limits.LimitsInterceptor, group: str, names: list[str]) -> float:
    """Seconds the limit check of a group read takes for each new consumer name (the best of 3 runs)."""

    async def check_all(batch: list[str]) -> None:
        for name in batch:
            await guard.check("Read", pb.ReadRequest(stream="s", group=group, consumer=name), engine)

    best = float("inf")
    for run in range(3):
        batch = [f"{name}-{run}" for name in names]
        started = time.perf_counter()
        asyncio.run(check_all(batch))
        best = min(best, (time.perf_counter() - started) / len(batch))
    return best


@needs_groups
def test_registering_a_consumer_costs_the_same_in_a_group_of_10_000(tmp_path: Path) -> None:
    """Issue 13: the check of max_consumers_per_group once listed every consumer of the group for each
    new name (27 ms on the event loop at 10,000 consumers). Compared at 100 and 10,000 consumers,
    with a generous factor: the listing made it about 100 times slower."""
    engine = Engine(tmp_path / "data", EngineConfig(fsync="no"))
    try:
        engine.append("s", AppendBatch([b"x"]))
        for group, size in (("small", 100), ("big", 10_000)):
            engine.create_group("s", group)
            for i in range(size):
                engine.read_group("s", group, GroupReadOptions(f"c{i}", 0))
        settings = small_settings(tmp_path, max_consumers_per_group=20_000)
        guard = limits.LimitsInterceptor(SERVICE.full_name, settings, lambda: engine)
        names = [f"new{i}" for i in range(30)]
        small = _register_timing(engine, guard, "small", names)
        big = _register_timing(engine, guard, "big", names)
        assert big < 10 * small + 0.0005, (small, big)
        # The 10,001st consumer registers, and the limit still counts every consumer.
        assert engine.read_group("s", "big", GroupReadOptions("new0-0", 1)).offsets == [0]
        assert len(engine.group_info("s", "big").consumers) == 10_001
        full = limits.LimitsInterceptor(
            SERVICE.full_name, small_settings(tmp_path, max_consumers_per_group=10_001), lambda: engine
        )
        request = pb.ReadRequest(stream="s", group="big", consumer="one-more")
        with pytest.raises(limits.LimitError, match="max_consumers_per_group=10001"):
            asyncio.run(full.check("Read", request, engine))
        known = pb.ReadRequest(stream="s", group="big", consumer="c7")
        assert asyncio.run(full.check("Read", known, engine)) is known
    finally:
        engine.close()


class _SlowContext:
    """A call's context whose writes each take `write_s` (a client taking replies slowly), or
    never complete once `stalled` is set."""

    def __init__(self, write_s: float) -> None:
        self.write_s = write_s
        self.stalled = False
        self.written = 0
        self.code: grpc.StatusCode | None = None

    async def write(self, reply: object) -> None:
        if self.stalled:
            await asyncio.Event().wait()
        await asyncio.sleep(self.write_s)
        self.written += 1

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"


def test_the_send_timeout_watches_a_call_with_one_timer_not_one_per_reply() -> None:
    """Issue 18: a timeout context per reply scheduled and cancelled a timer for every Publish
    answer and Subscribe reply (a third of a Publish message's Python calls). One timer per call
    now: a client taking every reply at once is not cut off, however long the call lasts (its
    timer, fired while a later send waits, is set again for that send); one that stops taking
    them is, once its stalled reply has waited the time-out. (A 2 s time-out against sends of
    20 ms: margins a loaded machine keeps.)"""
    timeout = limits.SendTimeout(timeout_ms=2000)

    async def serve() -> tuple[_SlowContext, int, int, float]:
        loop = asyncio.get_running_loop()
        context = _SlowContext(write_s=0.02)
        call = opencalls.OpenCall("Subscribe", pb.SubscribeRequest(stream="s"), context)
        scheduled = 0
        call_at = loop.call_at

        def counted(when: float, callback: Any, *args: Any, **kwargs: Any) -> asyncio.TimerHandle:
            nonlocal scheduled
            if getattr(callback, "__self__", None) is timeout:
                scheduled += 1
            return call_at(when, callback, *args, **kwargs)

        loop.call_at = counted  # type: ignore[method-assign]
        sends = 0
        try:
            until = time.monotonic() + 2.5  # past the time-out: its timer fires during a send
            while time.monotonic() < until:
                await timeout.send(call, b"reply")
                sends += 1
        finally:
            loop.call_at = call_at  # type: ignore[method-assign]
        context.stalled = True
        started = time.monotonic()
        with call.interruptible():
            await timeout.send(call, b"stuck")
        return context, sends, scheduled, time.monotonic() - started

    context, sends, scheduled, stalled_for = asyncio.run(serve())
    assert context.written == sends > 10
    assert scheduled <= 3, (scheduled, sends)  # set at the first send, and again when it fired
    assert context.code == EXHAUSTED and timeout.cut_off == 1
    assert 1.9 <= stalled_for < 30, stalled_for


def test_a_long_publish_session_refreshes_the_stream_count_without_visiting_every_stream_it_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Publish session may create a stream with each message and last for 100,000 of them: a
    refresh of the count visits the streams still being created, not all the session ever made
    (it did, once a second: a third of the server's time in a load of 20,000 streams)."""
    clock = [0.0]
    monkeypatch.setattr(limits.time, "monotonic", lambda: clock[0])
    engine = Engine(tmp_path / "data")
    try:
        guard = limits.LimitsInterceptor(
            SERVICE.full_name, small_settings(tmp_path, max_streams=10_000), lambda: engine
        )
        visits = [0]
        exists = engine.exists

        def counted(name: str) -> bool:
            visits[0] += 1
            return exists(name)

        monkeypatch.setattr(engine, "exists", counted)
        creating: set[str] = set()
        check = guard._creation_check("Publish", _Context(), creating)  # type: ignore[arg-type]
        messages = 400
        for i in range(messages):
            assert check(pb.PublishRequest(stream=f"s{i}", payloads=[b"x"])) is None
            engine.append(f"s{i}", AppendBatch([b"x"]))  # its write completes
            if i % 10 == 9:
                clock[0] += 5  # the next check refreshes the count
        assert visits[0] <= 3 * messages  # each name: its own check, and one refresh at most
        assert check(pb.PublishRequest(stream="one-more", payloads=[b"x"])) is None
        clock[0] += 5
        assert guard._count_streams(engine) == messages + 1  # "one-more": in flight, counted
    finally:
        engine.close()
