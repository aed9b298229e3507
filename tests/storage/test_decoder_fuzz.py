"""Every on-disk decoder, fed random and mutated bytes: it parses, or it raises CorruptionError.

Nothing else may escape (no IndexError, struct.error, UnicodeDecodeError,
MemoryError from a length field, ...): a damaged file must be reported, never
crash the server. Valid inputs are mutated (bit flips, truncations, splices)
as well as drawn at random, so the decoders are driven past their magic checks.
"""

from __future__ import annotations

import contextlib
import os
import struct
import tempfile
from array import array
from pathlib import Path

import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage import (
    AppendBatch,
    CorruptionError,
    Engine,
    EngineConfig,
    GroupConfig,
    GroupReadOptions,
    StreamConfig,
    grouplog,
    groupops,
)
from storage.dedup import BatchRecord, ProducerTable
from storage.format import NodeBody, NodeHeader, SegmentHeader
from storage.layout import decode_meta, encode_meta
from storage.packed import decode_packed_body, encode_packed_node
from storage.records import decode_records, encode_batch, record_offset_and_timestamp

from .conftest import SMALL

FUZZ = settings(
    max_examples=int(os.environ.get("STREAMLOG_FUZZ_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@st.composite
def mutated(draw, valid: bytes) -> bytes:
    """`valid` with a few bit flips, a truncation or extension, or a spliced run of random bytes."""
    data = bytearray(valid)
    for _ in range(draw(st.integers(0, 4))):
        if data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
    cut = draw(st.integers(0, len(data)))
    tail = draw(st.binary(max_size=16))
    return bytes(data[:cut]) + tail if draw(st.booleans()) else bytes(data)


def _parses_or_corrupt(decode, raw: bytes) -> None:
    with contextlib.suppress(CorruptionError):
        decode(raw)


_BLOB, _POSITIONS = encode_batch(
    1234,
    1_700_000_000_000,
    AppendBatch([b"payload-one", b"", b"x" * 300], ["tag", "", "é"], [None, {"k": b"v"}, {}], [0, 5, 0]),
)
_SEGMENT_HEADER = SegmentHeader(1000, 2000, 65536, 7, 1).encode()
_PACKED = encode_packed_node(NodeBody(1234, _POSITIONS, _BLOB), 1, 2, 0, zstandard.ZstdCompressor())
_META = encode_meta("stream/é", 42, StreamConfig(max_entries=10, compaction=True))


def _producer_snapshot() -> bytes:
    table = ProducerTable(4, 60_000, 10)
    table.record("producer-1", 3, BatchRecord(0, 9, 1))
    table.record("producer-2", 0, BatchRecord(10, 10, 2))
    return table.encode()


_PRODUCERS = _producer_snapshot()


def _decode_packed(raw: bytes) -> None:
    header = NodeHeader.decode(raw[:64])
    if header is None:
        raise CorruptionError("no valid header")
    body = decode_packed_body(header, raw[128 : 128 + header.stored_len], zstandard.ZstdDecompressor())
    decode_records(body.blob)


def _decode_record_prefix(raw: bytes) -> None:
    if raw:
        record_offset_and_timestamp(raw, 0)


def _load_producers(raw: bytes) -> None:
    ProducerTable(4, 60_000, 10).load(raw)


@FUZZ
@given(st.one_of(st.binary(max_size=80), mutated(_SEGMENT_HEADER)))
def test_segment_header(raw):
    _parses_or_corrupt(SegmentHeader.decode, raw)


@FUZZ
@given(st.one_of(st.binary(max_size=80), mutated(_PACKED[:64])))
def test_node_header_returns_a_header_or_none(raw):
    assert NodeHeader.decode(raw) is None or isinstance(NodeHeader.decode(raw), NodeHeader)


@FUZZ
@given(st.one_of(st.binary(max_size=600), mutated(_PACKED)))
def test_packed_node(raw):
    _parses_or_corrupt(_decode_packed, raw)


@FUZZ
@given(st.one_of(st.binary(max_size=600), mutated(_BLOB)))
def test_entry_records(raw):
    _parses_or_corrupt(decode_records, raw)
    _parses_or_corrupt(_decode_record_prefix, raw)


@FUZZ
@given(st.one_of(st.binary(max_size=300), mutated(_META)))
def test_stream_meta(raw):
    _parses_or_corrupt(decode_meta, raw)


@FUZZ
@given(st.one_of(st.binary(max_size=300), mutated(_PRODUCERS)))
def test_producer_snapshot(raw):
    _parses_or_corrupt(_load_producers, raw)


def _real_group_files() -> tuple[bytes, bytes, bytes]:
    """A snapshot, a journal (cut after its last record) and one record body, made by a real engine."""
    with tempfile.TemporaryDirectory() as tmp, Engine(tmp, EngineConfig(**SMALL)) as engine:
        engine.append("s", AppendBatch([b"a"] * 10))
        engine.create_group("s", "g", config=GroupConfig(max_pending=100))
        taken = engine.read_group("s", "g", GroupReadOptions("consumer-1", 5, retry_ms=1000))
        engine.ack("s", "g", offsets=taken.offsets[:2], ranges=[(3, 5)])
        engine.nack("s", "g", [2], delay_ms=10)
        directory = Path(tmp) / "streams" / "s"
        snapshot = (directory / "groups.snapshot").read_bytes()
        journal = next(directory.glob("groups-*.journal")).read_bytes()
    _, records, end, _ = grouplog.scan_journal(journal, _generation(journal))
    assert records > 0
    first_length = struct.unpack_from("<I", journal, grouplog.HEADER_SIZE)[0]
    body_start = grouplog.HEADER_SIZE + grouplog.RECORD_HEADER_SIZE
    return snapshot, journal[:end], journal[body_start : body_start + first_length]


def _generation(journal: bytes) -> int:
    return grouplog._JOURNAL_HEADER.unpack(journal[: grouplog.HEADER_SIZE - 4])[3]


_GROUP_SNAPSHOT, _JOURNAL, _OPS_BODY = _real_group_files()


@FUZZ
@given(st.one_of(st.binary(max_size=400), mutated(_GROUP_SNAPSHOT)))
def test_group_snapshot(raw):
    _parses_or_corrupt(grouplog.decode_snapshot, raw)


@FUZZ
@given(st.one_of(st.binary(max_size=400), mutated(_OPS_BODY)))
def test_group_journal_ops(raw):
    _parses_or_corrupt(groupops.decode_ops, raw)


@FUZZ
@given(st.one_of(st.binary(max_size=400), mutated(_JOURNAL)))
def test_group_journal_scan_cuts_or_raises(raw):
    _parses_or_corrupt(lambda data: grouplog.scan_journal(data, _generation(_JOURNAL)), raw)


def test_fixtures_are_valid_before_mutation():
    """The seeds the fuzzers mutate must decode: otherwise only the error paths would be exercised."""
    assert SegmentHeader.decode(_SEGMENT_HEADER).base_offset == 1000
    _decode_packed(_PACKED)
    assert [e.offset for e in decode_records(_BLOB)] == [1234, 1235, 1236]
    assert decode_meta(_META)[:2] == ("stream/é", 42)
    _load_producers(_PRODUCERS)
    assert grouplog.decode_snapshot(_GROUP_SNAPSHOT) and groupops.decode_ops(_OPS_BODY)
    assert isinstance(_POSITIONS, array)
