"""Behaviour of the engine through its public API: append, read, seek, count, retention, reopen."""

from __future__ import annotations

import json
import os
import threading

import pytest

from storage import (
    AppendBatch,
    DurabilityError,
    Engine,
    EngineConfig,
    EntriesMeta,
    FsyncPolicy,
    InvalidArgumentError,
    LimitExceededError,
    StreamBounds,
    StreamConfig,
    StreamNotFoundError,
)
from storage.catalog import NO_PLACE
from storage.growing import GrowingNode
from storage.segment import Segment


def offsets(result) -> list[int]:
    return [e.offset for e in result.entries()]


def test_append_assigns_contiguous_offsets_from_zero(open_engine):
    engine = open_engine()
    first = engine.append("s", AppendBatch([b"a", b"b", b"c"]))
    second = engine.append("s", AppendBatch([b"d"]))
    assert (first.first_offset, first.last_offset) == (0, 2)
    assert (second.first_offset, second.last_offset) == (3, 3)
    result = engine.read("s", 0, 10)
    assert [e.payload for e in result.entries()] == [b"a", b"b", b"c", b"d"]
    assert offsets(result) == [0, 1, 2, 3]
    assert (result.first_offset, result.end_offset, result.last_offset, result.count) == (0, 4, 3, 4)


def test_bounds_and_where_a_read_continues(open_engine):
    engine = open_engine()
    with pytest.raises(StreamNotFoundError):
        engine.bounds("s")
    engine.append("s", AppendBatch([b"x"] * 20))
    engine.trim("s", 5)
    assert engine.bounds("s") == StreamBounds(first_offset=5, end_offset=20)
    forward = engine.read("s", 7, 3)
    assert (forward.last_offset, forward.next_offset, forward.end_offset) == (9, 10, 20)
    evicted = engine.read("s", 2, 0)  # nothing taken: it continues after the gap
    assert (evicted.gap.end_offset, evicted.next_offset) == (5, 5)
    assert engine.read("s", 30, 5).next_offset == 30  # past the end: where it asked
    backward = engine.read("s", 9, 3, reverse=True)
    assert (offsets(backward), backward.next_offset) == ([9, 8, 7], 6)
    assert engine.read("s", 6, 5, reverse=True).next_offset == -1  # nothing older than 5 remains


def test_fsync_policy_is_the_streams_own_or_the_engines(open_engine):
    engine = open_engine(fsync="everysec")
    assert engine.config.fsync is FsyncPolicy.EVERYSEC
    assert engine.fsync_policy("new") is FsyncPolicy.EVERYSEC  # what its first append would get
    engine.create_stream("durable", StreamConfig(fsync="always"))
    assert engine.fsync_policy("durable") is FsyncPolicy.ALWAYS
    # The open stream's policy follows its config (every append reads it from the stream).
    engine.set_stream_config("durable", StreamConfig(fsync="no"))
    assert engine.fsync_policy("durable") is FsyncPolicy.NO
    engine.set_stream_config("durable", StreamConfig())
    assert engine.fsync_policy("durable") is FsyncPolicy.EVERYSEC  # none of its own: the engine's
    assert [policy.blocks for policy in FsyncPolicy] == [True, False, False]
    with pytest.raises(InvalidArgumentError, match="fsync must be one of always, everysec, no"):
        StreamConfig(fsync="sometimes")


def test_entry_fields_round_trip(open_engine):
    engine = open_engine()
    engine.append(
        "s",
        AppendBatch(
            [b"p1", b"", b"p3"],
            tags=["user-1", "user-2", ""],
            headers=[{"trace": b"\x00\x01", "k": b"v"}, None, {}],
            deliver_at_ms=[0, 123, 0],
        ),
    )
    e0, e1, e2 = engine.read("s", 0, 3).entries()
    assert (e0.tag, e0.payload, e0.headers, e0.deliver_at_ms) == (
        "user-1",
        b"p1",
        {"trace": b"\x00\x01", "k": b"v"},
        0,
    )
    assert (e1.tag, e1.payload, e1.headers, e1.deliver_at_ms) == ("user-2", b"", {}, 123)
    assert (e2.tag, e2.payload) == ("", b"p3")


def test_timestamps_never_go_backwards(open_engine, clock):
    engine = open_engine()
    engine.append("s", AppendBatch([b"a"]))
    clock.advance(-5000)  # the wall clock stepped back
    engine.append("s", AppendBatch([b"b"]))
    a, b = engine.read("s", 0, 2).entries()
    assert b.timestamp_ms == a.timestamp_ms


def test_records_are_protobuf_entry_wire_bytes(open_engine):
    engine = open_engine()
    engine.append("s", AppendBatch([b"hi"], tags=["t"]))
    ts = engine.read("s", 0, 1).entries()[0].timestamp_ms
    ts_varint = bytearray()
    value = ts
    while value > 0x7F:
        ts_varint.append((value & 0x7F) | 0x80)
        value >>= 7
    ts_varint.append(value)
    body = b"\x08\x00" + b"\x10" + bytes(ts_varint) + b"\x1a\x01t" + b"\x22\x02hi"
    assert engine.read("s", 0, 1).data() == b"\x0a" + bytes([len(body)]) + body


@pytest.mark.parametrize("name", ["../x", "a/b", "..", ".", "x" * 255, "ü/ñ %41", "~hash"])
def test_odd_names_are_just_names(open_engine, tmp_path, name):
    engine = open_engine()
    engine.append(name, AppendBatch([b"v"]))
    assert engine.read(name, 0, 1).entries()[0].payload == b"v"
    assert engine.list_streams() == [name]
    for path in (tmp_path / "data").rglob("*"):
        assert (tmp_path / "data") in path.parents  # nothing escaped the data directory
    engine.close()
    assert open_engine().list_streams() == [name]


@pytest.mark.parametrize("name", ["", "a\x00b", "x" * 256, "\udcff"])
def test_bad_names_are_refused(open_engine, name):
    engine = open_engine()
    with pytest.raises(InvalidArgumentError):
        engine.append(name, AppendBatch([b"v"]))
    assert engine.list_streams() == []


def test_limits_are_enforced_with_their_names(open_engine):
    engine = open_engine()
    with pytest.raises(LimitExceededError) as too_many:
        engine.append("s", AppendBatch([b"x"] * 65))
    assert too_many.value.limit == "max_batch_entries"
    with pytest.raises(LimitExceededError) as too_big:
        engine.append("s", AppendBatch([b"x" * 4097]))
    assert too_big.value.limit == "max_entry_bytes"
    with pytest.raises(LimitExceededError) as batch_bytes:
        engine.append("s", AppendBatch([b"x" * 4000] * 5))
    assert batch_bytes.value.limit == "max_batch_bytes"
    with pytest.raises(InvalidArgumentError):
        engine.append("s", AppendBatch([]))
    with pytest.raises(InvalidArgumentError):
        engine.append("s", AppendBatch([b"a"], tags=["a", "b"]))
    with pytest.raises(InvalidArgumentError):
        engine.append("s", AppendBatch([b"a"], deliver_at_ms=[-1]))
    assert not engine.exists("s")  # nothing refused created the stream


def test_unknown_stream_and_bad_read_arguments(open_engine):
    engine = open_engine()
    with pytest.raises(StreamNotFoundError):
        engine.read("nope", 0, 1)
    engine.append("s", AppendBatch([b"a"]))
    with pytest.raises(InvalidArgumentError):
        engine.read("s", -1, 1)
    with pytest.raises(InvalidArgumentError):
        engine.read("s", 0, -1)


def fill(engine, name, n, batch=5, size=20):
    for start in range(0, n, batch):
        k = min(batch, n - start)
        engine.append(name, AppendBatch([f"{start + i:0{size}d}".encode() for i in range(k)]))


def test_reads_across_nodes_segments_and_packing(open_engine):
    engine = open_engine()
    fill(engine, "s", 3000, batch=7, size=40)
    engine.maintain()  # packs (compresses) the full segments
    info = engine.info("s")
    assert info.segments > 2 and info.compression_ratio > 1.5
    got = []
    offset = 0
    while True:
        result = engine.read("s", offset, 101)
        if not result.count:
            break
        got.extend(result.entries())
        offset = result.last_offset + 1
    assert [e.offset for e in got] == list(range(3000))
    assert all(e.payload == f"{e.offset:040d}".encode() for e in got)


def test_reverse_read(open_engine):
    engine = open_engine()
    fill(engine, "s", 50)
    assert offsets(engine.read("s", 20, 5, reverse=True)) == [20, 19, 18, 17, 16]
    assert offsets(engine.read("s", 10_000, 3, reverse=True)) == [49, 48, 47]
    assert offsets(engine.read("s", 2, 10, reverse=True)) == [2, 1, 0]


def test_max_bytes_bounds_a_read_but_returns_at_least_one(open_engine):
    engine = open_engine()
    fill(engine, "s", 40, size=100)
    record = len(engine.read("s", 0, 1).data())
    assert engine.read("s", 0, 40, max_bytes=record * 3 + 1).count == 3
    assert engine.read("s", 0, 40, max_bytes=1).count == 1
    assert engine.read("s", 30, 40, max_bytes=record * 2, reverse=True).count == 2


def test_read_past_the_end_is_empty(open_engine):
    engine = open_engine()
    fill(engine, "s", 10)
    result = engine.read("s", 10, 5)
    assert (result.count, result.records, result.end_offset, result.gap) == (0, [], 10, None)


def test_seek_by_time(open_engine, clock):
    engine = open_engine()
    stamps = []
    for _ in range(30):
        engine.append("s", AppendBatch([b"x"] * 3))
        stamps.append(clock.now_ms)
        clock.advance(10)
    engine.maintain()
    assert engine.seek_time("s", 0) == 0
    assert engine.seek_time("s", stamps[7]) == 21
    assert engine.seek_time("s", stamps[7] + 1) == 24
    assert engine.seek_time("s", stamps[-1] + 1) == 90


def test_count_is_exact(open_engine):
    engine = open_engine()
    fill(engine, "s", 100)
    assert engine.count("s", 0, 100) == 100
    assert engine.count("s", 10, 20) == 10
    assert engine.count("s", 95, 1000) == 5
    engine.trim("s", 50)
    assert engine.count("s", 0, 100) == 50


def test_entries_meta_says_what_node_headers_know_of_a_range(open_engine, clock):
    engine = open_engine()  # nodes of 8 entries
    engine.append("s", AppendBatch([b"x"] * 8))  # node 0..7
    first = clock.now_ms
    clock.advance(10)
    engine.append("s", AppendBatch([b"x"] * 8, deliver_at_ms=[0] * 7 + [first + 99]))  # node 8..15
    clock.advance(10)
    engine.append("s", AppendBatch([b"x"] * 4))  # 16..19, the growing node
    assert engine.entries_meta("s", 0, 8) == EntriesMeta(delayed=False, max_timestamp_ms=first)
    assert engine.entries_meta("s", 3, 5) == EntriesMeta(False, first)
    assert engine.entries_meta("s", 7, 9) == EntriesMeta(True, first + 10)  # whole nodes: a bound
    assert engine.entries_meta("s", 16, 20) == EntriesMeta(False, first + 20)
    engine.maintain()  # packing keeps the flag
    assert engine.entries_meta("s", 8, 16) == EntriesMeta(True, first + 10)
    assert engine.entries_meta("s", 0, 20) == EntriesMeta(True, first + 20)
    with pytest.raises(StreamNotFoundError):
        engine.entries_meta("nope", 0, 1)


def test_evicted_range_is_reported_as_a_gap(open_engine):
    engine = open_engine()
    fill(engine, "s", 100)
    engine.trim("s", 42)
    result = engine.read("s", 10, 3)
    assert result.gap is not None and (result.gap.start_offset, result.gap.end_offset, result.gap.reason) == (
        10,
        42,
        "evicted",
    )
    assert offsets(result) == [42, 43, 44]
    assert result.first_offset == 42


def test_evict_and_keep_last_drop_whole_nodes(open_engine):
    engine = open_engine()
    fill(engine, "s", 100, batch=4)  # 8-entry nodes
    first = engine.evict("s", 20)
    assert first % 8 == 0 and 16 <= first <= 21
    assert engine.read("s", 0, 1).entries()[0].offset == first
    first = engine.keep_last("s", 30)
    assert 100 - first >= 30 and 100 - first < 30 + 8
    assert engine.info("s").end_offset == 100  # offsets never move back


def test_retention_deletes_segment_files(open_engine, tmp_path):
    engine = open_engine()
    fill(engine, "s", 4000, batch=8, size=40)
    directory = next((tmp_path / "data" / "streams").iterdir())
    before = len(list(directory.glob("*.seg")))
    engine.set_stream_config("s", StreamConfig(max_entries=100))
    engine.maintain()
    after = len(list(directory.glob("*.seg")))
    assert before > 3 and after < before
    info = engine.info("s")
    assert info.end_offset - info.first_offset >= 100
    engine.close()
    reopened = open_engine()
    assert reopened.info("s").first_offset == info.first_offset
    assert reopened.read("s", 0, 1).gap.reason == "evicted"


def test_age_and_bytes_retention(open_engine, clock):
    engine = open_engine()
    fill(engine, "old", 40)
    clock.advance(60_000)
    fill(engine, "old", 10)
    engine.set_stream_config("old", StreamConfig(max_age_ms=30_000))
    engine.apply_retention("old")
    assert engine.info("old").first_offset == 40  # exact: the first entry younger than the cutoff
    fill(engine, "big", 2000, batch=8, size=40)
    engine.maintain()
    engine.set_stream_config("big", StreamConfig(max_bytes=20_000))
    engine.apply_retention("big")
    info = engine.info("big")
    assert info.first_offset > 0 and info.end_offset == 2000


def test_retention_floor_hook_holds_entries_back(open_engine):
    engine = open_engine()
    engine.retention_floor = lambda name: 30
    fill(engine, "s", 200)
    engine.keep_last("s", 10)
    assert engine.info("s").first_offset <= 30


def test_compaction_keeps_latest_per_tag_and_offsets(open_engine, clock):
    engine = open_engine(compaction_interval_ms=0)
    engine.create_stream("kv", StreamConfig(compaction=True, tombstone_retention_ms=1000))
    expected = {}
    for i in range(600):
        key = f"k{i % 7}"
        payload = b"" if i == 300 and key == "k6" else f"v{i}".ljust(200).encode()
        engine.append("kv", AppendBatch([payload], tags=[key]))
        expected[key] = (i, payload)
    engine.append("kv", AppendBatch([b"untagged"]))
    removed = engine.compact("kv")
    assert removed > 400
    survivors = engine.read("kv", 0, 1000).entries()
    for entry in survivors:
        if entry.tag:
            offset, _ = expected[entry.tag]
            # Superseded entries are gone from sealed segments; the active segment is never compacted.
            assert entry.offset == offset or entry.offset >= 600 - 200
    assert survivors[-1].payload == b"untagged"
    assert engine.count("kv", 0, 601) == len(survivors)
    gap_read = engine.read("kv", 1, 1)
    assert gap_read.gap is not None and gap_read.gap.reason == "compacted"
    clock.advance(5000)
    engine.compact("kv")
    engine.close()
    again = open_engine().read("kv", 0, 1000).entries()
    assert [e.offset for e in again] == [e.offset for e in survivors]


def test_compression_off_gives_identical_reads(tmp_path, clock):
    results = []
    for compression in (True, False):
        config = EngineConfig(
            segment_bytes=64 * 1024,
            node_entries=8,
            max_batch_entries=64,
            max_batch_bytes=16 * 1024,
            max_entry_bytes=4096,
            background=False,
            compression=compression,
        )
        with Engine(tmp_path / f"d{compression}", config, clock=clock) as engine:
            fill(engine, "s", 1500, batch=9, size=50)
            engine.maintain()
            results.append([engine.read("s", o, 37).data() for o in range(0, 1500, 37)])
    assert results[0] == results[1]


def test_ride_records_compress_below_30_percent(tmp_path, clock):
    config = EngineConfig(
        segment_bytes=1 << 20, max_batch_bytes=256 << 10, max_entry_bytes=4096, background=False
    )
    rides = [
        json.dumps(
            {
                "id": 10_000 + i,
                "distance": round(100 + i * 0.37 % 900, 1),
                "rider": f"user-{i % 500}",
                "city": "San Francisco",
            }
        ).encode()
        for i in range(20_000)
    ]
    with Engine(tmp_path / "d", config, clock=clock) as engine:
        for i in range(0, len(rides), 1000):
            engine.append("rides", AppendBatch(rides[i : i + 1000]))
        engine.maintain()
        info = engine.info("rides")
        packed = sum(p.stat().st_size for p in (tmp_path / "d" / "streams").rglob("*.seg")) - (1 << 20)
    raw = sum(map(len, rides[: 20_000 - 1000]))  # the last segment is still growing
    assert info.compression_ratio > 3
    assert packed < 0.3 * raw * 1.1


def test_reopen_keeps_everything_and_reads_no_blob_at_startup(open_engine, monkeypatch):
    engine = open_engine()
    fill(engine, "s", 500, batch=7)
    engine.maintain()
    before = [engine.read("s", o, 50).data() for o in range(0, 500, 50)]
    engine.close()

    def no_blob_reads(*args, **kwargs):
        raise AssertionError("start-up read a node body")

    monkeypatch.setattr(Segment, "read_body", no_blob_reads)
    reopened = open_engine()
    monkeypatch.undo()
    assert [reopened.read("s", o, 50).data() for o in range(0, 500, 50)] == before
    assert reopened.append("s", AppendBatch([b"next"])).first_offset == 500


def test_unclean_shutdown_keeps_written_entries(tmp_path, clock):
    config = EngineConfig(
        segment_bytes=64 * 1024,
        node_entries=8,
        max_batch_entries=64,
        max_batch_bytes=16 * 1024,
        max_entry_bytes=4096,
        background=False,
    )
    engine = Engine(tmp_path / "d", config, clock=clock)
    fill(engine, "s", 333, batch=6)
    data = engine.read("s", 0, 333).data()
    # Simulate kill -9: drop the engine without close(); the page cache holds every write.
    os.close(engine._lock_fd)
    engine._lock_fd = None
    reopened = Engine(tmp_path / "d", config, clock=clock)
    assert reopened.read("s", 0, 333).data() == data
    reopened.close()


def test_second_engine_on_same_directory_is_refused(tmp_path):
    from storage import PreconditionError

    with Engine(tmp_path / "d", EngineConfig(background=False)), pytest.raises(PreconditionError):
        Engine(tmp_path / "d", EngineConfig(background=False))


def test_always_mode_shares_syncs_between_concurrent_appenders(open_engine, monkeypatch):
    engine = open_engine(fsync="always")
    engine.append("s", AppendBatch([b"warm-up"]))
    calls = []
    from storage import fs as fs_module

    real_sync = fs_module.SegmentFile.sync

    def slow_sync(self):
        calls.append(1)
        threading.Event().wait(0.005)
        real_sync(self)

    monkeypatch.setattr(fs_module.SegmentFile, "sync", slow_sync)
    appends = 8 * 25

    def worker():
        for _ in range(25):
            engine.append("s", AppendBatch([b"x" * 10]))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert engine.info("s").end_offset == appends + 1
    assert len(calls) < appends / 2  # group commit: many appends per sync


@pytest.mark.parametrize("small_streams", ["off", "slots"])
def test_always_mode_fsync_failure_stops_appends(open_engine, monkeypatch, small_streams):
    engine = open_engine(fsync="always", small_streams=small_streams)
    engine.append("s", AppendBatch([b"kept"]))
    from storage import fs as fs_module

    def failing_sync(self):
        raise DurabilityError("injected EIO")

    # The file whose fdatasync fails: the stream's segment, or the pack holding its slot.
    synced = fs_module.SegmentFile if small_streams == "off" else fs_module.PackFile
    monkeypatch.setattr(synced, "sync", failing_sync)
    with pytest.raises(DurabilityError):
        engine.append("s", AppendBatch([b"lost"]))
    monkeypatch.undo()
    with pytest.raises(DurabilityError):
        engine.append("s", AppendBatch([b"refused"]))
    assert [e.payload for e in engine.read("s", 0, 10).entries()] == [b"kept"]


@pytest.mark.parametrize("small_streams", ["off", "slots"])
def test_everysec_fsync_failure_refuses_later_appends_to_the_stream_opened_again_or_not(
    open_engine, monkeypatch, small_streams
):
    """docs/DURABILITY.md, "fsync error": under everysec the round's failed sync refuses every later
    append to the stream until restart. A pack's failure is every slot stream's, closed and reopened
    or not; a new small stream then takes a directory of its own."""
    engine = open_engine(fsync="everysec", max_open_streams=1, small_streams=small_streams)
    engine.append("s", AppendBatch([b"kept"]))
    engine.sync()
    engine.append("s", AppendBatch([b"unsynced"]))
    from storage import fs as fs_module

    def failing_sync(self):
        raise DurabilityError("injected EIO")

    synced = fs_module.SegmentFile if small_streams == "off" else fs_module.PackFile
    monkeypatch.setattr(synced, "sync", failing_sync)
    with pytest.raises(DurabilityError):
        engine.sync()  # the round's
    monkeypatch.undo()
    with pytest.raises(DurabilityError, match="refused"):
        engine.append("s", AppendBatch([b"refused"]))
    engine.append("other", AppendBatch([b"new"]))
    if small_streams == "slots":  # (a directory stream whose sync failed stays open: test_open_streams.py)
        engine._open.discard("s")  # closed and reopened: its pack's failure still refuses it
    with pytest.raises(DurabilityError, match="refused"):
        engine.append("s", AppendBatch([b"refused"]))
    assert [e.payload for e in engine.read("s", 0, 10).entries()] == [b"kept", b"unsynced"]
    assert engine._catalog.place("other") == NO_PLACE  # in a directory: the pack is refused
    assert [e.payload for e in engine.read("other", 0, 10).entries()] == [b"new"]


def test_always_mode_hides_unsynced_entries_from_readers(open_engine):
    engine = open_engine(fsync="always")
    stream_seen = []
    engine.add_append_listener(
        lambda name, nxt: stream_seen.append((name, nxt, engine.info(name).end_offset))
    )
    engine.append("s", AppendBatch([b"a", b"b"]))
    assert stream_seen == [("s", 2, 2)]


def test_delete_stream_removes_its_files(open_engine, tmp_path):
    engine = open_engine()
    fill(engine, "gone", 100)
    engine.delete_stream("gone")
    assert not engine.exists("gone")
    assert list((tmp_path / "data" / "streams").iterdir()) == []
    assert engine.append("gone", AppendBatch([b"new"])).first_offset == 0


def test_stats_and_info(open_engine):
    engine = open_engine()
    fill(engine, "a", 100)
    fill(engine, "b", 10)
    stats = engine.stats()
    assert stats["streams"] == 2 and stats["entries"] == 110
    info = engine.info("a")
    assert (info.entries, info.entries_added, info.first_offset, info.end_offset) == (100, 100, 0, 100)
    # Its one growing segment is as large as what it holds (in steps), not segment_bytes (64 KiB).
    assert info.used_bytes <= info.bytes_on_disk < 64 * 1024 and info.nodes >= 100 // 8


def test_invalid_config_is_refused():
    with pytest.raises(InvalidArgumentError):
        EngineConfig(fsync="sometimes")
    with pytest.raises(InvalidArgumentError):
        EngineConfig(segment_bytes=1024)
    with pytest.raises(InvalidArgumentError):
        StreamConfig(max_entries=-1)


def test_compaction_keeps_only_the_superseded_offsets_of_segments_not_yet_rewritten(open_engine):
    """The index holds one entry per tag, and 8 bytes per superseded entry until its segment is
    rewritten: it does not grow with the stream (the 30-minute soak found a set that did)."""
    engine = open_engine(compaction_interval_ms=0)
    engine.create_stream("kv", StreamConfig(compaction=True))
    for i in range(0, 3000, 50):
        engine.append(
            "kv",
            AppendBatch(
                [f"v{j}".ljust(100).encode() for j in range(i, i + 50)],
                tags=[f"k{j % 7}" for j in range(i, i + 50)],
            ),
        )
    stream = engine._stream("kv")
    assert len(stream.segments) > 3
    engine.compact("kv")
    index = stream.cleaner.tags
    assert len(index.latest) == 7
    # Sealed segments were rewritten without their superseded entries; only the active one's remain.
    assert set(index.superseded) <= {stream.segments[-1].base_offset}
    assert all(row.itemsize == 8 for row in index.superseded.values())
    left = sum(len(row) for row in index.superseded.values())
    assert left <= stream.end_offset - stream.segments[-1].base_offset


def test_compaction_rounds_decode_only_what_was_appended_since_the_last(open_engine, monkeypatch):
    from storage import cleaner as cleaner_module

    engine = open_engine(compaction_interval_ms=0)
    engine.create_stream("kv", StreamConfig(compaction=True))
    for i in range(600):
        engine.append("kv", AppendBatch([f"v{i}".ljust(200).encode()], tags=[f"k{i % 7}"]))
    first_removed = engine.compact("kv")
    decoded = []
    real = cleaner_module.decode_record

    def counting(*args, **kwargs):
        decoded.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cleaner_module, "decode_record", counting)
    for i in range(600, 610):
        engine.append("kv", AppendBatch([f"v{i}".ljust(200).encode()], tags=[f"k{i % 7}"]))
    engine.compact("kv")
    assert first_removed > 400
    assert len(decoded) <= 10  # the new records only, not the whole stream again
    survivors = engine.read("kv", 0, 1000).entries()
    assert {e.tag for e in survivors} == {f"k{i}" for i in range(7)}


def test_append_many_writes_each_batch_in_order_with_its_own_result_or_error(open_engine):
    engine = open_engine()
    woken = []
    engine.add_append_listener(lambda name, end: woken.append((name, end)))
    too_many = AppendBatch([b"x"] * (engine.config.max_batch_entries + 1))
    results = engine.append_many(
        "s",
        [
            (AppendBatch([b"a", b"b"]), None),
            (too_many, None),
            (AppendBatch([b"c"]), ("p", 0)),
            (AppendBatch([b"c"]), ("p", 0)),  # the same producer sequence again: a duplicate
            (AppendBatch([b"d"]), ("", 3)),  # a sequence without a producer id
            (AppendBatch([b"e"]), None),
        ],
    )
    written = [r for r in results if not isinstance(r, Exception)]
    assert [(r.first_offset, r.last_offset, r.duplicate) for r in written] == [
        (0, 1, False),
        (2, 2, False),
        (2, 2, True),
        (3, 3, False),
    ]
    assert isinstance(results[1], LimitExceededError)
    assert isinstance(results[4], InvalidArgumentError)
    assert [e.payload for e in engine.read("s", 0, 10).entries()] == [b"a", b"b", b"c", b"e"]
    assert woken == [("s", 4)]  # one wake-up for the whole write
    # A later resend of the same producer's sequence is a duplicate, as with `append`.
    again = engine.append("s", AppendBatch([b"c"]), producer=("p", 0))
    assert (again.first_offset, again.duplicate) == (2, True)


def test_append_many_writes_a_run_of_plain_batches_as_one_write(open_engine, monkeypatch):
    """Issue 18: a Publish session's coalesced one-entry messages were encoded and written one
    by one (three file writes and a node header each). Consecutive payload-only batches without
    a producer are written together now, each still with its own offsets; a batch with a
    producer or other columns is written on its own, between the runs."""
    engine = open_engine()
    engine.append("s", AppendBatch([b"warm-up"]))
    writes = []
    real_append = GrowingNode.append
    monkeypatch.setattr(GrowingNode, "append", lambda node, *a: (writes.append(1), real_append(node, *a)))
    results = engine.append_many("s", [(AppendBatch([b"m%d" % i]), None) for i in range(50)])
    assert [(r.first_offset, r.last_offset) for r in results] == [(i, i) for i in range(1, 51)]
    assert len(writes) == 1
    assert [e.payload for e in engine.read("s", 1, 100).entries()] == [b"m%d" % i for i in range(50)]

    writes.clear()
    results = engine.append_many(
        "s",
        [
            (AppendBatch([b"a", b"b"]), None),
            (AppendBatch([b"c"]), None),
            (AppendBatch([b"d"]), ("p", 7)),
            (AppendBatch([b"e"], tags=["t"]), None),
            (AppendBatch([b"f"]), None),
            (AppendBatch([b"g"]), None),
        ],
    )
    assert [(r.first_offset, r.last_offset) for r in results] == [
        (51, 52),
        (53, 53),
        (54, 54),
        (55, 55),
        (56, 56),
        (57, 57),
    ]
    assert len(writes) == 4  # a+b+c, d, e, f+g
    entries = engine.read("s", 51, 100).entries()
    assert [e.payload for e in entries] == [b"a", b"b", b"c", b"d", b"e", b"f", b"g"]
    assert entries[4].tag == "t"
    assert engine.append("s", AppendBatch([b"d"]), producer=("p", 7)).duplicate


def test_append_many_writes_plain_batches_on_their_own_past_the_batch_limits(open_engine):
    """Batches written together stay within max_batch_entries, and when together they would
    encode past max_batch_bytes each is written on its own, as before: every batch that passes
    its own checks is appended, in order."""
    engine = open_engine(max_batch_entries=4, max_batch_bytes=1000, max_entry_bytes=1000)
    big = b"x" * 400
    results = engine.append_many("s", [(AppendBatch([big]), None) for _ in range(5)])
    assert [r.first_offset for r in results] == list(range(5))
    results = engine.append_many("s", [(AppendBatch([b"y", b"y", b"y"]), None) for _ in range(3)])
    assert [(r.first_offset, r.last_offset) for r in results] == [(5, 7), (8, 10), (11, 13)]
    assert engine.read("s", 0, 100).entries()[-1].offset == 13


@pytest.mark.parametrize("small_streams", ["off", "slots"])
def test_append_many_under_always_makes_every_batch_durable_with_one_sync(
    open_engine, monkeypatch, small_streams
):
    engine = open_engine(fsync="always", small_streams=small_streams)
    engine.append("s", AppendBatch([b"warm-up"]))
    from storage import fs as fs_module

    syncs = []
    synced = fs_module.SegmentFile if small_streams == "off" else fs_module.PackFile  # see above
    real_sync = synced.sync
    monkeypatch.setattr(synced, "sync", lambda file: (syncs.append(1), real_sync(file)))
    results = engine.append_many("s", [(AppendBatch([b"m%d" % i]), None) for i in range(50)])
    assert [r.first_offset for r in results] == list(range(1, 51))
    assert len(syncs) == 1


def test_append_many_looks_an_open_stream_up_in_no_catalog_and_a_new_one_twice(open_engine, monkeypatch):
    """Each lookup is a dict probe and a bisection (issue 17: AppendMany asked three times per
    new stream, and once per batch to an open one): a new stream is looked up once before the
    cache's lock and once under it (another thread may have created it meanwhile)."""
    from storage.catalog import Catalog

    engine = open_engine(small_streams="slots")
    lookups: list[object] = []
    real = Catalog.__contains__
    monkeypatch.setattr(
        Catalog, "__contains__", lambda catalog, name: (lookups.append(name), real(catalog, name))[1]
    )
    engine.append_many("s", [(AppendBatch([b"a"]), None)])
    assert lookups == ["s", "s"]
    lookups.clear()
    assert engine.append_many("s", [(AppendBatch([b"b"]), None)])[0].first_offset == 1
    assert lookups == []
    assert engine._catalog.place("s") != NO_PLACE  # created in a slot: its first batch fits one
