"""Consumer groups' vocabulary: what group calls take and return, and the rules for their values.

`GroupConfig` (a group's policy), `GroupReadOptions` (one read's parameters),
the results (`GroupInfo`, `PendingInfo`, `GroupReadResult`, ...), and the
checks every entry point applies to names and durations. No state, no I/O.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from storage.errors import InvalidArgumentError
from storage.names import validate_name
from storage.records import Entry, decode_records
from storage.results import Gap

# Counts are int64 on the wire. An ack of huge ranges of offsets that are not pending names more
# unknown offsets than that: such counts saturate here rather than fail every later reply.
MAX_COUNT = 2**63 - 1

# Durations are added to clock times (ms since the epoch), and the sums are due times that go out as
# int64 (GetPending's due_ms) and arm timers: bounded far below int64, so that no sum can overflow.
MAX_DURATION_MS = 10**15


def validate_label(kind: str, name: str) -> None:
    """Group and consumer names follow the stream-name rule (storage/names.py)."""
    validate_name(name, kind)


def check_non_negative(name: str, value: int | None, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgumentError(f"{name} must be a non-negative integer")


def check_duration(name: str, value: int | None, *, optional: bool = True) -> None:
    """A duration that is added to a clock time (a retry, an expiry, a delay): 0..MAX_DURATION_MS."""
    check_non_negative(name, value, optional=optional)
    if value is not None and value > MAX_DURATION_MS:
        raise InvalidArgumentError(
            f"{name} is {value} ms; the limit is {MAX_DURATION_MS} ms (about 31,700 years)"
        )


# ---------------------------------------------------------------------- configuration


@dataclass(frozen=True, kw_only=True)
class GroupConfig:
    """Per-group policy. None means "no limit" or "not used"."""

    # Redeliver an entry not acknowledged this long after its delivery (RCP RETRY retry-ms). A read may
    # set its own. None: entries stay pending (as Redis XREADGROUP) and come back only by nack or claim.
    retry_ms: int | None = None
    # Take an entry out of the pending list this long after its first delivery (RCP RETRY expire-ms).
    expire_ms: int | None = None
    # An entry delivered this many times leaves the pending list when it would be redelivered.
    max_deliveries: int | None = None
    # Bounded pending (RCP): while this many entries are pending, reads get only redeliveries.
    max_pending: int | None = None
    # Expired and exhausted entries are appended here (with x-origin-* headers) instead of dropped.
    dead_letter_stream: str | None = None
    # An entry reaches the group only once its timestamp + delay_ms has passed.
    delay_ms: int = 0
    # Retention never evicts what this group still needs (its cursor, pending and scheduled entries)...
    retention_hold: bool = False
    # ...unless the group has been idle (no read, ack or claim) for longer than this.
    idle_release_ms: int | None = None

    def __post_init__(self) -> None:
        for name in ("retry_ms", "expire_ms", "idle_release_ms"):
            check_duration(name, getattr(self, name))
        check_duration("delay_ms", self.delay_ms, optional=False)
        for name in ("max_deliveries", "max_pending"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise InvalidArgumentError(f"{name} must be a positive integer")
        if not isinstance(self.retention_hold, bool):
            raise InvalidArgumentError("retention_hold must be a bool")
        if self.dead_letter_stream is not None:
            validate_name(self.dead_letter_stream)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> GroupConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


# ---------------------------------------------------------------------- what a group read takes


@dataclass(frozen=True, slots=True)
class GroupReadOptions:
    """One group read's parameters besides its stream and group (see GroupDelivery.read_group).

    Checked when made (InvalidArgumentError), so a reader that repeats a read
    (a waiting one, a Consume session) checks its options once.
    """

    consumer: str
    count: int  # at most this many entries (the engine caps it at max_batch_entries)
    max_bytes: int = 0  # bound on the records' size, at least one entry; 0: none
    retry_ms: int | None = None  # overrides the group's for the entries this read delivers
    expire_ms: int | None = None  # likewise (expiry counts from an entry's first delivery)
    noack: bool = False  # take only new entries, and do not track them
    claim_idle_ms: int | None = None  # also claim pending entries idle this long (claim-on-read)

    def __post_init__(self) -> None:
        validate_label("consumer", self.consumer)
        check_non_negative("count", self.count)
        check_non_negative("max_bytes", self.max_bytes)
        for name in ("retry_ms", "expire_ms", "claim_idle_ms"):
            check_duration(name, getattr(self, name))

    @property
    def kind(self) -> tuple[bool, int | None]:
        """Reads of the same kind see the same entries: if one finds nothing, so do the others."""
        return self.noack, self.claim_idle_ms


# ---------------------------------------------------------------------- what calls return


@dataclass(frozen=True, slots=True)
class GroupCounters:
    delivered: int = 0  # first deliveries
    redelivered: int = 0  # retries, claims, and new deliveries of entries still pending
    acked: int = 0
    ack_unknown: int = 0  # acks of offsets that were not pending (unknown or acknowledged before)
    expired: int = 0  # dropped by expire_ms or max_deliveries (no dead-letter stream)
    dead_lettered: int = 0
    evicted: int = 0  # pending or scheduled entries dropped because the stream no longer has them


@dataclass(frozen=True, slots=True)
class ConsumerInfo:
    name: str
    pending: int
    seen_ms: int  # last read or claim, successful or not (Redis seen-time)
    active_ms: int | None  # last read or claim that returned entries (Redis active-time); None: never


@dataclass(frozen=True, slots=True)
class GroupInfo:
    stream: str
    name: str
    config: GroupConfig
    cursor: int  # next offset new entries come from
    entries_read: int
    lag: int | None  # entries the group has still to receive (scheduled ones included); None if unknown
    entries_added: int  # the stream's all-time count (= its next offset)
    pending: int
    scheduled: int
    consumers: tuple[ConsumerInfo, ...]
    counters: GroupCounters
    created_ms: int
    active_ms: int
    hold_offset: int  # lowest offset the group still needs (what it holds if retention_hold is on)
    holds_retention: bool  # this group is the one holding the stream's retention back


@dataclass(frozen=True, slots=True)
class PendingRow:
    offset: int
    consumer: str | None  # None: released, waiting for redelivery
    idle_ms: int  # since its last delivery
    delivery_count: int
    due_ms: int | None  # when it is redelivered automatically; None: only by claim


@dataclass(frozen=True, slots=True)
class PendingInfo:
    count: int  # the whole group's pending entries (not filtered)
    lowest: int | None
    highest: int | None
    consumers: dict[str, int]  # pending entries per consumer (consumers with none are left out)
    released: int  # pending entries without an owner
    rows: tuple[PendingRow, ...]  # the filtered detail, in offset order


@dataclass(frozen=True, slots=True)
class AckResult:
    acknowledged: int  # entries that were pending and are now acknowledged
    unknown: int  # offsets named that were not pending (harmless; counted in ack_unknown)


@dataclass(frozen=True, slots=True)
class NackResult:
    released: int  # pending entries released for redelivery
    unknown: int  # offsets named that were not pending


@dataclass(slots=True)
class GroupReadResult:
    """Entries handed to one consumer: records as `ReadResult.records` holds them, in delivery order.

    `offsets` and `delivery_counts` have one item per entry (not per chunk of
    `records`). `next_due_ms` is the earliest time a read with the same options
    could get something that is not deliverable now (a retry, a delayed or
    scheduled entry, an entry becoming idle enough to claim), or None; a
    waiting reader arms one timer for it instead of polling. New appends and
    acks that free room (`pending_full`) are signalled separately.
    """

    records: list[bytes] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    delivery_counts: list[int] = field(default_factory=list)
    next_due_ms: int | None = None
    pending_full: bool = False  # new entries were held back because max_pending entries are pending
    # Evicted entries never delivered to this group: those the cursor jumped over, and delayed entries
    # evicted before they fell due; one range spanning them all.
    gap: Gap | None = None
    gone: list[int] = field(default_factory=list)  # pending offsets dropped: the stream no longer has them

    @property
    def count(self) -> int:
        return len(self.offsets)

    def data(self) -> bytes:
        return b"".join(self.records)

    def entries(self) -> list[Entry]:
        return decode_records(self.data())
