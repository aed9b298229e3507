"""Where a stream's bytes live: its home (docs/design/small-streams.md §4).

A stream's node index, appends and reads do not depend on where its bytes are; what does is
here: its creation, its open (files listed, meta read, segments loaded), the files beside its
segments (meta, epochs, producers, markers), what a close leaves (the SYNCED marker, or under a
policy that promises writes to the next round, the hand-off of storage/handoff.py), and its
removal. `DirectoryHome` is a directory under `streams/` (storage/layout.py), every stream's
home until small-stream slots stand beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from storage.cleanmark import SYNCED_MARKER, SyncedEnd, erase_slot, read_synced_end, write_synced_end
from storage.config import StreamConfig
from storage.context import EngineContext
from storage.creation import PendingCreation, start_creation
from storage.epochs import EpochHistory
from storage.errors import DurabilityError
from storage.fs import SegmentFile
from storage.growing import GrowingNode
from storage.handoff import UnsyncedClose
from storage.layout import CLEAN_MARKER, DELETED_SUFFIX, EPOCHS_FILE, TRUNCATE_MARKER, read_meta, write_meta
from storage.loader import LoadedLog, LogLoader
from storage.segment import Segment

if TYPE_CHECKING:
    from storage.stream import Stream


@dataclass(frozen=True)
class Opened:
    """What an open read from a stream's home."""

    name: str
    config: StreamConfig
    loaded: LoadedLog  # its segments, index and ends, recovered
    epochs: EpochHistory | None  # a replicated stream's epoch history
    truncating: bool  # a truncation a crash cut short is to be finished (storage/truncation.py)


class DirectoryHome:
    # A failed sync shared with other streams (SlotHome's pack); a directory's own is its stream's gate's.
    sync_error: DurabilityError | None = None

    def __init__(self, ctx: EngineContext, directory: Path) -> None:
        self.ctx = ctx
        self.directory = directory
        self.creation: PendingCreation | None = None  # a new stream not yet durable
        # A version-2 CLEAN marker is still on disk (opened after a clean close by an earlier
        # version, nothing written since): removed, durably, before the first write
        # (Stream._check_writable). The SYNCED marker that replaced it stays (storage/cleanmark.py).
        self.clean_marker = False
        self.synced_mark: SyncedEnd | None = None  # the SYNCED marker as the open found it
        self.marker_file = False  # a SYNCED file in its directory as the open found it (to remove)

    # ------------------------------------------------------------------ create, open, remove

    @classmethod
    def create(
        cls, ctx: EngineContext, name: str, directory: Path, config: StreamConfig, epochs: EpochHistory | None
    ) -> DirectoryHome:
        """A new stream's directory; with `epochs` (a replicated stream) durable at once, epochs
        first, else made durable by the stream's first sync (storage/creation.py)."""
        home = cls(ctx, directory)
        if epochs is not None:
            ctx.fs.makedirs(directory)
            # Before the meta file: a crash in between leaves a directory start-up removes.
            home.save_epochs(epochs)
            write_meta(ctx.fs, directory, name, 0, config)
        else:
            home.creation = start_creation(ctx.fs, ctx.streams_dir, name, directory, config)
        return home

    def load(self, handed: UnsyncedClose | None, held: int) -> Opened:
        """Read the stream: `handed`, its last close, left its files unsynced and is taken back
        (no crash came between, so its bodies are trusted); `held`: the entries the catalog
        counted in it (CorruptionError if its files hold none)."""
        fs, directory = self.ctx.fs, self.directory
        files = fs.listdir(directory)  # one listing answers every "is it there?" below
        present = set(files)
        name, first_offset, config = read_meta(fs, directory, present)
        old_clean = CLEAN_MARKER in present
        clean = handed is not None or old_clean
        synced = read_synced_end(fs, directory) if not clean and SYNCED_MARKER in present else None
        loaded = LogLoader(self.ctx, name, directory).load(first_offset, clean, synced, files, held)
        epochs = None
        if EPOCHS_FILE in present:
            epochs = EpochHistory.decode(fs.read_file(directory / EPOCHS_FILE))
        self.clean_marker = old_clean
        self.synced_mark = loaded.synced
        self.marker_file = SYNCED_MARKER in present
        if not clean and loaded.active is not None and not _vouched_for(loaded.synced, loaded.active):
            # After a crash the recovered tail may be in the page cache only (a kill -9): sync it, so
            # the header appends keep (storage/growing.py) is one a power loss keeps too. A tail the
            # SYNCED marker names as it stands was synced at the close.
            loaded.active.ref.segment.file.sync()
        return Opened(name, config, loaded, epochs, TRUNCATE_MARKER in present)

    def remove(self) -> None:
        """Remove a deleted stream's files: renamed first, so a crash midway leaves a directory
        start-up finishes removing."""
        doomed = self.directory.with_name(self.directory.name + DELETED_SUFFIX)
        self.ctx.fs.rename(self.directory, doomed)
        self.ctx.fs.remove_tree(doomed)

    # ------------------------------------------------------------------ files beside the segments

    def make_durable(self, files: list[SegmentFile]) -> None:
        """Sync the files the stream wrote since its last sync, then commit its creation."""
        for file in files:
            file.sync()
        self.commit_creation(lambda: [])  # its files were just synced

    def commit_creation(self, files: Callable[[], list[SegmentFile]]) -> None:
        """Make a new stream's creation durable, if it is not yet; `files`: its segment files to
        sync first (asked under the creation's lock: a segment made meanwhile is among them)."""
        creation = self.creation
        if creation is not None:
            creation.commit(self.ctx.fs, self.directory, files)
            self.creation = None

    def write_meta(
        self, name: str, first_offset: int, config: StreamConfig, files: Callable[[], list[SegmentFile]]
    ) -> None:
        """Replace the meta file, atomically and durably (a new stream's creation first)."""
        self.commit_creation(files)
        write_meta(self.ctx.fs, self.directory, name, first_offset, config)

    def save_epochs(self, epochs: EpochHistory) -> None:
        self.ctx.fs.write_file_atomic(self.directory / EPOCHS_FILE, epochs.encode())

    def save_file(self, name: str, raw: bytes) -> None:
        """Replace a file beside the segments (producers, a truncation marker), atomically."""
        self.ctx.fs.write_file_atomic(self.directory / name, raw)

    def unmark_clean(self) -> None:
        """Before the first write into the segments since the open: remove a version-2 CLEAN
        marker, durably, if it is still there: it vouches for every node, so from here on a crash
        must trigger the tail scan. Only a data directory written by an earlier version pays for
        it, once per stream."""
        if self.clean_marker:
            self.ctx.fs.remove(self.directory / CLEAN_MARKER)
            self.clean_marker = False

    def drop_markers(self, segments: list[Segment]) -> None:
        """Before bytes below the synced end are rewritten (a truncation; the stream's `lock`
        held): remove every marker, durably, as none would name a prefix that is still there: the
        SYNCED file, CLEAN, and the SYNCED slot of every segment that may end the stream once
        the later ones are gone."""
        self.unmark_clean()
        self.ctx.fs.remove(self.directory / SYNCED_MARKER)
        self.marker_file = False
        for segment in segments:
            if segment.header.has_slot and erase_slot(segment.file):
                segment.file.sync()
        self.synced_mark = None  # so the next close writes one

    # ------------------------------------------------------------------ close

    def close(self, stream: Stream, hand_off: bool) -> UnsyncedClose | None:
        """A clean close's work: with `hand_off` (a policy that promises writes to the next round)
        what is left for that round (`hand_off`), else the stream synced, its producers saved, and
        its SYNCED marker written; None if nothing is left."""
        handed = self.hand_off(stream) if hand_off else None
        if handed is None:
            stream.sync()
            stream.save_producers(stream.ctx.clock())
            self.mark_synced(stream)  # after the sync: see mark_synced
        return handed

    def mark_synced(self, stream: Stream) -> None:
        """A clean close synced every write: write the SYNCED marker naming the end as it stands
        (unless it is already the one on disk: a read-only visit). It needs no sync of its own:
        a power loss may take it back or tear it (the next open then checks the whole last
        segment), never make it vouch for unsynced bytes."""
        with stream.lock:
            synced = synced_end(stream.segments)
        if synced is not None and synced != self.synced_mark:
            write_synced_end(self.ctx.fs, self.directory, synced, file_may_exist=self.marker_file)

    def hand_off(self, stream: Stream) -> UnsyncedClose | None:
        """What a close under a policy that promises writes to the next round leaves to it: the
        files to sync, the creation to commit, and the marker to write (even for a synced stream:
        a marker is a file the disk creates, about a millisecond under load, on the caller's path
        otherwise). None if the close has none of these to leave (a read-only visit)."""
        with stream.lock:
            files = [file.path for file in stream.dirty]
            synced = synced_end(stream.segments)
            if not files and self.creation is None and synced == self.synced_mark:
                return None
            stream.dirty.clear()
            durable_seq = stream.active.durable_seq if stream.active is not None else 0
        handed = UnsyncedClose(self.directory, files, self.creation, durable_seq, synced, self.marker_file)
        self.creation = None
        return handed

    def take_back(self, stream: Stream, handed: UnsyncedClose) -> None:
        """Resume the unsynced state a close handed off (its files to sync, its creation)."""
        stream.dirty = {s.file for s in stream.segments if s.file.path in handed.files}
        if stream.active is not None:  # its header may not be durable: keep the one that was
            stream.active.set_durable(handed.durable_seq)
        self.creation = handed.creation
        stream.write_seq += 1  # a sync is due (the gate counts writes since the open)
        if handed.error is not None:  # its sync failed after the close: refuse appends, as `gate` does
            stream.gate.error = handed.error


def synced_end(segments: list[Segment]) -> SyncedEnd | None:
    """What the SYNCED marker says once every write so far is synced: the last segment, and its
    last node as it stands; None without a segment."""
    if not segments:
        return None
    tail = segments[-1]
    node = tail.nodes[-1] if tail.nodes and not tail.packed else None
    return SyncedEnd(
        tail.base_offset,
        tail.header.created_ms,
        node.pos if node is not None else 0,
        node.header if node is not None else None,
        in_slot=tail.header.has_slot,
    )


def _vouched_for(synced: SyncedEnd | None, node: GrowingNode) -> bool:
    """Whether the SYNCED marker names `node` with the header it has now (synced at the close)."""
    return (
        synced is not None
        and synced.base_offset == node.ref.segment.base_offset
        and synced.node_pos == node.ref.pos
        and synced.node_header == node.ref.header
    )
