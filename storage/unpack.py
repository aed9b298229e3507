"""Unpack: every stream in a slot of a pack file moved to a directory of its own, then the pack
files removed, so that a release before format 6 (which knows no packs) finds every stream
(docs/FORMAT.md, "Going back to format 5"). Offline: `python -m storage.inspect unpack DATA`
opens an `Engine` on the directory (refused while a server holds its lock) and calls `unpack`.

Each stream moves by the engine's own promotion (storage/slothome.py: `M`, its directory and
segment synced, `m`, the slot's zeroing synced), so a kill -9 or a power loss anywhere leaves each
stream whole in its slot or in its directory, and a second run goes on where the first stopped.
A stream whose slot cannot be read is left where it is, with its pack, and reported.
`Engine` takes it from `Unpacking`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from storage.catalog import Catalog
from storage.errors import StreamNotFoundError
from storage.slothome import Slots


@dataclass
class Unpacked:
    promoted: list[str] = field(default_factory=list)  # moved to their directories by this run
    unreadable: list[str] = field(default_factory=list)  # in a slot that fails its checks: left there
    removed: list[str] = field(default_factory=list)  # pack files removed by this run
    kept: list[str] = field(default_factory=list)  # pack files left (holding what could not move)


class Unpacking:
    _catalog: Catalog  # set by the engine
    _slots: Slots
    _in_directory: Callable[[str], None]

    def unpack(self) -> Unpacked:
        """Promote every stream in a slot, then remove every pack file none of whose slots is
        used, the last one too, and the packs directory if nothing is left in it."""
        done = Unpacked()
        packs, fs = self._slots.packs, self._slots.ctx.fs
        before = fs.listdir(packs.directory)
        for name in sorted(self._catalog.placed()):
            try:
                self._in_directory(name)  # its slot's freeing synced before this returns
            except StreamNotFoundError:  # its slot failed its checks: listed in `unreadable`
                done.unreadable.append(name)
                continue
            done.promoted.append(name)
        if packs.written:
            self._slots.sync.wait()  # (packs found empty at start-up: removed after a sync)
        packs.remove_empty(last=True)  # the others went as they emptied (SlotSync)
        done.kept = fs.listdir(packs.directory)
        done.removed = sorted(set(before) - set(done.kept))
        if not done.kept and fs.exists(packs.directory):
            fs.remove_tree(packs.directory)
        return done
