"""Entry records: how one entry is encoded inside a node's blob.

A record is exactly the protobuf wire encoding of one element of
`repeated streamlog.v1.Entry entries = 1` (see docs/FORMAT.md): the key byte
0x0A, a varint length, then the Entry fields

    1 offset (varint)  2 timestamp_ms (varint)  3 tag (bytes)  4 payload (bytes)
    5 headers (map entries: 1 key, 2 value)     6 deliver_at_ms (varint)
    14 producer_id (bytes)  15 producer_sequence (varint), on the last entry of an idempotent batch

Storing the wire form means a read hands a contiguous slice of the blob to the
network with no per-entry re-encoding (Kafka keeps one record format for
producer, disk and consumer for the same reason). The engine encodes and
decodes these bytes itself: `storage` does not depend on protobuf.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import accumulate
from operator import add

from storage.errors import CorruptionError
from storage.types import AppendBatch

# Varints come from tables: the append path runs per entry, and a lookup is several times
# cheaper than a loop. Numbers below 2**14 (lengths, mostly) are one lookup; a bigger one (an
# offset, a timestamp) takes its low 14 bits at a time from _CONTINUED (two bytes, both with the
# continuation bit), then its rest from _SMALL_VARINTS.
_SMALL_LIMIT = 1 << 14
_SMALL_VARINTS = [
    bytes((i,)) if i < 0x80 else bytes(((i & 0x7F) | 0x80, i >> 7)) for i in range(_SMALL_LIMIT)
]
_CONTINUED = [bytes(((i & 0x7F) | 0x80, (i >> 7) | 0x80)) for i in range(_SMALL_LIMIT)]
_LOW_BYTES = [bytes([i | 0x80]) for i in range(128)]


def encode_varint(value: int) -> bytes:
    if value < _SMALL_LIMIT:
        if value < 0:
            raise ValueError(f"a varint cannot hold {value}")
        return _SMALL_VARINTS[value]
    out = b""
    while value >= _SMALL_LIMIT:
        out += _CONTINUED[value & 0x3FFF]
        value >>= 14
    return out + _SMALL_VARINTS[value]


def _consecutive_varints(first: int, count: int) -> list[bytes]:
    """Varints of first .. first+count-1. All but the low 7 bits change only every 128 numbers."""
    out: list[bytes] = []
    value, end = first, first + count
    while value < end:
        high = value >> 7
        stop = min(end, (high + 1) << 7)
        if high == 0:
            out.extend(_SMALL_VARINTS[value:stop])
        else:
            rest = encode_varint(high)
            low = value & 0x7F
            out.extend([b + rest for b in _LOW_BYTES[low : low + stop - value]])
        value = stop
    return out


@dataclass(frozen=True, slots=True)
class Entry:
    """One decoded entry."""

    offset: int
    timestamp_ms: int
    tag: str = ""
    payload: bytes = b""
    headers: dict[str, bytes] = field(default_factory=dict)
    deliver_at_ms: int = 0
    producer_id: str = ""  # set on the last entry of an idempotent batch, with its sequence
    producer_sequence: int = 0


def _encode_headers(headers: Mapping[str, bytes]) -> bytes:
    parts = []
    for key in sorted(headers):
        raw_key = key.encode()
        value = bytes(headers[key])
        item = b"\x0a" + encode_varint(len(raw_key)) + raw_key + b"\x12" + encode_varint(len(value)) + value
        parts.append(b"\x2a" + encode_varint(len(item)) + item)
    return b"".join(parts)


def encode_batch(
    first_offset: int, timestamp_ms: int, batch: AppendBatch, start: int = 0
) -> tuple[bytes, array]:
    """Encode a batch of entries sharing one timestamp.

    Returns the records back to back and an `array('I')` of count+1 positions
    counted from `start` (where the batch lands in its node's blob): record i
    spans positions[i]-start : positions[i+1]-start of the returned bytes.
    Tag strings must be encodable as UTF-8 (the caller validates).
    """
    varint = encode_varint
    payloads, tags, headers, deliver_at_ms = batch.payloads, batch.tags, batch.headers, batch.deliver_at_ms
    plain = tags is None and headers is None and deliver_at_ms is None
    if plain and len(payloads) == 1 and 0 < (size := len(payload := payloads[0])) < _SMALL_LIMIT - 32:
        # One small entry (most unary Appends): its record in one expression, no per-entry lists.
        table = _SMALL_VARINTS
        head = b"\x08" + varint(first_offset) + b"\x10" + varint(timestamp_ms) + b"\x22" + table[size]
        record = b"\x0a" + table[len(head) + size] + head + payload
        return record, array("I", (start, start + len(record)))
    offsets = _consecutive_varints(first_offset, len(payloads))
    sizes = list(map(len, payloads)) if plain else []
    if plain and (lo := min(sizes)) > 0 and (hi := max(sizes)) < _SMALL_LIMIT - 32:
        # The common case (offset, timestamp, small payload): no per-entry Python but table lookups.
        table = _SMALL_VARINTS
        key = b"\x10" + encode_varint(timestamp_ms) + b"\x22"
        n = len(payloads)
        if lo == hi and len(offsets[0]) == len(offsets[-1]):
            # Records of one size (a load's) differ only in their offset and payload: one join of
            # [opener, offset, tail, payload] * n builds them. (A batch whose offsets' varints
            # differ in length, across 128, 16384, ..., is rare enough for the loop below.)
            tail = key + table[lo]
            opener = b"\x0a" + table[1 + len(offsets[0]) + len(tail) + lo] + b"\x08"
            pieces = [opener, b"", tail, b""] * n
            pieces[1::4] = offsets
            pieces[3::4] = payloads
            size = len(opener) + len(offsets[0]) + len(tail) + lo
            return b"".join(pieces), array("I", range(start, start + size * n + 1, size))
        heads = [
            b"\x0a" + table[len(h := b"\x08" + ov + key + table[s]) + s] + h
            for ov, s in zip(offsets, sizes, strict=True)
        ]
        interleaved = [b""] * (2 * n)
        interleaved[0::2] = heads
        interleaved[1::2] = payloads
        return b"".join(interleaved), array("I", accumulate(map(add, map(len, heads), sizes), initial=start))
    # Everything else: an empty payload is left out, as protobuf leaves out default values.
    ts_field = b"\x10" + encode_varint(timestamp_ms)
    parts: list[bytes] = []
    positions = array("I", [start])
    total = start
    for i, payload in enumerate(payloads):
        body = [b"\x08", offsets[i], ts_field]
        tag = tags[i] if tags is not None else ""
        if tag:
            raw_tag = tag.encode()
            body.append(b"\x1a" + varint(len(raw_tag)) + raw_tag)
        if payload:
            body.append(b"\x22" + varint(len(payload)))
            body.append(payload)
        entry_headers = headers[i] if headers is not None else None
        if entry_headers:
            body.append(_encode_headers(entry_headers))
        due = deliver_at_ms[i] if deliver_at_ms is not None else 0
        if due:
            body.append(b"\x30" + encode_varint(due))
        encoded = b"".join(body)
        record = b"\x0a" + varint(len(encoded)) + encoded
        parts.append(record)
        total += len(record)
        positions.append(total)
    return b"".join(parts), positions


def attach_producer(blob: bytes, last_start: int, producer_id: str, sequence: int) -> bytes:
    """`blob` with the producer id and sequence added to its last record (which starts at last_start).

    Protobuf fields may come in any order, so they are appended to the record's body and only
    its length prefix changes.
    """
    length, body_start = _read_varint(blob, last_start + 1, len(blob))
    raw = producer_id.encode()
    extra = b"\x72" + encode_varint(len(raw)) + raw + b"\x78" + encode_varint(sequence)
    body = blob[body_start : body_start + length] + extra
    return blob[:last_start] + b"\x0a" + encode_varint(len(body)) + body


def _read_varint(buf: bytes | memoryview, pos: int, end: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= end or shift > 63:
            raise CorruptionError("truncated or overlong varint in entry record")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def _read_length_delimited(buf: bytes | memoryview, pos: int, end: int) -> tuple[bytes, int]:
    length, pos = _read_varint(buf, pos, end)
    if pos + length > end:
        raise CorruptionError("field length runs past the end of its entry record")
    return bytes(buf[pos : pos + length]), pos + length


def _decode_header_item(raw: bytes) -> tuple[str, bytes]:
    key, value = b"", b""
    pos, end = 0, len(raw)
    while pos < end:
        tag, pos = _read_varint(raw, pos, end)
        if tag == 0x0A:
            key, pos = _read_length_delimited(raw, pos, end)
        elif tag == 0x12:
            value, pos = _read_length_delimited(raw, pos, end)
        else:
            raise CorruptionError(f"unexpected field key {tag:#x} in a header item")
    try:
        return key.decode(), value
    except UnicodeDecodeError as exc:
        raise CorruptionError("header key is not UTF-8") from exc


def decode_record(buf: bytes | memoryview, pos: int = 0, end: int | None = None) -> tuple[Entry, int]:
    """Decode the record starting at `pos`; returns the entry and the position after it."""
    end = len(buf) if end is None else end
    if pos >= end or buf[pos] != 0x0A:
        raise CorruptionError("entry record does not start with key 0x0a")
    length, pos = _read_varint(buf, pos + 1, end)
    stop = pos + length
    if stop > end:
        raise CorruptionError("entry record runs past the end of its node")
    offset = timestamp = due = sequence = 0
    tag = producer = ""
    payload = b""
    headers: dict[str, bytes] = {}
    while pos < stop:
        key, pos = _read_varint(buf, pos, stop)
        if key == 0x08:
            offset, pos = _read_varint(buf, pos, stop)
        elif key == 0x10:
            timestamp, pos = _read_varint(buf, pos, stop)
        elif key == 0x1A:
            raw, pos = _read_length_delimited(buf, pos, stop)
            try:
                tag = raw.decode()
            except UnicodeDecodeError as exc:
                raise CorruptionError("entry tag is not UTF-8") from exc
        elif key == 0x22:
            payload, pos = _read_length_delimited(buf, pos, stop)
        elif key == 0x2A:
            raw, pos = _read_length_delimited(buf, pos, stop)
            name, value = _decode_header_item(raw)
            headers[name] = value
        elif key == 0x30:
            due, pos = _read_varint(buf, pos, stop)
        elif key == 0x72:
            raw, pos = _read_length_delimited(buf, pos, stop)
            try:
                producer = raw.decode()
            except UnicodeDecodeError as exc:
                raise CorruptionError("entry producer id is not UTF-8") from exc
        elif key == 0x78:
            sequence, pos = _read_varint(buf, pos, stop)
        else:
            raise CorruptionError(f"unexpected field key {key:#x} in entry record")
    return Entry(offset, timestamp, tag, payload, headers, due, producer, sequence), stop


def decode_records(buf: bytes | memoryview) -> list[Entry]:
    """Decode back-to-back records, as `ReadResult.records` holds them."""
    entries = []
    pos, end = 0, len(buf)
    while pos < end:
        entry, pos = decode_record(buf, pos, end)
        entries.append(entry)
    return entries


def skim_records(chunks: Iterable[bytes]) -> list[tuple[int, int, int, bytes]]:
    """(offset, timestamp_ms, deliver_at_ms, record) for each record in `ReadResult.records` chunks.

    Reads only those three fields and skips the others by their wire type, without
    decoding tags, payloads or headers: consumer groups need no more to route entries.
    """
    out = []
    for chunk in chunks:
        pos, end = 0, len(chunk)
        while pos < end:
            offset, timestamp, stop, due, _, _ = _skim_record(chunk, pos, end)
            out.append((offset, timestamp, due, chunk[pos:stop]))
            pos = stop
    return out


def find_producers(chunk: bytes | memoryview) -> list[tuple[int, int, str, int]]:
    """(offset, timestamp_ms, producer id, sequence) of each record in `chunk` (records back to
    back) that ends an idempotent batch, read as skim_records reads them."""
    out = []
    pos, end = 0, len(chunk)
    while pos < end:
        offset, timestamp, pos, _, producer, sequence = _skim_record(chunk, pos, end)
        if producer:
            try:
                out.append((offset, timestamp, producer.decode(), sequence))
            except UnicodeDecodeError as exc:
                raise CorruptionError("entry producer id is not UTF-8") from exc
    return out


def _skim_record(chunk: bytes | memoryview, pos: int, end: int) -> tuple[int, int, int, int, bytes, int]:
    """(offset, timestamp, where it stops, deliver_at_ms, producer id, sequence) of the record at
    `pos`; the other fields are skipped by their wire type."""
    offset, timestamp = record_offset_and_timestamp(chunk, pos)
    length, p = _read_varint(chunk, pos + 1, end)
    stop = p + length
    if stop > end:
        raise CorruptionError("entry record runs past the end of its chunk")
    due = sequence = 0
    producer = b""
    while p < stop:
        key, p = _read_varint(chunk, p, stop)
        if key == 0x30:
            due, p = _read_varint(chunk, p, stop)
        elif key == 0x72:
            producer, p = _read_length_delimited(chunk, p, stop)
        elif key & 7 == 0:
            value, p = _read_varint(chunk, p, stop)
            if key == 0x78:
                sequence = value
        elif key & 7 == 2:
            n, p = _read_varint(chunk, p, stop)
            p += n
        else:
            raise CorruptionError(f"unexpected field key {key:#x} in entry record")
    if p != stop:
        raise CorruptionError("a field runs past the end of its entry record")
    return offset, timestamp, stop, due, producer, sequence


def record_offset_and_timestamp(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
    """The first two fields of a record, which the encoder always writes first."""
    end = len(buf)
    if pos >= end or buf[pos] != 0x0A:
        raise CorruptionError("entry record does not start with key 0x0a")
    _, pos = _read_varint(buf, pos + 1, end)
    if pos >= end or buf[pos] != 0x08:
        raise CorruptionError("entry record does not start with its offset")
    offset, pos = _read_varint(buf, pos + 1, end)
    if pos >= end or buf[pos] != 0x10:
        raise CorruptionError("entry record has no timestamp after its offset")
    timestamp, _ = _read_varint(buf, pos + 1, end)
    return offset, timestamp
