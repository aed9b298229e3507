"""What consumer groups need of the streams, and nothing more: the engine's public calls.

Groups never reach into a stream (its lock, nodes or index): they read entries,
bounds and node-header summaries through these calls, and append dead letters.
`Engine` is a `GroupStreams`; a replica or a test can stand in with anything
that has these calls.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from storage.config import EngineConfig
from storage.records import skim_records
from storage.results import AppendResult, EntriesMeta, ReadResult
from storage.types import AppendBatch, FsyncPolicy, StreamBounds


class GroupStreams(Protocol):
    data_dir: Path  # a stream's groups live in its directory (storage.layout)
    config: EngineConfig  # batch limits bound a group read and a dead-letter append

    def exists(self, name: str) -> bool: ...

    def list_streams(self) -> list[str]: ...

    def bounds(self, name: str) -> StreamBounds: ...

    def read(self, name: str, offset: int, count: int, *, max_bytes: int = 0) -> ReadResult: ...

    def entries_meta(self, name: str, start: int, stop: int) -> EntriesMeta: ...

    def count(self, name: str, start: int, end: int) -> int: ...

    def fsync_policy(self, name: str) -> FsyncPolicy: ...

    def append(self, name: str, batch: AppendBatch) -> AppendResult: ...


def fetch_records(streams: GroupStreams, stream: str, offsets: Iterable[int]) -> dict[int, bytes]:
    """The records of those offsets that still exist, one stream read per run of consecutive offsets."""
    want = sorted(set(offsets))
    found: dict[int, bytes] = {}
    i = 0
    while i < len(want):
        j = i
        while j + 1 < len(want) and want[j + 1] == want[j] + 1:
            j += 1
        start, stop = want[i], want[j] + 1
        result = streams.read(stream, start, stop - start)
        for offset, _, _, record in skim_records(result.records):
            if start <= offset < stop:
                found[offset] = record
        i = j + 1
    return found
