"""The catalog: every stream of a data directory, and what start-up and the totals need of each.

In memory it maps each stream's name to its directory, keeps the names sorted (for
paged listings), and keeps a summary of each stream that is not open (its entries,
bytes, segments and nodes as of its last close) with running totals of those
summaries, so the engine's totals cover every stream with no per-stream work.

On disk it is one file, `DATA/catalog` (docs/FORMAT.md), replaced atomically, so
start-up reads one file instead of a million `stream.meta` files. It is a cache of
what the stream directories hold, never the truth about which streams exist: start-up
lists the streams directory, takes what the file says of each directory it names,
reads the meta file of every directory it does not name (created since it was
written), and forgets the names whose directory is gone. A missing or damaged file
is rebuilt that way from the directories alone.
"""

from __future__ import annotations

import heapq
import json
import struct
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, overload

from crc32c import crc32c
from sortedcontainers import SortedList

from storage.errors import CorruptionError

if TYPE_CHECKING:
    from storage.fs import FileSystem

CATALOG_FILE = "catalog"
CATALOG_VERSION = 1
_MAGIC = b"SLCT"


class StreamSummary(NamedTuple):
    """What the catalog keeps of a stream that is not open."""

    entries: int = 0
    bytes_on_disk: int = 0
    segments: int = 0
    nodes: int = 0
    # When maintenance should next visit it while it is closed (wall-clock ms; 0: never): its
    # oldest node's age limit, its next compaction, or at once (packing or a limit pending, or
    # figures unknown).
    upkeep_ms: int = 0
    replicated: bool = False  # it has an epoch history, checked at start-up (a few streams)


UNKNOWN = StreamSummary(upkeep_ms=1)  # found by its meta file alone: a visit learns its figures
TOTALS = ("entries", "bytes_on_disk", "segments", "nodes")


class Catalog:
    """The streams of one engine; every method is safe to call from any thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._dirs: dict[str, str] = {}  # name -> directory name
        self._names: SortedList = SortedList()
        self._closed: dict[str, StreamSummary] = {}  # streams not open now
        self._totals = [0, 0, 0, 0]  # TOTALS over _closed
        self._due: list[tuple[int, str]] = []  # heap of (upkeep_ms, name); stale items skipped
        self.changes = 0  # streams added or removed since the file was last written

    def __contains__(self, name: object) -> bool:
        return name in self._dirs

    def __len__(self) -> int:
        return len(self._dirs)

    def directory(self, name: str) -> str | None:
        return self._dirs.get(name)

    def names(self) -> list[str]:
        """Every name, sorted (a copy)."""
        with self.lock:
            return list(self._names)

    def name_at(self, index: int | slice) -> str | list[str]:
        """The name(s) at `index` of the sorted names."""
        with self.lock:
            return self._names[index]

    def sorted_view(self) -> SortedNames:
        return SortedNames(self)

    def add(self, name: str, dirname: str) -> None:
        """A stream created now (it is open)."""
        with self.lock:
            if name in self._dirs:
                self._forget_summary(name)
            else:
                self._names.add(name)
            self._dirs[name] = dirname
            self.changes += 1

    def remove(self, name: str) -> None:
        with self.lock:
            if self._dirs.pop(name, None) is not None:
                self._names.remove(name)
                self._forget_summary(name)
                self.changes += 1

    def opened(self, name: str) -> None:
        """The stream is open: its figures come from it now."""
        with self.lock:
            self._forget_summary(name)

    def closed(self, name: str, summary: StreamSummary) -> None:
        """The stream closed with these figures."""
        with self.lock:
            if name in self._dirs:
                self._forget_summary(name)
                self._keep_summary(name, summary)

    def totals(self) -> dict[str, int]:
        """TOTALS over the streams not open."""
        with self.lock:
            return dict(zip(TOTALS, self._totals, strict=True))

    def fill(self, streams: dict[str, tuple[str, StreamSummary]]) -> None:
        """Start-up: the streams found (name -> (directory name, summary)), all closed."""
        with self.lock:
            self._dirs = {name: dirname for name, (dirname, _) in streams.items()}
            self._names = SortedList(self._dirs)
            self._closed = {name: summary for name, (_, summary) in streams.items()}
            self._totals = [sum(s[i] for s in self._closed.values()) for i in range(len(TOTALS))]
            self._due = [(s.upkeep_ms, name) for name, s in self._closed.items() if s.upkeep_ms]
            heapq.heapify(self._due)

    def due(self, now_ms: int, limit: int) -> list[str]:
        """Up to `limit` closed streams whose upkeep is due, soonest first (maintenance's batch)."""
        found: list[str] = []
        with self.lock:
            while self._due and self._due[0][0] <= now_ms and len(found) < limit:
                when, name = heapq.heappop(self._due)
                summary = self._closed.get(name)
                if summary is not None and summary.upkeep_ms == when and name not in found:
                    found.append(name)
        return found

    def _keep_summary(self, name: str, summary: StreamSummary) -> None:
        self._closed[name] = summary
        if summary.upkeep_ms:
            heapq.heappush(self._due, (summary.upkeep_ms, name))
        for i, key in enumerate(TOTALS):
            self._totals[i] += getattr(summary, key)

    def _forget_summary(self, name: str) -> None:
        # Its heap item, if any, goes stale: `due` skips it.
        summary = self._closed.pop(name, None)
        if summary is not None:
            for i, key in enumerate(TOTALS):
                self._totals[i] -= getattr(summary, key)

    # ------------------------------------------------------------------ the file

    def encode(self, skip: set[str], summaries: dict[str, StreamSummary]) -> bytes:
        """The file's bytes: every stream but `skip` (streams whose creation is not durable yet),
        with the summary of the closed ones and, for the open ones, `summaries` (else UNKNOWN)."""
        with self.lock:
            names = [n for n in self._names if n not in skip]
            rows = [self._closed.get(n) or summaries.get(n, UNKNOWN) for n in names]
            dirs = ["" if self._dirs[n] == n else self._dirs[n] for n in names]
            self.changes = 0
        columns = {
            field: [getattr(row, field) for row in rows] if rows else [] for field in StreamSummary._fields
        }
        body = json.dumps(
            {"version": CATALOG_VERSION, "names": names, "dirs": dirs, **columns}, separators=(",", ":")
        ).encode()
        return _MAGIC + struct.pack("<I", crc32c(body)) + body


def decode_catalog(raw: bytes) -> dict[str, tuple[str, StreamSummary]]:
    """directory name -> (stream name, summary), from the file's bytes (CorruptionError if damaged)."""
    if len(raw) < 8 or raw[:4] != _MAGIC:
        raise CorruptionError("catalog has a bad magic")
    body = raw[8:]
    if struct.unpack_from("<I", raw, 4)[0] != crc32c(body):
        raise CorruptionError("catalog CRC mismatch")
    try:
        data = json.loads(body)
        if data["version"] != CATALOG_VERSION:
            raise CorruptionError(f"catalog version {data['version']} is not {CATALOG_VERSION}")
        names = data["names"]
        dirs = [d or n for d, n in zip(data["dirs"], names, strict=True)]
        columns = [data[field] for field in StreamSummary._fields]
        summaries = map(StreamSummary._make, zip(*columns, strict=True)) if names else iter(())
        return dict(zip(dirs, zip(names, summaries, strict=True), strict=True))
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptionError(f"catalog is malformed: {exc}") from exc


def read_catalog(fs: FileSystem, data_dir: Path) -> dict[str, tuple[str, StreamSummary]] | None:
    """The catalog file's content, or None when there is none or it is damaged (then rebuilt)."""
    try:
        return decode_catalog(fs.read_file(data_dir / CATALOG_FILE))
    except FileNotFoundError:
        return None
    except CorruptionError:
        return None


class SortedNames(Sequence[str]):
    """The catalog's names in order, read in place (no copy of a million names for one page):
    each access takes the catalog's lock, so a page may miss a stream created meanwhile."""

    def __init__(self, catalog: Catalog) -> None:
        self._catalog = catalog

    def __len__(self) -> int:
        return len(self._catalog)

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...
    def __getitem__(self, index: int | slice) -> str | list[str]:
        return self._catalog.name_at(index)

    def __iter__(self) -> Iterator[str]:
        return iter(self._catalog.names())
