"""Client and AsyncClient against a real server on loopback."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from clients import (
    AppendResult,
    AsyncClient,
    Batch,
    Client,
    Entry,
    FailedPreconditionError,
    Gap,
    GapError,
    InvalidArgumentError,
    NotFoundError,
    OffsetMismatchError,
    OutOfRangeError,
    Record,
    StreamConfig,
)
from tests.service.helpers import ServerThread


def test_append_and_read_back_payloads_tags_and_headers(client: Client) -> None:
    first = client.append("orders", [b"a", b"b"])
    second = client.append("orders", [Record(b"c", tag="k", headers={"src": b"web"}), b"d"])
    assert (first.first_offset, first.last_offset, second.first_offset, second.last_offset) == (0, 1, 2, 3)
    result = client.read("orders", 0)
    assert [(e.offset, e.payload, e.tag, e.headers) for e in result] == [
        (0, b"a", "", {}),
        (1, b"b", "", {}),
        (2, b"c", "k", {"src": b"web"}),
        (3, b"d", "", {}),
    ]
    assert (result.next_offset, result.end_offset, result.lag, result.gap) == (4, 4, 0, None)
    assert all(e.timestamp_ms >= first.timestamp_ms for e in result)
    newest = client.read("orders", 2**63 - 1, reverse=True, count=2)
    assert [e.offset for e in newest] == [3, 2]


def test_a_blocking_read_wakes_on_append(client: Client) -> None:
    client.append("s", b"0")
    timer = threading.Timer(0.2, client.append, args=("s", b"late"))
    timer.start()
    try:
        started = time.monotonic()
        result = client.read("s", 1, block_ms=5000)
        assert [e.payload for e in result] == [b"late"]
        assert time.monotonic() - started < 4
    finally:
        timer.join()


def test_a_per_call_timeout_shorter_than_the_wait_returns_empty(client: Client) -> None:
    client.append("s", b"0")
    started = time.monotonic()
    result = client.read("s", 1, block_ms=8000, timeout=0.5)
    assert result.entries == [] and result.next_offset == 1
    assert time.monotonic() - started < 2


def test_subscription_history_then_live_then_resume_without_duplicates(client: Client) -> None:
    client.append("s", [b"0", b"1"])
    subscription = client.subscribe("s", "oldest")
    seen: list[bytes] = []
    for batch in subscription:
        seen.extend(e.payload for e in batch)
        if len(seen) == 2:
            client.append("s", b"2")
        if len(seen) == 3:
            break
    subscription.cancel()
    assert list(subscription) == []  # cancelled: iteration ends quietly
    assert seen == [b"0", b"1", b"2"] and subscription.next_offset == 3
    client.append("s", b"3")
    with client.subscribe("s", subscription.next_offset) as resumed:
        assert [e.payload for e in next(resumed)] == [b"3"]


def test_subscribe_latest_sees_only_new_entries(client: Client) -> None:
    client.append("s", b"old")
    with client.subscribe("s", "latest") as subscription:
        assert next(subscription).entries == []
        client.append("s", b"new")
        assert [e.payload for e in next(subscription)] == [b"new"]


def test_gaps_after_a_trim_are_reported_never_skipped(client: Client) -> None:
    client.append("s", [b"%d" % i for i in range(10)])
    assert client.trim("s", to_offset=6) == 6
    result = client.read("s", 0)
    assert result.gap == Gap(0, 6, "evicted")
    assert [e.offset for e in result] == [6, 7, 8, 9]
    with client.subscribe("s", 0) as subscription, pytest.raises(GapError) as caught:
        next(subscription.entries())
    assert caught.value.gap == Gap(0, 6, "evicted")
    gaps: list[Gap] = []
    with client.subscribe("s", 0) as subscription:
        entries = subscription.entries(on_gap=gaps.append)
        assert [next(entries).offset for _ in range(4)] == [6, 7, 8, 9]
    assert gaps == [Gap(0, 6, "evicted")]


def test_conditional_appends(client: Client) -> None:
    assert client.append("events", b"created", expected_next_offset=0).first_offset == 0
    with pytest.raises(OffsetMismatchError) as caught:
        client.append("events", b"conflict", expected_next_offset=0)
    assert caught.value.next_offset == 1
    assert (
        client.append("events", b"updated", expected_next_offset=caught.value.next_offset).first_offset == 1
    )
    assert client.info("events").next_offset == 2


def test_idempotent_appends_are_written_once(client: Client) -> None:
    first = client.append("s", [b"a", b"b"], producer_id="p", producer_sequence=5)
    again = client.append("s", [b"a", b"b"], producer_id="p", producer_sequence=5)
    assert not first.duplicate and again.duplicate
    assert again.offsets == first.offsets
    assert client.info("s").next_offset == 2


def test_append_many_gives_each_batch_its_result_or_its_error(client: Client) -> None:
    results = client.append_many(
        [
            ("a", [b"a0", b"a1"]),
            Batch("b", Record(b"b0", tag="t"), producer_id="p", producer_sequence=1),
            ("", b"bad name"),
            Batch("a", b"a2", expected_next_offset=9),
            ("b", b"b1"),
        ]
    )
    first, second, bad, conflict, last = results
    assert isinstance(first, AppendResult) and first.offsets == range(0, 2)
    assert isinstance(second, AppendResult) and second.first_offset == 0
    assert isinstance(bad, InvalidArgumentError)
    assert isinstance(conflict, FailedPreconditionError) and "2" in conflict.details
    assert last == AppendResult(1, 1, last.timestamp_ms)
    again = client.append_many([Batch("b", Record(b"b0", tag="t"), producer_id="p", producer_sequence=1)])
    assert again == [AppendResult(0, 0, second.timestamp_ms, duplicate=True)]
    assert [e.payload for e in client.read("a", 0)] == [b"a0", b"a1"]
    with pytest.raises(InvalidArgumentError):
        client.append_many([])  # no batches: the call itself fails


def test_admin_calls(client: Client, server: ServerThread) -> None:
    names = [f"admin-{i}" for i in range(7)]
    for name in names:
        client.append(name, b"x")
    client.append("other", b"x")
    # The server's page size is 3, so this follows three pages.
    assert client.list_streams("admin-") == names
    assert client.list_streams() == [*names, "other"]

    config = StreamConfig(max_entries=1000, compaction=True, tombstone_retention_ms=60_000, fsync="always")
    assert client.set_config("admin-0", config) == config
    assert client.get_config("admin-0") == config
    info = client.info("admin-0")
    assert (info.name, info.first_offset, info.next_offset, info.entries, info.effective_fsync) == (
        "admin-0",
        0,
        1,
        1,
        "always",
    )
    before = client.info("admin-1").last_timestamp_ms
    client.append("admin-1", [b"y", b"z"])
    assert client.count("admin-1") == 3 and client.count("admin-1", 1, 2) == 1
    assert client.seek("admin-1", 0) == 0 and client.seek("admin-1", 2**62) == 3
    assert client.seek("admin-1", before + 1) in (1, 3)
    with pytest.raises(OutOfRangeError):
        client.trim("admin-1", to_offset=10)
    client.delete_stream("admin-1")
    with pytest.raises(NotFoundError) as caught:
        client.info("admin-1")
    assert isinstance(caught.value.__cause__, grpc.RpcError)
    assert caught.value.code == grpc.StatusCode.NOT_FOUND
    assert client.health() == "SERVING"


def test_bad_names_are_invalid_arguments(client: Client) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        client.append("", b"x")
    assert "stream" in caught.value.details


def test_async_client_round_trip(server: ServerThread) -> None:
    async def scenario() -> None:
        async with AsyncClient(server.target, timeout=10) as client:
            result = await client.append("a", [b"1", Record(b"2", tag="t")])
            assert (result.first_offset, result.last_offset) == (0, 1)
            page = await client.read("a", 0)
            assert [(e.offset, e.payload, e.tag) for e in page] == [(0, b"1", ""), (1, b"2", "t")]
            subscription = client.subscribe("a", "oldest")
            entries: list[Entry] = []
            async for entry in subscription.entries():
                entries.append(entry)
                if len(entries) == 2:
                    await client.append("a", b"3")
                if len(entries) == 3:
                    break
            subscription.cancel()
            assert [e.payload for e in entries] == [b"1", b"2", b"3"]
            assert [batch async for batch in subscription] == []
            with pytest.raises(OffsetMismatchError) as caught:
                await client.append("a", b"x", expected_next_offset=0)
            assert caught.value.next_offset == 3
            with pytest.raises(NotFoundError):
                await client.info("missing")
            assert await client.list_streams() == ["a"]
            assert (await client.info("a")).entries_added == 3
            assert await client.count("a", 1) == 2
            assert await client.trim("a", to_offset=1) == 1
            blocked = await client.read("a", 3, block_ms=8000, timeout=0.5)
            assert blocked.entries == []
            many = await client.append_many([("a", b"4"), ("other", [b"o0", b"o1"])])
            assert [(r.first_offset, r.last_offset) for r in many if isinstance(r, AppendResult)] == [
                (3, 3),
                (0, 1),
            ]

    asyncio.run(scenario())
