"""A new stream's creation, made durable by the stream's first sync (cheap creation, issue 17).

Creating a stream writes its directory, its meta file (as `stream.meta.new`) and
its first segment without a sync. The stream's first sync (an "always" append's,
the everysec round's, a close's, or a meta rewrite's) makes it durable in an order
a power loss cannot tear:

1. its segment files (header and entries);
2. `stream.meta.new`, then its rename to `stream.meta`: from here the stream exists, whole;
3. its directory, then the streams directory, whose sync every stream created
   meanwhile shares (DirSync in storage/durability.py).

A crash before that sync leaves a directory with `stream.meta.new` and no
`stream.meta`. After a process crash (kill -9) the page cache kept it all, and
after a power loss some of it: start-up adopts the stream when
`stream.meta.new` is whole (`recover_creation`), so an acknowledged entry
survives a kill -9 as it always did, and otherwise removes the directory (a
creation the power took back, with its unsynced entries).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from storage.durability import DirSync
from storage.errors import CorruptionError
from storage.format import SEGMENT_HEADER_SIZE, SegmentHeader
from storage.fs import FileSystem, SegmentFile
from storage.layout import META_FILE, META_NEW, SEGMENT_SUFFIX, decode_meta


class PendingCreation:
    def __init__(self, streams_dir: DirSync) -> None:
        self._streams_dir = streams_dir
        self._ticket = streams_dir.changed()  # taken after the directory was made
        self._lock = threading.Lock()
        self.pending = True

    def commit(self, fs: FileSystem, directory: Path, files: Callable[[], list[SegmentFile]]) -> None:
        """Make the creation durable (once; DurabilityError if a sync fails)."""
        with self._lock:
            if not self.pending:
                return
            for file in files():
                file.sync()
            fs.commit_file(directory / META_NEW, directory / META_FILE)
            fs.sync_dir(directory)
            self._streams_dir.ensure(self._ticket)
            self.pending = False


def recover_creation(fs: FileSystem, directory: Path) -> str | None:
    """At start-up, for a directory holding `stream.meta.new` and no `stream.meta`: adopt the
    stream if its meta file is whole (made durable now; its segments get the usual recovery when
    it is opened) and return its name, else remove the directory and return None.

    Its first segment was created without a sync and never synced (a roll would have synced it):
    a header a power loss tore means that segment holds nothing that was synced, so it goes.
    """
    try:
        name = decode_meta(fs.read_file(directory / META_NEW))[0]
    except (CorruptionError, ValueError, KeyError):
        fs.remove_tree(directory)
        return None
    segments = sorted(n for n in fs.listdir(directory) if n.endswith(SEGMENT_SUFFIX))
    if segments:
        try:
            SegmentHeader.decode(fs.read_head(directory / segments[0], SEGMENT_HEADER_SIZE))
        except CorruptionError:
            for segment in segments:
                fs.remove(directory / segment)
    fs.commit_file(directory / META_NEW, directory / META_FILE)
    fs.sync_dir(directory)
    fs.sync_dir(directory.parent)
    return name
