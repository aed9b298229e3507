"""Durable consumer-group state of one stream: a snapshot plus an append-only journal of ops.

Files, in the stream's directory (see docs/FORMAT.md, "Consumer groups"):

    groups.snapshot                    every group as ops that rebuild it (the journal, compacted),
                                       and the op sequence number it stands at
    groups-<20-digit generation>.journal   ops applied since that snapshot, one checksummed record per call

Recovery reads the snapshot, then replays the journal of the snapshot's
generation up to its first invalid record (a torn tail is cut there), and
never reads the stream's history (Kafka keeps its group offsets in a compacted
log for the same reason). A checkpoint writes the current state as a new
snapshot with a fresh, empty journal of the next generation:

    1. create journal g+1 (preallocated; `create_segment` writes and syncs its header)
    2. replace the snapshot atomically (it names generation g+1)
    3. delete journal g

A crash between any two steps leaves a snapshot and the journal it names;
journals of other generations are leftovers and are deleted on load. The
journal is a preallocated file written through `FileSystem.create_segment`,
like segments: a full disk fails when it is created, and a fault-injecting
file system sees every record write and sync.

Records and the snapshot hold ops encoded by `storage.groupops.encode_ops`.

The op sequence number (`op_seq`) counts the op batches a stream's groups ever
made (a replica's: the ones it applied): one journal record is one batch, so
a snapshot records the number it stands at and recovery adds the records
replayed after it. Replication names batches by it (storage.groupstore).
"""

from __future__ import annotations

import logging
import struct
import threading
from collections.abc import Sequence
from pathlib import Path

from crc32c import crc32c

from storage.errors import CorruptionError
from storage.fs import FileSystem, SegmentFile
from storage.groupops import GroupOp, decode_ops, encode_ops

log = logging.getLogger("streamlog.storage")

SNAPSHOT_FILE = "groups.snapshot"
JOURNAL_PREFIX = "groups-"
JOURNAL_SUFFIX = ".journal"
FORMAT_VERSION = 1
# Version 2 snapshots begin their body with the op sequence number (version 1: 0).
SNAPSHOT_VERSION = 2
HEADER_SIZE = 32
RECORD_HEADER_SIZE = 8
# A journal is at least twice the size of the snapshot before it, so the cost of rewriting a big
# state (a long pending list) stays proportional to the calls made since; up to this size.
MAX_JOURNAL_BYTES = 64 << 20

_SNAPSHOT_MAGIC = b"SLGS"
_JOURNAL_MAGIC = b"SLGJ"
# magic, version, zero, generation, body length, body CRC (+ header CRC of these 28 bytes)
_SNAPSHOT_HEADER = struct.Struct("<4sHHQQI")
# magic, version, zero, generation, 12 zero bytes (+ header CRC)
_JOURNAL_HEADER = struct.Struct("<4sHHQ12x")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_RECORD = struct.Struct("<II")  # body length, CRC32C of the length's 4 bytes + body


def journal_name(generation: int) -> str:
    return f"{JOURNAL_PREFIX}{generation:020d}{JOURNAL_SUFFIX}"


# ---------------------------------------------------------------------- files


def encode_snapshot(generation: int, ops: Sequence[GroupOp], op_seq: int = 0) -> bytes:
    body = _U64.pack(op_seq) + encode_ops(ops)
    head = _SNAPSHOT_HEADER.pack(_SNAPSHOT_MAGIC, SNAPSHOT_VERSION, 0, generation, len(body), crc32c(body))
    return head + _U32.pack(crc32c(head)) + body


def decode_snapshot(raw: bytes) -> tuple[int, list[GroupOp], int]:
    """(generation, ops, op sequence number) of a snapshot image."""
    if len(raw) < HEADER_SIZE:
        raise CorruptionError("group snapshot is shorter than its header")
    head = raw[: HEADER_SIZE - 4]
    if _U32.unpack_from(raw, HEADER_SIZE - 4)[0] != crc32c(head):
        raise CorruptionError("group snapshot header CRC mismatch")
    magic, version, _, generation, length, body_crc = _SNAPSHOT_HEADER.unpack(head)
    if magic != _SNAPSHOT_MAGIC or version not in (FORMAT_VERSION, SNAPSHOT_VERSION):
        raise CorruptionError(f"group snapshot has magic {magic!r} version {version}")
    body = raw[HEADER_SIZE : HEADER_SIZE + length]
    if len(body) != length or crc32c(body) != body_crc:
        raise CorruptionError("group snapshot body CRC mismatch")
    if version == FORMAT_VERSION:
        return generation, decode_ops(body), 0
    if length < _U64.size:
        raise CorruptionError("group snapshot body is shorter than its op sequence number")
    return generation, decode_ops(body[_U64.size :]), _U64.unpack_from(body)[0]


def encode_journal_header(generation: int) -> bytes:
    head = _JOURNAL_HEADER.pack(_JOURNAL_MAGIC, FORMAT_VERSION, 0, generation)
    return head + _U32.pack(crc32c(head))


def encode_record(body: bytes) -> bytes:
    length = _U32.pack(len(body))
    return length + _U32.pack(crc32c(length + body)) + body


def scan_journal(raw: bytes, generation: int) -> tuple[list[GroupOp], int, int, str | None]:
    """Replay a journal image: (ops, records, end position, why it was cut or None).

    Records are trusted up to the first one that is incomplete or fails its CRC; the rest is
    cut. A zero length where a record would start, with only zeros after it, is the clean end.
    """
    if len(raw) < HEADER_SIZE:
        return [], 0, HEADER_SIZE, "journal is shorter than its header"
    head = raw[: HEADER_SIZE - 4]
    magic, version, _, gen = _JOURNAL_HEADER.unpack(head)
    if _U32.unpack_from(raw, HEADER_SIZE - 4)[0] != crc32c(head) or magic != _JOURNAL_MAGIC:
        return [], 0, HEADER_SIZE, "journal header is damaged"
    if version != FORMAT_VERSION or gen != generation:
        return [], 0, HEADER_SIZE, f"journal header says version {version} generation {gen}"
    ops: list[GroupOp] = []
    records = 0
    pos = HEADER_SIZE
    size = len(raw)
    while pos + RECORD_HEADER_SIZE <= size:
        length, crc = _RECORD.unpack_from(raw, pos)
        if length == 0:
            # The end, if nothing follows. Bytes after it are records written after one that was
            # lost (a dropped write): they must not be replayed, nor be overwritten piecemeal.
            if crc != 0 or raw[pos:] != bytes(size - pos):
                return ops, records, pos, f"bytes follow the end of the journal at byte {pos}"
            return ops, records, pos, None
        end = pos + RECORD_HEADER_SIZE + length
        if end > size:
            return ops, records, pos, f"record at byte {pos} runs past the end of the journal"
        body = raw[pos + RECORD_HEADER_SIZE : end]
        if crc32c(raw[pos : pos + 4] + body) != crc:
            return ops, records, pos, f"record at byte {pos} fails its CRC"
        ops.extend(decode_ops(body))
        records += 1
        pos = end
    return ops, records, pos, None


class JournalFullError(Exception):
    """The record does not fit in the journal: checkpoint, which makes the record unnecessary."""


class GroupLog:
    """The snapshot and journal of one stream directory. Thread-safe; `seq` counts records written."""

    def __init__(self, fs: FileSystem, directory: Path, journal_bytes: int) -> None:
        if journal_bytes < HEADER_SIZE + 1024:
            raise ValueError("journal_bytes is too small to hold any record")
        self.fs = fs
        self.directory = directory
        self.journal_bytes = journal_bytes
        self.generation = 0
        self.seq = 0  # records appended since open (checkpoints cover every one before them)
        self.op_seq = 0  # the op sequence number the last load found (module doc)
        self.synced_seq = 0
        self.replayed = 0  # records the last load replayed
        self.cut: str | None = None  # why the last load cut the journal, if it did
        self._file: SegmentFile | None = None
        self._pos = HEADER_SIZE
        self._lock = threading.Lock()

    @staticmethod
    def exists(fs: FileSystem, directory: Path) -> bool:
        return fs.exists(directory / SNAPSHOT_FILE)

    # ------------------------------------------------------------------ load

    def load(self) -> list[GroupOp]:
        """Read the snapshot and the valid prefix of its journal; returns the ops to apply, in order.

        Raises CorruptionError if the snapshot itself is damaged (the files are then left alone).
        Call `checkpoint` next if `replayed` or `cut` is set, so that appends never land in front
        of stale bytes of a cut tail.
        """
        fs, directory = self.fs, self.directory
        generation, ops, self.op_seq = decode_snapshot(fs.read_file(directory / SNAPSHOT_FILE))
        self.generation = generation
        path = directory / journal_name(generation)
        if fs.exists(path):
            try:
                self._file = fs.open_segment(path, writable=True)
            except CorruptionError as exc:  # shorter than a header: nothing in it can be trusted
                self.cut = str(exc)
                log.warning("%s: %s", path, exc)
                self._remove_leftovers()
                return ops
            raw = self._file.read(0, self._file.size)
            journal_ops, self.replayed, self._pos, self.cut = scan_journal(raw, generation)
            if self.cut is not None:
                log.warning("%s: %s; cut there (%d records kept)", path, self.cut, self.replayed)
            ops.extend(journal_ops)
            self.op_seq += self.replayed
        else:
            self.cut = f"journal {path.name} is missing"
            log.error("%s: the snapshot names a journal that does not exist", directory)
        self._remove_leftovers()
        return ops

    def _remove_leftovers(self) -> None:
        keep = journal_name(self.generation)
        for name in self.fs.listdir(self.directory):
            if name.startswith(JOURNAL_PREFIX) and name.endswith(JOURNAL_SUFFIX) and name != keep:
                self.fs.remove(self.directory / name)

    # ------------------------------------------------------------------ write

    @property
    def capacity_bytes(self) -> int:
        return self._file.size if self._file is not None else 0

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self._pos

    @property
    def used_bytes(self) -> int:
        return self._pos

    @property
    def dirty(self) -> bool:
        return self.synced_seq < self.seq

    def append(self, body: bytes) -> int:
        """Write one record holding `body`, ops as `encode_ops` gives them (not synced); returns
        its seq. JournalFullError if it cannot fit."""
        record = encode_record(body)
        with self._lock:
            file = self._file
            # Keep 8 zero bytes after the last record: the end marker a reader stops at.
            if file is None or self._pos + len(record) + RECORD_HEADER_SIZE > file.size:
                raise JournalFullError
            file.write(self._pos, record)
            self._pos += len(record)
            self.seq += 1
            return self.seq

    def checkpoint(self, state_ops: Sequence[GroupOp], op_seq: int) -> None:
        """Write `state_ops` as the snapshot of a new generation standing at op batch `op_seq`,
        with an empty journal (module doc)."""
        body = encode_snapshot(self.generation + 1, state_ops, op_seq)
        with self._lock:
            fs, directory = self.fs, self.directory
            generation = self.generation + 1
            fresh_path = directory / journal_name(generation)
            if fs.exists(fresh_path):
                fs.remove(fresh_path)  # a leftover of a checkpoint that failed part-way
            size = max(self.journal_bytes, min(2 * len(body), MAX_JOURNAL_BYTES))
            fresh = fs.create_segment(fresh_path, size, encode_journal_header(generation))
            try:
                fs.write_file_atomic(directory / SNAPSHOT_FILE, body)
            except BaseException:
                fresh.close()
                raise
            old, old_generation = self._file, self.generation
            self._file, self._pos, self.generation = fresh, HEADER_SIZE, generation
            self.synced_seq = self.seq  # the snapshot holds every record written so far, durably
            if old is not None:
                old.close()
                fs.remove(directory / journal_name(old_generation))

    def sync(self) -> int:
        """Make every record written so far durable; returns the seq covered (for SyncGate)."""
        with self._lock:
            seq = self.seq
            if self._file is not None:
                self._file.sync()
            self.synced_seq = max(self.synced_seq, seq)
            return seq

    def destroy(self) -> None:
        """Remove both files: the stream has no groups any more. The snapshot goes first."""
        with self._lock:
            self.fs.remove(self.directory / SNAPSHOT_FILE)
            if self._file is not None:
                self._file.close()
                self._file = None
            self.fs.remove(self.directory / journal_name(self.generation))

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
