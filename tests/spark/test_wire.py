"""The Read reply decoder against protobuf itself: same columns for any reply, errors for broken ones."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from streamlog.v1 import streamlog_pb2 as pb

from pyspark_streamlog.wire import Gap, WireError, _decode_with_protobuf, decode_read_response

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
OFFSET = st.integers(min_value=0, max_value=2**63 - 1)

entries = st.builds(
    pb.Entry,
    offset=OFFSET,
    timestamp_ms=st.integers(min_value=0, max_value=2**50),
    tag=st.text(max_size=20),
    payload=st.binary(max_size=300),
    headers=st.dictionaries(st.text(max_size=8), st.binary(max_size=20), max_size=3),
    deliver_at_ms=st.integers(min_value=0, max_value=2**45),
    producer_id=st.text(max_size=10),
    producer_sequence=st.integers(min_value=0, max_value=2**40),
)
reasons = st.sampled_from([1, 2, 3])
gaps = st.none() | st.builds(pb.Gap, start_offset=OFFSET, end_offset=OFFSET, reason=reasons)


def columns(reply) -> tuple:
    return (
        reply.offsets.tolist(),
        reply.timestamps_ms.tolist(),
        reply.tags.to_pylist(),
        reply.payloads.to_pylist(),
        sorted((row, sorted(items)) for row, items in reply.headers),
        reply.first_offset,
        reply.next_offset,
        reply.end_offset,
        reply.gap,
    )


def expected(message: pb.ReadResponse) -> tuple:
    gap = None
    if message.HasField("gap"):
        reason = {1: "evicted", 2: "compacted", 3: "corrupt"}[message.gap.reason]
        gap = Gap(message.gap.start_offset, message.gap.end_offset, reason)
    return (
        [e.offset for e in message.entries],
        [e.timestamp_ms for e in message.entries],
        [e.tag for e in message.entries],
        [e.payload for e in message.entries],
        sorted((row, sorted(e.headers.items())) for row, e in enumerate(message.entries) if e.headers),
        message.first_offset,
        message.next_offset,
        message.end_offset,
        gap,
    )


@settings(max_examples=150, deadline=None)
@given(
    st.lists(entries, max_size=40),
    OFFSET,
    INT64,
    OFFSET,
    gaps,
)
def test_decoder_agrees_with_protobuf(items, first, following, end, gap) -> None:
    message = pb.ReadResponse(
        entries=items, first_offset=first, next_offset=following, end_offset=end, gap=gap
    )
    raw = message.SerializeToString()
    assert columns(decode_read_response(raw)) == expected(message)
    assert columns(_decode_with_protobuf(raw)) == expected(message)


def stored_record(offset: int, timestamp_ms: int, payload: bytes) -> bytes:
    """An entry as the server stores it: offset written even when 0 (protobuf would leave it out)."""

    def varint(value: int) -> bytes:
        out = bytearray()
        while value > 0x7F:
            out.append(value & 0x7F | 0x80)
            value >>= 7
        out.append(value)
        return bytes(out)

    body = b"\x08" + varint(offset) + b"\x10" + varint(timestamp_ms)
    body += b"\x22" + varint(len(payload)) + payload
    return b"\x0a" + varint(len(body)) + body


def test_stored_records_take_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # The server's own encoding (offset 0 written out) must not fall back to the slow decoder.
    def fail(raw: bytes) -> None:
        raise AssertionError("fell back to protobuf")

    monkeypatch.setattr("pyspark_streamlog.wire._decode_with_protobuf", fail)
    payloads = [bytes([i % 256]) * (i % 300) for i in range(2000)]
    raw = b"".join(stored_record(i, 1_790_000_000_000 + i, p) for i, p in enumerate(payloads))
    raw += pb.ReadResponse(first_offset=0, next_offset=2000, end_offset=2500).SerializeToString()
    reply = decode_read_response(raw)
    assert reply.offsets.tolist() == list(range(2000))
    assert reply.payloads.to_pylist() == payloads
    assert reply.tags.to_pylist() == [""] * 2000
    assert (reply.next_offset, reply.end_offset) == (2000, 2500)


def test_out_of_order_fields_fall_back_to_protobuf() -> None:
    # Timestamp before offset is valid protobuf; the fast path does not expect it.
    raw = b"\x0a\x06\x10\x05\x08\x07\x22\x00"
    reply = decode_read_response(raw)
    assert reply.offsets.tolist() == [7]
    assert reply.timestamps_ms.tolist() == [5]


def test_head_keeps_the_first_rows_and_their_headers() -> None:
    message = pb.ReadResponse(
        entries=[pb.Entry(offset=i, timestamp_ms=1, payload=b"p", headers={"k": b"%d" % i}) for i in range(5)]
    )
    head = decode_read_response(message.SerializeToString()).head(2)
    assert head.offsets.tolist() == [0, 1]
    assert head.payloads.to_pylist() == [b"p", b"p"]
    assert head.headers == [(0, [("k", b"0")]), (1, [("k", b"1")])]


@pytest.mark.parametrize(
    "raw",
    [
        b"\x0a\x05\x08\x01",  # entry longer than the reply
        b"\x0a\x04\x08\x01\x10\xff",  # varint cut off inside its entry
        b"\x10" + b"\xff" * 11,  # varint with no end
        b"\x22\x05ab",  # gap field cut off
        b"\x0f",  # wire type 7 does not exist
        b"\x0a\x07\x08\x01\x10\x01\x1a\x01\xff",  # a tag that is not UTF-8
        b"\x0a\x04\x10\x01\x08\x80",  # out of order (protobuf path) and cut off
    ],
)
def test_broken_replies_raise_wire_error(raw: bytes) -> None:
    with pytest.raises(WireError):
        decode_read_response(raw)


def test_large_reply_matches_protobuf() -> None:
    rng = np.random.default_rng(7)
    items = [
        pb.Entry(offset=10**12 + i, timestamp_ms=1_790_000_000_000 + i // 7, payload=rng.bytes(int(n)))
        for i, n in enumerate(rng.integers(0, 3000, size=3000))
    ]
    items[1234].tag = "ride-1234"
    items[2000].headers["source"] = b"api"
    items[-1].producer_id = "spark:q:0:1"
    message = pb.ReadResponse(entries=items, next_offset=10**12 + 3000, end_offset=10**12 + 5000)
    assert columns(decode_read_response(message.SerializeToString())) == expected(message)
