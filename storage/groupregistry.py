"""Which streams have consumer groups, so start-up loads their group stores without looking into
the directory of every stream (issue 17: a million streams, a few with groups).

    DATA/groups/<stream directory name>      holds the stream's name (UTF-8); one per stream with groups

A stream's entry is made durable before its first group's files are written, and removed
after its last group's files are (storage/groupstore.py), so every stream with group files
has an entry; an entry whose stream has no group files any more (a crash between the two
steps, a deleted stream) is stale, and start-up removes it when it finds it so.

A data directory of an earlier version has no `groups/`: the first start-up looks into every
stream's directory once (`probe`), as earlier versions did at every start-up, builds the
directory as `groups.new/` and renames it into place (a crash before the rename: built again).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from storage.fs import FileSystem
from storage.layout import TMP_SUFFIX
from storage.names import dirname_for

log = logging.getLogger("streamlog.storage")

GROUPS_DIR = "groups"
_BUILDING = "groups.new"


class GroupRegistry:
    def __init__(self, fs: FileSystem, data_dir: Path) -> None:
        self._fs = fs
        self._root = data_dir / GROUPS_DIR
        self._lock = threading.Lock()  # held through a change: an entry is written or removed once
        self._names: set[str] = set()  # the streams with an entry

    def load(self, probe: Callable[[], Iterable[str]]) -> list[str]:
        """Start-up: the streams with an entry; built from `probe()` (the streams whose
        directories hold group files) when this data directory has no registry yet."""
        fs = self._fs
        if not fs.exists(self._root):
            building = self._root.with_name(_BUILDING)
            fs.remove_tree(building)  # a build a crash cut short
            fs.makedirs(building)
            for name in probe():
                fs.write_file_atomic(building / dirname_for(name), name.encode())
            fs.rename(building, self._root)
        for entry in fs.listdir(self._root):
            path = self._root / entry
            try:
                name = fs.read_file(path).decode() if not entry.endswith(TMP_SUFFIX) else ""
                valid = bool(name) and dirname_for(name) == entry
            except (UnicodeDecodeError, ValueError) as exc:
                log.error("group registry entry %s is unreadable: %s", entry, exc)
                valid = False
            if valid:
                self._names.add(name)
            else:  # a write a crash cut short (its group files, if any, came after it: none)
                fs.remove(path)
        return sorted(self._names)

    def add(self, name: str) -> None:
        """Before the stream's first group files are written: its entry, durably."""
        with self._lock:
            if name not in self._names:
                self._fs.write_file_atomic(self._root / dirname_for(name), name.encode())
                self._names.add(name)

    def remove(self, name: str) -> None:
        """After the stream's last group files were removed (durably)."""
        with self._lock:
            if name in self._names:
                self._fs.remove(self._root / dirname_for(name))
                self._names.discard(name)

    def forget(self, name: str) -> None:
        """The stream is being deleted: its entry stays on disk until start-up finds it stale (its
        removal now could come before a crash that leaves the stream and its groups there)."""
        with self._lock:
            self._names.discard(name)
