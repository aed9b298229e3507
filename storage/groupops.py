"""Consumer-group ops: the typed records that change group state, and their stable encoding.

Every change to a stream's groups is a list of ops. `storage.groupstate`
applies them, `storage.grouplog` journals them encoded by `encode_ops`, and
recovery decodes and applies them again, so a recovered state equals the live
one by construction. Replication ships the same records to followers: the
leader's op batches and snapshots are `encode_ops` bytes, and a follower
applies them through `GroupStores.apply_ops` (a snapshot is ops too:
`GroupStores.snapshot_ops`).
An op is a fact, never a request: applying it needs only the state it applies
to (no clock, no stream, no timer), so every replica that applies the same ops
in the same order holds the same state.

One frozen dataclass per op; its `CODE` and its fields, in declaration order,
are its encoding (docs/FORMAT.md, "Ops"). A body is `varint(count)` and the
ops; an op is `varint(CODE)` and its fields, each encoded by its type:

    str            varint length, UTF-8
    int            varint
    int | None     varint: 0 for None, n + 1 for n
    bool           one byte, 0 or 1
    GroupConfig    its sorted-key JSON, as a str (unknown keys are ignored when read)
    RemoveReason   varint
    GroupCounters  its seven counts, as varints in field order
    Offsets        runs: varint(runs), then per run zigzag(start - end of the run before), length
    DueTimes       varint(n), then per pair zigzag(offset - offset before), due ms
    PendingRows    a table of owner names (varint(n), n str), varint(rows), then per row
                   zigzag(offset - offset before), owner index (0: none), count,
                   delivered_ms, first_ms, and retry_ms, retry_at, expire_at as int | None

Codes are persisted: never renumber an op, never change its fields' types or
order. A new op takes a new code (older versions refuse a body holding it).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from enum import IntEnum
from operator import attrgetter
from typing import Any, ClassVar, get_type_hints

from storage.errors import CorruptionError, InvalidArgumentError
from storage.grouptypes import GroupConfig, GroupCounters

Offsets = Sequence[int]  # ascending runs encode in a few bytes
DueTimes = Sequence[tuple[int, int]]  # (offset, due ms)


class RemoveReason(IntEnum):
    """Why an entry left the pending (or scheduled) list, and the counter it feeds."""

    ACK = 0
    EXPIRED = 1
    DEAD_LETTERED = 2
    EVICTED = 3

    @property
    def counter(self) -> str:
        return _REASON_COUNTERS[self]


_REASON_COUNTERS = {
    RemoveReason.ACK: "acked",
    RemoveReason.EXPIRED: "expired",
    RemoveReason.DEAD_LETTERED: "dead_lettered",
    RemoveReason.EVICTED: "evicted",
}


@dataclass(frozen=True, slots=True)
class PendingRecord:
    """One pending entry as a snapshot holds it (RestorePending)."""

    offset: int
    consumer: str | None  # None: released, waiting for redelivery
    count: int
    delivered_ms: int
    first_ms: int
    retry_ms: int | None
    retry_at: int | None
    expire_at: int | None


PendingRows = Sequence[PendingRecord]  # in delivery order, least recently delivered first


@dataclass(frozen=True, slots=True)
class GroupOp:
    """What every op has: the group it applies to."""

    group: str
    CODE: ClassVar[int] = 0


@dataclass(frozen=True, slots=True)
class CreateGroup(GroupOp):
    """A new group (replacing one of the same name)."""

    CODE: ClassVar[int] = 1
    config: GroupConfig
    cursor: int
    entries_read: int
    now_ms: int


@dataclass(frozen=True, slots=True)
class DropGroup(GroupOp):
    CODE: ClassVar[int] = 2


@dataclass(frozen=True, slots=True)
class Seek(GroupOp):
    """The group's position was set (SetGroupOffset)."""

    CODE: ClassVar[int] = 3
    cursor: int
    entries_read: int


@dataclass(frozen=True, slots=True)
class SetConfig(GroupOp):
    CODE: ClassVar[int] = 4
    config: GroupConfig


@dataclass(frozen=True, slots=True)
class Seen(GroupOp):
    """The consumer (created if new) made a read or claim; `active`: it got entries."""

    CODE: ClassVar[int] = 5
    consumer: str
    now_ms: int
    active: bool


@dataclass(frozen=True, slots=True)
class Touch(GroupOp):
    """The group was used without a consumer (acks, nacks): it is not idle."""

    CODE: ClassVar[int] = 6
    now_ms: int


@dataclass(frozen=True, slots=True)
class Deliver(GroupOp):
    """First delivery, or redelivery of pending entries (their count goes up), to `consumer`."""

    CODE: ClassVar[int] = 7
    consumer: str
    now_ms: int
    retry_ms: int | None
    expire_ms: int | None
    offsets: Offsets


@dataclass(frozen=True, slots=True)
class DeliverUntracked(GroupOp):
    """Delivered without tracking (NOACK reads)."""

    CODE: ClassVar[int] = 8
    offsets: Offsets


@dataclass(frozen=True, slots=True)
class Schedule(GroupOp):
    """Entries the cursor passed before their deliver_at_ms: each is delivered once due."""

    CODE: ClassVar[int] = 9
    due: DueTimes


@dataclass(frozen=True, slots=True)
class Advance(GroupOp):
    """The cursor moved forward over what a read scanned; `caught_up`: it reached the end."""

    CODE: ClassVar[int] = 10
    cursor: int
    caught_up: bool


@dataclass(frozen=True, slots=True)
class Remove(GroupOp):
    """Entries leave the pending (or scheduled) list."""

    CODE: ClassVar[int] = 11
    reason: RemoveReason
    offsets: Offsets


@dataclass(frozen=True, slots=True)
class AckUnknown(GroupOp):
    """Acks of offsets that were not pending."""

    CODE: ClassVar[int] = 12
    count: int


@dataclass(frozen=True, slots=True)
class Release(GroupOp):
    """The owner of pending entries is dropped (nack, deleted consumer); redelivered from due_ms on."""

    CODE: ClassVar[int] = 13
    due_ms: int
    offsets: Offsets


@dataclass(frozen=True, slots=True)
class Claim(GroupOp):
    """Pending entries change owner (their count goes up)."""

    CODE: ClassVar[int] = 14
    consumer: str
    now_ms: int
    offsets: Offsets


@dataclass(frozen=True, slots=True)
class DeleteConsumer(GroupOp):
    CODE: ClassVar[int] = 15
    consumer: str


@dataclass(frozen=True, slots=True)
class RestoreGroup(GroupOp):
    """Snapshots only: the group's last use and counters."""

    CODE: ClassVar[int] = 16
    active_ms: int
    counters: GroupCounters


@dataclass(frozen=True, slots=True)
class RestoreConsumer(GroupOp):
    """Snapshots only: a consumer and its times."""

    CODE: ClassVar[int] = 17
    consumer: str
    seen_ms: int
    active_ms: int | None


@dataclass(frozen=True, slots=True)
class RestorePending(GroupOp):
    """Snapshots only: the pending list."""

    CODE: ClassVar[int] = 18
    rows: PendingRows


OP_TYPES: tuple[type[GroupOp], ...] = (
    CreateGroup,
    DropGroup,
    Seek,
    SetConfig,
    Seen,
    Touch,
    Deliver,
    DeliverUntracked,
    Schedule,
    Advance,
    Remove,
    AckUnknown,
    Release,
    Claim,
    DeleteConsumer,
    RestoreGroup,
    RestoreConsumer,
    RestorePending,
)

# More offsets than any pending list can hold in memory (about 250 bytes each): a length
# field this large is damage, and expanding it would exhaust memory instead of failing.
MAX_OFFSETS_PER_FIELD = 1 << 24


# ---------------------------------------------------------------------- encoding a field


def _varint(out: bytearray, value: int) -> None:
    if 0 <= value < 0x80:
        out.append(value)
        return
    if value < 0:
        raise ValueError(f"cannot encode negative value {value} as an unsigned varint")
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _zigzag(value: int) -> int:
    return value << 1 if value >= 0 else ((-value) << 1) - 1


def _unzigzag(value: int) -> int:
    return value >> 1 if not value & 1 else -((value + 1) >> 1)


def _runs(offsets: Sequence[int]) -> list[tuple[int, int]]:
    if isinstance(offsets, range) and offsets.step == 1:
        return [(offsets.start, len(offsets))] if len(offsets) else []
    if (
        offsets
        and offsets[-1] - offsets[0] + 1 == len(offsets)
        and list(offsets) == list(range(offsets[0], offsets[-1] + 1))
    ):
        return [(offsets[0], len(offsets))]  # the common case, checked at C speed
    runs: list[tuple[int, int]] = []
    for offset in offsets:
        if runs and runs[-1][0] + runs[-1][1] == offset:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((offset, 1))
    return runs


def _enc_str(out: bytearray, value: str) -> None:
    raw = value.encode()
    if len(raw) < 0x80:  # names are short: the length is one byte (saves a call per name)
        out.append(len(raw))
    else:
        _varint(out, len(raw))
    out += raw


def _enc_optional(out: bytearray, value: int | None) -> None:
    if value is None:
        out.append(0)
    else:
        _varint(out, value + 1)


def _enc_bool(out: bytearray, value: bool) -> None:
    out.append(1 if value else 0)


def _enc_config(out: bytearray, value: GroupConfig) -> None:
    _enc_str(out, json.dumps(value.to_dict(), sort_keys=True))


_COUNTER_FIELDS = tuple(f.name for f in fields(GroupCounters))


def _enc_counters(out: bytearray, value: GroupCounters) -> None:
    for name in _COUNTER_FIELDS:
        _varint(out, getattr(value, name))


def _enc_offsets(out: bytearray, value: Offsets) -> None:
    runs = _runs(value)
    _varint(out, len(runs))
    prev = 0
    for start, length in runs:  # offsets are mostly ascending runs: a read of 1000 entries is 3 bytes
        delta = start - prev
        _varint(out, delta << 1 if delta >= 0 else ((-delta) << 1) - 1)  # _zigzag, inline: per run
        _varint(out, length)
        prev = start + length


def _enc_due_times(out: bytearray, value: DueTimes) -> None:
    _varint(out, len(value))
    prev = 0
    for offset, due in value:
        _varint(out, _zigzag(offset - prev))
        _varint(out, due)
        prev = offset


def _enc_rows(out: bytearray, value: PendingRows) -> None:
    names = sorted({row.consumer for row in value if row.consumer is not None})
    index = {name: i + 1 for i, name in enumerate(names)}
    _varint(out, len(names))
    for name in names:
        _enc_str(out, name)
    _varint(out, len(value))
    prev = 0
    for row in value:
        _varint(out, _zigzag(row.offset - prev))
        _varint(out, 0 if row.consumer is None else index[row.consumer])
        _varint(out, row.count)
        _varint(out, row.delivered_ms)
        _varint(out, row.first_ms)
        _enc_optional(out, row.retry_ms)
        _enc_optional(out, row.retry_at)
        _enc_optional(out, row.expire_at)
        prev = row.offset


# ---------------------------------------------------------------------- decoding a field


class _Reader:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.pos = 0

    def varint(self) -> int:
        result = shift = 0
        buf = self.buf
        while True:
            if self.pos >= len(buf) or shift > 63:
                raise CorruptionError("truncated or overlong varint in a group op")
            byte = buf[self.pos]
            self.pos += 1
            result |= (byte & 0x7F) << shift
            if byte < 0x80:
                return result
            shift += 7

    def raw(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise CorruptionError("a group op runs past the end of its record")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def text(self) -> str:
        try:
            return self.raw(self.varint()).decode()
        except UnicodeDecodeError as exc:
            raise CorruptionError("a name in a group op is not UTF-8") from exc

    def optional(self) -> int | None:
        value = self.varint()
        return None if value == 0 else value - 1

    def flag(self) -> bool:
        return self.raw(1) != b"\x00"

    def config(self) -> GroupConfig:
        text = self.text()
        try:
            return GroupConfig.from_dict(json.loads(text))
        except (ValueError, TypeError, AttributeError, InvalidArgumentError) as exc:
            raise CorruptionError(f"group config in a group op is unreadable: {exc}") from exc

    def reason(self) -> RemoveReason:
        value = self.varint()
        try:
            return RemoveReason(value)
        except ValueError:
            raise CorruptionError(f"unknown reason {value} in a group op") from None

    def counters(self) -> GroupCounters:
        return GroupCounters(*(self.varint() for _ in _COUNTER_FIELDS))

    def offsets(self) -> tuple[int, ...]:
        out: list[int] = []
        prev = 0
        for _ in range(self.varint()):
            start = prev + _unzigzag(self.varint())
            length = self.varint()
            if start < 0:
                raise CorruptionError("negative offset in a group op")
            if len(out) + length > MAX_OFFSETS_PER_FIELD:
                raise CorruptionError(f"a group op lists more than {MAX_OFFSETS_PER_FIELD} offsets")
            out.extend(range(start, start + length))
            prev = start + length
        return tuple(out)

    def due_times(self) -> tuple[tuple[int, int], ...]:
        pairs = []
        prev = 0
        for _ in range(self.varint()):
            offset = prev + _unzigzag(self.varint())
            pairs.append((offset, self.varint()))
            prev = offset
        return tuple(pairs)

    def rows(self) -> tuple[PendingRecord, ...]:
        names = [self.text() for _ in range(self.varint())]
        rows = []
        prev = 0
        for _ in range(self.varint()):
            offset = prev + _unzigzag(self.varint())
            owner_index = self.varint()
            if owner_index > len(names):
                raise CorruptionError("pending row names an unknown consumer")
            owner = None if owner_index == 0 else names[owner_index - 1]
            rows.append(
                PendingRecord(
                    offset,
                    owner,
                    self.varint(),
                    self.varint(),
                    self.varint(),
                    self.optional(),
                    self.optional(),
                    self.optional(),
                )
            )
            prev = offset
        return tuple(rows)


# ---------------------------------------------------------------------- ops <-> bytes

Encoder = Callable[[bytearray, Any], None]
Decoder = Callable[[_Reader], Any]

# A field's type -> how it is written and read (the table in the module doc).
_FIELD_CODECS: dict[Any, tuple[Encoder, Decoder]] = {
    str: (_enc_str, _Reader.text),
    int: (_varint, _Reader.varint),
    int | None: (_enc_optional, _Reader.optional),
    bool: (_enc_bool, _Reader.flag),
    GroupConfig: (_enc_config, _Reader.config),
    RemoveReason: (_varint, _Reader.reason),
    GroupCounters: (_enc_counters, _Reader.counters),
    Offsets: (_enc_offsets, _Reader.offsets),
    DueTimes: (_enc_due_times, _Reader.due_times),
    PendingRows: (_enc_rows, _Reader.rows),
}


def _codecs(cls: type[GroupOp]) -> tuple[Callable[[GroupOp], tuple], list[Encoder], list[Decoder]]:
    """An op type's field getter, encoders and decoders, from its fields' types."""
    hints = get_type_hints(cls)
    names = [f.name for f in fields(cls)]
    try:
        pairs = [_FIELD_CODECS[hints[name]] for name in names]
    except KeyError as exc:
        raise TypeError(f"{cls.__name__}: no encoding for a field of type {exc}") from None
    getter = attrgetter(*names) if len(names) > 1 else (lambda op, name=names[0]: (getattr(op, name),))
    return getter, [p[0] for p in pairs], [p[1] for p in pairs]


_ENCODING: dict[type[GroupOp], tuple[int, Callable[[GroupOp], tuple], list[Encoder]]] = {}
_DECODING: dict[int, tuple[type[GroupOp], list[Decoder]]] = {}
for _cls in OP_TYPES:
    if _cls.CODE in _DECODING or not 0 < _cls.CODE < 0x80:
        raise TypeError(f"{_cls.__name__}: code {_cls.CODE} is taken or invalid")
    _get, _encoders, _decoders = _codecs(_cls)
    _ENCODING[_cls] = (_cls.CODE, _get, _encoders)
    _DECODING[_cls.CODE] = (_cls, _decoders)


def encode_ops(ops: Sequence[GroupOp]) -> bytes:
    """The bytes of a batch of ops: one journal record's body, a snapshot's, or a replicated batch."""
    out = bytearray()
    _varint(out, len(ops))
    for op in ops:
        code, get, encoders = _ENCODING[type(op)]
        out.append(code)  # codes are below 0x80: one byte, as a varint
        for encode, value in zip(encoders, get(op), strict=True):
            encode(out, value)
    return bytes(out)


def decode_ops(body: bytes) -> list[GroupOp]:
    """The ops of `encode_ops` bytes; CorruptionError on anything malformed (nothing is trusted)."""
    r = _Reader(body)
    ops: list[GroupOp] = []
    for _ in range(r.varint()):
        code = r.varint()
        found = _DECODING.get(code)
        if found is None:
            raise CorruptionError(f"unknown group op code {code}")
        cls, decoders = found
        ops.append(cls(*[decode(r) for decode in decoders]))
    if r.pos != len(body):
        raise CorruptionError("trailing bytes after the group ops of a record")
    return ops
