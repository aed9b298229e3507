"""Consumer groups through the engine's API, one rule at a time, on a fake clock.

RCP 11 GROUP / RETRY / TACK and bounded pending, Redis stream.h (consumers,
pending entries, claims, lag), delayed delivery, dead letters, retention
holds, and group state across restarts and crashes.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import storage.engine
from storage import (
    MAX_DURATION_MS,
    AppendBatch,
    DiskFullError,
    DurabilityError,
    Engine,
    EngineConfig,
    GroupConfig,
    GroupNotFoundError,
    GroupReadOptions,
    InvalidArgumentError,
    PreconditionError,
    StreamConfig,
    StreamNotFoundError,
    groups,
)
from storage.groupops import Advance, Deliver, Seen
from storage.groupstate import GroupSet
from storage.records import skim_records
from storage.results import EntriesMeta, Gap
from tests.storage.faultfs import FaultFS

from .conftest import SMALL, FakeClock

ROOT = Path("/faultfs/data")


def fill(engine: Engine, n: int, stream: str = "s", **columns) -> None:
    """Append entries whose payload names their offset: b"e<offset>"."""
    first = engine.bounds(stream).end_offset if engine.exists(stream) else 0
    engine.append(stream, AppendBatch([b"e%d" % (first + i) for i in range(n)], **columns))


def fill_nodes(engine: Engine, nodes: int, stream: str = "s") -> None:
    """Append whole nodes (8 entries each in SMALL), so retention has nodes to evict."""
    for _ in range(nodes):
        fill(engine, 8, stream)


def payloads(result) -> list[bytes]:
    return [e.payload for e in result.entries()]


def pending_map(engine: Engine, group: str = "g", stream: str = "s") -> dict[int, tuple[str | None, int]]:
    rows = engine.pending(stream, group, count=10_000).rows
    return {r.offset: (r.consumer, r.delivery_count) for r in rows}


# ---------------------------------------------------------------------- lifecycle


def test_create_group_at_oldest_newest_and_an_offset(open_engine):
    engine = open_engine()
    fill(engine, 10)
    engine.trim("s", 3)
    assert engine.create_group("s", "old").cursor == 3
    assert engine.create_group("s", "new", start="newest").cursor == 10
    assert engine.create_group("s", "mid", start=7).cursor == 7
    assert engine.read_group("s", "old", GroupReadOptions("c", 2)).offsets == [3, 4]
    assert engine.read_group("s", "new", GroupReadOptions("c", 2)).offsets == []
    assert engine.read_group("s", "mid", GroupReadOptions("c", 5)).offsets == [7, 8, 9]
    assert [i.name for i in engine.list_groups("s")] == ["mid", "new", "old"]


def test_create_group_refusals(open_engine):
    engine = open_engine()
    fill(engine, 3)
    engine.create_group("s", "g")
    with pytest.raises(PreconditionError):
        engine.create_group("s", "g")
    with pytest.raises(StreamNotFoundError):
        engine.create_group("nope", "g")
    for bad in ("", "a\x00b", "x" * 256):
        with pytest.raises(InvalidArgumentError):
            engine.create_group("s", bad)
    with pytest.raises(InvalidArgumentError):
        engine.create_group("s", "h", start=4)  # past the end
    with pytest.raises(InvalidArgumentError):
        engine.create_group("s", "h", start="middle")
    with pytest.raises(InvalidArgumentError):
        engine.create_group("s", "h", config=GroupConfig(dead_letter_stream="s"))
    with pytest.raises(InvalidArgumentError):
        GroupConfig(max_pending=0)
    with pytest.raises(InvalidArgumentError):
        GroupConfig(retry_ms=-1)
    with pytest.raises(InvalidArgumentError):
        engine.read_group("s", "g", GroupReadOptions("", 1))


# Durations are added to the clock and the due times go out as int64: past the bound they are
# refused, where they used to be accepted and make every later GetPending fail (issue 12).
OVER = MAX_DURATION_MS + 1


@pytest.mark.parametrize(
    "call",
    [
        lambda e: e.read_group("s", "g", GroupReadOptions("c", 1, retry_ms=OVER)),
        lambda e: e.read_group("s", "g", GroupReadOptions("c", 1, retry_ms=2**63 - 1)),
        lambda e: e.read_group("s", "g", GroupReadOptions("c", 1, expire_ms=OVER)),
        lambda e: e.read_group("s", "g", GroupReadOptions("c", 1, claim_idle_ms=OVER)),
        lambda e: e.nack("s", "g", [0], delay_ms=OVER),
        lambda e: e.nack("s", "g", [0], delay_ms=2**63 - 1),
        lambda e: GroupConfig(retry_ms=OVER),
        lambda e: GroupConfig(expire_ms=OVER),
        lambda e: GroupConfig(delay_ms=OVER),
        lambda e: GroupConfig(idle_release_ms=OVER),
    ],
)
def test_durations_past_the_bound_are_refused_and_change_nothing(open_engine, call):
    engine = open_engine()
    fill(engine, 3)
    engine.create_group("s", "g")
    engine.read_group("s", "g", GroupReadOptions("a", 1))
    before = engine._groups.dump("s")
    with pytest.raises(InvalidArgumentError, match="the limit is"):
        call(engine)
    assert engine._groups.dump("s") == before


def test_durations_at_the_bound_keep_due_times_inside_int64(open_engine, clock):
    engine = open_engine()
    fill(engine, 3)
    engine.create_group("s", "g", config=GroupConfig(retry_ms=MAX_DURATION_MS, delay_ms=0))
    engine.read_group(
        "s", "g", GroupReadOptions("a", 2, expire_ms=MAX_DURATION_MS, claim_idle_ms=MAX_DURATION_MS)
    )
    engine.nack("s", "g", [1], delay_ms=MAX_DURATION_MS)
    rows = engine.pending("s", "g").rows
    assert [r.due_ms for r in rows] == [clock.now_ms + MAX_DURATION_MS] * 2
    assert all(r.due_ms < 2**63 for r in rows)


def test_entries_read_past_what_the_stream_had_is_refused(open_engine):
    engine = open_engine()
    fill(engine, 3)
    with pytest.raises(InvalidArgumentError, match="entries_added 3"):
        engine.create_group("s", "g", start=0, entries_read=4)
    engine.create_group("s", "g", start=0, entries_read=3)
    with pytest.raises(InvalidArgumentError, match="entries_added 3"):
        engine.set_group_offset("s", "g", 0, entries_read=2**63 - 1)
    assert engine.group_info("s", "g").entries_read == 3


def test_missing_group_is_not_found_and_delete_group_forgets_it(open_engine):
    engine = open_engine()
    fill(engine, 3)
    with pytest.raises(GroupNotFoundError):
        engine.read_group("s", "g", GroupReadOptions("c", 1))
    assert engine.list_groups("s") == []
    engine.create_group("s", "g")
    engine.read_group("s", "g", GroupReadOptions("c", 2))
    engine.delete_group("s", "g")
    with pytest.raises(GroupNotFoundError):
        engine.group_info("s", "g")
    with pytest.raises(GroupNotFoundError):
        engine.ack("s", "g", [0])
    engine.create_group("s", "g")  # a new group of the same name starts afresh
    info = engine.group_info("s", "g")
    assert (info.cursor, info.pending, info.consumers) == (0, 0, ())


def test_last_group_deleted_removes_the_group_files(open_engine, tmp_path):
    engine = open_engine()
    fill(engine, 3)
    engine.create_group("s", "g")
    directory = tmp_path / "data" / "streams" / "s"
    assert any(p.name.startswith("groups") for p in directory.iterdir())
    engine.delete_group("s", "g")
    assert not any(p.name.startswith("groups") for p in directory.iterdir())


def test_deleting_a_stream_deletes_its_groups(open_engine):
    engine = open_engine()
    fill(engine, 3)
    engine.create_group("s", "g")
    engine.read_group("s", "g", GroupReadOptions("c", 2))
    engine.delete_stream("s")
    with pytest.raises(StreamNotFoundError):
        engine.list_groups("s")
    fill(engine, 2)
    assert engine.list_groups("s") == []
    engine.close()
    assert open_engine().list_groups("s") == []


def test_group_streams_names_the_streams_with_groups_across_restarts(open_engine):
    engine = open_engine()
    for stream in ("a", "b", "c"):
        fill(engine, 2, stream)
    assert engine.group_streams() == []
    engine.create_group("a", "g")
    engine.create_group("c", "g")
    engine.create_group("c", "h")
    engine.list_groups("b")  # looking at a stream without groups does not count it
    assert sorted(engine.group_streams()) == ["a", "c"]
    engine.delete_group("c", "g")
    engine.delete_stream("a")
    assert engine.group_streams() == ["c"]
    engine.close()
    assert open_engine().group_streams() == ["c"]


# ---------------------------------------------------------------------- delivery


def test_each_entry_goes_to_exactly_one_consumer(open_engine):
    engine = open_engine()
    fill(engine, 40)
    engine.create_group("s", "g")
    seen: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    while True:
        got = 0
        for consumer, offsets in seen.items():
            result = engine.read_group("s", "g", GroupReadOptions(consumer, 3))
            assert payloads(result) == [b"e%d" % o for o in result.offsets]
            offsets.extend(result.offsets)
            got += result.count
        if not got:
            break
    everything = sorted(o for offsets in seen.values() for o in offsets)
    assert everything == list(range(40))
    assert engine.pending("s", "g").consumers == {c: len(o) for c, o in seen.items()}


def test_every_group_sees_every_entry(open_engine):
    engine = open_engine()
    fill(engine, 12)
    engine.create_group("s", "g1")
    engine.create_group("s", "g2")
    assert engine.read_group("s", "g1", GroupReadOptions("c", 100)).offsets == list(range(12))
    assert engine.read_group("s", "g2", GroupReadOptions("c", 100)).offsets == list(range(12))


def test_reads_track_pending_entries_like_xreadgroup_and_noack_does_not(open_engine):
    engine = open_engine()
    fill(engine, 6)
    engine.create_group("s", "g")
    tracked = engine.read_group("s", "g", GroupReadOptions("c", 3))
    assert tracked.delivery_counts == [1, 1, 1]
    untracked = engine.read_group("s", "g", GroupReadOptions("c", 3, noack=True))
    assert untracked.offsets == [3, 4, 5]
    assert untracked.delivery_counts == [1, 1, 1]
    assert sorted(pending_map(engine)) == [0, 1, 2]
    info = engine.group_info("s", "g")
    assert (info.cursor, info.pending, info.counters.delivered) == (6, 3, 6)


def test_count_zero_and_max_bytes(open_engine):
    engine = open_engine()
    engine.append("s", AppendBatch([b"x" * 100] * 10))
    engine.create_group("s", "g")
    assert engine.read_group("s", "g", GroupReadOptions("c", 0)).count == 0
    result = engine.read_group("s", "g", GroupReadOptions("c", 10, max_bytes=350))
    assert result.count == 3  # about 110 bytes per record
    assert len(result.data()) <= 350
    assert (
        engine.read_group("s", "g", GroupReadOptions("c", 10, max_bytes=1)).count == 1
    )  # at least one entry
    assert engine.group_info("s", "g").cursor == 4


def test_consumers_are_created_on_first_read_with_seen_and_active_times(open_engine, clock):
    engine = open_engine()
    fill(engine, 1)
    engine.create_group("s", "g")
    t0 = clock.now_ms
    engine.read_group("s", "g", GroupReadOptions("a", 5))
    clock.advance(100)
    engine.read_group("s", "g", GroupReadOptions("b", 5))  # nothing left: seen, never active
    consumers = {c.name: c for c in engine.group_info("s", "g").consumers}
    assert (consumers["a"].seen_ms, consumers["a"].active_ms, consumers["a"].pending) == (t0, t0, 1)
    assert (consumers["b"].seen_ms, consumers["b"].active_ms, consumers["b"].pending) == (t0 + 100, None, 0)


# ---------------------------------------------------------------------- acknowledgement


def test_unknown_counts_of_huge_range_acks_saturate_at_int64_and_survive_a_restart(open_engine):
    engine = open_engine()
    fill(engine, 10)
    engine.create_group("s", "g")
    engine.read_group("s", "g", GroupReadOptions("c", 10))
    top = 2**63 - 1
    result = engine.ack("s", "g", ranges=[(0, top), (0, top)])
    assert (result.acknowledged, result.unknown) == (10, top)
    engine.ack("s", "g", ranges=[(0, top)])
    assert engine.group_info("s", "g").counters.ack_unknown == top
    engine.close()
    assert open_engine().group_info("s", "g").counters.ack_unknown == top


def test_ack_by_offsets_and_half_open_ranges_counts_unknown(open_engine):
    engine = open_engine()
    fill(engine, 10)
    engine.create_group("s", "g")
    engine.read_group("s", "g", GroupReadOptions("c", 10))
    result = engine.ack("s", "g", offsets=[0, 0, 99], ranges=[(3, 6)])
    assert (result.acknowledged, result.unknown) == (4, 2)  # 0, 3, 4, 5 acked; the second 0 and 99 unknown
    assert sorted(pending_map(engine)) == [1, 2, 6, 7, 8, 9]
    again = engine.ack("s", "g", ranges=[(0, 10)])  # RCP TACK 0-9
    assert (again.acknowledged, again.unknown) == (6, 4)
    counters = engine.group_info("s", "g").counters
    assert (counters.acked, counters.ack_unknown) == (10, 6)
    with pytest.raises(InvalidArgumentError):
        engine.ack("s", "g", ranges=[(5, 4)])
    with pytest.raises(InvalidArgumentError):
        engine.ack("s", "g", offsets=[-1])


# ---------------------------------------------------------------------- redelivery


def test_unacked_entries_are_redelivered_after_retry_ms_before_new_entries(open_engine, clock):
    engine = open_engine()
    fill(engine, 6)
    engine.create_group("s", "g")
    first = engine.read_group("s", "g", GroupReadOptions("a", 2, retry_ms=1000))
    assert first.next_due_ms == clock.now_ms + 1000
    engine.ack("s", "g", [1])
    clock.advance(999)
    assert engine.read_group("s", "g", GroupReadOptions("b", 1)).offsets == [2]  # not yet due
    clock.advance(1)
    again = engine.read_group("s", "g", GroupReadOptions("b", 3))
    assert again.offsets == [0, 3, 4]
    assert again.delivery_counts == [2, 1, 1]
    assert pending_map(engine)[0] == ("b", 2)
    assert engine.group_info("s", "g").counters.redelivered == 1


def test_group_retry_ms_applies_when_a_read_sets_none_and_none_means_claim_only(open_engine, clock):
    engine = open_engine()
    fill(engine, 4)
    engine.create_group("s", "g", config=GroupConfig(retry_ms=500))
    engine.create_group("s", "plain")
    engine.read_group("s", "g", GroupReadOptions("a", 2))
    engine.read_group("s", "plain", GroupReadOptions("a", 2))
    clock.advance(10_000)
    assert engine.read_group("s", "g", GroupReadOptions("b", 2)).offsets == [0, 1]
    assert engine.read_group("s", "plain", GroupReadOptions("b", 2)).offsets == [
        2,
        3,
    ]  # no retry: stays with "a"
    assert engine.pending("s", "plain").consumers == {"a": 2, "b": 2}


def test_nack_releases_for_redelivery_after_its_delay(open_engine, clock):
    engine = open_engine()
    fill(engine, 3)
    engine.create_group("s", "g")
    engine.read_group("s", "g", GroupReadOptions("a", 3))
    released = engine.nack("s", "g", [1, 2, 7], delay_ms=200)
    assert (released.released, released.unknown) == (2, 1)
    summary = engine.pending("s", "g")
    assert (summary.consumers, summary.released) == ({"a": 1}, 2)
    empty = engine.read_group("s", "g", GroupReadOptions("b", 5))
    assert empty.count == 0 and empty.next_due_ms == clock.now_ms + 200
    clock.advance(200)
    result = engine.read_group("s", "g", GroupReadOptions("b", 5))
    assert (result.offsets, result.delivery_counts) == ([1, 2], [2, 2])


def test_delete_consumer_releases_its_entries_to_the_group(open_engine):
    engine = open_engine()
    fill(engine, 4)
    engine.create_group("s", "g")
    engine.read_group("s", "g", GroupReadOptions("a", 2))
    engine.read_group("s", "g", GroupReadOptions("b", 1))
    assert engine.delete_consumer("s", "g", "a") == 2
    assert engine.delete_consumer("s", "g", "ghost") == 0
    assert [c.name for c in engine.group_info("s", "g").consumers] == ["b"]
    result = engine.read_group("s", "g", GroupReadOptions("c", 5))
    assert (result.offsets, result.delivery_counts) == ([0, 1, 3], [2, 2, 1])


# ---------------------------------------------------------------------- bounded pending


def test_bounded_pending_stops_new_entries_until_an_ack_makes_room(open_engine, clock):
    engine = open_engine()
    fill(engine, 10)
    engine.create_group("s", "g", config=GroupConfig(max_pending=3))
    woken = []
    engine.add_group_listener(lambda stream, group: woken.append((stream, group)))
    first = engine.read_group("s", "g", GroupReadOptions("a", 5, retry_ms=100))
    assert first.offsets == [0, 1, 2] and first.pending_full
    blocked = engine.read_group("s", "g", GroupReadOptions("b", 5))
    assert blocked.count == 0 and blocked.pending_full
    assert blocked.next_due_ms == clock.now_ms + 100  # only retries can come
    clock.advance(100)
    assert engine.read_group("s", "g", GroupReadOptions("b", 5)).offsets == [0, 1, 2]  # due retries only
    woken.clear()
    engine.ack("s", "g", [0])
    assert woken == [("s", "g")]
    result = engine.read_group("s", "g", GroupReadOptions("b", 5))
    assert result.offsets == [3] and result.pending_full
    assert engine.group_info("s", "g").pending == 3


def test_noack_reads_are_not_bounded_by_pending(open_engine):
    engine = open_engine()
    fill(engine, 5)
    engine.create_group("s", "g", config=GroupConfig(max_pending=1))
    engine.read_group("s", "g", GroupReadOptions("a", 1))
    assert engine.read_group("s", "g", GroupReadOptions("a", 5, noack=True)).offsets == [1, 2, 3, 4]


# ---------------------------------------------------------------------- expiry and dead letters


def test_expire_ms_takes_entries_out_of_the_pending_list(open_engine, clock):
    engine = open_engine()
    fill(engine, 3)
    engine.create_group("s", "g")
    engine.read_group("s", "g", GroupReadOptions("a", 2, retry_ms=100, expire_ms=250))
    clock.advance(100)
    assert engine.read_group("s", "g", GroupReadOptions("a", 2)).offsets == [
        0,
        1,
    ]  # retried; expiry counts from the first
    clock.advance(150)
    info = engine.group_info("s", "g")
    assert (info.pending, info.counters.expired) == (0, 2)
    assert engine.read_group("s", "g", GroupReadOptions("a", 5)).offsets == [2]


def test_max_deliveries_dead_letters_with_origin_headers(open_engine, clock):
    engine = open_engine()
    engine.append("s", AppendBatch([b"p0", b"p1"], tags=["t0", ""], headers=[{"h": b"v"}, None]))
    config = GroupConfig(retry_ms=10, max_deliveries=2, dead_letter_stream="dlq")
    engine.create_group("s", "g", config=config)
    assert engine.read_group("s", "g", GroupReadOptions("a", 2)).delivery_counts == [1, 1]
    engine.ack("s", "g", [1])
    clock.advance(10)
    assert engine.read_group("s", "g", GroupReadOptions("a", 2)).delivery_counts == [2]
    clock.advance(10)
    assert (
        engine.read_group("s", "g", GroupReadOptions("a", 2)).count == 0
    )  # exhausted: dead-lettered, not delivered
    (letter,) = engine.read("dlq", 0, 10).entries()
    assert (letter.payload, letter.tag) == (b"p0", "t0")
    assert letter.headers == {
        "h": b"v",
        "x-origin-stream": b"s",
        "x-origin-offset": b"0",
        "x-group": b"g",
        "x-delivery-count": b"2",
        "x-reason": b"max_deliveries",
    }
    counters = engine.group_info("s", "g").counters
    assert (counters.dead_lettered, counters.expired) == (1, 0)


def test_expiry_dead_letters_from_maintenance_without_readers(open_engine, clock):
    engine = open_engine()
    fill(engine, 2)
    engine.create_group("s", "g", config=GroupConfig(expire_ms=1000, dead_letter_stream="dlq"))
    engine.read_group("s", "g", GroupReadOptions("a", 2))
    clock.advance(1000)
    engine.maintain()
    letters = engine.read("dlq", 0, 10).entries()
    assert [e.headers["x-reason"] for e in letters] == [b"expired", b"expired"]
    assert [e.headers["x-origin-offset"] for e in letters] == [b"0", b"1"]
    assert engine.pending("s", "g").count == 0


def test_claim_of_an_exhausted_entry_retires_it_instead(open_engine, clock):
    engine = open_engine()
    fill(engine, 1)
    engine.create_group("s", "g", config=GroupConfig(max_deliveries=1))
    engine.read_group("s", "g", GroupReadOptions("a", 1))
    clock.advance(50)
    assert engine.claim("s", "g", "b", 10, [0]).count == 0
    assert engine.group_info("s", "g").counters.expired == 1


# ---------------------------------------------------------------------- delays


def test_delayed_entries_do_not_hold_back_later_entries(open_engine, clock):
    engine = open_engine()
    now = clock.now_ms
    fill(engine, 4, deliver_at_ms=[0, now + 500, 0, now + 200])
    assert engine.read("s", 0, 10).count == 4  # plain reads see them at once
    engine.create_group("s", "g")
    first = engine.read_group("s", "g", GroupReadOptions("a", 10))
    assert first.offsets == [0, 2]
    assert first.next_due_ms == now + 200
    info = engine.group_info("s", "g")
    assert (info.cursor, info.scheduled, info.lag, info.hold_offset) == (4, 2, 2, 0)
    clock.advance(200)
    assert engine.read_group("s", "g", GroupReadOptions("a", 10)).offsets == [3]
    clock.advance(300)
    fill(engine, 1)
    assert engine.read_group("s", "g", GroupReadOptions("b", 10)).offsets == [
        1,
        4,
    ]  # due delayed entries first


def test_group_delay_ms_holds_entries_until_timestamp_plus_delay(open_engine, clock):
    engine = open_engine()
    fill(engine, 2)
    clock.advance(300)
    fill(engine, 2)
    engine.create_group("s", "g", config=GroupConfig(delay_ms=500))
    empty = engine.read_group("s", "g", GroupReadOptions("a", 10))
    assert empty.count == 0 and empty.next_due_ms == clock.now_ms + 200
    clock.advance(200)
    result = engine.read_group("s", "g", GroupReadOptions("a", 10))
    assert result.offsets == [0, 1] and result.next_due_ms == clock.now_ms + 300
    clock.advance(300)
    assert engine.read_group("s", "g", GroupReadOptions("a", 10)).offsets == [2, 3]


# ---------------------------------------------------------------------- claims


def test_claim_takes_idle_entries_and_counts_a_delivery(open_engine, clock):
    engine = open_engine()
    fill(engine, 3)
    engine.create_group("s", "g")
    engine.read_group("s", "g", GroupReadOptions("a", 2))
    clock.advance(100)
    engine.read_group("s", "g", GroupReadOptions("a", 1))
    claimed = engine.claim("s", "g", "b", 100, [0, 2, 9])
    assert (claimed.offsets, claimed.delivery_counts, payloads(claimed)) == ([0], [2], [b"e0"])
    assert pending_map(engine) == {0: ("b", 2), 1: ("a", 1), 2: ("a", 1)}
    assert [r.idle_ms for r in engine.pending("s", "g").rows] == [0, 100, 0]


def test_autoclaim_scans_from_a_cursor(open_engine, clock):
    engine = open_engine()
    fill(engine, 6)
    engine.create_group("s", "g")
    engine.read_group("s", "g", GroupReadOptions("a", 6))
    engine.ack("s", "g", [1])
    clock.advance(60)
    cursor, first = engine.autoclaim("s", "g", "b", 50, 0, 2)
    assert (first.offsets, cursor) == ([0, 2], 3)
    cursor, second = engine.autoclaim("s", "g", "b", 50, cursor, 10)
    assert (second.offsets, cursor) == ([3, 4, 5], 0)
    assert engine.pending("s", "g").consumers == {"b": 5}


def test_claim_on_read_takes_idle_entries_after_due_retries(open_engine, clock):
    engine = open_engine()
    fill(engine, 5)
    engine.create_group("s", "g")
    engine.read_group("s", "g", GroupReadOptions("a", 1, retry_ms=100))
    engine.read_group("s", "g", GroupReadOptions("a", 2))
    clock.advance(100)
    empty_claim = engine.read_group("s", "g", GroupReadOptions("b", 2, claim_idle_ms=200))
    assert empty_claim.offsets == [0, 3]  # the due retry, then a new entry: nothing idle 200 ms yet
    assert empty_claim.next_due_ms == clock.now_ms + 100  # entries 1 and 2 become idle enough then
    clock.advance(100)
    result = engine.read_group("s", "g", GroupReadOptions("b", 3, claim_idle_ms=200))
    assert (result.offsets, result.delivery_counts) == ([1, 2, 4], [2, 2, 1])


def test_pending_summary_and_filtered_detail(open_engine, clock):
    engine = open_engine()
    fill(engine, 8)
    engine.create_group("s", "g")
    engine.read_group("s", "g", GroupReadOptions("a", 3))
    clock.advance(500)
    engine.read_group("s", "g", GroupReadOptions("b", 3))
    info = engine.pending("s", "g", consumer="a", min_idle_ms=100, start=1, end=3)
    assert (info.count, info.lowest, info.highest, info.consumers) == (6, 0, 5, {"a": 3, "b": 3})
    assert [(r.offset, r.consumer, r.idle_ms, r.delivery_count) for r in info.rows] == [
        (1, "a", 500, 1),
        (2, "a", 500, 1),
    ]
    assert [r.offset for r in engine.pending("s", "g", count=2).rows] == [0, 1]
    assert [r.offset for r in engine.pending("s", "g", min_idle_ms=1).rows] == [0, 1, 2]


# ---------------------------------------------------------------------- lag


def test_lag_against_hand_computed_values(open_engine):
    engine = open_engine(compression=False)
    fill(engine, 10)
    engine.create_group("s", "g")
    info = engine.group_info("s", "g")
    assert (info.entries_added, info.entries_read, info.lag) == (10, 0, 10)
    engine.read_group("s", "g", GroupReadOptions("a", 4))
    info = engine.group_info("s", "g")
    assert (info.entries_read, info.lag) == (4, 6)
    engine.trim("s", 7)  # entries 4..6 evicted before the group got them
    assert engine.group_info("s", "g").lag == 3
    result = engine.read_group("s", "g", GroupReadOptions("a", 10))
    assert result.offsets == [7, 8, 9] and (result.gap.start_offset, result.gap.end_offset) == (4, 7)
    info = engine.group_info("s", "g")
    assert (info.entries_read, info.lag) == (10, 0)


def test_lag_counts_exactly_over_compaction_holes(open_engine):
    engine = open_engine(compression=False)
    engine.append("s", AppendBatch([b"v"] * 16, tags=["k"] * 16))  # one tag: compaction keeps only the last
    for _ in range(6):  # roll the segment, so the tagged entries are in a sealed one
        engine.append("s", AppendBatch([b"x" * 3000] * 4))
    engine.create_group("s", "g")
    assert engine.compact("s") == 15
    info = engine.group_info("s", "g")
    assert (info.entries_added, info.lag) == (40, 25)
    assert info.lag == len(engine.read("s", 0, 100).entries())
    engine.read_group("s", "g", GroupReadOptions("a", 2))
    assert engine.group_info("s", "g").lag == 23


def test_explicit_entries_read_makes_lag_unknown_until_the_group_catches_up(open_engine):
    engine = open_engine()
    fill(engine, 10)
    engine.create_group("s", "g", start=2, entries_read=1)  # disagrees with its offset
    info = engine.group_info("s", "g")
    assert (info.entries_read, info.lag) == (1, None)
    engine.read_group("s", "g", GroupReadOptions("a", 3))
    assert engine.group_info("s", "g").lag is None
    engine.read_group("s", "g", GroupReadOptions("a", 100))
    info = engine.group_info("s", "g")
    assert (info.entries_read, info.lag) == (10, 0)
    engine.set_group_offset("s", "g", 4)
    info = engine.group_info("s", "g")
    assert (info.entries_read, info.lag) == (4, 6)


def test_set_group_offset_rewinds_and_redelivers(open_engine):
    engine = open_engine()
    fill(engine, 5)
    engine.create_group("s", "g")
    engine.read_group("s", "g", GroupReadOptions("a", 5))
    engine.ack("s", "g", ranges=[(0, 3)])
    engine.set_group_offset("s", "g", 2)
    result = engine.read_group("s", "g", GroupReadOptions("b", 5))
    assert (result.offsets, result.delivery_counts) == ([2, 3, 4], [1, 2, 2])
    engine.set_group_offset("s", "g", "oldest")
    assert engine.group_info("s", "g").cursor == 0
    with pytest.raises(InvalidArgumentError):
        engine.set_group_offset("s", "g", 6)


# A rewound position meets entries a read also takes as redeliveries (due, released, idle, or
# delayed and due): one reply holds each offset once, with the count GetPending then shows.


def assert_counts_match_pending(engine: Engine, result) -> None:
    assert len(set(result.offsets)) == len(result.offsets), result.offsets
    assert result.delivery_counts == [pending_map(engine)[o][1] for o in result.offsets]


def _nacked(engine: Engine, clock: FakeClock) -> None:
    engine.read_group("s", "g", GroupReadOptions("a", 3))
    engine.set_group_offset("s", "g", "oldest")
    engine.nack("s", "g", [1])


def _released_by_a_deleted_consumer(engine: Engine, clock: FakeClock) -> None:
    engine.read_group("s", "g", GroupReadOptions("a", 5))
    assert engine.delete_consumer("s", "g", "a") == 5
    engine.set_group_offset("s", "g", 2)


def _due_retries(engine: Engine, clock: FakeClock) -> None:
    engine.read_group("s", "g", GroupReadOptions("a", 3, retry_ms=200))
    engine.set_group_offset("s", "g", 0)
    clock.advance(300)


def _idle(engine: Engine, clock: FakeClock) -> None:
    engine.read_group("s", "g", GroupReadOptions("a", 2))
    engine.set_group_offset("s", "g", 0)
    clock.advance(100)


@pytest.mark.parametrize(
    ("prepare", "options", "offsets", "counts"),
    [
        pytest.param(_nacked, {}, [1, 0, 2, 3, 4], [2, 2, 2, 1, 1], id="nacked"),
        pytest.param(_released_by_a_deleted_consumer, {}, [0, 1, 2, 3, 4], [2] * 5, id="deleted-consumer"),
        pytest.param(_due_retries, {}, [0, 1, 2, 3, 4], [2, 2, 2, 1, 1], id="due-retries"),
        pytest.param(_idle, {"claim_idle_ms": 100}, [0, 1, 2, 3, 4], [2, 2, 1, 1, 1], id="claimed-on-read"),
    ],
)
def test_a_rewind_over_redeliveries_gives_each_offset_once(
    open_engine, clock, prepare, options, offsets, counts
):
    """Issue 12's reproductions: the position moved back over entries a read also takes as redeliveries."""
    engine = open_engine()
    fill(engine, 5)
    engine.create_group("s", "g")
    prepare(engine, clock)
    result = engine.read_group("s", "g", GroupReadOptions("b", 10, **options))
    assert (result.offsets, result.delivery_counts) == (offsets, counts)
    assert_counts_match_pending(engine, result)
    assert payloads(result) == [b"e%d" % o for o in offsets]
    assert engine.group_info("s", "g").cursor == 5


def test_a_rewind_over_a_delayed_entry_now_due_gives_it_once(open_engine, clock):
    engine = open_engine()
    fill(engine, 4, deliver_at_ms=[0, clock.now_ms + 100, 0, 0])
    engine.create_group("s", "g")
    assert engine.read_group("s", "g", GroupReadOptions("a", 10)).offsets == [0, 2, 3]
    engine.set_group_offset("s", "g", 0)
    clock.advance(100)
    result = engine.read_group("s", "g", GroupReadOptions("a", 10))
    assert (result.offsets, result.delivery_counts) == ([1, 0, 2, 3], [1, 2, 2, 2])
    assert_counts_match_pending(engine, result)
    assert engine.group_info("s", "g").scheduled == 0


def test_a_noack_read_over_pending_entries_reports_their_pending_counts(open_engine):
    engine = open_engine()
    fill(engine, 3)
    engine.create_group("s", "g")
    engine.read_group("s", "g", GroupReadOptions("a", 2))
    engine.nack("s", "g", [1])
    assert engine.read_group("s", "g", GroupReadOptions("a", 1)).offsets == [1]
    engine.set_group_offset("s", "g", 0)
    result = engine.read_group("s", "g", GroupReadOptions("b", 10, noack=True))
    assert (result.offsets, result.delivery_counts) == ([0, 1, 2], [1, 2, 1])
    assert pending_map(engine) == {0: ("a", 1), 1: ("a", 2)}  # untracked: still a's, counts unchanged


# ---------------------------------------------------------------------- retention


def test_retention_hold_keeps_what_a_group_still_needs(open_engine, clock):
    engine = open_engine(compression=False)
    fill_nodes(engine, 5)
    engine.create_group("s", "g", config=GroupConfig(retention_hold=True))
    engine.create_group("s", "free")
    engine.read_group("s", "g", GroupReadOptions("a", 20))
    engine.read_group("s", "free", GroupReadOptions("a", 40))
    engine.ack("s", "g", ranges=[(0, 12)])
    assert engine.retention_holder("s") == ("g", 12)
    assert engine.keep_last("s", 0) == 12  # whole nodes are evicted, never past the floor
    engine.set_stream_config("s", StreamConfig(max_entries=0))
    engine.apply_retention("s")
    assert engine.bounds("s").first_offset == 12
    info = engine.group_info("s", "g")
    assert info.holds_retention and info.hold_offset == 12
    assert not engine.group_info("s", "free").holds_retention
    engine.ack("s", "g", ranges=[(12, 20)])
    assert engine.retention_holder("s") == ("g", 20)  # now the cursor
    engine.apply_retention("s")
    assert engine.bounds("s").first_offset == 20


def test_an_idle_group_releases_retention(open_engine, clock):
    engine = open_engine()
    fill_nodes(engine, 3)
    config = GroupConfig(retention_hold=True, idle_release_ms=60_000)
    engine.create_group("s", "g", config=config)
    engine.read_group("s", "g", GroupReadOptions("a", 2))
    assert engine.retention_holder("s") == ("g", 0)
    clock.advance(60_001)
    assert engine.retention_holder("s") is None
    assert engine.keep_last("s", 0) > 0
    engine.read_group("s", "g", GroupReadOptions("a", 1))  # active again: holds again, from what is left
    assert engine.retention_holder("s") is not None


def test_a_scheduled_entry_holds_retention(open_engine, clock):
    engine = open_engine()
    fill(engine, 8, deliver_at_ms=[0, clock.now_ms + 10_000] + [0] * 6)
    fill_nodes(engine, 2)
    engine.create_group("s", "g", config=GroupConfig(retention_hold=True))
    engine.read_group("s", "g", GroupReadOptions("a", 100, noack=True))
    assert engine.retention_holder("s") == ("g", 1)
    assert engine.keep_last("s", 0) <= 1


def test_pending_entries_evicted_without_a_hold_are_dropped_on_redelivery(open_engine, clock):
    engine = open_engine()
    fill(engine, 20)
    engine.create_group("s", "g")
    engine.read_group("s", "g", GroupReadOptions("a", 3, retry_ms=10))
    engine.trim("s", 2)
    clock.advance(10)
    result = engine.read_group("s", "g", GroupReadOptions("a", 3))
    assert result.gone == [0, 1]
    assert (result.offsets, result.delivery_counts) == ([2, 3, 4], [2, 1, 1])
    assert engine.group_info("s", "g").counters.evicted == 2


@pytest.mark.parametrize("wait_ms", [0, 500])
def test_a_delayed_entry_trimmed_before_it_fell_due_is_a_gap(open_engine, clock, wait_ms):
    engine = open_engine()
    fill(engine, 3, deliver_at_ms=[0, clock.now_ms + 500, 0])
    engine.create_group("s", "g")
    assert engine.read_group("s", "g", GroupReadOptions("a", 10)).offsets == [0, 2]
    engine.trim("s", 3)  # trim_to_offset: past the scheduled entry (no hold stops it)
    clock.advance(wait_ms)  # read at once, or after the entry would have fallen due
    result = engine.read_group("s", "g", GroupReadOptions("a", 10))
    assert result.offsets == []
    assert result.gap == Gap(1, 2, "evicted")
    info = engine.group_info("s", "g")
    assert (info.scheduled, info.counters.evicted) == (0, 1)
    assert engine.read_group("s", "g", GroupReadOptions("a", 10)).gap is None  # reported once


def test_evicted_delayed_entries_and_a_cursor_gap_make_one_gap(open_engine, clock):
    engine = open_engine()
    fill(engine, 6, deliver_at_ms=[0, clock.now_ms + 500, 0, 0, 0, 0])
    engine.create_group("s", "g")
    assert engine.read_group("s", "g", GroupReadOptions("a", 2)).offsets == [
        0,
        2,
    ]  # 1 scheduled, the cursor at 3
    engine.trim("s", 5)
    result = engine.read_group("s", "g", GroupReadOptions("a", 10))
    assert (result.offsets, result.gap) == ([5], Gap(1, 5, "evicted"))
    assert engine.group_info("s", "g").counters.evicted == 1


# ---------------------------------------------------------------------- restart and crash


def test_group_state_survives_a_restart_exactly(tmp_path, clock):
    config = EngineConfig(**SMALL)
    engine = Engine(tmp_path, config, clock=clock)
    fill(engine, 30, deliver_at_ms=[0] * 29 + [clock.now_ms + 1000])
    engine.create_group("s", "g", config=GroupConfig(retry_ms=100, max_pending=20))
    engine.create_group("s", "h", start=5, entries_read=3)
    engine.read_group("s", "g", GroupReadOptions("a", 4, expire_ms=5000))
    clock.advance(10)
    engine.read_group("s", "g", GroupReadOptions("b", 30))
    engine.ack("s", "g", [1, 2, 50])
    engine.nack("s", "g", [3], delay_ms=40)
    engine.read_group("s", "h", GroupReadOptions("x", 3, noack=True))
    before = {"s": engine._groups.dump("s")}
    engine.close()
    engine = Engine(tmp_path, config, clock=clock)
    assert {"s": engine._groups.dump("s")} == before
    clock.advance(100)
    # Timers work after the restart: 3 (nacked, due at +50), 0 (due at +100), 4 (due at +110).
    assert engine.read_group("s", "g", GroupReadOptions("c", 3)).offsets == [3, 0, 4]
    engine.close()


def test_journal_checkpoints_as_it_fills_and_recovers(tmp_path, clock):
    config = EngineConfig(**SMALL)  # 64 KiB segments: a 64 KiB journal
    engine = Engine(tmp_path, config, clock=clock)
    engine.create_stream("s")
    engine.create_group("s", "g")
    directory = tmp_path / "streams" / "s"
    for _ in range(200):  # about 60 KiB of records
        fill(engine, 20)
        result = engine.read_group("s", "g", GroupReadOptions("a", 20))
        for offset in result.offsets[::2]:  # one journal record each
            engine.ack("s", "g", [offset])
        clock.advance(1)
    journals = [p.name for p in directory.iterdir() if p.suffix == ".journal"]
    assert len(journals) == 1 and journals[0] != "groups-00000000000000000001.journal"
    before = engine._groups.dump("s")
    engine.maintain()
    engine.close()
    engine = Engine(tmp_path, config, clock=clock)
    assert engine._groups.dump("s") == before
    engine.close()


def fault_engine(fs: FaultFS, clock, fsync: str) -> Engine:
    return Engine(ROOT, EngineConfig(**{**SMALL, "fsync": fsync}), clock=clock, fs=fs)


def test_always_mode_survives_power_loss_with_every_returned_change(clock):
    fs = FaultFS()
    fs.prepare_dir(ROOT)
    engine = fault_engine(fs, clock, "always")
    fill(engine, 20)
    engine.create_group("s", "g", config=GroupConfig(retry_ms=50))
    engine.read_group("s", "g", GroupReadOptions("a", 5))
    engine.ack("s", "g", [0, 2])
    clock.advance(50)
    engine.read_group("s", "g", GroupReadOptions("b", 2))
    before = engine._groups.dump("s")
    after = fault_engine(fs.crashed_copy(mode="lost"), clock, "always")
    recovered = after._groups.dump("s")
    for state in (before, recovered):  # seen and activity times may be older after a crash
        state["g"].pop("consumers")
        state["g"].pop("active_ms")
    assert recovered == before
    assert sorted(recovered["g"]["pending"]) == [1, 3, 4]


def test_process_crash_keeps_group_state_in_every_mode(clock):
    fs = FaultFS()
    fs.prepare_dir(ROOT)
    engine = fault_engine(fs, clock, "no")
    fill(engine, 10)
    engine.create_group("s", "g")
    engine.read_group("s", "g", GroupReadOptions("a", 6))
    engine.ack("s", "g", [1])
    before = engine._groups.dump("s")
    after = fault_engine(fs.crashed_copy(mode="process"), clock, "no")
    assert after._groups.dump("s") == before


def test_everysec_power_loss_redelivers_and_never_loses(clock):
    """What a power loss takes from group state comes back as redeliveries (at-least-once)."""
    fs = FaultFS()
    fs.prepare_dir(ROOT)
    engine = fault_engine(fs, clock, "everysec")
    fill(engine, 10)
    engine.sync()
    engine.create_group("s", "g")
    engine.read_group("s", "g", GroupReadOptions("a", 4))
    engine.ack("s", "g", [0, 1])
    engine.maintain()  # syncs: 0 and 1 acked, 2 and 3 pending, for good
    engine.read_group("s", "g", GroupReadOptions("a", 4))  # 4..7 delivered, never synced
    engine.ack("s", "g", [2])  # never synced
    after = fault_engine(fs.crashed_copy(mode="lost"), clock, "everysec")
    assert sorted(pending_map(after)) == [2, 3]
    again = after.read_group("s", "g", GroupReadOptions("b", 10))
    assert again.offsets == [4, 5, 6, 7, 8, 9]
    assert after.ack("s", "g", ranges=[(0, 10)]).acknowledged == 8


def test_a_failed_journal_sync_stops_group_changes(clock):
    fs = FaultFS()
    fs.prepare_dir(ROOT)
    engine = fault_engine(fs, clock, "always")
    fill(engine, 5)
    engine.create_group("s", "g")
    engine.read_group("s", "g", GroupReadOptions("a", 1))
    fs.fail_at_sync = fs.syncs + 1
    with pytest.raises(DurabilityError):
        engine.read_group("s", "g", GroupReadOptions("a", 1))
    with pytest.raises(DurabilityError):
        engine.ack("s", "g", [0])
    restarted = fault_engine(fs.crashed_copy(mode="lost"), clock, "always")
    assert sorted(pending_map(restarted)) == [0]  # the unsynced delivery of 1 is not there


def test_concurrent_readers_never_share_an_entry(open_engine):
    engine = open_engine(fsync="always")
    fill(engine, 60)
    engine.create_group("s", "g")
    got: dict[str, list[int]] = {}

    def consume(name: str) -> None:
        mine = got.setdefault(name, [])
        while True:
            result = engine.read_group("s", "g", GroupReadOptions(name, 2))
            if not result.count:
                return
            mine.extend(result.offsets)
            engine.ack("s", "g", result.offsets)

    threads = [threading.Thread(target=consume, args=(f"c{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    everything = sorted(o for offsets in got.values() for o in offsets)
    assert everything == list(range(60))
    assert engine.group_info("s", "g").counters.acked == 60


# ---------------------------------------------------------------------- the state machine alone


def test_state_machine_timers_order_and_replay():
    clock = FakeClock(1000)
    state = GroupSet()
    group = state.create("g", GroupConfig(max_deliveries=2), 0, 0, clock())
    group.deliver("a", 1000, 30, None, [0, 1, 2])
    group.deliver("a", 1010, 10, None, [3])
    assert group.pending.take_due_retries(1019, 10) == []
    assert group.pending.take_due_retries(1020, 10) == [3]
    group.pending.restore_retries([3])
    assert group.pending.take_due_retries(1030, 2) == [3, 0]  # by due time, then by offset
    group.pending.restore_retries([3, 0])
    group.deliver("b", 1030, 5, None, [0])  # second delivery: exhausted when due again
    assert group.pending.take_due_retries(1035, 10) == [3, 1, 2]
    assert [d.offset for d in group.pending.take_doomed(1035)] == [0]
    replica = GroupSet()
    for op in state.drain():
        replica.apply(op)
    assert replica.dump() == state.dump()
    snapshot = GroupSet()
    for op in state.snapshot_ops():
        snapshot.apply(op)
    assert snapshot.dump() == state.dump()


def test_a_full_disk_refuses_group_changes_cleanly(clock, monkeypatch):
    monkeypatch.setattr(storage.engine, "GROUP_JOURNAL_BYTES", 2048)  # a checkpoint every few dozen calls
    fs = FaultFS()
    fs.prepare_dir(ROOT)
    engine = fault_engine(fs, clock, "always")
    fill(engine, 50)
    fs.disk_full = True
    with pytest.raises(DiskFullError):
        engine.create_group("s", "g")  # the first snapshot cannot be written: as if never called
    assert engine.list_groups("s") == []
    fs.disk_full = False
    engine.create_group("s", "g")
    fs.disk_full = True
    delivered = []
    with pytest.raises(DiskFullError):  # sooner or later the journal needs a checkpoint
        for _ in range(200):
            delivered += engine.read_group("s", "g", GroupReadOptions("a", 1)).offsets
    fs.disk_full = False
    assert sorted(engine._groups.dump("s")["g"]["pending"]) == delivered  # the refused call changed nothing
    assert engine.read_group("s", "g", GroupReadOptions("a", 1)).offsets == [len(delivered)]


def test_group_read_options_are_checked_when_made(open_engine):
    for bad in (
        {"consumer": "", "count": 1},
        {"consumer": "c", "count": -1},
        {"consumer": "c", "count": 1, "max_bytes": -1},
        {"consumer": "c", "count": 1, "retry_ms": -1},
        {"consumer": "c", "count": 1, "claim_idle_ms": OVER},
    ):
        with pytest.raises(InvalidArgumentError):
            GroupReadOptions(**bad)
    engine = open_engine()
    fill(engine, 3)
    engine.create_group("s", "g")
    with pytest.raises(InvalidArgumentError, match="GroupReadOptions"):
        engine.read_group("s", "g", ("c", 1))  # type: ignore[arg-type]
    assert engine.read_group("s", "g", GroupReadOptions("c", 2)).offsets == [0, 1]


def test_a_group_read_is_a_plan_that_asks_the_stream_and_decides_alone(open_engine, clock):
    """storage.groups.read does no I/O: it yields what it needs of the stream and, given it,
    decides what is delivered and which ops record it (here: a redelivery due, then new entries)."""
    engine = open_engine()
    fill(engine, 6)
    records = {offset: record for offset, _, _, record in skim_records(engine.read("s", 0, 6).records)}
    state = GroupSet()
    group = state.create("g", GroupConfig(), 0, 0, clock())
    group.deliver("a", clock(), 0, None, [0])  # pending, due again at once
    group.advance(1, caught_up=False)
    state.drain()
    answers = {
        groups.FetchRecords: lambda r: {o: records[o] for o in r.offsets},
        groups.ReadFrom: lambda r: (
            engine.read("s", r.start, r.limit, max_bytes=r.max_bytes),
            EntriesMeta(False, 0),
        ),
    }
    plan = groups.read(group, GroupReadOptions("b", 3), 3, clock())
    asked = []
    try:
        request = next(plan)
        while True:
            asked.append(request)
            request = plan.send(answers[type(request)](request))
    except StopIteration as done:
        result = done.value
    assert asked == [groups.FetchRecords([0]), groups.ReadFrom(1, 2, 0)]
    assert result.offsets == [0, 1, 2] and result.delivery_counts == [2, 1, 1]
    assert [type(op) for op in state.drain()] == [Deliver, Deliver, Advance, Seen]
