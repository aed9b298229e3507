"""Option parsing, range splitting and the per-trigger budget, without Spark."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pyspark_streamlog.errors import OptionError
from pyspark_streamlog.options import EARLIEST, LATEST, Position, parse_read, parse_write
from pyspark_streamlog.reading import split
from pyspark_streamlog.source import _admit


def test_defaults_follow_the_kafka_connector() -> None:
    batch = parse_read({"endpoint": "h:1", "streams": " a , b ,a"}, streaming=False)
    assert batch.streams == ("a", "b")
    assert batch.starting == {"a": Position(offset=EARLIEST), "b": Position(offset=EARLIEST)}
    assert batch.ending == {"a": Position(offset=LATEST), "b": Position(offset=LATEST)}
    assert (batch.fail_on_data_loss, batch.payload_as_string, batch.include_headers) == (True, False, True)
    stream = parse_read({"endpoint": "h:1", "streams": "a"}, streaming=True)
    assert stream.starting == {"a": Position(offset=LATEST)}
    assert stream.max_entries_per_trigger is None


def test_option_names_are_case_insensitive() -> None:
    parsed = parse_read(
        {"ENDPOINT": "h:1", "Streams": "a", "MAXENTRIESPERTRIGGER": "7", "failondataloss": "FALSE"}, True
    )
    assert (parsed.max_entries_per_trigger, parsed.fail_on_data_loss) == (7, False)


def test_json_positions_and_timestamps() -> None:
    parsed = parse_read(
        {"endpoint": "h:1", "streams": "a,b", "startingOffsets": '{"a": 5, "b": -2}', "endingTimestamp": "9"},
        streaming=False,
    )
    assert parsed.starting == {"a": Position(offset=5), "b": Position(offset=EARLIEST)}
    assert parsed.ending == {"a": Position(timestamp_ms=9), "b": Position(timestamp_ms=9)}


def test_endpoint_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMLOG_ADDRESS", "env-host:7070")
    assert parse_read({"streams": "a"}, streaming=False).endpoint == "env-host:7070"
    assert parse_read({"streams": "a", "endpoint": "opt:1"}, streaming=False).endpoint == "opt:1"
    assert parse_write({"stream": "a"}).endpoint == "env-host:7070"


@pytest.mark.parametrize(
    ("options", "streaming", "message"),
    [
        ({"streams": "a", "endingOffsets": "latest"}, True, "unknown option.*endingOffsets"),
        ({"streams": "a", "endingOffsets": "earliest"}, False, "cannot be earliest"),
        ({"streams": "a,b", "startingOffsets": '{"a": 1}'}, False, "missing: b"),
        ({"streams": "a", "startingOffsets": '{"a": -3}'}, False, "offset >= 0, -2"),
        ({"streams": "a", "startingOffsets": '{"a": true}'}, False, "offset >= 0, -2"),
        ({"streams": "a", "startingOffsets": "[1]"}, False, "must be an object"),
        ({"streams": "a", "failOnDataLoss": "yes"}, False, "true or false"),
        ({"streams": "a", "entriesPerPartition": "x"}, False, "must be an integer"),
        ({"streams": "a", "startingTimestamp": "-1"}, False, "at least 0"),
        ({"streams": "x" * 256}, False, "not a valid stream name"),
        ({"streams": " , "}, False, "streams option is required"),
    ],
)
def test_bad_read_options(options: dict, streaming: bool, message: str) -> None:
    with pytest.raises(OptionError, match=message):
        parse_read({"endpoint": "h:1", **options}, streaming)


def test_write_options() -> None:
    parsed = parse_write({"endpoint": "h:1", "stream": "out", "producerId": "daily-2026-11-22"})
    assert (parsed.stream, parsed.producer_id, parsed.entries_per_append) == ("out", "daily-2026-11-22", 5000)
    # Spark hands a sink the query's own options too.
    parse_write({"endpoint": "h:1", "checkpointLocation": "/tmp/x"})
    with pytest.raises(OptionError, match=r"unknown option.*streams"):
        parse_write({"endpoint": "h:1", "streams": "a"})
    with pytest.raises(OptionError, match=r"producerId must be 1\.\.200 bytes"):
        parse_write({"endpoint": "h:1", "producerId": "p" * 201})


def test_split_by_size_then_min_partitions() -> None:
    assert split([("a", 0, 10)], 4, None) == [("a", 0, 3), ("a", 3, 7), ("a", 7, 10)]
    assert split([("a", 5, 5)], 4, 3) == []
    # minPartitions cuts in proportion: the big stream gets most of the pieces.
    pieces = split([("big", 0, 900), ("small", 0, 100)], 10_000, 10)
    assert [p for p in pieces if p[0] == "small"] == [("small", 0, 100)]
    assert len([p for p in pieces if p[0] == "big"]) == 9
    # Never more pieces than entries.
    assert split([("a", 0, 2)], 100, 5) == [("a", 0, 1), ("a", 1, 2)]


@given(
    st.dictionaries(
        st.text(min_size=1, max_size=3),
        st.tuples(st.integers(0, 10**5), st.integers(0, 10**5)),
        min_size=1,
        max_size=5,
    ),
    st.integers(100, 10**5),
    st.integers(1, 2000),
)
def test_split_covers_each_range_exactly(bounds, size, minimum) -> None:
    ranges = [(s, min(a, b), max(a, b)) for s, (a, b) in bounds.items()]
    pieces = split(ranges, size, minimum)
    for stream, start, end in ranges:
        mine = sorted((lo, hi) for s, lo, hi in pieces if s == stream)
        covered = [x for lo, hi in mine for x in (lo, hi)]
        if end > start:
            assert covered[0] == start and covered[-1] == end
            assert all(a == b for a, b in zip(covered[1:-1:2], covered[2::2], strict=True))
            assert all(0 < hi - lo <= size for lo, hi in mine)
        else:
            assert mine == []


@given(
    st.dictionaries(
        st.text(min_size=1, max_size=3),
        st.tuples(st.integers(0, 1000), st.integers(0, 1000)),
        min_size=1,
        max_size=6,
    ),
    st.integers(1, 3000),
)
def test_admission_uses_the_budget_and_stays_in_range(streams, budget) -> None:
    begin = {s: min(a, b) for s, (a, b) in streams.items()}
    latest = {s: max(a, b) for s, (a, b) in streams.items()}
    end = _admit(begin, latest, budget)
    waiting = sum(latest[s] - begin[s] for s in begin)
    assert all(begin[s] <= end[s] <= latest[s] for s in begin)
    assert sum(end[s] - begin[s] for s in begin) == min(budget, waiting)
