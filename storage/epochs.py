"""A stream's leader-epoch history and incarnation (Kafka's leader-epoch-checkpoint, KIP-101/279).

Replication (cluster/) begins an epoch each time a replica becomes the
stream's leader: the history is the list of (epoch, start_offset), the first
offset written under each epoch, both strictly increasing. A follower whose
log diverged asks the leader where its last epoch ends (`end_of`) and
truncates there. The `incarnation` tells two streams of the same name apart
(one deleted, the other created later): 0 for a stream created without one.

The history lives in the stream's `epochs` file (storage/layout.py), replaced
atomically and durably on every change (write a temporary file, fsync,
rename, fsync the directory): a crash leaves the old history or the new one.
No file means an empty history and incarnation 0. docs/FORMAT.md has the layout.
"""

from __future__ import annotations

import json
import struct
from bisect import bisect_right

from crc32c import crc32c

from storage.errors import CorruptionError, InvalidArgumentError, PreconditionError

_MAGIC = b"SLEP"
NO_EPOCH = -1  # what `end_of` answers when no recorded epoch is at or below the one asked


class EpochHistory:
    __slots__ = ("entries", "incarnation")

    def __init__(self, incarnation: int = 0, entries: list[tuple[int, int]] | None = None) -> None:
        self.incarnation = incarnation
        self.entries: list[tuple[int, int]] = entries or []  # (epoch, start_offset), both increasing

    @property
    def latest(self) -> int:
        return self.entries[-1][0] if self.entries else NO_EPOCH

    def begun(self, epoch: int, start_offset: int) -> EpochHistory | None:
        """The history with `epoch` begun at `start_offset`, or None if it is already the latest.

        An epoch lower than the latest is refused. An epoch that recorded no entry (its start is
        `start_offset` too) gives way to the new one, as in Kafka, so starts stay increasing.
        """
        if not isinstance(epoch, int) or epoch < 0:
            raise InvalidArgumentError("an epoch must be a non-negative integer")
        if epoch == self.latest:
            return None
        if epoch < self.latest:
            raise PreconditionError(f"epoch {epoch} is older than the stream's latest epoch {self.latest}")
        kept = [(e, s) for e, s in self.entries if s < start_offset]
        return EpochHistory(self.incarnation, [*kept, (epoch, start_offset)])

    def end_of(self, epoch: int, first_offset: int, end_offset: int) -> tuple[int, int]:
        """KIP-279's lookup: (the largest recorded epoch <= `epoch`, the offset where it ends: the
        next epoch's start, or `end_offset` when it is the latest).

        When no recorded epoch is at or below `epoch`: (NO_EPOCH, the first recorded epoch's start),
        the offset below which the log predates every epoch recorded; and (NO_EPOCH, first_offset)
        when nothing is recorded at all (nothing in the log is vouched for by an epoch).
        """
        i = bisect_right(self.entries, epoch, key=lambda entry: entry[0])
        if i == 0:
            return NO_EPOCH, self.entries[0][1] if self.entries else first_offset
        found = self.entries[i - 1][0]
        return found, self.entries[i][1] if i < len(self.entries) else end_offset

    def truncated(self, end_offset: int) -> EpochHistory | None:
        """The history without the epochs that start at or after `end_offset` (None: no change)."""
        kept = [(e, s) for e, s in self.entries if s < end_offset]
        return None if len(kept) == len(self.entries) else EpochHistory(self.incarnation, kept)

    def encode(self) -> bytes:
        body = json.dumps({"incarnation": self.incarnation, "epochs": self.entries}).encode()
        return _MAGIC + struct.pack("<I", crc32c(body)) + body

    @classmethod
    def decode(cls, raw: bytes) -> EpochHistory:
        if raw[:4] != _MAGIC or len(raw) < 8 or struct.unpack_from("<I", raw, 4)[0] != crc32c(raw[8:]):
            raise CorruptionError("epoch history failed its checks")
        try:
            data = json.loads(raw[8:])
            entries = [(int(e), int(s)) for e, s in data["epochs"]]
            incarnation = int(data["incarnation"])
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptionError(f"epoch history is malformed: {exc}") from exc
        return cls(incarnation, entries)
