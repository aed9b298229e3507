"""AppendMany: batches for many streams in one call, end to end against real servers.

Each batch is atomic on its own and gets its own result, in request order; a batch that
fails (bad input, a limit, a refused permission) does not fail the others.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from bench.common import free_port
from service import auth
from service.appendmany import ON_LOOP_SLICE, check_request
from service.config import Settings
from service.errors import ServiceError
from tests.cluster.nodes import eventually
from tests.service.helpers import ServerThread
from tests.service.test_auth import ACL_TOML, TOKENS_TOML, bearer, write
from tests.service.test_metrics import scrape, value

TIMEOUT = 20
PERMISSION_DENIED = grpc.StatusCode.PERMISSION_DENIED.value[0]
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]


def batch(stream: str, *payloads: bytes, **fields: Any) -> pb.AppendRequest:
    return pb.AppendRequest(stream=stream, payloads=list(payloads), **fields)


def append_many(
    server: ServerThread, batches: list[pb.AppendRequest], metadata: tuple[tuple[str, str], ...] = ()
) -> list[pb.AppendManyResult]:
    with grpc.insecure_channel(server.target) as channel:
        reply = pb_grpc.StreamLogServiceStub(channel).AppendMany(
            pb.AppendManyRequest(batches=batches), timeout=TIMEOUT, metadata=metadata
        )
    return list(reply.results)


def offsets(results: list[pb.AppendManyResult]) -> list[tuple[int, int]]:
    return [(r.first_offset, r.last_offset) for r in results]


def payloads(server: ServerThread, stream: str) -> list[bytes]:
    return [e.payload for e in server.server.engine.read(stream, 0, 1000).entries()]


def test_results_come_in_request_order_and_batches_of_a_stream_in_order(start_server):
    server = start_server()
    batches = [
        batch("a", b"a0", b"a1"),
        batch("b", b"b0"),
        pb.AppendRequest(stream="a", entries=[pb.Entry(payload=b"a2", tag="t")]),
        batch("c", *[b"c"] * 5),
        batch("b", b"b1", b"b2"),
    ]
    results = append_many(server, batches)
    assert not any(r.HasField("error") for r in results)
    assert offsets(results) == [(0, 1), (0, 0), (2, 2), (0, 4), (1, 2)]
    assert results[0].timestamp_ms > 0
    assert payloads(server, "a") == [b"a0", b"a1", b"a2"]
    assert payloads(server, "b") == [b"b0", b"b1", b"b2"]
    assert server.server.engine.read("a", 2, 1).entries()[0].tag == "t"


def test_a_bad_batch_gets_its_error_and_writes_nothing_while_the_others_are_written(start_server):
    server = start_server(fsync="always")  # written in the thread pool: the same outcomes
    limit = server.settings.max_batch_entries
    batches = [
        batch("s", b"ok"),
        batch("", b"x"),  # no stream name
        pb.AppendRequest(stream="s"),  # no entries
        batch("s", *[b"x"] * (limit + 1)),  # past max_batch_entries: none of it written
        batch("s", b"y" * (server.settings.max_entry_bytes + 1)),
        batch("s", b"z", producer_id="p", producer_sequence=-1),
        batch("t", b"t0"),
    ]
    results = append_many(server, batches)
    codes = [r.error.code for r in results]
    bad_name = no_entries = bad_sequence = INVALID_ARGUMENT
    assert codes == [0, bad_name, no_entries, RESOURCE_EXHAUSTED, RESOURCE_EXHAUSTED, bad_sequence, 0]
    assert "max_batch_entries" in results[3].error.message
    assert "max_entry_bytes" in results[4].error.message
    assert offsets([results[0], results[6]]) == [(0, 0), (0, 0)]
    assert payloads(server, "s") == [b"ok"]  # each refused batch wrote nothing of itself


def test_per_batch_options_idempotence_and_conditions(start_server):
    server = start_server()
    first = append_many(
        server,
        [
            batch("s", b"a", producer_id="p", producer_sequence=1),
            batch("s", b"b", expected_next_offset=1),
            batch("s", b"c", expected_next_offset=7),  # wrong: refused, the others go on
            batch("new", b"n", expected_next_offset=0),
        ],
    )
    assert [r.error.code for r in first] == [0, 0, FAILED_PRECONDITION, 0]
    assert "2" in first[2].error.message  # the stream's actual next offset
    again = append_many(server, [batch("s", b"a", producer_id="p", producer_sequence=1), batch("s", b"d")])
    assert again[0].duplicate and (again[0].first_offset, again[0].last_offset) == (0, 0)
    assert offsets(again[1:]) == [(2, 2)]
    assert payloads(server, "s") == [b"a", b"b", b"d"]
    assert payloads(server, "new") == [b"n"]


def test_a_malformed_request_or_one_past_its_bounds_is_refused_whole(start_server):
    server = start_server(max_append_many_batches=3, max_append_many_bytes=1000)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        cases = [
            ([], grpc.StatusCode.INVALID_ARGUMENT, "at least one batch"),
            ([batch("s", b"x")] * 4, grpc.StatusCode.RESOURCE_EXHAUSTED, "max_append_many_batches=3"),
            ([batch("s", b"x" * 1000)], grpc.StatusCode.RESOURCE_EXHAUSTED, "max_append_many_bytes=1000"),
        ]
        for batches, code, text in cases:
            with pytest.raises(grpc.RpcError) as info:
                stub.AppendMany(pb.AppendManyRequest(batches=batches), timeout=TIMEOUT)
            assert info.value.code() == code
            assert text in info.value.details()
    assert not server.server.engine.exists("s")


def test_each_batch_needs_write_on_its_stream(start_server, tmp_path: Path):
    server = start_server(
        tokens_file=write(tmp_path / "tokens.toml", TOKENS_TOML),
        acl_file=write(tmp_path / "acl.toml", ACL_TOML),
    )
    batches = [batch("s1", b"a"), batch("x", b"b"), batch("s2", b"c")]
    results = append_many(server, batches, bearer("writer"))  # may write s*, not x
    assert [r.error.code for r in results] == [0, PERMISSION_DENIED, 0]
    assert "may not AppendMany on stream 'x'" in results[1].error.message
    assert not server.server.engine.exists("x")
    refused = append_many(server, batches, bearer("reader"))  # may write nowhere
    assert {r.error.code for r in refused} == {PERMISSION_DENIED}
    with pytest.raises(grpc.RpcError) as info:
        append_many(server, batches)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert auth.METHOD_ACCESS["AppendMany"].permission == auth.WRITE


def test_written_batches_count_as_appends_and_max_streams_refuses_a_batch_only(start_server):
    server = start_server(metrics_port=free_port(), max_streams=1)
    results = append_many(server, [batch("s", b"a"), batch("s", b"bc", b"d"), batch("new", b"x")])
    assert results[2].error.code == RESOURCE_EXHAUSTED  # max_streams, this one only
    assert "max_streams" in results[2].error.message
    assert offsets(results[:2]) == [(0, 0), (1, 2)]
    samples = scrape(server)
    assert value(samples, "streamlog_append_requests_total", stream="s") == 2
    assert value(samples, "streamlog_appended_entries_total", stream="s") == 3
    assert value(samples, "streamlog_refusals_total", kind="limit", reason="max_streams") == 1
    assert value(samples, "streamlog_rpc_duration_seconds_count", method="AppendMany", code="OK") == 1


def test_appends_wake_blocked_readers_of_every_stream(start_server):
    server = start_server()
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        reads = [
            stub.Read.future(pb.ReadRequest(stream=name, offset=0, block_ms=10_000), timeout=TIMEOUT)
            for name in ("r1", "r2")
        ]
        # Both reads are waiting once the server counts them (no sleep: bounded by the deadline).
        waiters = server.server._servicer._serving.waiters
        eventually(lambda: server.call(waiters.count) >= 2)
        stub.AppendMany(pb.AppendManyRequest(batches=[batch("r1", b"1"), batch("r2", b"2")]), timeout=TIMEOUT)
        assert [[e.payload for e in r.result().entries] for r in reads] == [[b"1"], [b"2"]]


def test_a_call_creating_many_streams_leaves_the_loop_to_other_calls(start_server, monkeypatch):
    """While a large AppendMany of new streams is being written (held here in its first creation,
    in a slot or a directory, as a busy disk would), the server answers Health and an Append to an
    open stream."""
    server = start_server()
    engine = server.server.engine
    creating, release = threading.Event(), threading.Event()
    create = engine._create

    def slow_create(*args: Any) -> Any:
        creating.set()
        release.wait(TIMEOUT)
        return create(*args)

    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        stub.Append(batch("open", b"first"), timeout=TIMEOUT)
        monkeypatch.setattr(engine, "_create", slow_create)
        large = stub.AppendMany.future(
            pb.AppendManyRequest(batches=[batch(f"new-{i}", b"x") for i in range(20)]), timeout=TIMEOUT * 2
        )
        try:
            assert creating.wait(TIMEOUT)
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            assert stub.Append(batch("open", b"second"), timeout=5).first_offset == 1
            assert not large.done()  # both were answered while the large call was being written
        finally:
            release.set()
        results = large.result()
    assert offsets(list(results.results)) == [(0, 0)] * 20
    assert payloads(server, "new-19") == [b"x"]


def test_a_call_to_many_open_streams_is_written_on_the_loop_in_slices_with_turns_between(
    start_server, monkeypatch
):
    """Open streams cost least on the loop; between slices the loop serves other callbacks."""
    count = 3 * ON_LOOP_SLICE
    server = start_server(max_append_many_batches=count)
    names = [f"s{i}" for i in range(count)]
    assert not any(r.HasField("error") for r in append_many(server, [batch(n, b"a") for n in names]))
    engine = server.server.engine
    assert all(engine.is_open(n) for n in names)
    written: list[int] = []  # the thread of each stream's write
    turns: list[int] = []  # streams written when a callback queued at the first write ran
    real = engine.append_many

    def append_many_here(stream: str, appends: Any) -> Any:
        if not written:
            asyncio.get_running_loop().call_soon(lambda: turns.append(len(written)))
        written.append(threading.get_ident())
        return real(stream, appends)

    monkeypatch.setattr(engine, "append_many", append_many_here)
    results = append_many(server, [batch(n, b"b") for n in names])
    assert offsets(results) == [(1, 1)] * count
    assert set(written) == {server._thread.ident}  # all on the loop: none hopped to a thread
    assert turns == [ON_LOOP_SLICE]  # the loop ran other callbacks after the first slice


def _most_writes_at_once(server: ServerThread, monkeypatch: Any, fsync: str, calls: int, target: int) -> int:
    """`calls` AppendMany calls of 20 new streams each in flight: the most engine writes seen at
    once. Writes wait (a second at most, in all) until `target` of them run at once, as slow ones
    would: where the server lets that many run together, they do."""
    engine = server.server.engine
    # The engine call that writes them: under "always", all a thread's streams together.
    method = "append_many_streams" if fsync == "always" else "append_many"
    real = getattr(engine, method)
    lock, running, most = threading.Lock(), [0], [0]
    reached = threading.Event()

    def append_many_watched(*args: Any) -> Any:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            if running[0] >= target:
                reached.set()
        try:
            if not reached.wait(1.0):
                reached.set()  # not reached: the others go on at once
            return real(*args)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(engine, method, append_many_watched)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        futures = [
            stub.AppendMany.future(
                pb.AppendManyRequest(batches=[batch(f"{fsync}-{c}-{i}", b"x") for i in range(20)]),
                timeout=TIMEOUT,
            )
            for c in range(calls)
        ]
        for future in futures:
            assert offsets(list(future.result().results)) == [(0, 0)] * 20
    return most[0]


def test_two_calls_creating_streams_under_everysec_write_one_at_a_time(start_server, monkeypatch):
    """New streams cost CPU, not waits: two calls' creations in two threads only fight over the GIL."""
    server = start_server(fsync="everysec")
    assert _most_writes_at_once(server, monkeypatch, "everysec", calls=2, target=2) == 1


def test_two_calls_creating_streams_under_always_write_at_once(start_server, monkeypatch):
    """Writes that wait for their sync keep overlapping across calls: a sync in progress does not
    hold another call's writes back (their syncs can merge). Two threads: one call's writes take one."""
    server = start_server(fsync="always", append_threads=2)
    assert _most_writes_at_once(server, monkeypatch, "always", calls=2, target=2) == 2


def test_one_call_creating_streams_under_always_writes_them_in_threads_at_once(start_server, monkeypatch):
    """A directory stream's sync is its own: the call's parts in the pool's threads but one
    overlap theirs."""
    server = start_server(fsync="always", append_threads=4)
    assert _most_writes_at_once(server, monkeypatch, "always", calls=1, target=3) == 3


def test_one_call_of_new_slot_streams_under_always_is_made_durable_by_a_few_syncs(start_server, monkeypatch):
    """Each stream written then waited for in turn, 60 new slot streams waited for 120 fdatasyncs
    (the packs' and the journal's, each stream's own); written all, then waited for, a thread's
    part shares one of each."""
    server = start_server(fsync="always", append_threads=4, max_append_many_batches=60)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        stub.Append(batch("warm", b"x"), timeout=TIMEOUT)  # its pack file made
        real, syncs = os.fdatasync, [0]

        def counted(fd: int) -> None:
            syncs[0] += 1
            real(fd)

        monkeypatch.setattr(os, "fdatasync", counted)
        reply = stub.AppendMany(
            pb.AppendManyRequest(batches=[batch(f"n{i}", b"x") for i in range(60)]), timeout=TIMEOUT
        )
        monkeypatch.setattr(os, "fdatasync", real)
    assert offsets(list(reply.results)) == [(0, 0)] * 60
    assert syncs[0] <= 6  # 3 parts, each the packs' and the journal's


class _Sized:
    """An AppendManyRequest's stand-in that counts the times its size is asked (each encodes it)."""

    def __init__(self, size: int) -> None:
        self.batches = [batch("s", b"x")]
        self.size = size
        self.measured = 0

    def ByteSize(self) -> int:
        self.measured += 1
        return self.size


def test_a_request_is_measured_only_under_a_bound_below_the_receive_limit():
    """At the default bounds (max_append_many_bytes = max_message_bytes) the transport refused
    every larger request already: its size is not asked. Under a lower bound it is, and checked."""
    settings = Settings()
    assert settings.max_append_many_bytes == settings.max_message_bytes
    request = _Sized(settings.max_message_bytes)
    check_request(request, settings)
    assert request.measured == 0
    lower = Settings(max_append_many_bytes=1000)
    check_request(_Sized(1000), lower)
    with pytest.raises(ServiceError, match="max_append_many_bytes=1000"):
        check_request(_Sized(1001), lower)


def test_a_cancelled_call_holds_the_lane_until_its_thread_is_done(start_server, monkeypatch):
    """A call cancelled while its new streams are being written leaves its thread writing them:
    the next call's creations wait for that thread, not for the cancellation."""
    server = start_server(fsync="everysec")
    engine = server.server.engine
    real = engine.append_many
    first_held, release = threading.Event(), threading.Event()
    written: list[str] = []

    def append_many_held(stream: str, appends: Any) -> Any:
        if stream == "first-0":
            first_held.set()
            release.wait(TIMEOUT)
        written.append(stream)
        return real(stream, appends)

    monkeypatch.setattr(engine, "append_many", append_many_held)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        first = stub.AppendMany.future(
            pb.AppendManyRequest(batches=[batch(f"first-{i}", b"x") for i in range(3)]), timeout=TIMEOUT
        )
        assert first_held.wait(TIMEOUT)
        first.cancel()
        assert first.cancelled()
        second = stub.AppendMany.future(
            pb.AppendManyRequest(batches=[batch("second", b"y")]), timeout=TIMEOUT
        )
        time.sleep(0.3)  # the second call's time to start writing, were the lane let go
        assert written == []
        release.set()
        assert offsets(list(second.result().results)) == [(0, 0)]
    assert written.index("second") > written.index("first-2")  # after the first thread's last
