"""The catalog's journal: the streams created, deleted, opened and closed since the catalog file was written.

A start-up after a crash could trust the catalog file only for the streams it names, so it
listed the streams directory (a million entries) to find those created since. The journal
names them instead: the engine appends a record to `DATA/catalog.<generation>.log` as a
stream's name enters or leaves the catalog, as a closed stream is opened (its figures in the
file are stale from then on) and as it closes again, with its figures then: so a start-up
after a crash knows the figures of every stream but those open at the crash, which count as
unknown until they are recovered. Records are written (never synced) under the catalog's
lock, so their order is the catalog's.

Each catalog file names the generation of the journal that continues it (docs/FORMAT.md);
writing the file starts the next generation and, once the file is in place, removes the
older journals. After a process crash (kill -9) the page cache kept every record, so start-up
replays the journals of the file's generation onwards, in order, and lists no directory. A
journal is trusted only if it was started since the machine last booted (its header holds
the kernel's boot id: an operating-system crash or a power loss may have lost unsynced
records) and every record in it is whole, but for a torn last one (a crash cut its write
short: what it announced never happened; a generation a start-up left behind may end so too,
until the catalog is next saved); otherwise start-up lists the streams directory, as
without a journal. A `RELIST` record asks for that listing too (a stream found unreadable:
the listing reports it again).

A stream in a slot of a pack file (docs/design/small-streams.md) has no directory to find:
its `PLACED` record, written once its slot is, says where it is; a promotion to a directory is
`PROMOTING` (begun) then `PROMOTED` (done). A round that synced the packs and then the journal
writes `VOUCHED` with the journal's length before the syncs: every record before it names
durable data. So after a power loss or an OS crash (another boot id) `replay_vouched` still
trusts each generation up to its last VOUCHED length; the records after it are returned for
start-up to check against their slots. A slot stream's close writes no CLOSED record (its slot
gives its figures again).

    header: b"SLCJ", u16 version, u16 boot id bytes, the boot id (ASCII)
    record: u8 kind, u16 name bytes, the name (UTF-8), [payload], u32 CRC32C of the ones before
    payload: CLOSED: i64 entries, bytes on disk, segments, nodes, upkeep_ms, u8 replicated;
             PLACED, PROMOTING: i64 place; VOUCHED (no name): u64 length
"""

from __future__ import annotations

import contextlib
import errno
import logging
import re
import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from crc32c import crc32c

from storage.catalog import NO_PLACE, StreamSummary
from storage.errors import DiskFullError, StorageError

if TYPE_CHECKING:
    from storage.fs import AppendFile, FileSystem

JOURNAL_VERSION = 3  # 2: CLOSED records; 3: places, promotions, VOUCHED
_MAGIC = b"SLCJ"
_HEAD = struct.Struct("<4sHH")
_RECORD = struct.Struct("<BH")
_FIGURES = struct.Struct("<qqqqqB")  # a StreamSummary's fields, in order
_PLACE = struct.Struct("<q")
_LENGTH = struct.Struct("<Q")
_CRC = struct.Struct("<I")
CREATED, DELETED, OPENED, CLOSED, RELIST = b"+"[0], b"-"[0], b"o"[0], b"c"[0], b"!"[0]
PLACED, PROMOTING, PROMOTED, VOUCHED = b"p"[0], b"M"[0], b"m"[0], b"r"[0]
# The kinds each version writes -> their payload's bytes.
_KINDS_2 = {CREATED: 0, DELETED: 0, OPENED: 0, CLOSED: _FIGURES.size, RELIST: 0}
_PAYLOADS = {
    2: _KINDS_2,
    3: {**_KINDS_2, PLACED: _PLACE.size, PROMOTING: _PLACE.size, PROMOTED: 0, VOUCHED: _LENGTH.size},
}
_NAME = re.compile(r"catalog\.(\d{1,18})\.log")

log = logging.getLogger("streamlog.storage")


def journal_name(generation: int) -> str:
    return f"catalog.{generation}.log"


def journal_generations(names: Iterable[str]) -> list[int]:
    """The generations of the journals among a data directory's entries, in order."""
    return sorted(int(m.group(1)) for n in names if (m := _NAME.fullmatch(n)))


def encode_record(kind: int, name: str, payload: bytes = b"") -> bytes:
    raw = name.encode()
    body = _RECORD.pack(kind, len(raw)) + raw + payload
    return body + _CRC.pack(crc32c(body))


class Journal:
    """One generation's journal, open for appending (records are written, not synced)."""

    def __init__(self, fs: FileSystem, data_dir: Path, generation: int) -> None:
        self.generation = generation
        self._fs = fs
        self._data_dir = data_dir
        self._path = data_dir / journal_name(generation)
        boot = fs.boot_id().encode()
        head = _HEAD.pack(_MAGIC, JOURNAL_VERSION, len(boot)) + boot
        try:
            self._file: AppendFile | None = fs.create_append(self._path, head)
        except (OSError, DiskFullError) as exc:
            # Not a file cut short (no room for its header): the generation is missing, as it is
            # when none was started, and start-up handles that.
            with contextlib.suppress(OSError, StorageError):
                fs.remove(self._path)
            full = isinstance(exc, DiskFullError) or exc.errno in (errno.ENOSPC, errno.EDQUOT)
            error = DiskFullError if full else StorageError
            raise error(f"cannot start the catalog journal {self._path.name}: {exc}") from exc
        self._open: set[str] = set()  # streams opened since their last CLOSED record (or none)
        self.records = 0  # written in this generation: a replay's work
        self._length = len(head)  # bytes written
        self._entry_durable = False  # whether the file's directory entry was synced
        self._closing = threading.Lock()  # a sync (on the round's thread) never meets a closed file

    def created(self, name: str) -> None:
        self._append(CREATED, name)

    def deleted(self, name: str) -> None:
        self._open.discard(name)
        self._append(DELETED, name)

    def opened(self, name: str) -> None:
        """Record the stream's opening, unless it is open since its last record already."""
        if name not in self._open:
            self._open.add(name)
            self._append(OPENED, name)

    def closed(self, name: str, figures: StreamSummary) -> None:
        """Record the figures the stream closed with: its last ones, until it is opened again."""
        self._open.discard(name)
        self._append(CLOSED, name, _FIGURES.pack(*figures))

    def relist(self, name: str) -> None:
        self._append(RELIST, name)

    def placed(self, name: str, place: int) -> None:
        """Record a stream created in the slot at `place` (once the slot is written)."""
        self._append(PLACED, name, _PLACE.pack(place))

    def promoting(self, name: str, place: int) -> None:
        """Record that the stream's promotion from the slot at `place` to a directory begins."""
        self._append(PROMOTING, name, _PLACE.pack(place))

    def promoted(self, name: str) -> None:
        """Record that the stream's promotion is done: it is in its directory, its slot is not its."""
        self._append(PROMOTED, name)

    def length(self) -> int:
        """The bytes written so far (a round's mark, before its syncs)."""
        return self._length

    def vouch(self, length: int) -> None:
        """Record that every record before byte `length` names durable data (the packs and the
        journal were synced since `length` was taken)."""
        self._append(VOUCHED, "", _LENGTH.pack(length))

    def sync(self) -> None:
        """fdatasync the journal (and, the first time, the data directory that names it): its
        records so far survive a power loss."""
        with self._closing:
            if self._file is not None:
                self._file.sync()
                if not self._entry_durable:
                    self._fs.sync_dir(self._data_dir)
                    self._entry_durable = True

    def _append(self, kind: int, name: str, payload: bytes = b"") -> None:
        if self._file is None:
            return  # broken: removed, so start-up lists the streams directory
        self.records += 1
        record = encode_record(kind, name, payload)
        try:
            self._file.append(record)
            self._length += len(record)
        except (OSError, StorageError) as exc:
            # A record lost must not leave journals that look whole: the generations before this
            # one go too (a kill -9's start-up goes on in a new generation beside the file's), or
            # a start-up would trust them alone; with none, it lists and scans until the catalog
            # is next saved.
            log.error("catalog journal %s: %s; removed with the generations before it", self._path.name, exc)
            self.close()
            self._remove_generations()

    def _remove_generations(self) -> None:
        """Remove this generation's file and every older one's, then sync their directory."""
        for generation in journal_generations(self._fs.listdir(self._data_dir)):
            if generation <= self.generation:
                path = self._data_dir / journal_name(generation)
                try:
                    self._fs.remove(path)
                except (OSError, StorageError) as again:
                    log.error("catalog journal %s could not be removed: %s", path.name, again)
        try:
            self._fs.sync_dir(self._data_dir)
        except (OSError, StorageError) as again:
            log.error("the removal of the catalog journals could not be synced: %s", again)

    def close(self) -> None:
        with self._closing:
            if self._file is not None:
                self._file.close()
                self._file = None


@dataclass
class Replay:
    """What the journals since the catalog file say: per name its last CREATED, PLACED or DELETED
    record (True: created), the streams opened (figures in the file stale), the figures of
    those whose last record is a CLOSED one (the others opened or created since have figures
    unknown until they are recovered), the places the journals gave (a slot, or NO_PLACE once
    promoted; a stream created in a directory has none here), the promotions begun and not done
    (name -> the slot it leaves), and per generation the length its last VOUCHED record gave."""

    last: dict[str, bool] = field(default_factory=dict)
    opened: set[str] = field(default_factory=set)
    closed: dict[str, StreamSummary] = field(default_factory=dict)
    places: dict[str, int] = field(default_factory=dict)
    promoting: dict[str, int] = field(default_factory=dict)
    vouched: dict[int, int] = field(default_factory=dict)


def replay(fs: FileSystem, data_dir: Path, first: int, generations: list[int]) -> Replay | None:
    """The journals from generation `first` on, in order; None if they cannot be trusted (one
    missing, from before the last boot, damaged, or holding a RELIST record). A torn record at
    the end of one is a write a kill -9 cut short: left out (a start-up after it replays it and
    goes on in the next generation, so the torn one need not be the last)."""
    journals = _journals(fs, data_dir, first, generations, fs.boot_id().encode())
    if journals is None:
        return None
    found = Replay()
    for generation, raw, start in journals:
        records, damaged = _read_records(raw, start)
        if damaged is not None or any(kind == RELIST for _, kind, _, _ in records):
            return None
        for pos, kind, name, at in records:
            if not _apply(found, generation, raw, pos, kind, name, at):
                return None
    return found


@dataclass
class Vouched:
    """What the journals say after a power loss or an OS crash (design §5): `trusted`, the records
    before each generation's last VOUCHED length (synced with the packs before them: their slots
    are durable), and `tail`, (kind, name, place or NO_PLACE) of every record after it, in order
    (each creation to be checked against its slot: never synced, it may be lost)."""

    trusted: Replay
    tail: list[tuple[int, str, int]]


def replay_vouched(fs: FileSystem, data_dir: Path, first: int, generations: list[int]) -> Vouched | None:
    """The journals from generation `first` on, written under any boot: None if one is missing,
    its header is damaged, a VOUCHED record names bytes after its own, or a record before the
    last VOUCHED length fails its checks (synced: damage). One past it that fails them ends its
    generation: never synced, and nothing after it was either (a sync would have covered it
    too). RELIST records count for nothing here: the start-up lists the streams directory anyway."""
    journals = _journals(fs, data_dir, first, generations, None)
    if journals is None:
        return None
    found, tail = Replay(), []
    for generation, raw, start in journals:
        records, damaged = _read_records(raw, start)
        if damaged is not None and _vouched_past(raw, damaged):
            return None
        vouched = 0
        for pos, kind, _, at in records:
            if kind == VOUCHED:
                vouched = _LENGTH.unpack_from(raw, at)[0]
                if vouched > pos:
                    return None
        for pos, kind, name, at in records:
            if pos >= vouched:
                tail.append((kind, name, _PLACE.unpack_from(raw, at)[0] if kind == PLACED else NO_PLACE))
            elif kind != RELIST and not _apply(found, generation, raw, pos, kind, name, at):
                return None
    return Vouched(found, tail)


def _journals(
    fs: FileSystem, data_dir: Path, first: int, generations: list[int], boot: bytes | None
) -> list[tuple[int, bytes, int]] | None:
    """(generation, its bytes, where its records start) of the journals from `first` on, written
    under `boot` (None: any); None if one is missing, of another boot, or its header is damaged."""
    wanted = [g for g in generations if g >= first]
    if not wanted or wanted != list(range(first, first + len(wanted))):
        return None
    found = []
    for generation in wanted:
        raw = fs.read_file(data_dir / journal_name(generation))
        if len(raw) < _HEAD.size:
            return None
        magic, version, boot_len = _HEAD.unpack_from(raw)
        start = _HEAD.size + boot_len
        if magic != _MAGIC or version not in _PAYLOADS or boot not in (None, raw[_HEAD.size : start]):
            return None
        found.append((generation, raw, start))
    return found


def _read_records(raw: bytes, pos: int) -> tuple[list[tuple[int, int, str, int]], int | None]:
    """(position, kind, name, payload position) of one generation's whole records from `pos` on,
    up to a torn one at the end (a write cut short: left out), and where a record fails its
    checks (None: none does)."""
    payloads = _PAYLOADS[_HEAD.unpack_from(raw)[1]]
    records: list[tuple[int, int, str, int]] = []
    while pos < len(raw):
        end = pos + _RECORD.size
        if end > len(raw):
            return records, None  # torn: left out
        kind, length = _RECORD.unpack_from(raw, pos)
        size = payloads.get(kind)
        if size is None:
            return records, pos
        body_end = end + length + size
        stop = body_end + _CRC.size
        if stop > len(raw):
            return records, None  # torn: left out
        if _CRC.unpack_from(raw, body_end)[0] != crc32c(raw[pos:body_end]):
            return records, pos
        try:
            name = raw[end : end + length].decode()
        except UnicodeDecodeError:
            return records, pos
        records.append((pos, kind, name, end + length))
        pos = stop
    return records, None


def _vouched_past(raw: bytes, damaged: int) -> bool:
    """Whether a whole VOUCHED record after the damaged record at `damaged` vouches for it (the
    records after it cannot be told apart: every place where one could start is tried)."""
    empty = _RECORD.pack(VOUCHED, 0)
    size = _RECORD.size + _LENGTH.size
    pos = raw.find(empty, damaged + 1)
    while pos >= 0 and pos + size + _CRC.size <= len(raw):
        whole = _CRC.unpack_from(raw, pos + size)[0] == crc32c(raw[pos : pos + size])
        if whole and _LENGTH.unpack_from(raw, pos + _RECORD.size)[0] > damaged:
            return True
        pos = raw.find(empty, pos + 1)
    return False


def _apply(found: Replay, generation: int, raw: bytes, pos: int, kind: int, name: str, at: int) -> bool:
    """Add one record (its payload at `at`) to `found`; False if it cannot be trusted."""
    if kind == CLOSED:
        entries, on_disk, segments, nodes, upkeep, replicated = _FIGURES.unpack_from(raw, at)
        found.closed[name] = StreamSummary(entries, on_disk, segments, nodes, upkeep, bool(replicated))
    elif kind == OPENED:
        found.closed.pop(name, None)
        found.opened.add(name)
    elif kind == PROMOTING:
        found.promoting[name] = _PLACE.unpack_from(raw, at)[0]
    elif kind == PROMOTED:
        found.promoting.pop(name, None)
        found.places[name] = NO_PLACE
    elif kind == VOUCHED:
        vouched = _LENGTH.unpack_from(raw, at)[0]
        if vouched > pos:  # it cannot vouch for what came after it
            return False
        found.vouched[generation] = vouched
    else:  # CREATED, PLACED, DELETED: the stream came or went
        found.closed.pop(name, None)
        found.promoting.pop(name, None)
        found.last[name] = kind != DELETED
        if kind == PLACED:
            found.places[name] = _PLACE.unpack_from(raw, at)[0]
        else:
            found.places.pop(name, None)
    return True
