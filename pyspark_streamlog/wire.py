"""Read replies decoded straight into Arrow columns, without a Python object per entry.

A `ReadResponse` is mostly `repeated Entry entries = 1`, and the server sends
its stored records as they are, so every entry of a plain stream has the same
shape: `0x0A len | 0x08 offset | 0x10 timestamp | [0x1A tag] | [0x22 payload]
| [headers, deliver time, producer fields]`. Letting protobuf build an `Entry`
object per row and reading its attributes costs ~1.3 µs per entry (measured),
more than the rest of a Spark read together. Here one Python loop finds where
each entry starts (two byte reads per entry), numpy decodes the fixed part of
every entry at once (offset, timestamp, tag and payload positions), and Arrow
gathers the payload bytes into a column through a binary-view array cast in
C++. Only the rare entries with headers or producer fields get a few lines of
Python each.

Anything the fast path does not expect (fields out of order, a missing offset
or timestamp) sends the whole reply to `_decode_with_protobuf`, which is slow
but follows protobuf's rules exactly; the tests check both against protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
from google.protobuf.message import DecodeError
from streamlog.v1 import streamlog_pb2 as pb

__all__ = ["Gap", "ReadReply", "WireError", "decode_read_response"]

# GapReason values of the proto, by name (the Spark side logs and reports names).
GAP_REASONS = {1: "evicted", 2: "compacted", 3: "corrupt"}
GAP_COMPACTED = 2

_LANES = np.arange(16, dtype=np.int64)
_PAD = bytes(16)  # lets the vectorized varint reader look past the last byte safely
_VIEW_INLINE = 12  # binary-view values up to this many bytes live inside the view itself


class WireError(ValueError):
    """A reply that is not a valid ReadResponse encoding."""


@dataclass(frozen=True, slots=True)
class Gap:
    """A range of offsets the server reported as gone, and why (a GAP_REASONS name)."""

    start_offset: int
    end_offset: int
    reason: str

    @property
    def is_loss(self) -> bool:
        """Evicted or corrupt entries are lost data; compacted ones were superseded by design."""
        return self.reason != "compacted"


@dataclass(slots=True)
class ReadReply:
    """The columns of one Read reply and the reply's own fields."""

    offsets: np.ndarray  # int64
    timestamps_ms: np.ndarray  # int64
    tags: pa.Array  # string
    payloads: pa.Array  # binary
    headers: list[tuple[int, list[tuple[str, bytes]]]]  # (row, items) for rows that have headers
    first_offset: int
    next_offset: int
    end_offset: int
    gap: Gap | None

    def __len__(self) -> int:
        return len(self.offsets)

    def head(self, rows: int) -> ReadReply:
        """The first `rows` entries (a read that went past the end of a partition's range)."""
        if rows >= len(self):
            return self
        return ReadReply(
            self.offsets[:rows],
            self.timestamps_ms[:rows],
            self.tags.slice(0, rows),
            self.payloads.slice(0, rows),
            [(row, items) for row, items in self.headers if row < rows],
            self.first_offset,
            self.next_offset,
            self.end_offset,
            self.gap,
        )


def _varint(raw: bytes, pos: int, end: int) -> tuple[int, int]:
    """(value, position after it) of the varint at raw[pos]; WireError past `end`."""
    value = shift = 0
    while pos < end:
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift >= 70:
            break
    raise WireError("malformed varint")


def _skip(raw: bytes, wire_type: int, pos: int, end: int) -> int:
    """Position after a field's value of `wire_type` starting at raw[pos]."""
    if wire_type == 0:
        return _varint(raw, pos, end)[1]
    if wire_type == 2:
        length, pos = _varint(raw, pos, end)
        pos += length
    elif wire_type == 1:
        pos += 8
    elif wire_type == 5:
        pos += 4
    else:
        raise WireError(f"unsupported wire type {wire_type}")
    if pos > end:
        raise WireError("field runs past the end of its message")
    return pos


def _signed(value: int) -> int:
    """An int64 field's value: protobuf sends negative numbers as 64-bit two's complement."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _decode_gap(raw: bytes, pos: int, end: int) -> Gap:
    start = stop = reason = 0
    while pos < end:
        key, pos = _varint(raw, pos, end)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0 and field in (1, 2, 3):
            value, pos = _varint(raw, pos, end)
            if field == 1:
                start = _signed(value)
            elif field == 2:
                stop = _signed(value)
            else:
                reason = value
        else:
            pos = _skip(raw, wire_type, pos, end)
    return Gap(start, stop, GAP_REASONS.get(reason, f"unknown({reason})"))


def _lengths(buf: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Length varints (up to 5 bytes) at each position: values, sizes, and which ones end in time.

    Unlike _varints it never raises: it also runs at positions that merely might
    start an entry, where the bytes can be anything.
    """
    byte = buf[pos]
    value = (byte & 0x7F).astype(np.int64)
    size = np.ones(len(pos), dtype=np.int64)
    active = np.flatnonzero(byte >= 0x80)
    for shift in (7, 14, 21, 28):
        if not len(active):
            break
        byte = buf[pos[active] + size[active]]
        value[active] |= (byte & 0x7F).astype(np.int64) << shift
        size[active] += 1
        active = active[byte >= 0x80]
    ok = np.ones(len(pos), dtype=bool)
    ok[active] = False
    return value, size, ok


def _leading_entries(buf: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Body positions and lengths of the entries a reply starts with, and where they end.

    Entries are chained: each one's length says where the next field starts. To
    follow the chain without a Python turn per entry, every 0x0A byte is taken
    as a possible entry start and linked to the possible start its length points
    at; then pointer doubling (each round doubles the jump length, so ~log2(n)
    rounds) collects every candidate reachable from the first byte. Candidates
    inside payloads are never reached from it, since real entries link only to
    real entries.
    """
    empty = np.zeros(0, dtype=np.int64)
    if size == 0 or buf[0] != 0x0A:
        return empty, empty, 0
    candidates = np.flatnonzero(buf[:size] == 0x0A)
    count = len(candidates)
    lengths, sizes, ok = _lengths(buf, candidates + 1)
    after = candidates + 1 + sizes + lengths
    index = np.searchsorted(candidates, after)
    linked = ok & (index < count) & (candidates[np.minimum(index, count - 1)] == after)
    jump = np.append(np.where(linked, index, count), count)  # `count`: the chain ends here
    reached = np.zeros(1, dtype=np.int64)
    for _ in range(64):  # 2**64 jumps would be more entries than any reply holds
        found = jump[reached]
        found = found[found < count]
        if not len(found):
            break
        reached = np.concatenate([reached, found])
        jump = jump[jump]
    chain = np.sort(reached)
    last = chain[-1]
    if not ok[last] or after[last] > size:
        # A broken last entry: leave it to the byte-by-byte scan, which reports it.
        chain = chain[:-1]
        return candidates[chain] + 1 + sizes[chain], lengths[chain], int(candidates[last])
    return candidates[chain] + 1 + sizes[chain], lengths[chain], int(after[last])


def _scan(raw: bytes, buf: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, int, int, Gap | None]:
    """Entry body positions and lengths, and the reply's other fields.

    The server sends its entries first; _leading_entries finds those at numpy
    speed, and the loop below reads whatever follows (the reply's own fields,
    and entries in any other order a sender may choose) a field at a time.
    """
    size = len(raw)
    lead_starts, lead_lengths, pos = _leading_entries(buf, size)
    starts: list[int] = []
    lengths: list[int] = []
    first = following = end_offset = 0
    gap = None
    while pos < size:
        key, pos = _varint(raw, pos, size)
        field, wire_type = key >> 3, key & 7
        if key == 0x0A:
            length, pos = _varint(raw, pos, size)
            starts.append(pos)
            lengths.append(length)
            pos += length
        elif wire_type == 0 and field in (2, 3, 5):
            value, pos = _varint(raw, pos, size)
            if field == 2:
                first = _signed(value)
            elif field == 3:
                following = _signed(value)
            else:
                end_offset = _signed(value)
        elif wire_type == 2 and field == 4:
            length, pos = _varint(raw, pos, size)
            if pos + length > size:
                raise WireError("gap runs past the end of the reply")
            gap = _decode_gap(raw, pos, pos + length)
            pos += length
        else:
            pos = _skip(raw, wire_type, pos, size)
    if pos != size:
        raise WireError("the last entry runs past the end of the reply")
    if starts:
        lead_starts = np.concatenate([lead_starts, np.array(starts, dtype=np.int64)])
        lead_lengths = np.concatenate([lead_lengths, np.array(lengths, dtype=np.int64)])
    return lead_starts, lead_lengths, first, following, end_offset, gap


def _varints(buf: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Values (int64) and sizes of the varints starting at each position of `pos`.

    One numpy pass per byte of the longest varint, each over the rows still
    unfinished: lengths take one or two passes, millisecond timestamps six.
    """
    rows = len(pos)
    byte = buf[pos]
    value = (byte & 0x7F).astype(np.uint64)
    size = np.ones(rows, dtype=np.int64)
    active = np.flatnonzero(byte >= 0x80)
    at = pos[active]
    for shift in range(7, 70, 7):
        if not len(active):
            return value.view(np.int64), size
        at = at + 1
        byte = buf[at]
        value[active] |= (byte & 0x7F).astype(np.uint64) << np.uint64(shift)
        size[active] += 1
        more = byte >= 0x80
        active, at = active[more], at[more]
    if len(active):
        raise WireError("malformed varint")
    return value.view(np.int64), size


def _field(
    buf: np.ndarray, pos: np.ndarray, stop: np.ndarray, key: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where the optional length-delimited field `key` starts and how long it is, per entry.

    Entries that do not have it get length 0; `pos` moves past it where present.
    """
    start = pos.copy()
    length = np.zeros(len(pos), dtype=np.int64)
    present = np.flatnonzero((pos < stop) & (buf[np.minimum(pos, len(buf) - 1)] == key))
    if len(present):
        values, sizes = _varints(buf, pos[present] + 1)
        start[present] = pos[present] + 1 + sizes
        length[present] = values
        pos[present] = start[present] + values
    return start, length, pos


def _gather(
    kind: pa.DataType, raw: bytes, buf: np.ndarray, start: np.ndarray, length: np.ndarray
) -> pa.Array:
    """A binary column of raw[start[i] : start[i] + length[i]], gathered by Arrow in C++.

    The values are described as a binary-view array over the reply's own buffer
    (16-byte views: length, then either the value inline when it has at most 12
    bytes, or a 4-byte prefix, buffer index 0 and the value's position), and
    casting that to a plain binary array copies the bytes into one block.
    """
    rows = len(start)
    if rows == 0:
        return pa.array([], type=kind)
    if not length.any():
        offsets = np.zeros(rows + 1, dtype=np.int32)
        return pa.Array.from_buffers(kind, rows, [None, pa.py_buffer(offsets), pa.py_buffer(b"")])
    views = np.zeros((rows, 4), dtype="<i4")
    views[:, 0] = length
    short = np.flatnonzero(length <= _VIEW_INLINE)
    if len(short) < rows:
        long_rows = np.flatnonzero(length > _VIEW_INLINE)
        prefix = buf[start[long_rows, None] + _LANES[:4]]
        views[long_rows, 1] = np.ascontiguousarray(prefix).view("<i4")[:, 0]
        views[long_rows, 3] = start[long_rows]
    if len(short):
        head = buf[start[short, None] + _LANES[:_VIEW_INLINE]]
        head[_LANES[:_VIEW_INLINE] >= length[short, None]] = 0
        views[short, 1:4] = np.ascontiguousarray(head).view("<i4")
    array = pa.Array.from_buffers(pa.binary_view(), rows, [None, pa.py_buffer(views), pa.py_buffer(raw)])
    return array.cast(kind)


def _rest_of_entry(raw: bytes, pos: int, end: int) -> list[tuple[str, bytes]] | None:
    """Headers from an entry's trailing fields; None when fields 1-4 come again (out of order)."""
    items: dict[str, bytes] = {}
    while pos < end:
        key, pos = _varint(raw, pos, end)
        field, wire_type = key >> 3, key & 7
        if field <= 4:
            return None
        if field == 5 and wire_type == 2:
            length, pos = _varint(raw, pos, end)
            stop = pos + length
            if stop > end:
                raise WireError("header runs past the end of its entry")
            name, value = "", b""
            while pos < stop:
                item_key, pos = _varint(raw, pos, stop)
                if item_key in (0x0A, 0x12):
                    size, pos = _varint(raw, pos, stop)
                    if pos + size > stop:
                        raise WireError("header field runs past the end of its header")
                    if item_key == 0x0A:
                        name = raw[pos : pos + size].decode()
                    else:
                        value = raw[pos : pos + size]
                    pos += size
                else:
                    pos = _skip(raw, item_key & 7, pos, stop)
            items[name] = value  # protobuf maps: the last value of a key wins
        else:
            pos = _skip(raw, wire_type, pos, end)
    return list(items.items())


def decode_read_response(raw: bytes) -> ReadReply:
    """Decode a serialized ReadResponse (or SubscribeResponse: same field numbers)."""
    buf = np.frombuffer(raw + _PAD, dtype=np.uint8)
    starts, lengths, first, following, end_offset, gap = _scan(raw, buf)
    if len(starts) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return ReadReply(
            empty,
            empty,
            pa.array([], pa.string()),
            pa.array([], pa.binary()),
            [],
            first,
            following,
            end_offset,
            gap,
        )
    pos = starts.copy()
    stop = starts + lengths
    if not ((buf[pos] == 0x08).all()):
        return _decode_with_protobuf(raw)
    offsets, sizes = _varints(buf, pos + 1)
    pos += 1 + sizes
    if not ((pos < stop).all() and (buf[pos] == 0x10).all()):
        return _decode_with_protobuf(raw)
    timestamps, sizes = _varints(buf, pos + 1)
    pos += 1 + sizes
    tag_start, tag_length, pos = _field(buf, pos, stop, 0x1A)
    payload_start, payload_length, pos = _field(buf, pos, stop, 0x22)
    if (pos > stop).any():
        raise WireError("a field runs past the end of its entry")
    headers: list[tuple[int, list[tuple[str, bytes]]]] = []
    for row in np.flatnonzero(pos < stop).tolist():
        items = _rest_of_entry(raw, int(pos[row]), int(stop[row]))
        if items is None:
            return _decode_with_protobuf(raw)
        if items:
            headers.append((row, items))
    try:
        # Gathered as bytes, then cast: that cast checks UTF-8, as protobuf does for strings.
        tags = _gather(pa.binary(), raw, buf, tag_start, tag_length).cast(pa.string())
    except pa.ArrowInvalid as exc:
        raise WireError(f"a tag is not valid UTF-8: {exc}") from exc
    payloads = _gather(pa.binary(), raw, buf, payload_start, payload_length)
    return ReadReply(offsets, timestamps, tags, payloads, headers, first, following, end_offset, gap)


def _decode_with_protobuf(raw: bytes) -> ReadReply:
    """The general decoder: protobuf parses, Python collects the columns (slow, always right)."""
    try:
        reply = pb.ReadResponse.FromString(raw)
    except DecodeError as exc:
        raise WireError(f"not a ReadResponse: {exc}") from exc
    entries = list(reply.entries)
    headers = [(row, list(entry.headers.items())) for row, entry in enumerate(entries) if entry.headers]
    gap = None
    if reply.HasField("gap"):
        reason = GAP_REASONS.get(reply.gap.reason, f"unknown({reply.gap.reason})")
        gap = Gap(reply.gap.start_offset, reply.gap.end_offset, reason)
    return ReadReply(
        np.array([e.offset for e in entries], dtype=np.int64),
        np.array([e.timestamp_ms for e in entries], dtype=np.int64),
        pa.array([e.tag for e in entries], type=pa.string()),
        pa.array([e.payload for e in entries], type=pa.binary()),
        headers,
        reply.first_offset,
        reply.next_offset,
        reply.end_offset,
        gap,
    )
