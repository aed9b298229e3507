"""The catalog: every stream of a data directory, and what start-up and the totals need of each.

In memory it knows every stream by name, keeps the figures of each stream that is
not open (entries, bytes, segments and nodes as of its last close) with running
totals of them, so the engine's totals cover every stream with no per-stream
work, and the names sorted (built on the first listing) for paged listings. It is
laid out for a million streams: the names the file held stay the sorted list its
one decode made (row i for name i, found by bisection: no dict of a million rows
to build at start-up), the streams created since in a dict of name -> row, the
figures in columns of machine integers.

On disk it is one file, `DATA/catalog` (docs/FORMAT.md), replaced atomically, so
start-up reads one file instead of a million `stream.meta` files. It is a cache of
what the stream directories hold, never the truth about which streams exist: the
engine's start-up (storage/engine.py) lists the streams directory, takes from the
file the streams whose directories it names and those in a slot of a pack file
(a `place`: they have no directory), reads the meta file of the others, and
forgets the names whose directory is gone. A missing or damaged file is rebuilt
from the directories alone.
"""

from __future__ import annotations

import heapq
import json
import re
import struct
import sys
import threading
from array import array
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, overload

from crc32c import crc32c
from sortedcontainers import SortedList

from storage.errors import CorruptionError
from storage.names import dirname_for
from storage.packs import NO_PLACE

if TYPE_CHECKING:
    from storage.catalogjournal import Journal
    from storage.fs import FileSystem

CATALOG_FILE = "catalog"
# The file a deletion set aside (storage/engine.py): read only with its journals, after a process crash.
CATALOG_SET_ASIDE = "catalog.set-aside"
# Present after a clean shutdown wrote a complete file: start-up need not list the streams.
CATALOG_CLEAN = "catalog.clean"
CATALOG_VERSION = 2  # 2: the place column
_MAGIC = b"SLCT"
_HEAD = struct.Struct("<4sIHHII")  # magic, CRC32C of the rest, version, 0, streams, JSON bytes
TOTALS = ("entries", "bytes_on_disk", "segments", "nodes")
# Records in one journal generation past which the file is due to be rewritten (the journal, and
# a replay's work, stay bounded when the cache opens and closes streams at large).
JOURNAL_RECORDS_MAX = 200_000
_OWN_DIRNAME = re.compile(r"[A-Za-z0-9_-]{1,200}")  # a name that is its directory's (storage/names.py)


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
NO_FIGURES = StreamSummary()  # an open or deleted stream's row


@dataclass
class CatalogFile:
    """What the file holds: the names (sorted), their figures (columns in TOTALS order), the
    directory names that are not the stream's own name, the replicated streams, the
    pending upkeep of closed streams ((upkeep_ms, name)), their places (NO_PLACE for
    every stream of a version-1 file), and the slots of the streams found unreadable there
    (name -> place: kept for the operator, never reused)."""

    names: list[str]
    columns: list[array]
    dirs: dict[str, str]
    replicated: list[str]
    due: list[tuple[int, str]]
    places: array
    journal: int = 0  # the generation of the journal that continues the file (storage/catalogjournal.py)
    unreadable: dict[str, int] = field(default_factory=dict)

    def dirnames(self) -> set[str]:
        """The directories of its streams in streams/ (a stream in a slot has none)."""
        found = {name for name, place in zip(self.names, self.places, strict=True) if place == NO_PLACE}
        for name, dirname in self.dirs.items():
            if name in found:
                found.discard(name)
                found.add(dirname)
        return found


class Catalog:
    """The streams of one engine; every method is safe to call from any thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._base: list[str] = []  # the file's names, sorted: name i has row i
        self._gone: set[str] = set()  # names of _base deleted since
        self._rows: dict[str, int] = {}  # the other names -> row of the columns
        # Per row, TOTALS of the stream if it is closed (zeros while it is open or gone).
        self._columns = [array("q") for _ in TOTALS]
        self._upkeep = array("q")  # per row: StreamSummary.upkeep_ms of a closed stream
        self._places = array("q")  # per row: where the stream is (NO_PLACE: its own directory)
        self._totals = [0] * len(TOTALS)  # sums of the columns
        self._due: list[tuple[int, str]] = []  # heap of (upkeep_ms, name); stale items skipped
        self._replicated: set[str] = set()
        # Streams found unreadable in their slot -> its place: out of the catalog, the slot kept.
        self._unreadable: dict[str, int] = {}
        self._sorted: SortedList | None = None  # the names in order, built on the first listing
        self._open: set[str] = set()  # streams open now: their figures are not the catalog's
        self._journal: Journal | None = None  # the changes since the file (storage/catalogjournal.py)
        self.changes = 0  # streams added or removed since the file was last written

    def __contains__(self, name: object) -> bool:
        # A name in `_rows` without a call (the service asks on every Append), one not there
        # without a second probe of `_rows` (a new stream's creation asks twice).
        return isinstance(name, str) and (name in self._rows or self._base_row(name) is not None)

    def __len__(self) -> int:
        return len(self._base) - len(self._gone) + len(self._rows)

    def _row(self, name: str) -> int | None:
        row = self._rows.get(name)
        return row if row is not None else self._base_row(name)

    def _base_row(self, name: str) -> int | None:
        """The row of a name of the file's, found by bisection (None if it is not one, or gone)."""
        base = self._base
        if base:  # (a new data directory's file has no name)
            i = bisect_left(base, name)
            if i < len(base) and base[i] == name and name not in self._gone:
                return i
        return None

    def _all(self) -> Iterator[str]:
        """Every name, the file's in order first."""
        gone = self._gone
        yield from (n for n in self._base if n not in gone) if gone else self._base
        yield from self._rows

    # ------------------------------------------------------------------ start-up

    def load(self, listed: CatalogFile, gone: set[str]) -> None:
        """Start-up: the file's streams, all closed, but for those in `gone` (no directory)."""
        with self.lock:
            n = len(listed.names)
            self._base, self._gone, self._rows = listed.names, set(), {}
            self._columns = listed.columns
            self._places = listed.places
            self._upkeep = array("q", bytes(8 * n))
            for when, name in listed.due:
                self._upkeep[bisect_left(self._base, name)] = when
            self._due = list(listed.due)
            heapq.heapify(self._due)
            self._replicated = set(listed.replicated)
            self._unreadable = dict(listed.unreadable)
            for name in gone:
                if (row := self._row(name)) is not None:
                    self._drop(row, name)
            self._totals = [sum(column) for column in self._columns]

    def add_closed(self, name: str, summary: StreamSummary, place: int = NO_PLACE) -> None:
        """Start-up: a stream found by its directory, or by a journal's record of its slot (closed)."""
        with self.lock:
            row = self._row(name)
            self._keep(self._new_row(name, place) if row is None else row, name, summary)
            self.changes += 1

    # ------------------------------------------------------------------ changes

    def creating(self, name: str) -> None:
        """A stream's directory is about to be made: journaled first, so that a start-up after a
        crash knows every directory it need not list."""
        with self.lock:
            if self._journal is not None:
                self._journal.created(name)

    def add(self, name: str, place: int = NO_PLACE) -> None:
        """A stream created now (it is open): in its own directory (its creation journaled by
        `creating`), or in the slot at `place`, written already: journaled here, so that a
        record never names a slot the page cache does not hold."""
        with self.lock:
            row = self._row(name)
            if row is not None:
                self._forget(row)
                self._places[row] = place
            else:
                self._new_row(name, place)
            self._open.add(name)
            self.changes += 1
            if place != NO_PLACE and self._journal is not None:
                self._journal.placed(name, place)

    def set_place(self, name: str, place: int) -> None:
        """The stream moved (journaled): to its own directory (NO_PLACE) at a promotion's end,
        or into a slot."""
        with self.lock:
            row = self._row(name)
            if row is None:
                return
            self._places[row] = place
            if self._journal is not None:
                if place == NO_PLACE:
                    self._journal.promoted(name)
                else:
                    self._journal.placed(name, place)

    def promoting(self, name: str) -> None:
        """The stream's promotion from its slot to a directory begins (journaled: a start-up after
        a crash checks the directory it may have left)."""
        with self.lock:
            row = self._row(name)
            if row is not None and self._journal is not None:
                self._journal.promoting(name, self._places[row])

    def remove(self, name: str, *, unreadable: bool = False) -> None:
        """The stream is deleted, or (`unreadable`) it failed its checks: then the next start-up
        lists the streams directory, which reports it again, and a slot's stream keeps its slot
        (`unreadable`: in the file, never reused) for the operator."""
        with self.lock:
            row = self._row(name)
            if row is not None:
                if unreadable and self._places[row] != NO_PLACE:
                    self._unreadable[name] = self._places[row]
                self._drop(row, name)
                self.changes += 1
                if self._journal is not None:
                    (self._journal.relist if unreadable else self._journal.deleted)(name)

    def opened(self, name: str) -> None:
        """The stream is open: its figures come from it now."""
        with self.lock:
            if (row := self._row(name)) is not None:
                self._forget(row)
                self._open.add(name)
                if self._journal is not None:
                    self._journal.opened(name)

    def closed(self, name: str, summary: StreamSummary) -> None:
        """The stream closed with these figures, journaled for a directory's stream (a start-up
        after a crash knows them). A slot stream's are not (design §7: half its records): after a
        crash they are unknown, and its slot gives them again with one pread."""
        with self.lock:
            row = self._row(name)
            if row is not None:
                self._keep(row, name, summary)
                self._open.discard(name)
                if self._journal is not None and self._places[row] == NO_PLACE:
                    self._journal.closed(name, summary)

    def recounted(self, name: str, summary: StreamSummary) -> bool:
        """A closed slot stream's figures, read from its slot (after a crash they were unknown):
        kept unless it was opened meanwhile (its figures are its own then). Not journaled."""
        with self.lock:
            row = self._row(name)
            if row is None or name in self._open or self._places[row] == NO_PLACE:
                return False
            self._keep(row, name, summary)
            return True

    def _new_row(self, name: str, place: int) -> int:
        """The row of a name not in the catalog, at `place`, its figures zero."""
        if name in self._gone:  # back under its old row (zeroed when it went)
            self._gone.discard(name)
            row = self._base_row(name)
            assert row is not None
            self._places[row] = place
        else:
            row = self._rows[name] = len(self._upkeep)
            for column in self._columns:
                column.append(0)
            self._upkeep.append(0)
            self._places.append(place)
        if self._sorted is not None:
            self._sorted.add(name)
        return row

    def _drop(self, row: int, name: str) -> None:
        self._forget(row)
        self._open.discard(name)
        if self._rows.pop(name, None) is None:
            self._gone.add(name)  # its row stays, zeroed, until the file is next written
        self._replicated.discard(name)
        if self._sorted is not None:
            self._sorted.remove(name)

    def _keep(self, row: int, name: str, summary: StreamSummary) -> None:
        """The row's figures are `summary`'s now (the stream `name` is closed)."""
        self._figures(row, summary)
        self._upkeep[row] = summary.upkeep_ms
        if summary.upkeep_ms:
            heapq.heappush(self._due, (summary.upkeep_ms, name))
        if summary.replicated:
            self._replicated.add(name)

    def _forget(self, row: int) -> None:
        # Its heap item, if any, goes stale: `due` skips it.
        self._figures(row, NO_FIGURES)
        self._upkeep[row] = 0

    def _figures(self, row: int, figures: StreamSummary) -> None:
        """Set the row's TOTALS to `figures`', the totals following (one pass for both)."""
        totals = self._totals
        for i, column in enumerate(self._columns):
            value = figures[i]
            totals[i] += value - column[row]
            column[row] = value

    # ------------------------------------------------------------------ queries

    def totals(self) -> dict[str, int]:
        """TOTALS over the streams not open."""
        with self.lock:
            return dict(zip(TOTALS, self._totals, strict=True))

    def entries(self, name: str) -> int:
        """The entries the catalog counts in a closed stream (0 while it is open, unknown or absent)."""
        with self.lock:
            row = self._row(name)
            return 0 if row is None else self._columns[0][row]  # TOTALS[0]: entries

    def place(self, name: str) -> int:
        """Where the stream is: its slot, or NO_PLACE (its own directory, or not in the catalog)."""
        with self.lock:
            row = self._row(name)
            return NO_PLACE if row is None else self._places[row]

    def unreadable(self) -> dict[str, int]:
        """The streams found unreadable in their slots, and their places (kept, never reused)."""
        with self.lock:
            return dict(self._unreadable)

    def placed(self) -> dict[str, int]:
        """The streams in slots, and their places (start-up: every other slot of the packs is free)."""
        with self.lock:
            places, gone = self._places, self._gone
            found = {
                n: places[i] for i, n in enumerate(self._base) if places[i] != NO_PLACE and n not in gone
            }
            found.update((name, places[row]) for name, row in self._rows.items() if places[row] != NO_PLACE)
            return found

    def due(self, now_ms: int, limit: int) -> list[str]:
        """Up to `limit` closed streams whose upkeep is due, soonest first (maintenance's batch)."""
        found: list[str] = []
        with self.lock:
            while self._due and self._due[0][0] <= now_ms and len(found) < limit:
                when, name = heapq.heappop(self._due)
                row = self._row(name)
                if row is not None and self._upkeep[row] == when and name not in found:
                    found.append(name)
        return found

    def names(self) -> list[str]:
        """Every name, sorted (a copy). A one-off listing (the consumer groups' probe at a new
        data directory's start-up) builds no sorted list: kept, it costs every creation an
        insertion (issue 17); a paged listing (`name_at`) builds it."""
        with self.lock:
            return list(self._sorted) if self._sorted is not None else sorted(self._all())

    def name_at(self, index: int | slice) -> str | list[str]:
        """The name(s) at `index` of the sorted names."""
        with self.lock:
            return self._names()[index]

    def sorted_view(self) -> SortedNames:
        return SortedNames(self)

    def _names(self) -> SortedList:
        if self._sorted is None:
            self._sorted = SortedList(self._all())
        return self._sorted

    # ------------------------------------------------------------------ the file

    def encode(
        self, skip: set[str], summaries: dict[str, StreamSummary], journal: Journal | None = None
    ) -> bytes:
        """The file's bytes: every stream but `skip` (streams whose creation is not durable yet),
        with the figures of the closed ones and, for the open ones, `summaries` (else UNKNOWN).
        `journal` (a new generation) continues the file from now on: the streams of `skip` are
        recorded in it as created (in their slots, for those that have one). The lock is held
        only to copy the columns (a million rows: milliseconds); the file is built outside it."""
        with self.lock:
            # The file's names are never changed in place: `load` replaces the list.
            base, left = self._base, self._gone | skip
            added = sorted((n, r) for n, r in self._rows.items() if n not in skip)
            columns = [column[:] for column in (*self._columns, self._places)]  # the file's columns
            upkeep = self._upkeep[:]
            replicated = self._replicated - skip
            unreadable = dict(sorted(self._unreadable.items()))
            unknown = self._open - skip
            self.changes = 0
            old, generation = self._journal, 0
            if journal is not None:
                self._journal, generation = journal, journal.generation
                for name in skip:
                    row = self._row(name)
                    if row is not None and self._places[row] != NO_PLACE:
                        journal.placed(name, self._places[row])
                    else:
                        journal.created(name)
        if old is not None and journal is not None:
            old.close()
        copy = _Copy(base, left, added, columns, upkeep, replicated, unreadable, unknown, generation)
        return _encode_copy(copy, summaries, skip)

    def start_journal(self, journal: Journal) -> None:
        """Start-up: the file and its journals were read; changes go to `journal` from now on."""
        with self.lock:
            self._journal = journal

    def relist(self) -> None:
        """The next start-up is to list the streams directory, even after a process crash."""
        with self.lock:
            if self._journal is not None:
                self._journal.relist("")

    def journal_generation(self) -> int:
        with self.lock:
            return self._journal.generation if self._journal is not None else 0

    def journal_full(self) -> bool:
        """Whether the journal reached JOURNAL_RECORDS_MAX records: the file is due now (a replay
        after a kill -9 stays bounded however fast streams come, go, open and close)."""
        with self.lock:
            return self._journal is not None and self._journal.records >= JOURNAL_RECORDS_MAX

    def journal_mark(self) -> tuple[Journal, int] | None:
        """The journal and its length now, taken before a round syncs the packs and then the
        journal (`Journal.sync`, outside the lock): every record before it names written data."""
        with self.lock:
            return None if self._journal is None else (self._journal, self._journal.length())

    def vouch(self, journal: Journal, length: int) -> None:
        """Record that the journal's bytes before `length` name durable data (after the syncs
        `journal_mark` says): unless a new generation began meanwhile, with a file that holds them."""
        with self.lock:
            if journal is self._journal:
                journal.vouch(length)

    def close_journal(self) -> None:
        with self.lock:
            journal, self._journal = self._journal, None
        if journal is not None:
            journal.close()

    def uncounted(self) -> int:
        """Closed slot streams whose figures are not known yet: after a crash (their closes journal
        none) until maintenance reads them from their slots; the totals miss them meanwhile.
        They are due at once (UNKNOWN's upkeep), before any other stream, and a slot stream is
        never due at once otherwise (no packing, no limits): with no such item first in the heap
        there is none, and the columns are not looked at."""
        with self.lock:
            if not self._due or self._due[0][0] != UNKNOWN.upkeep_ms:
                return 0
            upkeep, places = self._upkeep[:], self._places[:]  # copied: counted outside the lock
        unknown = UNKNOWN.upkeep_ms
        pairs = zip(upkeep, places, strict=True)
        return sum(1 for when, place in pairs if when == unknown and place != NO_PLACE)


class _Copy(NamedTuple):
    """What `Catalog.encode` copies under the lock, to build the file from outside it."""

    base: list[str]
    left: set[str]
    added: list[tuple[str, int]]
    columns: list[array]
    upkeep: array
    replicated: set[str]
    unreadable: dict[str, int]
    unknown: set[str]
    generation: int


def _encode_copy(copy: _Copy, summaries: dict[str, StreamSummary], skip: set[str]) -> bytes:
    """The catalog file's bytes from a copy of the catalog (Catalog.encode), outside its lock."""
    base, left, added, columns, upkeep, replicated, unreadable, unknown, generation = copy
    # The file's names are in order already: merge the few created since into them.
    if left or added:
        kept = [(n, i) for i, n in enumerate(base) if n not in left]
        merged = list(heapq.merge(kept, added))
        names, rows = [n for n, _ in merged], [r for _, r in merged]
        columns = [array("q", (column[r] for r in rows)) for column in columns]
        due = {n: when for n, r in zip(names, rows, strict=True) if (when := upkeep[r])}
    else:  # nothing came or went since the file was read: its rows as they are
        names = base
        columns = [column[: len(base)] for column in columns]  # rows of streams added and gone
        due = {base[r]: when for r, when in enumerate(upkeep) if when}
    *figures, places = columns
    for name in unknown:  # open, maybe since `summaries` were taken: visited after a crash
        due[name] = UNKNOWN.upkeep_ms
    for name, summary in summaries.items():
        if name in skip:
            continue
        i = bisect_left(names, name)
        for column, value in zip(figures, summary, strict=False):
            column[i] = value
        due[name] = summary.upkeep_ms or UNKNOWN.upkeep_ms
        if summary.replicated:
            replicated.add(name)
    dirs = {
        n: dirname_for(n)
        for n, place in zip(names, places, strict=True)
        if place == NO_PLACE and not _OWN_DIRNAME.fullmatch(n)
    }
    head = json.dumps(
        {
            "dirs": dirs,
            "replicated": sorted(replicated),
            "due": sorted((w, n) for n, w in due.items()),
            "journal": generation,
            "unreadable": unreadable,
        },
        separators=(",", ":"),
    ).encode()
    body = b"".join([head, "\0".join(names).encode(), *(_stored(column) for column in columns)])
    return _HEAD.pack(_MAGIC, crc32c(body), CATALOG_VERSION, 0, len(names), len(head)) + body


def decode_catalog(raw: bytes) -> CatalogFile:
    """The file's content (CorruptionError if it is damaged or of another version). A version-1
    file (before places) holds directory streams only."""
    if len(raw) < _HEAD.size or raw[:4] != _MAGIC:
        raise CorruptionError("catalog has a bad magic")
    _, crc, version, _, n, head_len = _HEAD.unpack_from(raw)
    body = memoryview(raw)[_HEAD.size :]
    if crc32c(body) != crc:
        raise CorruptionError("catalog CRC mismatch")
    if version not in (1, CATALOG_VERSION):
        raise CorruptionError(f"catalog version {version} is not {CATALOG_VERSION}")
    stored = len(TOTALS) + (version >= 2)  # the figures, then the places
    names_end = len(body) - 8 * n * stored
    if not head_len <= names_end <= len(body):
        raise CorruptionError("catalog sizes do not add up")
    try:
        head = json.loads(bytes(body[:head_len]))
        names = bytes(body[head_len:names_end]).decode().split("\0") if n else []
        width = 8 * n
        columns = [_column(body[names_end + width * i : names_end + width * (i + 1)]) for i in range(stored)]
        places = columns.pop() if version >= 2 else array("q", [NO_PLACE]) * n
        due = [(int(when), str(name)) for when, name in head["due"]]
        listed = CatalogFile(
            names,
            columns,
            dict(head["dirs"]),
            list(head["replicated"]),
            due,
            places,
            int(head.get("journal", 0)),
            {str(name): int(place) for name, place in head.get("unreadable", {}).items()},
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptionError(f"catalog is malformed: {exc}") from exc
    if len(names) != n:
        raise CorruptionError(f"catalog lists {len(names)} names, not {n}")
    if names != sorted(names):  # the catalog finds them by bisection (linear on a sorted list)
        raise CorruptionError("catalog names are not in order")
    return listed


def _column(raw: memoryview) -> array:
    column = array("q")
    column.frombytes(raw)
    if sys.byteorder == "big":
        column.byteswap()  # stored little-endian
    return column


def _stored(column: array) -> bytes:
    if sys.byteorder == "big":
        column = array("q", column)
        column.byteswap()
    return column.tobytes()


def read_catalog(fs: FileSystem, data_dir: Path, name: str = CATALOG_FILE) -> CatalogFile | None:
    """The catalog file's content, or None when there is none or it is damaged (then rebuilt)."""
    try:
        return decode_catalog(fs.read_file(data_dir / name))
    except (FileNotFoundError, CorruptionError):
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
