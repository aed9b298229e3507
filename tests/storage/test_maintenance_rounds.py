"""A maintenance round's work on the open streams (storage/maintenance.py, issue 17).

A round visits only the open streams it has something to do for: written since their last
upkeep, not yet durable, or with producers, limits or compaction that time alone makes due.
An idle stream in a full cache costs the round no call (its Python work holds the GIL that
every call overlapping the round waits for), yet time-driven upkeep still happens.
"""

from __future__ import annotations

from storage import AppendBatch, StreamConfig

IDLE = [f"idle-{i}" for i in range(20)]


def upkept_by_next_round(engine) -> list[str]:
    """The streams the next round keeps up (packing, retention, producers, compaction)."""
    seen: list[str] = []
    upkeep = engine._upkeep

    def counted(stream, now):
        seen.append(stream.name)
        upkeep(stream, now)

    engine._upkeep = counted
    try:
        engine.maintain()
    finally:
        del engine._upkeep
    return sorted(seen)


def test_a_round_keeps_up_only_the_open_streams_that_have_something_due(open_engine):
    engine = open_engine(max_open_streams=64)
    for name in IDLE:
        engine.append(name, AppendBatch([name.encode()]))
    engine.append("aged", AppendBatch([b"a"]))
    engine.set_stream_config("aged", StreamConfig(max_age_ms=60_000))
    engine.append("produced", AppendBatch([b"p"]), producer=("writer", 1))
    engine.maintain()  # the writes' syncs and first upkeep
    assert engine.open_streams() == len(IDLE) + 2

    # Idle streams are left alone; a limit and a producer table can come due with time alone.
    assert upkept_by_next_round(engine) == ["aged", "produced"]
    # A read writes nothing; an append makes its stream due once.
    engine.read(IDLE[0], 0, 10)
    engine.append(IDLE[3], AppendBatch([b"again"]))
    assert upkept_by_next_round(engine) == ["aged", IDLE[3], "produced"]
    assert upkept_by_next_round(engine) == ["aged", "produced"]


def test_time_driven_upkeep_of_an_idle_open_stream_still_happens(open_engine, clock):
    engine = open_engine(max_open_streams=64, dedup_window_ms=10_000)
    engine.append("aged", AppendBatch([b"old"] * 20))  # two sealed nodes and the growing one
    engine.set_stream_config("aged", StreamConfig(max_age_ms=5_000))
    engine.append("produced", AppendBatch([b"p"]), producer=("writer", 1))
    engine.maintain()
    assert engine.bounds("aged").first_offset == 0

    clock.advance(20_000)  # past the age limit and the dedup window, with no write since
    engine.maintain()
    assert engine.bounds("aged").first_offset > 0  # its old sealed nodes evicted
    # The producer was forgotten: the same sequence is a new batch, not a duplicate.
    assert not engine.append("produced", AppendBatch([b"p"]), producer=("writer", 1)).duplicate


def test_a_round_opens_no_closed_stream_for_consumer_groups_it_never_had(open_engine):
    """A metrics scrape lists the groups of every open stream; a stream it saw and the cache closed
    since, with no group, costs the rounds nothing (they opened it for its fsync policy, closing
    another: every stream a scrape ever saw, each round, 325 ms of a round holding the GIL and the
    cache's lock against the calls, issue 17)."""
    engine = open_engine(max_open_streams=4)
    names = [f"seen-{i}" for i in range(12)]
    for name in names:
        engine.append(name, AppendBatch([name.encode()]))
        assert engine.list_groups(name) == []  # as a scrape asks (service/metrics.py)
    engine.append("grouped", AppendBatch([b"g"]))
    engine.create_group("grouped", "readers", start=0)  # a stream with a group is still kept up
    engine.maintain()
    opened: list[str] = []
    cache = engine._open
    open_stream = cache._open_stream
    cache._open_stream = lambda name: opened.append(name) or open_stream(name)
    engine.maintain()
    assert not set(opened) & set(names)
    assert engine.list_groups("grouped")[0].name == "readers"
