"""A new stream's creation, made durable by the stream's first sync (cheap creation, issue 17).

Creating a stream makes its directory and its first segment, and syncs nothing. A stream
whose directory name encodes its name (storage/names.py: every name of up to 200 encoded
characters) needs no meta file while its meta is what a new stream's is (first offset 0,
the default config): a stream costs its directory and one page of segment. A hashed name
is kept in `stream.meta.new` until the first sync renames it `stream.meta`, and so is the
name of a stream that has no segment yet at its first sync (created empty: a directory
without a meta file or a segment is a creation a crash cut short); a later meta rewrite
(a config change, a trim) writes `stream.meta` in any case.

The stream's first sync (an "always" append's, the everysec round's, a close's, or a meta
rewrite's) makes it durable in an order a power loss cannot tear:

1. its segment files (header and entries);
2. `stream.meta.new`, if it has one (fsync), then its rename to `stream.meta`;
3. its directory, then the streams directory, whose sync every stream created
   meanwhile shares (DirSync in storage/durability.py).

A round finishing many closed streams at once (storage/handoff.py) keeps that order with
file-system syncs: one syncfs (1 and 3, and `stream.meta.new`), the renames, a second syncfs
only if a rename happened.

A crash before that sync leaves a directory holding a segment and no `stream.meta` (and
`stream.meta.new` for a hashed name). After a process crash (kill -9) the page cache kept
it all, and after a power loss some of it: start-up adopts the stream when its name and its
first segment are whole (`recover_creation`), so an acknowledged entry survives a kill -9,
and otherwise removes the directory (a creation the power took back, with its unsynced
entries). The adopted streams are made durable together once every directory is read
(`commit_adopted`), in the same order with file-system syncs as a round's batch: a kill -9
during a big load leaves thousands of them. A directory with a `SYNCED` marker (in its last
segment's slot, or the `SYNCED` file of format 3 and 4, or version 2's `CLEAN`) was committed
before the clean close that wrote it, so start-up takes it as it is, syncing nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from storage.cleanmark import SYNCED_MARKER, marker_in
from storage.config import DEFAULT_STREAM_CONFIG, StreamConfig
from storage.durability import DirSync
from storage.errors import CorruptionError
from storage.format import SEGMENT_HEADER_SIZE, SegmentHeader
from storage.fs import FileSystem, SegmentFile
from storage.layout import (
    CLEAN_MARKER,
    DAMAGED_SUFFIX,
    META_FILE,
    META_NEW,
    SEGMENT_SUFFIX,
    decode_meta,
    encode_meta,
    segment_base,
)
from storage.names import HASHED, name_of_dirname
from storage.segment import Segment


class PendingCreation:
    def __init__(self, streams_dir: DirSync, name: str, meta_new: bool) -> None:
        self._streams_dir = streams_dir
        self._name = name
        self._ticket = streams_dir.changed()  # taken after the directory was made
        self._meta_new = meta_new  # a hashed name's stream.meta.new is to be committed
        self._lock = threading.Lock()
        self.pending = True
        self.has_segment = False  # set by the stream when it creates its first segment

    def commit(self, fs: FileSystem, directory: Path, files: Callable[[], list[SegmentFile]]) -> None:
        """Make the creation durable (once; DurabilityError if a sync fails). A stream that has
        no segment yet (created empty) is kept by a meta file, which it then gets."""
        with self._lock:
            if not self.pending:
                return
            for file in files():
                file.sync()
            self._keep_if_empty(fs, directory)
            if self._meta_new:
                fs.commit_file(directory / META_NEW, directory / META_FILE)
            fs.sync_dir(directory)
            self._streams_dir.ensure(self._ticket)
            self.pending = False

    # A batch of creations committed by file-system syncs (storage/handoff.py), in the same order:
    # `before_sync`, a syncfs (segments, meta files, directories), `rename_meta`, a second syncfs
    # if any renamed, then `synced`.

    def before_sync(self, fs: FileSystem, directory: Path) -> None:
        with self._lock:
            if self.pending:
                self._keep_if_empty(fs, directory)

    def rename_meta(self, fs: FileSystem, directory: Path) -> bool:
        """Rename a synced `stream.meta.new` to `stream.meta`, synced by nothing; whether it did."""
        with self._lock:
            if not (self.pending and self._meta_new):
                return False
            fs.replace(directory / META_NEW, directory / META_FILE)
            self._meta_new = False  # a commit by the stream reopened before the batch ends renames none
            return True

    def synced(self) -> None:
        with self._lock:
            self.pending = False

    def _keep_if_empty(self, fs: FileSystem, directory: Path) -> None:
        """A stream with no segment yet is kept by a meta file (unsynced: the commit syncs it)."""
        if not self.has_segment and not self._meta_new:
            fs.write_file(directory / META_NEW, encode_meta(self._name, 0, StreamConfig()))
            self._meta_new = True


def start_creation(
    fs: FileSystem, streams_dir: DirSync, name: str, directory: Path, config: StreamConfig
) -> PendingCreation:
    """Make a new stream's directory (and a hashed name's `stream.meta.new`), syncing nothing."""
    fs.makedirs(directory, durable=False)
    meta_new = directory.name.startswith(HASHED) or config != DEFAULT_STREAM_CONFIG
    if meta_new:
        fs.write_file(directory / META_NEW, encode_meta(name, 0, config))
    return PendingCreation(streams_dir, name, meta_new)


@dataclass(frozen=True)
class Adopted:
    """A crashed creation start-up adopts, durable once `commit_adopted` returns."""

    name: str
    directory: Path
    meta_new: bool  # its name is in `stream.meta.new`, to be renamed `stream.meta`


def recover_creation(fs: FileSystem, directory: Path, names: list[str]) -> str | Adopted | None:
    """At start-up, for a directory with no `stream.meta` (holding `names`): adopt the stream if
    its name (from `stream.meta.new`, else its directory's name) and its first segment are whole,
    and return its name when a clean close marked it (durable already), else an `Adopted` for
    `commit_adopted`; else remove the directory and return None. Its segments get the usual
    recovery when it is opened.

    A new stream's first segment is written without a sync and never synced before its creation
    is committed (a roll would have synced it): a header a power loss tore means that nothing
    of the stream was synced, unless the segment still holds whole nodes (then it opens with
    its header salvaged), or others follow it.

    A directory whose segments were all set aside as damaged (storage/loader.py) held a stream
    whose entries are lost: CorruptionError, the directory kept for the operator.
    """
    segments = sorted(n for n in names if n.endswith(SEGMENT_SUFFIX))
    if not segments and any(n.endswith(SEGMENT_SUFFIX + DAMAGED_SUFFIX) for n in names):
        raise CorruptionError("its only segments were set aside as damaged")
    meta_new = META_NEW in names
    if meta_new:
        try:
            name = decode_meta(fs.read_file(directory / META_NEW))[0]
        except (CorruptionError, ValueError, KeyError):
            fs.remove_tree(directory)
            return None
    else:
        decoded = name_of_dirname(directory.name)
        if decoded is None or not segments:
            fs.remove_tree(directory)  # a creation a crash cut short
            return None
        name = decoded
        if SYNCED_MARKER in names or CLEAN_MARKER in names or marker_in(fs, directory / segments[-1]):
            return name
    if segments and not _first_segment_whole(fs, directory, segments):
        if not meta_new and len(segments) == 1:
            fs.remove_tree(directory)
            return None
        if meta_new:
            for segment in segments:
                fs.remove(directory / segment)
    return Adopted(name, directory, meta_new)


def commit_adopted(fs: FileSystem, root: Path, adopted: list[Adopted]) -> None:
    """Make the creations start-up adopted durable in the order of the module doc, with syncs of
    `root`'s file system: one syncfs (segments, `stream.meta.new`, directories, the streams
    directory), the renames to `stream.meta`, a second syncfs only if one was renamed. A
    DurabilityError stops the start-up, as a failed directory sync did."""
    if not adopted:
        return
    fs.sync_filesystem(root)
    renamed = [a for a in adopted if a.meta_new]
    for creation in renamed:
        fs.replace(creation.directory / META_NEW, creation.directory / META_FILE)
    if renamed:
        fs.sync_filesystem(root)


def _first_segment_whole(fs: FileSystem, directory: Path, segments: list[str]) -> bool:
    """Whether the first segment's header reads, or can be salvaged from the nodes it holds."""
    path = directory / segments[0]
    try:
        SegmentHeader.decode(fs.read_head(path, SEGMENT_HEADER_SIZE))
        return True
    except CorruptionError:
        pass
    try:
        salvaged = Segment.salvage(fs, path, segment_base(segments[0]))
    except CorruptionError:  # shorter than a header
        return False
    if salvaged is None:
        return False
    salvaged.close()
    return True
