"""The stored-record contract the zero-copy read path depends on.

The engine stores each entry as the protobuf encoding of one element of
`repeated Entry entries = 1`, so a Read or Subscribe reply is the stored
records joined, followed by the reply's other fields (service/servicer.py).
Here the engine's encoder (storage.records) is checked against protobuf's own
serializer, byte for byte, and both are decoded back. storage itself never
imports protobuf, hence this test lives with the service.

Protobuf leaves the order of map entries to the implementation (upb's
"deterministic" order is not even lexicographic: "ab" comes before "a"); the
engine writes headers in key order. So the expected bytes of an entry are
protobuf's encoding of the entry without its headers, with protobuf's encoding
of each header alone spliced in, in key order: fields may be written apart and
in any order, and parse as one message.

The one liberty the encoder takes is documented in docs/FORMAT.md: offset and
timestamp_ms are always written, first, even when 0 (protobuf leaves a 0 out),
and so is a producer sequence of 0. Protobuf parsers read both forms as the
same message; the last test pins that case.
"""

from __future__ import annotations

from google.protobuf import wrappers_pb2
from hypothesis import given, settings
from hypothesis import strategies as st
from streamlog.v1 import streamlog_pb2 as pb

from storage import AppendBatch
from storage.records import attach_producer, decode_records, encode_batch

INT64_MAX = 2**63 - 1
positive = st.one_of(st.integers(min_value=1, max_value=300), st.integers(min_value=1, max_value=INT64_MAX))
payloads = st.one_of(
    st.binary(max_size=200), st.sampled_from([127, 128, 16383, 16384, 20000]).map(lambda n: b"p" * n)
)
headers = st.one_of(
    st.none(),
    st.just({}),
    st.dictionaries(st.text(max_size=6), st.binary(max_size=6), max_size=4),
)
producers = st.one_of(st.none(), st.tuples(st.text(min_size=1, max_size=20), positive))


@st.composite
def batches(draw):
    n = draw(st.integers(min_value=1, max_value=8))
    first = draw(st.integers(min_value=1, max_value=INT64_MAX - n))
    entries = [
        pb.Entry(
            offset=first + i,
            tag=draw(st.text(max_size=10)),
            payload=draw(payloads),
            headers=draw(headers),
            deliver_at_ms=draw(st.one_of(st.just(0), positive)),
        )
        for i in range(n)
    ]
    # The engine takes columns, None for one no entry uses (as the servicer builds them).
    plain = draw(st.booleans())
    batch = AppendBatch(
        [e.payload for e in entries],
        tags=None if plain and not any(e.tag for e in entries) else [e.tag for e in entries],
        headers=None if plain and not any(e.headers for e in entries) else [dict(e.headers) for e in entries],
        deliver_at_ms=None
        if plain and not any(e.deliver_at_ms for e in entries)
        else [e.deliver_at_ms for e in entries],
    )
    return first, entries, batch, draw(producers)


def protobuf_record(entry: pb.Entry) -> bytes:
    """Protobuf's encoding of `entry` as an element of `repeated Entry entries = 1`, headers in key order."""
    fields = pb.Entry()
    fields.CopyFrom(entry)
    fields.ClearField("headers")
    fields.ClearField("deliver_at_ms")
    fields.ClearField("producer_id")
    fields.ClearField("producer_sequence")
    tail = pb.Entry(
        deliver_at_ms=entry.deliver_at_ms,
        producer_id=entry.producer_id,
        producer_sequence=entry.producer_sequence,
    )
    body = b"".join(
        [
            fields.SerializeToString(),
            *(pb.Entry(headers={k: entry.headers[k]}).SerializeToString() for k in sorted(entry.headers)),
            tail.SerializeToString(),
        ]
    )
    # A BytesValue is field 1, length-delimited: the framing of one element of `entries = 1`.
    return wrappers_pb2.BytesValue(value=body).SerializeToString()


def engine_records(first: int, timestamp_ms: int, batch: AppendBatch, producer) -> tuple[bytes, list]:
    """The bytes the engine stores for a batch, and its record boundaries."""
    blob, positions = encode_batch(first, timestamp_ms, batch)
    if producer is not None:
        blob = attach_producer(blob, positions[-2], *producer)
        positions[-1] = len(blob)
    return blob, list(positions)


@settings(max_examples=400, deadline=None)
@given(batch=batches(), timestamp_ms=positive)
def test_a_stored_record_is_the_protobuf_encoding_of_its_entry(batch, timestamp_ms):
    first, entries, columns, producer = batch
    for entry in entries:
        entry.timestamp_ms = timestamp_ms
    if producer is not None:
        entries[-1].producer_id, entries[-1].producer_sequence = producer
    blob, positions = engine_records(first, timestamp_ms, columns, producer)
    assert blob == b"".join(map(protobuf_record, entries))
    for i, entry in enumerate(entries):
        record = blob[positions[i] : positions[i + 1]]
        assert record == protobuf_record(entry)
        if len(entry.headers) < 2:  # no order to choose: protobuf's own encoding of the whole reply
            assert record == pb.ReadResponse(entries=[entry]).SerializeToString()
    # Decoded back: by protobuf as a client would, and by the engine.
    assert list(pb.ReadResponse.FromString(blob).entries) == entries
    decoded = decode_records(blob)
    assert [(e.offset, e.timestamp_ms, e.tag, e.payload, e.headers, e.deliver_at_ms) for e in decoded] == [
        (e.offset, e.timestamp_ms, e.tag, e.payload, dict(e.headers), e.deliver_at_ms) for e in entries
    ]
    assert [(e.producer_id, e.producer_sequence) for e in decoded] == [
        (e.producer_id, e.producer_sequence) for e in entries
    ]


def test_stored_records_followed_by_the_other_fields_are_a_read_reply():
    """What the servicer sends: the records joined, then the reply's scalar fields serialized alone."""
    blob, _ = engine_records(5, 1_700_000_000_000, AppendBatch([b"a", b"b"], tags=["t", ""]), None)
    tail = pb.ReadResponse(first_offset=0, next_offset=7, end_offset=7).SerializeToString()
    reply = pb.ReadResponse.FromString(blob + tail)
    assert [(e.offset, e.tag, e.payload) for e in reply.entries] == [(5, "t", b"a"), (6, "", b"b")]
    assert (reply.first_offset, reply.next_offset, reply.end_offset) == (0, 7, 7)


def test_zero_offset_timestamp_and_sequence_are_written_out_and_read_as_protobuf_reads_them():
    blob, _ = engine_records(0, 0, AppendBatch([b"x"]), ("p", 0))
    entry = pb.Entry(offset=0, timestamp_ms=0, payload=b"x", producer_id="p", producer_sequence=0)
    protobuf = pb.ReadResponse(entries=[entry]).SerializeToString()
    assert protobuf == b"\x0a\x06\x22\x01x\x72\x01p"  # protobuf leaves the zeros out
    assert blob == b"\x0a\x0c\x08\x00\x10\x00\x22\x01x\x72\x01p\x78\x00"  # the engine writes them
    assert list(pb.ReadResponse.FromString(blob).entries) == [entry]
