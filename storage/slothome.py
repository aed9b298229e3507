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
import functools
import logging
import threading
from collections.abc import Callable, Iterable
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from storage.catalog import Catalog, StreamSummary
from storage.config import StreamConfig
from storage.context import EngineContext
from storage.creation import PendingCreation, start_creation
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
from storage.names import dirname_for
from storage.nodewriter import FIRST_NODE_SLOTS
from storage.packs import NO_PLACE, Packs, SlotFile
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
        if a sync failed, now or before). Syncs are numbered (`Packs.begin_sync`): this waits for
        the next one to end, or for the last one."""
        with self._lock:
            begun = self._packs.syncs_begun
            pending = self._running or self._journaled or self._packs.written
        self._gate.wait(begun + 1 if pending else begun, self._sync)

    def wait_after(self, synced_by: int) -> None:
        """Return once a sync numbered past `synced_by` ended (a slot's `SlotFile.synced_by`: one
        that began after the slot's last write and the records before it). A stream written before
        the round's sync began needs no other (DurabilityError if it failed): the round then syncs
        each written open stream, and a sync for each, with the calls writing meanwhile, was 131
        fdatasyncs of the packs and the journal in 8 rounds of 480 ms (issue 17)."""
        self._gate.wait(synced_by + 1, self._sync)

    def _sync(self) -> int:
        with self._lock:
            # Numbered before the journal's mark: every record journaled before a write that read
            # an older number is under the mark.
            number, self._running, self._journaled = self._packs.begin_sync(), True, False
            closed = dict(self._closed)
        try:
            mark = self._catalog.journal_mark()  # before the packs' sync: its records name written slots
            self._packs.sync()
            if mark is not None:
                journal, length = mark
                journal.sync()
                self._catalog.vouch(journal, length)
            self._packs.remove_empty()  # after the journal's sync: no trusted record names their slots
        finally:
            with self._lock:
                self._running = False
        for name, left in closed.items():  # their writes are durable now: nothing to keep
            if self._closed.get(name) is left:
                self._closed.pop(name, None)
        return number


class Slots:
    """The engine's slot streams: their packs, their sync, and the catalog that places them."""

    def __init__(self, ctx: EngineContext, data_dir: Path, catalog: Catalog) -> None:
        self.ctx = ctx
        self.packs = Packs(ctx.fs, data_dir)
        self.catalog = catalog
        self.sync = SlotSync(self.packs, catalog)

    def summary(self, name: str, place: int) -> StreamSummary:
        """The figures of the closed stream in the slot at `place`, from its nodes (one pread, every
        node checked): what its close left in the catalog, which no journal record keeps.
        CorruptionError if the slot is not its or its segment header is damaged."""
        file = self.packs.open_slot(place, name, writable=False)
        segment, _ = Segment.over(file, verify=True)
        return StreamSummary(segment.end_offset(), file.size, 1, len(segment.nodes))

    def close(self) -> None:
        self.packs.close()


@dataclasses.dataclass(frozen=True)
class Moving:
    """A promotion's directory and segment, written, not synced yet (`SlotHome.write_directory`)."""

    creation: PendingCreation
    file: SegmentFile


class SlotHome:
    """A stream in a slot: `DirectoryHome`'s interface, `directory` the one it would be promoted to
    (under `root`, the streams directory)."""

    clean_marker = False  # no marker of any kind: every open checks the slot's nodes
    creation = None  # its creation is durable with the slot's pack and its `p` record

    def __init__(self, ctx: EngineContext, slots: Slots, name: str, root: Path, place: int) -> None:
        self.ctx = ctx
        self.slots = slots
        self.name = name
        self._root = root
        self.place = place

    @cached_property
    def directory(self) -> Path:
        """Joined on first use (an open, a promotion): a creation's path join cost more than its
        catalog lookup, and most slot streams are created and closed without one."""
        return self._root / dirname_for(self.name)

    @classmethod
    def create(cls, ctx: EngineContext, slots: Slots, name: str, root: Path) -> tuple[SlotHome, Segment]:
        """A new stream in a slot, placed in the catalog (journaled), and its empty segment.
        The slot is written whole (zeros past the segment's header): a reused slot keeps
        nothing of its last stream's nodes."""
        header, raw = _slot_segment_header(ctx.clock())
        file = slots.packs.create_slot(name, header.created_ms, raw)
        slots.catalog.add(name, file.place)  # the `p` record, after the slot's write
        slots.sync.journaled()
        return cls(ctx, slots, name, root, file.place), Segment(file, header)

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
        scan must not bring the stream back), reused after that sync. The journal's `-` record is
        synced first: a zeroing the kernel writes back early never leaves a catalog file (kept:
        no set-aside for a slot's deletion) naming a free slot with no record to say why."""
        mark = self.slots.catalog.journal_mark()
        if mark is not None:
            mark[0].sync()
        self.slots.packs.free_slot(self.place)
        self.slots.sync.take_back(self.name)  # (a stream made again under its name starts afresh)
        self.slots.sync.wait()

    # ------------------------------------------------------------------ as DirectoryHome

    @property
    def sync_error(self) -> DurabilityError | None:
        """A failed sync of the packs: every slot stream's (their writes share its pages)."""
        return self.slots.sync.error

    def make_durable(self, files: list[SegmentFile]) -> None:
        """Sync the stream's writes (its slot's, `files`): the packs and the journal, shared with
        every slot stream, unless a sync begun since its last write made them durable already."""
        slots = [file for file in files if isinstance(file, SlotFile)]
        if slots and len(slots) == len(files):
            self.slots.sync.wait_after(max(file.synced_by for file in slots))
        else:
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
        moving = self.write_directory(stream)
        moving.creation.commit(self.ctx.fs, self.directory, lambda: [moving.file])  # file, meta, directories
        self.leave_slot()
        # The slot's zeroing, then `m`, durable before an append goes to the directory: a slot that
        # still names the stream after a crash holds all of it (the directory at most a copy).
        self.slots.sync.wait()
        return self.moved(stream, moving.file)

    # A promotion in three parts, so that storage/unpack.py can promote many streams with their
    # syncs shared, in the same order: `write_directory`; the directory made durable (`promote`:
    # its creation's commit); `leave_slot`; that made durable (`SlotSync`); `moved`.

    def write_directory(self, stream: Stream) -> Moving:
        """`M`, the directory, and the slot's segment as its first `.seg` file (its header
        rewritten with the engine's segment capacity), nothing synced (with the stream's `lock`
        held, till `moved`)."""
        ctx, fs = self.ctx, self.ctx.fs
        old = stream.segments[0]
        self.slots.catalog.promoting(self.name)  # M
        creation = start_creation(fs, ctx.streams_dir, self.name, self.directory, stream.config)
        header = dataclasses.replace(old.header, capacity=ctx.config.segment_bytes).encode()
        body = header + old.file.read(len(header), old.end_pos - len(header))
        file = fs.create_segment(self.directory / segment_name(0), SLOT_BYTES, body, durable=False)
        creation.has_segment = True
        return Moving(creation, file)

    def leave_slot(self) -> None:
        """Once the directory is durable: `m`, and the slot's header zeroed."""
        self.slots.catalog.set_place(self.name, NO_PLACE)  # m
        self.slots.packs.free_slot(self.place)

    def moved(self, stream: Stream, file: SegmentFile) -> DirectoryHome:
        """Once `leave_slot` is durable: the stream in its directory, whose segment is `file` (its
        new home, returned)."""
        segment, _ = Segment.over(file, verify=False)
        stream.release(stream.segments[0])  # (its file closed: the pack's descriptor stays)
        stream.segments = [segment]
        resumed = segment.nodes[-1] if segment.nodes else None
        stream.index = NodeIndex(segment.nodes)
        stream.active = GrowingNode.resume(resumed) if resumed is not None else None  # synced: durable
        stream.dirty.clear()
        home = DirectoryHome(self.ctx, self.directory)
        stream.home = home
        return home


@functools.lru_cache(maxsize=1)
def _slot_segment_header(created_ms: int) -> tuple[SegmentHeader, bytes]:
    """A new slot's segment header and its bytes, kept for the next creation in the same
    millisecond (a load creates a dozen streams in one: 1.4 us each saved). Frozen: shared."""
    header = SegmentHeader(0, 0, SLOT_SEGMENT_BYTES, created_ms)
    return header, header.encode()


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
