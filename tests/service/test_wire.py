"""The payload-only check of Append batches, against a plain per-entry model."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from streamlog.v1 import streamlog_pb2 as pb

from service.wire import entries_hold_only_payloads, payload_only_size, varint_size

# Lengths around every varint step an entry can reach, where off-by-ones would hide.
EDGES = [
    1,
    2,
    125,
    126,
    127,
    128,
    129,
    16379,
    16380,
    16381,
    16382,
    16383,
    16384,
    16385,
    2**21 - 5,
    2**21 - 4,
    2**21,
]

entries = st.builds(
    pb.Entry,
    payload=st.one_of(st.binary(max_size=300), st.sampled_from(EDGES).map(lambda n: b"p" * n)),
    tag=st.one_of(st.just(""), st.text(max_size=5)),
    headers=st.one_of(st.just({}), st.dictionaries(st.text(max_size=3), st.binary(max_size=3), max_size=2)),
    deliver_at_ms=st.one_of(st.just(0), st.integers(min_value=-5, max_value=2**40)),
    offset=st.one_of(st.just(0), st.integers(min_value=1, max_value=2**40)),
    timestamp_ms=st.one_of(st.just(0), st.integers(min_value=1, max_value=2**45)),
)


def is_payload_only(entry: pb.Entry) -> bool:
    return bool(entry.payload) and entry == pb.Entry(payload=entry.payload)


@settings(max_examples=300, deadline=None)
@given(stream=st.text(max_size=300), batch=st.lists(entries, min_size=1, max_size=8))
def test_the_size_check_agrees_with_looking_at_every_entry(stream: str, batch: list[pb.Entry]) -> None:
    request = pb.AppendRequest(stream=stream, entries=batch)
    payloads = [e.payload for e in request.entries]
    expected = all(is_payload_only(e) for e in batch)
    assert entries_hold_only_payloads(request, stream, payloads) == expected


@settings(max_examples=100, deadline=None)
@given(stream=st.text(max_size=300), lengths=st.lists(st.sampled_from(EDGES), min_size=1, max_size=4))
def test_payload_only_size_is_the_encoded_size(stream: str, lengths: list[int]) -> None:
    request = pb.AppendRequest(stream=stream, entries=[pb.Entry(payload=b"x" * n) for n in lengths])
    assert payload_only_size(len(stream.encode()), lengths) == request.ByteSize()


def test_varint_size() -> None:
    assert [varint_size(n) for n in (0, 127, 128, 16383, 16384, 2**21 - 1, 2**21)] == [1, 1, 2, 2, 3, 3, 4]
