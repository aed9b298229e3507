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
