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
records) and every record in it is whole; otherwise start-up lists the streams directory, as
without a journal. A `RELIST` record asks for that listing too (a stream found unreadable:
the listing reports it again).

    header: b"SLCJ", u16 version, u16 boot id bytes, the boot id (ASCII)
    record: u8 kind, u16 name bytes, the name (UTF-8), [figures], u32 CRC32C of the ones before
    figures (CLOSED records only): i64 entries, bytes on disk, segments, nodes, upkeep_ms, u8 replicated
"""

from __future__ import annotations

import logging
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from crc32c import crc32c

from storage.catalog import StreamSummary
from storage.errors import StorageError

if TYPE_CHECKING:
    from storage.fs import AppendFile, FileSystem

JOURNAL_VERSION = 2  # 2: CLOSED records
_MAGIC = b"SLCJ"
_HEAD = struct.Struct("<4sHH")
_RECORD = struct.Struct("<BH")
_FIGURES = struct.Struct("<qqqqqB")  # a StreamSummary's fields, in order
_CRC = struct.Struct("<I")
CREATED, DELETED, OPENED, CLOSED, RELIST = b"+"[0], b"-"[0], b"o"[0], b"c"[0], b"!"[0]
_KINDS = {CREATED, DELETED, OPENED, CLOSED, RELIST}
_NAME = re.compile(r"catalog\.(\d{1,18})\.log")

log = logging.getLogger("streamlog.storage")


def journal_name(generation: int) -> str:
    return f"catalog.{generation}.log"


def journal_generations(names: Iterable[str]) -> list[int]:
    """The generations of the journals among a data directory's entries, in order."""
    return sorted(int(m.group(1)) for n in names if (m := _NAME.fullmatch(n)))


def encode_record(kind: int, name: str, figures: StreamSummary | None = None) -> bytes:
    raw = name.encode()
    body = _RECORD.pack(kind, len(raw)) + raw
    if figures is not None:
        body += _FIGURES.pack(*figures)
    return body + _CRC.pack(crc32c(body))


class Journal:
    """One generation's journal, open for appending (records are written, not synced)."""

    def __init__(self, fs: FileSystem, data_dir: Path, generation: int) -> None:
        self.generation = generation
        self._fs = fs
        self._path = data_dir / journal_name(generation)
        boot = fs.boot_id().encode()
        try:
            self._file: AppendFile | None = fs.create_append(
                self._path, _HEAD.pack(_MAGIC, JOURNAL_VERSION, len(boot)) + boot
            )
        except OSError as exc:
            raise StorageError(f"cannot start the catalog journal {self._path.name}: {exc}") from exc
        self._open: set[str] = set()  # streams opened since their last CLOSED record (or none)
        self.records = 0  # written in this generation: a replay's work

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
        self._append(CLOSED, name, figures)

    def relist(self, name: str) -> None:
        self._append(RELIST, name)

    def _append(self, kind: int, name: str, figures: StreamSummary | None = None) -> None:
        if self._file is None:
            return  # broken: removed, so start-up lists the streams directory
        self.records += 1
        try:
            self._file.append(encode_record(kind, name, figures))
        except (OSError, StorageError) as exc:
            # A record lost must not leave a journal that looks whole: without this generation
            # start-up cannot trust the ones after it either, until the catalog is next saved.
            log.error("catalog journal %s: %s; removed", self._path.name, exc)
            self.close()
            try:
                self._fs.remove(self._path)
            except (OSError, StorageError) as again:
                log.error("catalog journal %s could not be removed: %s", self._path.name, again)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


@dataclass
class Replay:
    """What the journals since the catalog file say: per name its last CREATED or DELETED
    record (True: created), the streams opened (figures in the file stale), and the figures
    of those whose last record is a CLOSED one (the others opened or created since have
    figures unknown until they are recovered)."""

    last: dict[str, bool] = field(default_factory=dict)
    opened: set[str] = field(default_factory=set)
    closed: dict[str, StreamSummary] = field(default_factory=dict)


def replay(fs: FileSystem, data_dir: Path, first: int, generations: list[int]) -> Replay | None:
    """The journals from generation `first` on, in order; None if they cannot be trusted (one
    missing, from before the last boot, damaged, or holding a RELIST record)."""
    wanted = [g for g in generations if g >= first]
    if not wanted or wanted != list(range(first, first + len(wanted))):
        return None
    boot = fs.boot_id().encode()
    found = Replay()
    for generation in wanted:
        raw = fs.read_file(data_dir / journal_name(generation))
        if len(raw) < _HEAD.size:
            return None
        magic, version, boot_len = _HEAD.unpack_from(raw)
        pos = _HEAD.size + boot_len
        if magic != _MAGIC or version != JOURNAL_VERSION or raw[_HEAD.size : pos] != boot:
            return None
        while pos < len(raw):
            end = pos + _RECORD.size
            if end > len(raw):
                return None
            kind, length = _RECORD.unpack_from(raw, pos)
            body_end = end + length + (_FIGURES.size if kind == CLOSED else 0)
            stop = body_end + _CRC.size
            if stop > len(raw) or kind not in _KINDS or kind == RELIST:
                return None
            if _CRC.unpack_from(raw, body_end)[0] != crc32c(raw[pos:body_end]):
                return None
            try:
                name = raw[end : end + length].decode()
            except UnicodeDecodeError:
                return None
            if kind == CLOSED:
                entries, size, segments, nodes, upkeep, replicated = _FIGURES.unpack_from(raw, end + length)
                found.closed[name] = StreamSummary(entries, size, segments, nodes, upkeep, bool(replicated))
            else:
                found.closed.pop(name, None)
                if kind == OPENED:
                    found.opened.add(name)
                else:
                    found.last[name] = kind == CREATED
            pos = stop
    return found
