"""Unpack: every stream in a slot of a pack file moved to a directory of its own, then the pack
files removed, so that a release before format 6 (which knows no packs) finds every stream
(docs/FORMAT.md, "Going back to format 5"). Offline: `python -m storage.inspect unpack DATA`
opens an `Engine` on the directory (refused while a server holds its lock) and calls `unpack`;
its `--segment-bytes` is the server's `segment_bytes`, the capacity the moved segments get.

Streams move by the engine's promotion (storage/slothome.py), `BATCH` at a time with their syncs
shared, in the order one promotion keeps: each stream's `M`, directory and segment written; one
syncfs for all (a second after the renames of hashed names' `stream.meta.new`); each stream's `m`
and its slot's zeroing; one sync of the packs and the journal (`SlotSync`). So a kill -9 or a
power loss anywhere leaves each stream whole in its slot (a directory written and not synced, or
synced and not yet its, is a promotion cut short: start-up and the stream's next open remove
it) or in its directory, and a second run goes on where the first stopped. A stream whose slot
cannot be read is left where it is, with its pack, and reported. `Engine` takes it from
`Unpacking`.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from storage.catalog import Catalog
from storage.errors import StreamNotFoundError
from storage.fs import FileSystem
from storage.handoff import UnsyncedCloses
from storage.openstreams import OpenStreams
from storage.slothome import Moving, SlotHome, Slots

if TYPE_CHECKING:
    from storage.stream import Stream

# Streams promoted together: each batch costs one or two syncfs and one sync of the packs and the
# journal, and holds its streams open till its end, a segment's descriptor each: 500 and the
# engine's own fit the limit of 1,024 descriptors a shell gives by default.
BATCH = 500


@dataclass
class Unpacked:
    promoted: list[str] = field(default_factory=list)  # moved to their directories by this run
    unreadable: list[str] = field(default_factory=list)  # in a slot that fails its checks: left there
    removed: list[str] = field(default_factory=list)  # pack files removed by this run
    kept: list[str] = field(default_factory=list)  # pack files left (holding what could not move)


class Unpacking:
    data_dir: Path  # set by the engine
    _fs: FileSystem
    _catalog: Catalog
    _slots: Slots
    _open: OpenStreams
    _unsynced: UnsyncedCloses

    def unpack(self, batch: int = BATCH) -> Unpacked:
        """Promote every stream in a slot, `batch` at a time, then remove every pack file none of
        whose slots is used, the last one too, and the packs directory if nothing is left in it."""
        done = Unpacked()
        packs, fs = self._slots.packs, self._fs
        before = fs.listdir(packs.directory)
        names = sorted(self._catalog.placed())
        for start in range(0, len(names), batch):
            self._promote_together(names[start : start + batch], done)
        if packs.written:
            self._slots.sync.wait()  # (packs found empty at start-up: removed after a sync)
        packs.remove_empty(last=True)  # the others went as they emptied (SlotSync)
        done.kept = fs.listdir(packs.directory)
        done.removed = sorted(set(before) - set(done.kept))
        if not done.kept and fs.exists(packs.directory):
            fs.remove_tree(packs.directory)
        return done

    def _promote_together(self, names: list[str], done: Unpacked) -> None:
        """Promote these streams as `SlotHome.promote` does one, each open and locked till it is
        in its directory, with one sync of each kind for all (the module doc's order)."""
        moving: list[tuple[Stream, SlotHome, Moving]] = []
        with ExitStack() as held:
            for name in names:
                try:
                    stream = self._open.visit(name)  # closed again at the end, unless a call holds it
                except StreamNotFoundError:  # its slot failed its checks: listed in `unreadable`
                    done.unreadable.append(name)
                    continue
                held.callback(self._open.end_visit, stream)
                held.enter_context(stream.lock)  # no append till it is in its directory
                home = stream.home
                assert isinstance(home, SlotHome)  # (the catalog places it in a slot)
                moving.append((stream, home, home.write_directory(stream)))
            if not moving:
                return
            self._fs.sync_filesystem(self.data_dir)  # the segments, meta files and directories
            renamed = [m for _, home, m in moving if m.creation.rename_meta(self._fs, home.directory)]
            if renamed:
                self._fs.sync_filesystem(self.data_dir)
            for _, home, m in moving:
                m.creation.synced()
                home.leave_slot()
            # Every `m` and zeroing durable before a stream is its directory's (SlotHome.promote).
            self._slots.sync.wait()
            for stream, home, m in moving:
                home.moved(stream, m.file)
                done.promoted.append(stream.name)
        # Their closes' markers (end_visit's), now: offline no round runs, and a million such
        # closes would wait, held in memory, for the engine's close.
        self._unsynced.finish_all()
