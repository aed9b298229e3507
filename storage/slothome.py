"""A small stream's home in a slot of a shared pack file (docs/design/small-streams.md §4-§5,
under `EngineConfig.small_streams = "slots"`, the default).

A stream created by an append with the default config and no incarnation gets a slot
(storage/packs.py): its slot header and an empty growing segment of SLOT_SEGMENT_BYTES written
with one pwrite, then one catalog-journal record `p` naming the place (storage/catalog.py's
`add`): no directory, no file, no inode. Its appends go through `GrowingNode` into the slot's
`SlotFile` as into a one-page segment; its open is one pread, every node checked (there is no
SYNCED marker to trust: at most 3.5 KiB); its close journals its figures (the catalog's, as
any close) and writes nothing else: no marker, no hand-off, the pack's dirty pages are the
round's.

Durability (`SlotSync`): the everysec round, and under "always" each append's sync as a group
commit, take the journal's length L, fdatasync the packs written since the last sync, fdatasync
the journal, then journal `r`(L): every record before L names durable slot data.

Promotion (`SlotHome.promote`) moves the stream to a directory of its own when it needs one:
its segment outgrows the slot, or a meta file (a config, a trim), groups, a truncation or epochs.
With the stream's locks held: journal `M`; make the directory (storage/creation.py's
`start_creation`); write the slot's segment as its first `.seg` file, header rewritten with the
engine's segment capacity; sync it, the directory and the streams directory (the creation's
commit); journal `m`; zero the slot's header; sync the packs and the journal (`SlotSync`) before
an append goes to the directory. So a slot that still names the stream after a crash holds all
of it, the directory at most a copy: the slot wins (the directory is removed at the stream's
next open, `_remove_leftover`, or by a start-up's scan); once the zeroing is durable the
directory is the stream, whole since its syncs.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from storage.catalog import Catalog
from storage.config import StreamConfig
from storage.context import EngineContext
from storage.creation import start_creation
from storage.durability import SyncGate
from storage.errors import DurabilityError
from storage.format import (
    NODE_PREFIX_SIZE,
    SLOT_BYTES,
    SLOT_SEGMENT_BYTES,
    SLOTTED_HEADER_SIZE,
    SegmentHeader,
)
from storage.fs import SegmentFile
from storage.growing import GrowingNode
from storage.home import DirectoryHome, Opened
from storage.index import NodeIndex
from storage.layout import segment_name
from storage.loader import LogLoader
from storage.nodewriter import FIRST_NODE_SLOTS
from storage.packs import NO_PLACE, Packs
from storage.segment import Segment
from storage.types import AppendBatch

if TYPE_CHECKING:
    from storage.handoff import UnsyncedClose
    from storage.stream import Stream

log = logging.getLogger("streamlog.storage")


class SlotSync:
    """What makes slot streams durable: the packs written and the catalog journal's records that
    name their slots, synced together, and callers waiting at once sharing one such sync (the
    round, and under "always" every append to a slot stream). A failed sync is remembered: every
    later wait raises it (after a failed fdatasync the kernel may have dropped the pages)."""

    def __init__(self, packs: Packs, catalog: Catalog) -> None:
        self._packs = packs
        self._catalog = catalog
        self._gate = SyncGate()  # its leader syncs; the others wait for a sync that covers them
        self._lock = threading.Lock()
        self._asked = 0  # syncs asked for: a sync covers those asked before it began
        self._running = False
        self._journaled = False  # a record naming a slot was journaled since the last sync began
        # Slot streams closed with writes no sync has covered yet: the seq of the last durable
        # header of their growing node (in a 1-tuple: each close's own), as storage/handoff.py's
        # `durable_seq`: reopened before a sync, a stream keeps that header's slot, not the newer
        # header its close left, which a power loss may take.
        self._closed: dict[str, tuple[int]] = {}

    @property
    def error(self) -> DurabilityError | None:
        """The failure of a sync of the packs or the journal, if one failed (then every wait raises it)."""
        return self._gate.error

    def journaled(self) -> None:
        """A record naming a slot (a creation) was just journaled: the next wait syncs."""
        self._journaled = True

    def closed_unsynced(self, name: str, durable_seq: int) -> None:
        self._closed[name] = (durable_seq,)

    def take_back(self, name: str) -> int | None:
        """The durable header's seq a stream's close left unsynced (None: its writes are synced)."""
        left = self._closed.pop(name, None)
        return None if left is None else left[0]

    def wait(self) -> None:
        """Return once every slot write and record journaled before this call is durable: at
        once if nothing was written since the last sync began and none is running (DurabilityError
        if a sync failed, now or before)."""
        with self._lock:
            if self._running or self._journaled or self._packs.written:
                self._asked += 1
            asked = self._asked
        self._gate.wait(asked, self._sync)

    def _sync(self) -> int:
        with self._lock:
            covered, self._running, self._journaled = self._asked, True, False
            closed = dict(self._closed)
        try:
            mark = self._catalog.journal_mark()  # before the packs' sync: its records name written slots
            self._packs.sync()
            if mark is not None:
                journal, length = mark
                journal.sync()
                self._catalog.vouch(journal, length)
        finally:
            with self._lock:
                self._running = False
        for name, left in closed.items():  # their writes are durable now: nothing to keep
            if self._closed.get(name) is left:
                self._closed.pop(name, None)
        return covered


class Slots:
    """The engine's slot streams: their packs, their sync, and the catalog that places them."""

    def __init__(self, ctx: EngineContext, data_dir: Path, catalog: Catalog) -> None:
        self.ctx = ctx
        self.packs = Packs(ctx.fs, data_dir)
        self.catalog = catalog
        self.sync = SlotSync(self.packs, catalog)

    def close(self) -> None:
        self.packs.close()


class SlotHome:
    """A stream in a slot: `DirectoryHome`'s interface, `directory` the one it would be promoted to."""

    clean_marker = False  # no marker of any kind: every open checks the slot's nodes
    creation = None  # its creation is durable with the slot's pack and its `p` record

    def __init__(self, ctx: EngineContext, slots: Slots, name: str, directory: Path, place: int) -> None:
        self.ctx = ctx
        self.slots = slots
        self.name = name
        self.directory = directory
        self.place = place

    @classmethod
    def create(cls, ctx: EngineContext, slots: Slots, name: str, directory: Path) -> tuple[SlotHome, Segment]:
        """A new stream in a slot, placed in the catalog (journaled), and its empty segment.
        The slot is written whole (zeros past the segment's header): a reused slot keeps
        nothing of its last stream's nodes."""
        header = SegmentHeader(0, 0, SLOT_SEGMENT_BYTES, ctx.clock())
        raw = header.encode()
        place = slots.packs.create_slot(name, header.created_ms, raw + bytes(SLOT_SEGMENT_BYTES - len(raw)))
        slots.catalog.add(name, place)  # the `p` record, after the slot's write
        slots.sync.journaled()
        file = slots.packs.open_slot(place, name, writable=True)
        return cls(ctx, slots, name, directory, place), Segment(file, header)

    def load(self, handed: UnsyncedClose | None, held: int) -> Opened:
        """Read the stream from its slot (one pread, every node checked). A slot stream's close
        hands nothing off (`handed` is None) and the catalog's count needs no check (the slot
        header names the stream at its generation)."""
        self._remove_leftover()
        file = self.slots.packs.open_slot(self.place, self.name, writable=True)
        loaded = LogLoader(self.ctx, self.name, self.directory).load_slot(file)
        return Opened(self.name, StreamConfig(), loaded, None, False)

    def take_back(self, stream: Stream) -> None:
        """After `load`: resume what its last close left to the round, if the round has not synced
        it yet (storage/handoff.py's rules): its node keeps the header its last sync made durable,
        not the one it has now, and a sync is due, which makes that one durable."""
        durable_seq = self.slots.sync.take_back(self.name)
        if durable_seq is not None and stream.active is not None:
            stream.active.set_durable(durable_seq)
            stream.dirty.add(stream.active.ref.segment.file)
            stream.write_seq += 1

    def _remove_leftover(self) -> None:
        """Remove, durably, the directory a promotion a crash cut short left (its `m` was not
        durable, so the slot is the stream's): a later promotion makes it anew, and a start-up
        that lists streams/ must not take it for the stream."""
        if self.ctx.fs.exists(self.directory):
            log.warning("stream %r: removing the directory a promotion cut short left", self.name)
            self.ctx.fs.remove_tree(self.directory)

    def remove(self) -> None:
        """A deleted stream's slot: its header zeroed, durably (as a directory's removal is: a
        scan must not bring the stream back), reused after that sync."""
        self.slots.packs.free_slot(self.place)
        self.slots.sync.take_back(self.name)  # (a stream made again under its name starts afresh)
        self.slots.sync.wait()

    # ------------------------------------------------------------------ as DirectoryHome

    @property
    def sync_error(self) -> DurabilityError | None:
        """A failed sync of the packs: every slot stream's (their writes share its pages)."""
        return self.slots.sync.error

    def make_durable(self, files: list[SegmentFile]) -> None:
        """Sync the stream's writes: the packs and the journal, shared with every slot stream."""
        self.slots.sync.wait()

    def commit_creation(self, files: Callable[[], list[SegmentFile]]) -> None:
        """Nothing to commit: the slot and its `p` record are the round's (`SlotSync`)."""

    def unmark_clean(self) -> None:
        """No marker to remove (a slot stream has none)."""

    def save_file(self, name: str, raw: bytes) -> None:
        """A slot stream keeps no file beside its segment: its producers are rebuilt from its nodes
        at each open (storage/loader.py's `load_slot`), so their snapshot is not kept."""

    def close(self, stream: Stream, hand_off: bool) -> UnsyncedClose | None:
        """A close writes nothing: its writes are the next round's (`SlotSync`), which also keeps
        the durable header of its growing node till then (`closed_unsynced`), or synced now when
        the policy does not promise them to it."""
        if not hand_off:
            stream.sync()
            return None
        with stream.lock:
            node = stream.active
            if stream.dirty and node is not None and node.ref.header.seq != node.durable_seq:
                self.slots.sync.closed_unsynced(self.name, node.durable_seq)
        return None

    # ------------------------------------------------------------------ promotion

    def promote(self, stream: Stream) -> DirectoryHome:
        """Move the stream into a directory of its own (the module doc's steps; call with the
        stream's `lock` held, no append between). Returns its new home, already the stream's."""
        ctx, fs, catalog = self.ctx, self.ctx.fs, self.slots.catalog
        old = stream.segments[0]
        catalog.promoting(self.name)  # M
        creation = start_creation(fs, ctx.streams_dir, self.name, self.directory, stream.config)
        header = dataclasses.replace(old.header, capacity=ctx.config.segment_bytes).encode()
        body = header + old.file.read(len(header), old.end_pos - len(header))
        file = fs.create_segment(self.directory / segment_name(0), SLOT_BYTES, body, durable=False)
        creation.has_segment = True
        creation.commit(fs, self.directory, lambda: [file])  # the segment, meta, directories
        catalog.set_place(self.name, NO_PLACE)  # m
        self.slots.packs.free_slot(self.place)
        # The slot's zeroing, then `m`, durable before an append goes to the directory: a slot that
        # still names the stream after a crash holds all of it (the directory at most a copy).
        self.slots.sync.wait()
        segment, _ = Segment.over(file, verify=False)
        stream.release(old)  # (its file closed: the pack's descriptor stays)
        stream.segments = [segment]
        resumed = segment.nodes[-1] if segment.nodes else None
        stream.index = NodeIndex(segment.nodes)
        stream.active = GrowingNode.resume(resumed) if resumed is not None else None  # synced: durable
        stream.dirty.clear()
        home = DirectoryHome(ctx, self.directory)
        stream.home = home
        return home


# What a record adds to its payload at most in a slot stream's first node (field tags, lengths,
# offset and timestamp varints), and that node's offset table at its smallest (nodewriter.py's
# FIRST_NODE_SLOTS entries).
RECORD_OVERHEAD = 24
_SLOT_ROOM = SLOT_SEGMENT_BYTES - SLOTTED_HEADER_SIZE - NODE_PREFIX_SIZE


def fits_slot(batches: Iterable[AppendBatch]) -> bool:
    """Whether a new stream's first batches fit a slot, written as one node: payloads only (no
    tags, headers or delivery times: a stream carrying them starts in a directory). A batch
    the estimate lets through and that does not fit promotes the stream: correct, if slower."""
    entries = size = 0
    for batch in batches:
        if batch.tags is not None or batch.headers is not None or batch.deliver_at_ms is not None:
            return False
        entries += len(batch.payloads)
        size += sum(map(len, batch.payloads))
    return size + entries * RECORD_OVERHEAD + 4 * max(entries, FIRST_NODE_SLOTS) <= _SLOT_ROOM
