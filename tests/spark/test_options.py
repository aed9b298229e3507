"""Option parsing, range splitting and the per-trigger budget, without Spark."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pyspark_streamlog.errors import OptionError
from pyspark_streamlog.options import EARLIEST, LATEST, Position, Server, parse_read, parse_write
from pyspark_streamlog.reading import split, spread
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
    assert batch.read_from == stream.read_from == "replica"
    assert parse_read({"endpoint": "h:1", "streams": "a", "readFrom": " Leader"}, False).read_from == "leader"


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
    assert parse_read({"streams": "a"}, streaming=False).server.address == "env-host:7070"
    assert parse_read({"streams": "a", "endpoint": "opt:1"}, streaming=False).server.address == "opt:1"
    assert parse_write({"stream": "a"}).server.address == "env-host:7070"


def test_endpoint_takes_a_clusters_seed_addresses() -> None:
    # Several nodes, comma-separated (as Client and the CLI's --address take them), normalized.
    parsed = parse_read({"endpoint": " n1:7070, n2:7070 ,,n1:7070,n3:7070 ", "streams": "a"}, True)
    assert parsed.server.address == "n1:7070,n2:7070,n3:7070"
    with pytest.raises(OptionError, match="no streamlog server given"):
        parse_write({"endpoint": " , "})


def test_connection_options_are_the_clients(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STREAMLOG_TOKEN", raising=False)
    assert parse_write({"endpoint": "h:1"}).server == Server("h:1")
    assert parse_write({"endpoint": "h:1", "tls": "true"}).server == Server("h:1", tls=True)
    for name in ("ca", "cert", "key"):
        (tmp_path / name).write_bytes(b"-----BEGIN " + name.encode() + b"-----\n")
    options = {
        "endpoint": "h:1",
        "tlsCa": str(tmp_path / "ca"),
        "TLSCERT": str(tmp_path / "cert"),
        "tlsKey": str(tmp_path / "key"),
        "tlsServerName": "streamlog.internal",
        "token": "t0k3n",
    }
    server = parse_read({**options, "streams": "a"}, streaming=False).server
    # The files are read here, on the driver: the tasks get their contents.
    assert server == Server(
        address="h:1",
        token="t0k3n",
        tls=True,
        root_certificates=b"-----BEGIN ca-----\n",
        certificate_chain=b"-----BEGIN cert-----\n",
        private_key=b"-----BEGIN key-----\n",
        server_name="streamlog.internal",
    )
    # Pickled into the tasks, where it keys the channel cache.
    copy = pickle.loads(pickle.dumps(server))
    assert copy == server and hash(copy) == hash(server)
    assert "t0k3n" not in repr(server) and "BEGIN" not in repr(server)
    # The token comes from STREAMLOG_TOKEN, as the CLI's, unless the option gives one.
    monkeypatch.setenv("STREAMLOG_TOKEN", "from-env")
    assert parse_write({"endpoint": "h:1"}).server.token == "from-env"
    assert parse_write({**options}).server.token == "t0k3n"


def test_bad_connection_options(tmp_path: Path) -> None:
    (tmp_path / "ca.pem").write_bytes(b"-----BEGIN CERTIFICATE-----\n")
    (tmp_path / "plain.txt").write_text("not a certificate")
    ca = str(tmp_path / "ca.pem")
    cases = [
        ({"tlsCert": ca}, "tlsCert and tlsKey go together"),
        ({"tlsKey": ca}, "tlsCert and tlsKey go together"),
        ({"tlsCa": str(tmp_path / "missing.pem")}, r"tlsCa: cannot read .*missing\.pem"),
        ({"tlsCa": str(tmp_path / "plain.txt")}, "not a PEM file"),
        ({"tlsCa": ca, "tls": "false"}, "tls is false, but tlsCa"),
        ({"tlsServerName": "x"}, "tlsServerName is for TLS"),
        ({"tls": "yes"}, "tls must be true or false"),
    ]
    for options, message in cases:
        with pytest.raises(OptionError, match=message):
            parse_write({"endpoint": "h:1", **options})


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
        ({"streams": "a", "readFrom": "follower"}, True, "readFrom must be replica or leader, got 'fol"),
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


def test_partitions_spread_over_their_streams_in_sync_replicas() -> None:
    isr = ["n1", "n2", "n3"]
    # One stream's partitions: one per in-sync replica, in turn.
    pieces = split([("a", 0, 600)], 100, None)
    assert spread(pieces, {"a": isr}) == ["n1", "n2", "n3"] * 2
    # Several streams: the fewest offsets so far, across the streams, not each stream from n1.
    pieces = [("a", 0, 100), ("b", 0, 100), ("c", 0, 100), ("d", 0, 300), ("e", 0, 50)]
    assert spread(pieces, dict.fromkeys("abcde", isr)) == ["n1", "n2", "n3", "n1", "n2"]
    # Only a stream's own in-sync replicas; a stream with none known is read from its leader.
    pieces = [("a", 0, 100), ("b", 0, 100), ("b", 100, 200), ("c", 0, 100)]
    assert spread(pieces, {"a": ["n1"], "b": ["n1", "n3"], "c": []}) == ["n1", "n3", "n1", None]
    # Successive plans (a streaming query's micro-batches of one partition) start on another node.
    assert [spread([("a", 0, 10)], {"a": isr}, turn)[0] for turn in range(4)] == ["n1", "n2", "n3", "n1"]
    assert spread([("a", 0, 10)], {"a": ["n1", "n3"]}, 1) == ["n3"]  # turns count the nodes in sync
    assert spread([("a", 0, 10)], {}) == [None]


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
