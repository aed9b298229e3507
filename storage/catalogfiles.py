"""The engine's catalog on disk (storage/catalog.py, docs/FORMAT.md): what start-up reads (the
file, after a clean shutdown; the file and its journals, after a process crash; the file and
the streams directory's listing, otherwise, with the slot streams placed by the journals'
synced prefix after a power loss, or by a scan of the packs when no journal can be trusted),
when the file is rewritten, and the file set aside before a deletion. `Engine` takes it from
`CatalogFiles`.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from storage.catalog import (
    CATALOG_CLEAN,
    CATALOG_FILE,
    CATALOG_SET_ASIDE,
    NO_PLACE,
    UNKNOWN,
    Catalog,
    CatalogFile,
    StreamSummary,
    read_catalog,
)
from storage.catalogjournal import (
    CREATED,
    DELETED,
    PLACED,
    PROMOTED,
    PROMOTING,
    Journal,
    Replay,
    Vouched,
    journal_generations,
    journal_name,
    replay,
    replay_vouched,
)
from storage.creation import Adopted, commit_adopted, recover_creation
from storage.epochs import EpochHistory
from storage.errors import CorruptionError, DiskFullError
from storage.format import SEGMENT_HEADER_SIZE, SegmentHeader
from storage.fs import FileSystem
from storage.handoff import UnsyncedCloses
from storage.layout import (
    DELETED_SUFFIX,
    EPOCHS_FILE,
    META_FILE,
    PACKS_DIR,
    SEGMENT_SUFFIX,
    decode_meta,
    pack_name,
    stream_directory,
    streams_root,
)
from storage.openstreams import OpenStreams
from storage.packs import split_place
from storage.slothome import Slots
from storage.streaminfo import stream_summary

log = logging.getLogger("streamlog.storage")


class CatalogFiles:
    data_dir: Path  # set by the engine
    _fs: FileSystem
    _catalog: Catalog
    _catalog_saved: float
    _catalog_on_disk: bool
    _lock: threading.Lock
    _leftovers: bool
    _adopted: dict[Path, Adopted]
    _open: OpenStreams
    _unsynced: UnsyncedCloses
    _slots: Slots
    _clean_start: bool  # set by _load: the last shutdown was clean
    unreadable: list[str]

    def _load(self) -> None:
        """Learn every stream from the catalog file, and the streams it does not name from their
        meta files (created since it was written, or all of them when it is missing or damaged);
        open none (they open on first use). After a clean shutdown the file is complete
        (`CATALOG_CLEAN`), after a process crash its journals say what changed since
        (storage/catalogjournal.py): then the streams directory is not listed."""
        root = streams_root(self.data_dir)
        listed = read_catalog(self._fs, self.data_dir)
        clean = self._fs.exists(self.data_dir / CATALOG_CLEAN)
        self._clean_start = clean
        if clean:
            # Durably gone before any stream is created: from here on the file may go stale.
            self._fs.remove(self.data_dir / CATALOG_CLEAN)
        generations = journal_generations(self._fs.listdir(self.data_dir))
        journaled = read_journaled(self._fs, self.data_dir, listed, clean, generations)
        if journaled is not None:
            listed, changes = journaled
            self._release_zeroed(listed)
            self._catalog.load(listed, set())
            if changes is None:  # complete: the journal that continues it starts empty
                generation = listed.journal
            else:  # the file and the journals so far stay until the catalog is next saved
                self._apply_journal(changes)
                generation = generations[-1] + 1
            gone = {name for name in listed.replicated if name not in self._catalog}
            self._check_replicated(listed.replicated, gone)
            self._commit_adopted()
            try:
                self._catalog.start_journal(Journal(self._fs, self.data_dir, generation))
            except DiskFullError as exc:
                self._without_journal(exc)
            if self.unreadable:  # found among the streams created since: reported again next time
                self._catalog.relist()
            self._report_unreadable_slots()
            return
        # A power loss or an OS crash: the journals' synced prefix still places the slot streams.
        vouched = (
            None if listed is None else replay_vouched(self._fs, self.data_dir, listed.journal, generations)
        )
        on_disk = self._fs.entries(root)
        for dirname in [d for d in on_disk if d.endswith(DELETED_SUFFIX)]:
            self._fs.remove_tree(root / dirname)  # a delete that crashed half-way
            on_disk.discard(dirname)
        unlisted = on_disk
        if listed is not None:
            in_file = listed.dirnames()
            unlisted = on_disk - in_file
            name_of = {dirname: name for name, dirname in listed.dirs.items()}
            gone = {name_of.get(dirname, dirname) for dirname in in_file - on_disk}
            self._release_zeroed(listed)
            self._catalog.load(listed, gone)
            self._catalog.changes += len(gone)
            self._check_replicated(listed.replicated, gone)
        from_dirs: set[str] = set()
        for dirname in sorted(unlisted):
            name = self._read_stream_dir(root / dirname)
            if name is not None:
                self._catalog.add_closed(name, UNKNOWN)
                from_dirs.add(name)
        if vouched is None:
            self._scan_slots()
        else:
            self._place_vouched(vouched, from_dirs)
        self._commit_adopted()  # before the new catalog file names them
        self._report_unreadable_slots()
        # The journals could not be trusted (or there was no file): a new file, a new generation.
        generation = 1 + max(generations[-1] if generations else 0, listed.journal if listed else 0)
        try:
            self._save_catalog(generation)
        except DiskFullError as exc:
            self._without_journal(exc)

    def _without_journal(self, exc: DiskFullError) -> None:
        """Start-up on a full disk, with no room for a new journal generation (or catalog file):
        serve without a journal, so reads go on and appends fail as a full disk fails them. The
        journals on disk go (unlinks need no space): this run's changes are in none of them, so
        a start-up before the catalog is saved again must list the streams directory and scan the
        packs, as without a journal. A change is counted: maintenance saves the catalog (a new
        generation) within its minute once there is room."""
        log.error("catalog journal not started, the disk is full (%s): running without one", exc)
        self._catalog.close_journal()
        for generation in journal_generations(self._fs.listdir(self.data_dir)):
            self._fs.remove(self.data_dir / journal_name(generation))
        self._catalog.changes += 1

    def _scan_slots(self) -> None:
        """With no journal to trust (a damaged or missing one, or no catalog file): the streams in
        slots are those the packs' slot headers name (every header read, design §5's fallback,
        and the segment header after it), each at the place its header gives. Of two slots naming
        one stream (one deleted, its zeroing lost, then created again) the later creation wins."""
        found: dict[str, tuple[int, int]] = {}  # name -> (created ms, place)
        if self._fs.exists(self._slots.packs.directory):
            damaged: list[tuple[int, str]] = []
            torn: set[int] = set()  # places whose creation's write was torn: never synced
            for place, header, segment in self._slots.packs.scan(damaged):
                held = found.get(header.name)
                if held is None or (header.created_ms, place) > held:
                    found[header.name] = (header.created_ms, place)
                if _torn(segment):
                    torn.add(place)
            found = {name: held for name, held in found.items() if held[1] not in torn}
            self._keep_damaged(damaged)
        self._settle_places(found, self._catalog.placed().keys() | found.keys())

    def _keep_damaged(self, damaged: list[tuple[int, str]]) -> None:
        """Keep each slot the scan found damaged as an unreadable slot stream's is kept (in the
        catalog's `unreadable`, adopted as used: never handed out, its bytes the operator's): under
        the name of the catalog row that places a stream there, else (no such row, or its stream
        in a directory now: promoted since the file) a key no stream name can be
        (`damaged_slot_key`). A pack that does not open is left out by `Packs.adopt` already."""
        if not damaged:
            return
        by_slot = {split_place(place)[:2]: name for name, place in self._catalog.placed().items()}
        kept = self._catalog.unreadable()
        for place, why in damaged:
            pack, slot, _ = split_place(place)
            if not slot:
                log.error("pack %d does not open, its slots left alone: %s", pack, why)
                continue
            log.error("slot %d of pack %d is damaged, kept for the operator: %s", slot, pack, why)
            name = by_slot.get((pack, slot))
            if name is None or self._fs.exists(stream_directory(self.data_dir, name)):
                name = damaged_slot_key(place)  # (a stream promoted since the file: its directory's)
            if name not in kept:
                if name not in self._catalog:
                    self._catalog.add_closed(name, UNKNOWN, place)
                self._catalog.remove(name, unreadable=True)

    def _place_vouched(self, vouched: Vouched, from_dirs: set[str]) -> None:
        """A power loss or an OS crash, with the journals' synced prefix whole (design §5): the
        slot streams are those the catalog file and that prefix place (their slots durable: not
        read), but that a slot is read for each stream a record past the prefix creates, deletes
        or moves (the latest of its places whose slot names it, at its generation, with a whole
        segment header, wins; none: the creation is dropped, never synced) and for each that
        `from_dirs` (the listing) also found in a directory. Figures the prefix gives are the
        stream's; those of a stream opened or closed past it are unknown."""
        trusted, tail = vouched.trusted, vouched.tail
        in_slots = self._catalog.placed()  # the file's, then the prefix's
        replay_places(in_slots, trusted)
        later: dict[str, list[int]] = {}  # a name the tail moves -> the places it gives, latest first
        unknown: set[str] = set()
        for kind, name, place in tail:
            if kind in (CREATED, DELETED, PLACED, PROMOTING, PROMOTED):
                later.setdefault(name, []).insert(0, place)
            else:
                unknown.add(name)
        changed = trusted.last.keys() | trusted.places.keys()
        read = later.keys() | (from_dirs & in_slots.keys())
        # (a row of the directory's that the listing found, whose slot may be its promotion cut short)
        read |= {
            n for n in changed & in_slots.keys() if n in self._catalog and self._catalog.place(n) == NO_PLACE
        }
        # The names to settle: a place the file gave and no record moved is right as it is.
        found = {name: (-1, in_slots[name]) for name in changed - read if name in in_slots}
        for name in read:
            for place in [*later.get(name, []), in_slots.get(name, NO_PLACE)]:
                created_ms = None if place == NO_PLACE else self._slot_created_ms(name, place)
                if created_ms is not None:
                    found[name] = (created_ms, place)
                    break
        self._settle_places(found, changed | read)
        for name in trusted.opened | trusted.closed.keys():
            if name in self._catalog:
                self._known(name, trusted.closed.get(name, UNKNOWN))
        for name in unknown | later.keys():
            if name in self._catalog:
                self._known(name, UNKNOWN)

    def _settle_places(self, found: dict[str, tuple[int, int]], names: set[str]) -> None:
        """Put each of `names` where the slots say (`found`: name -> (created ms, place)). A row
        whose slot names it no more is its directory's if the listing found one (promoted since
        the file), else dropped (a creation a power loss took back, or a slot freed). A stream
        also found in a directory keeps the slot if the directory is its promotion cut short (its
        first segment created when the slot was: storage/slothome.py), else the directory
        (created later)."""
        kept = self._catalog.unreadable()
        for name in names - kept.keys():  # (an unreadable one stays so: its slot for the operator)
            held, place = found.get(name), self._catalog.place(name)
            # (a name in no row has no place: only then is it looked up again)
            if held is not None and place == NO_PLACE and name not in self._catalog:
                self._catalog.add_closed(name, UNKNOWN, held[1])
                continue
            if held is None:
                if place == NO_PLACE:
                    continue  # a directory's stream, or none
                if self._fs.exists(stream_directory(self.data_dir, name)):  # promoted since the file
                    self._catalog.set_place(name, NO_PLACE)
                else:
                    self._catalog.remove(name)
            elif place != NO_PLACE:
                if place != held[1]:
                    self._catalog.set_place(name, held[1])
            elif self._created_ms(name) <= held[0]:  # a promotion cut short: the slot holds it all
                log.warning("stream %r: removing the directory a promotion cut short left", name)
                self._fs.remove_tree(stream_directory(self.data_dir, name))
                self._adopted.pop(stream_directory(self.data_dir, name), None)
                self._catalog.set_place(name, held[1])

    def _report_unreadable_slots(self) -> None:
        """List in `unreadable` the streams a slot holds that an earlier open found unreadable
        (the catalog keeps their places: the slots are never reused)."""
        for name, place in self._catalog.unreadable().items():
            if name.startswith(_DAMAGED):
                pack, slot, _ = split_place(place)
                dirname = f"{PACKS_DIR}/{pack_name(pack)} slot {slot}"
            else:
                dirname = stream_directory(self.data_dir, name).name
            if dirname not in self.unreadable:
                log.error("stream %r is unreadable in its slot %d (kept for the operator)", name, place)
                self.unreadable.append(dirname)

    def _release_zeroed(self, listed: CatalogFile) -> None:
        """Forget the kept slots of `listed.unreadable` whose header an operator zeroed (with the
        server stopped, after copying them out: docs/OPERATIONS.md): free, they may be reused."""
        for name, place in list(listed.unreadable.items()):
            try:
                zeroed = self._slots.packs.is_free(place)
            except CorruptionError:
                continue  # its pack does not open: kept
            if zeroed:
                log.warning("the kept slot of %r was zeroed by the operator: free again", name)
                del listed.unreadable[name]

    def _slot_created_ms(self, name: str, place: int) -> int | None:
        """When the stream in the slot at `place` was created, from its segment header; None if
        the slot does not name it at the place's generation, or its segment header does not read.
        A slot and its segment are written by one pwrite; a power loss may keep the header's
        sector and not the segment's: a creation no sync covered, whose stream was never durable."""
        try:
            file = self._slots.packs.open_slot(place, name, writable=False)
            return SegmentHeader.decode(file.read(0, SEGMENT_HEADER_SIZE)).created_ms
        except CorruptionError:
            return None

    def _created_ms(self, name: str) -> int:
        """When the first segment of a directory stream was created (-1: it has none that reads)."""
        directory = stream_directory(self.data_dir, name)
        segments = sorted(n for n in self._fs.listdir(directory) if n.endswith(SEGMENT_SUFFIX))
        try:
            return SegmentHeader.decode(
                self._fs.read_head(directory / segments[0], SEGMENT_HEADER_SIZE)
            ).created_ms
        except (IndexError, CorruptionError):
            return -1

    def _apply_journal(self, changes: Replay) -> None:
        """Start-up after a process crash: the streams the journals say were created since the
        file, in a slot (kept: checked at first use, as a slot is written before its record) or
        in a directory (each checked as start-up checks a directory the file does not name: a
        creation the crash cut short is finished or removed), or deleted (a deletion the crash
        cut short is finished), those promoted since (in their directory now), and those opened
        since, whose figures in the file are stale: the ones they last closed with, else (open
        at the crash) unknown until the stream is recovered."""
        last, figures, places = changes.last, changes.closed, changes.places
        for name, created in sorted(last.items()):
            place = places.get(name, NO_PLACE)
            if place != NO_PLACE:  # created in a slot: no directory to look into
                self._known(name, figures.get(name, UNKNOWN), place)
                continue
            directory = stream_directory(self.data_dir, name)
            if created:
                if self._fs.exists(directory) and self._read_stream_dir(directory) == name:
                    self._known(name, figures.get(name, UNKNOWN), NO_PLACE)
                elif name in self._catalog:
                    self._catalog.remove(name)
            else:
                if name in self._catalog:
                    self._catalog.remove(name)
                doomed = directory.with_name(directory.name + DELETED_SUFFIX)
                for leftover in (directory, doomed):
                    if self._fs.exists(leftover):
                        self._fs.remove_tree(leftover)
        for name in (changes.opened | figures.keys()) - last.keys():
            if name in self._catalog:
                self._known(name, figures.get(name, UNKNOWN))
        for name in places.keys() - last.keys():  # promoted (NO_PLACE), of a stream the file names
            self._catalog.set_place(name, places[name])

    def _known(self, name: str, summary: StreamSummary, place: int | None = None) -> None:
        """A stream with these figures (UNKNOWN: a maintenance visit, or its first use, learns them)
        and, unless None, this place."""
        if name not in self._catalog:
            self._catalog.add_closed(name, summary, NO_PLACE if place is None else place)
            return
        self._catalog.closed(name, summary)
        if place is not None:
            self._catalog.set_place(name, place)

    def _check_replicated(self, replicated: list[str], gone: set[str]) -> None:
        """A few streams: their meta and epoch files are checked at start-up, as replication may
        ask for them before their first use."""
        for name in replicated:
            directory = stream_directory(self.data_dir, name)
            if name not in gone and self._read_stream_dir(directory) is None:
                self._catalog.remove(name)

    def _read_stream_dir(self, directory: Path) -> str | None:
        """The name of the stream in `directory`, from its meta file, or for a directory without one
        as storage/creation.py says; None (the directory removed, or listed in `unreadable`) if it
        holds no stream or a damaged meta file."""
        try:
            name = decode_meta(self._fs.read_file(directory / META_FILE))[0]
            if self._fs.exists(directory / EPOCHS_FILE):  # replicated streams only: a few
                EpochHistory.decode(self._fs.read_file(directory / EPOCHS_FILE))
            return name
        except FileNotFoundError:  # a stream without one (storage/creation.py), or a crashed creation
            try:
                recovered = recover_creation(self._fs, directory, self._fs.listdir(directory))
            except CorruptionError as exc:
                self._unreadable(directory, exc)
                return None
            if isinstance(recovered, Adopted):
                self._adopted[directory] = recovered  # (a directory read twice is adopted once)
                return recovered.name
            return recovered
        except (CorruptionError, ValueError, KeyError) as exc:
            self._unreadable(directory, exc)
            return None

    def _commit_adopted(self) -> None:
        """Make the creations adopted so far durable, together (storage/creation.py)."""
        commit_adopted(self._fs, self.data_dir, list(self._adopted.values()))
        self._adopted = {}

    def _unreadable(self, directory: Path, exc: Exception) -> None:
        log.error("stream directory %s is unreadable: %s", directory.name, exc)
        self.unreadable.append(directory.name)

    def _save_catalog(self, generation: int | None = None) -> bool:
        """Rewrite the catalog file (atomically): at start-up when it was stale, at close, and by
        maintenance when streams came or went. Streams whose creation is not durable yet are
        left out (start-up finds them by their directories, or by the next journal: a new
        generation, `generation` or the next, continues the file and the older ones are
        removed once it is in place): True if there were none."""
        if generation is None:
            generation = self._catalog.journal_generation() + 1
        journal = Journal(self._fs, self.data_dir, generation)
        pending = self._unsynced.creating()
        summaries: dict[str, StreamSummary] = {}
        for stream in self._open.values():
            if stream.closed:
                continue  # the engine's close: its summary is the catalog's now
            if stream.creation is not None:
                pending.add(stream.name)
            else:  # its figures may move on before the next file: visited after a crash
                summaries[stream.name] = stream_summary(stream)._replace(upkeep_ms=1)
        raw = self._catalog.encode(pending, summaries, journal)
        if self.unreadable or self._leftovers:  # a listing finds them again: the next start-up's
            self._catalog.relist()
        with self._lock:  # not between a deletion's look at the file and its setting it aside
            self._fs.write_file_atomic(self.data_dir / CATALOG_FILE, raw)
            self._catalog_on_disk = True
        self._catalog_saved = time.monotonic()
        for older in journal_generations(self._fs.listdir(self.data_dir)):
            if older < generation:
                self._fs.remove(self.data_dir / journal_name(older))
        return not pending

    def _drop_catalog_file(self) -> None:
        """Set the catalog file aside (durably) before a stream it may name is deleted: start-up
        must not take a name from it whose directory may hold a recreated stream not yet durable
        (it rebuilds the file from the directories instead, until maintenance rewrites it), but
        for a start-up after a process crash, whose journals name every stream created or deleted
        since the file (each created one checked)."""
        # Deletions run on several threads at once (a cluster node drops copies in parallel),
        # and a save may be writing the file: one at a time sees and moves it.
        with self._lock:
            if self._catalog_on_disk:
                self._fs.rename(self.data_dir / CATALOG_FILE, self.data_dir / CATALOG_SET_ASIDE)
                self._catalog_on_disk = False


def read_journaled(
    fs: FileSystem, data_dir: Path, listed: CatalogFile | None, clean: bool, generations: list[int]
) -> tuple[CatalogFile, Replay | None] | None:
    """What a start-up takes without listing the streams directory: after a clean shutdown the
    catalog file `listed` (read by the caller), complete (no replay: None); else that file, or
    the one a deletion set aside (it holds every name but those its journals add or remove),
    and its journals' replay. None when there is no such file or the journals cannot be trusted
    (a power loss, an OS crash: `_load` then lists the streams directory)."""
    journaled = listed or (None if clean else read_catalog(fs, data_dir, CATALOG_SET_ASIDE))
    if journaled is None:
        return None
    if clean:
        return journaled, None
    changes = replay(fs, data_dir, journaled.journal, generations)
    return None if changes is None else (journaled, changes)


def replay_places(in_slots: dict[str, int], changes: Replay) -> None:
    """Move `in_slots` (name -> place of the streams in slots, as the catalog file gives them) as
    the journals' records `changes` say: a stream created in a slot is there, one created in a
    directory, deleted or promoted since is in no slot."""
    for name, created in changes.last.items():
        place = changes.places.get(name, NO_PLACE)
        if created and place != NO_PLACE:
            in_slots[name] = place
        else:
            in_slots.pop(name, None)
    for name, place in changes.places.items():
        if place == NO_PLACE:  # promoted
            in_slots.pop(name, None)


# The catalog's `unreadable` key of a damaged slot no catalog row names (`_keep_damaged`): a NUL,
# which no stream name holds, then where the slot is.
_DAMAGED = "\0damaged "


def damaged_slot_key(place: int) -> str:
    pack, slot, _ = split_place(place)
    return f"{_DAMAGED}slot {slot} of pack {pack}"


def _torn(segment_head: bytes) -> bool:
    """Whether a slot's segment header fails its checks (`_slot_created_ms` says why that is a
    creation no sync covered)."""
    try:
        SegmentHeader.check(segment_head)
        return False
    except CorruptionError:
        return True
