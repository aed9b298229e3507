"""Doomed pending entries: dropped, or appended to the group's dead-letter stream.

A pending entry is doomed when it expires or has been delivered max_deliveries
times (storage.grouppending). With a `dead_letter_stream` configured, it is
appended there with headers saying where it came from (RCP 11's x-origin-*,
x-group, x-delivery-count, x-reason); without one, it is dropped. Either way
it leaves the group's pending list, by ops on the group (storage.groupstate).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from storage.errors import InvalidArgumentError, LimitExceededError, StorageError
from storage.groupops import RemoveReason
from storage.grouppending import Doomed
from storage.groupstate import Group
from storage.groupstreams import GroupStreams, fetch_records
from storage.records import Entry, decode_records
from storage.types import AppendBatch

log = logging.getLogger("streamlog.storage")

# A doomed entry whose dead-lettering failed for a passing reason is tried again after this long.
DEAD_LETTER_RETRY_MS = 1000


class DeadLetters:
    def __init__(self, streams: GroupStreams) -> None:
        self._streams = streams

    def retire(self, stream: str, group: Group, doomed: list[Doomed], now: int) -> list[int]:
        """Drop or dead-letter doomed entries; returns the offsets found gone from the stream."""
        records = fetch_records(self._streams, stream, [d.offset for d in doomed])
        gone = [d.offset for d in doomed if d.offset not in records]
        group.remove(gone, RemoveReason.EVICTED)
        live = [d for d in doomed if d.offset in records]
        target = group.config.dead_letter_stream
        if target is None:
            group.remove([d.offset for d in live], RemoveReason.EXPIRED)
            return gone
        for batch in self._batches(live, records):
            offsets = [d.offset for d, _ in batch]
            try:
                self._streams.append(target, _letters(stream, group.name, batch))
            except (InvalidArgumentError, LimitExceededError) as exc:
                # Will never fit (e.g. headers at the size limit): keeping it pending would block forever.
                log.error(
                    "stream %r group %r: offsets %s cannot go to dead-letter stream %r (%s); dropped",
                    stream,
                    group.name,
                    offsets,
                    target,
                    exc,
                )
                group.remove(offsets, RemoveReason.EXPIRED)
            except StorageError as exc:
                log.error(
                    "stream %r group %r: dead-lettering to %r failed (%s); retrying in %d ms",
                    stream,
                    group.name,
                    target,
                    exc,
                    DEAD_LETTER_RETRY_MS,
                )
                group.pending.defer_doom(offsets, now + DEAD_LETTER_RETRY_MS)
            else:
                group.remove(offsets, RemoveReason.DEAD_LETTERED)
        return gone

    def _batches(
        self, doomed: list[Doomed], records: dict[int, bytes]
    ) -> Iterator[list[tuple[Doomed, Entry]]]:
        """Doomed entries with their decoded entry, in batches within the engine's append limits."""
        cfg = self._streams.config
        batch: list[tuple[Doomed, Entry]] = []
        size = 0
        for d in doomed:
            entry = decode_records(records[d.offset])[0]
            if batch and (
                len(batch) >= cfg.max_batch_entries or size + len(entry.payload) > cfg.max_batch_bytes
            ):
                yield batch
                batch, size = [], 0
            batch.append((d, entry))
            size += len(entry.payload)
        if batch:
            yield batch


def _letters(stream: str, group: str, batch: list[tuple[Doomed, Entry]]) -> AppendBatch:
    """The dead letters of a batch: each entry as it was, with headers saying where it came from."""
    headers = [
        {
            **entry.headers,
            "x-origin-stream": stream.encode(),
            "x-origin-offset": str(d.offset).encode(),
            "x-group": group.encode(),
            "x-delivery-count": str(d.delivery_count).encode(),
            "x-reason": d.reason.encode(),
        }
        for d, entry in batch
    ]
    return AppendBatch([e.payload for _, e in batch], [e.tag for _, e in batch], headers)
