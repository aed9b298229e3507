"""Idempotent appends: the recent (producer id, sequence) batches of one stream.

A producer that retries an append with the same sequence gets the offsets of
the first attempt back, and nothing is written twice (Kafka's idempotent
producer, NATS Msg-Id, Redis 8.6 IDMP). The table keeps, per producer, its
most recent batches, and forgets producers idle longer than the window.

The source of truth is the stream itself: the last entry of an idempotent
batch carries the producer id and sequence (storage/records.py), in the same
atomic node write as the batch. This table is a cache of it, saved to
`producers.snap` (storage/layout.py) now and then; at start-up the snapshot is loaded and only
nodes written after it are scanned (those flagged as holding producer info).
"""

from __future__ import annotations

import json
import struct
from collections import OrderedDict
from dataclasses import dataclass

from crc32c import crc32c

from storage.errors import CorruptionError, PreconditionError

_MAGIC = b"SLPD"


@dataclass(frozen=True, slots=True)
class BatchRecord:
    first_offset: int
    last_offset: int
    timestamp_ms: int


class ProducerTable:
    def __init__(self, batches_per_producer: int, window_ms: int, max_producers: int) -> None:
        self._batches = batches_per_producer
        self._window_ms = window_ms
        self._max_producers = max_producers
        # producer -> (sequence -> batch), both in insertion order: oldest first.
        self._producers: OrderedDict[str, OrderedDict[int, BatchRecord]] = OrderedDict()
        self.scanned_to = 0  # every idempotent batch below this offset is in the table
        self.changed = False

    def __len__(self) -> int:
        return len(self._producers)

    def lookup(self, producer: str, sequence: int) -> BatchRecord | None:
        """The batch an earlier attempt wrote, or None for a new sequence.

        A sequence older than every one remembered for the producer cannot be
        told apart from a retry that came too late: it is refused.
        """
        batches = self._producers.get(producer)
        if not batches:
            return None
        found = batches.get(sequence)
        if found is None and len(batches) >= self._batches and sequence < next(iter(batches)):
            raise PreconditionError(
                f"sequence {sequence} of producer {producer!r} is older than the deduplication window "
                f"(the oldest remembered is {next(iter(batches))})"
            )
        return found

    def record(self, producer: str, sequence: int, batch: BatchRecord) -> None:
        batches = self._producers.pop(producer, None) or OrderedDict()
        batches[sequence] = batch
        while len(batches) > self._batches:
            batches.popitem(last=False)
        self._producers[producer] = batches  # most recently used last
        while len(self._producers) > self._max_producers:
            self._producers.popitem(last=False)
        self.scanned_to = max(self.scanned_to, batch.last_offset + 1)
        self.changed = True

    def expire(self, now_ms: int) -> None:
        """Forget producers whose latest batch is older than the window."""
        horizon = now_ms - self._window_ms
        stale = [p for p, b in self._producers.items() if next(reversed(b.values())).timestamp_ms < horizon]
        for producer in stale:
            del self._producers[producer]
        if stale:
            self.changed = True

    def forget_from(self, end_offset: int) -> None:
        """Drop batches at or past `end_offset`: after a power loss their entries are gone."""
        for producer in list(self._producers):
            batches = self._producers[producer]
            for sequence in [s for s, b in batches.items() if b.last_offset >= end_offset]:
                del batches[sequence]
            if not batches:
                del self._producers[producer]
        self.scanned_to = min(self.scanned_to, end_offset)

    def snapshot(self, now_ms: int, end_offset: int) -> bytes | None:
        """Expire idle producers; the table's snapshot if it changed since the last one, else None.
        `end_offset`: the stream's end, below which every idempotent batch is in the table."""
        self.expire(now_ms)
        if not self.changed:
            return None
        self.scanned_to = end_offset
        self.changed = False
        return self.encode()

    def encode(self) -> bytes:
        body = json.dumps(
            {
                "scanned_to": self.scanned_to,
                "producers": [
                    [p, [[s, b.first_offset, b.last_offset, b.timestamp_ms] for s, b in batches.items()]]
                    for p, batches in self._producers.items()
                ],
            }
        ).encode()
        return _MAGIC + struct.pack("<I", crc32c(body)) + body

    def load(self, raw: bytes) -> None:
        if raw[:4] != _MAGIC or len(raw) < 8 or struct.unpack_from("<I", raw, 4)[0] != crc32c(raw[8:]):
            raise CorruptionError("producer snapshot failed its checks")
        try:
            data = json.loads(raw[8:])
            for producer, batches in data["producers"]:
                for sequence, first, last, ts in batches:
                    self.record(producer, sequence, BatchRecord(first, last, ts))
            self.scanned_to = int(data["scanned_to"])
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptionError(f"producer snapshot is malformed: {exc}") from exc
        self.changed = False
