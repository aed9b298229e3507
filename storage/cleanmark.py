"""The `SYNCED` marker: how far a stream was synced at its last clean close (issue 17).

A clean close syncs the stream, then writes this marker (not synced itself): the last
segment's identity (base offset, creation time) and its last node's position and header
as they stood. The marker stays through later writes, so the first write after a reopen
costs no sync: recovery trusts the prefix the marker names (no node body read) and checks
only what lies past it, the marked node's newer header slots and any node after it; if the
newer slots fail their checks, the marked header (whose bytes were synced) is put back.
A marker that does not match what is on disk (another segment, a chain that does not reach
the marked node) is not trusted: the whole last segment is checked, as after a crash.

Where it lives (format 5): in the SYNCED slot of the segment it names, bytes 64-191 of a
version 3 growing segment, so a closed stream costs no block for it. A segment without a
slot (a packed one, or a growing one an earlier version created) keeps it in the stream's
`SYNCED` file, as format 3 and 4 did; a slot marker replaces such a file (removed).

Before version 3 of the format the marker was `CLEAN`, an empty file removed durably before
the first write: one still found means what it meant (every node trusted) and is removed,
durably, before the first write as before. docs/FORMAT.md has the bytes.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass, field
from pathlib import Path

from crc32c import crc32c

from storage.errors import CorruptionError, StorageError
from storage.format import (
    NODE_HEADER_SIZE,
    SEGMENT_HEADER_SIZE,
    SLOTTED_HEADER_SIZE,
    SYNCED_SLOT_SIZE,
    NodeHeader,
    SegmentHeader,
)
from storage.fs import FileSystem, SegmentFile
from storage.layout import segment_name

log = logging.getLogger("streamlog.storage")

SYNCED_MARKER = "SYNCED"
_MAGIC = b"SLSY"
_VERSION = 1
_LAYOUT = struct.Struct("<4sIHHqqQ64s")  # magic, CRC, version, 0, base, created_ms, node pos, node header
assert _LAYOUT.size <= SYNCED_SLOT_SIZE


@dataclass(frozen=True, slots=True)
class SyncedEnd:
    """A segment's synced state: its base and creation time, its last node's position and
    header slot (pos 0 and no header: no growing node, nothing in it to check); `in_slot`:
    kept in that segment's SYNCED slot, not in the stream's SYNCED file (not encoded)."""

    base_offset: int
    created_ms: int
    node_pos: int = 0
    node_header: NodeHeader | None = None
    in_slot: bool = field(default=False, compare=False)

    def encode(self) -> bytes:
        header = self.node_header.encode() if self.node_header is not None else bytes(NODE_HEADER_SIZE)
        body = _LAYOUT.pack(_MAGIC, 0, _VERSION, 0, self.base_offset, self.created_ms, self.node_pos, header)
        return body[:4] + struct.pack("<I", crc32c(body[8:])) + body[8:]

    @classmethod
    def decode(cls, raw: bytes) -> SyncedEnd:
        """The marker's content; CorruptionError if it is torn or not a marker."""
        if len(raw) != _LAYOUT.size:
            raise CorruptionError(f"SYNCED marker of {len(raw)} bytes")
        magic, crc, version, _, base, created, pos, header = _LAYOUT.unpack(raw)
        if magic != _MAGIC or crc != crc32c(raw[8:]):
            raise CorruptionError("SYNCED marker fails its checks")
        if version != _VERSION:
            raise CorruptionError(f"SYNCED marker of version {version}")
        node_header = NodeHeader.decode(header) if pos else None
        if pos and node_header is None:
            raise CorruptionError("SYNCED marker holds a damaged node header")
        return cls(base, created, pos, node_header)

    def in_its_slot(self) -> SyncedEnd:
        return SyncedEnd(self.base_offset, self.created_ms, self.node_pos, self.node_header, in_slot=True)


def read_synced_end(fs: FileSystem, directory: Path) -> SyncedEnd | None:
    """The stream's SYNCED marker; None if there is none or it is torn (a power loss took its
    write: the last segment is then checked whole)."""
    try:
        return SyncedEnd.decode(fs.read_file(directory / SYNCED_MARKER))
    except FileNotFoundError:
        return None
    except CorruptionError as exc:
        log.warning("stream directory %s: %s; checking its last segment", directory.name, exc)
        return None


def slot_marker(head: bytes, header: SegmentHeader) -> SyncedEnd | None:
    """The marker in a segment's SYNCED slot (`head`: the file's first bytes, the slot's
    included; `header`: decoded from them); None if the file has no slot, or it is empty, torn
    (a power loss took its write) or names another segment."""
    raw = head[SEGMENT_HEADER_SIZE : SEGMENT_HEADER_SIZE + _LAYOUT.size]
    if not header.has_slot or not any(raw):
        return None
    try:
        end = SyncedEnd.decode(raw)
    except CorruptionError as exc:
        log.warning("segment %s: %s; checking it whole", segment_name(header.base_offset), exc)
        return None
    if (end.base_offset, end.created_ms) != (header.base_offset, header.created_ms):
        log.warning("segment %s: its SYNCED slot names another segment", segment_name(header.base_offset))
        return None
    return end.in_its_slot()


def marker_in(fs: FileSystem, segment: Path) -> SyncedEnd | None:
    """The marker in a segment file's SYNCED slot; None if there is none (or the header is torn)."""
    head = fs.read_head(segment, SLOTTED_HEADER_SIZE)
    try:
        return slot_marker(head, SegmentHeader.decode(head))
    except CorruptionError:
        return None


def erase_slot(file: SegmentFile) -> bool:
    """Zero a segment's SYNCED slot if it holds anything (not synced: the caller syncs the file
    when this returns True)."""
    if not any(file.read(SEGMENT_HEADER_SIZE, SYNCED_SLOT_SIZE)):
        return False
    file.write(SEGMENT_HEADER_SIZE, bytes(SYNCED_SLOT_SIZE))
    return True


def write_synced_end(fs: FileSystem, directory: Path, end: SyncedEnd, *, file_may_exist: bool = True) -> None:
    """Write the marker after the stream's sync, not synced itself: a power loss may tear it or
    keep the one before, which names a prefix synced earlier. Into the SYNCED slot of the
    segment it names if it goes there (an earlier `SYNCED` file, if any, is removed: it names
    an older segment; not looked for unless `file_may_exist`: a stream created since, or opened
    without one, has none), else into the stream's `SYNCED` file. A marker that cannot be written
    (a full disk) costs the next open a check of the last segment, nothing more."""
    try:
        if end.in_slot:
            fs.write_at(directory / segment_name(end.base_offset), SEGMENT_HEADER_SIZE, end.encode())
            if file_may_exist and fs.exists(directory / SYNCED_MARKER):
                fs.remove(directory / SYNCED_MARKER)
        else:
            fs.overwrite_file(directory / SYNCED_MARKER, end.encode())
    except StorageError as exc:
        log.warning("stream directory %s: SYNCED marker not written: %s", directory.name, exc)
