"""Pack files: small streams' segments in 4 KiB slots of shared files, with no inode each.

    DATA/packs/00000.pack, 00001.pack, ...   up to PACK_BYTES each (docs/FORMAT.md, "Pack files")

Slot 0 of a pack holds its header; every other slot is free (its header all zeros) or holds
one stream: a slot header (name, generation) and then the first SLOT_SEGMENT_BYTES of a growing
segment, byte for byte what the stream's first `.seg` file would hold (docs/design/small-streams.md).
A stream in a slot is found by its *place* (the catalog's column): pack, slot and generation in
one int64. `SlotFile` is the window over one slot that `Segment` and `GrowingNode` write through.

Space: a pack grows by `posix_fallocate` in GROWTH_BYTES steps before any slot of a step is
written (a smaller step, down to the slot's own, on a disk without room for a whole one), so a
full disk is DiskFullError at a creation, with nothing changed, and a slot's writes never need
a block. Reuse: a freed slot is taken again only once a `sync` that began after
its zeroing has ended (so no crash can bring back a stream's header over another's data), and its
generation goes up by one, so a stale place names no stream.

Removal: a pack none of whose slots is used, their freeings durable, is removed (`remove_empty`,
after a sync of the packs and of the catalog journal records that freed them: storage/slothome.py's
SlotSync), but for the last one: a new pack takes the id after the highest on disk, so an id
is never reused while a place may name it (only `python -m storage.inspect unpack`, which
leaves no stream in a slot, removes the last pack too).

The engine's slot streams (storage/slothome.py, `small_streams = "slots"`) live here.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TypeVar

from storage.errors import CorruptionError, DiskFullError, DurabilityError
from storage.format import (
    SEGMENT_HEADER_SIZE,
    SLOT_BYTES,
    SLOT_HEADER_BYTES,
    SLOT_SEGMENT_BYTES,
    PackHeader,
    SlotHeader,
)
from storage.fs import FileSystem, PackFile, SegmentFile
from storage.layout import PACKS_DIR, pack_id_of, pack_name

log = logging.getLogger("streamlog.storage")

PACK_BYTES = 1 << 30
SLOTS_PER_PACK = PACK_BYTES // SLOT_BYTES  # slot 0 is the pack's header
GROWTH_BYTES = 16 << 20
MAX_PACKS = 1 << 15  # a place is a non-negative int64: the pack id takes its top 15 bits
# What a scan reads at a time: 1 MiB stays in the caches while its headers are decoded (16 MiB
# cost 1.3 us more a slot: a fresh buffer's page faults, then its headers read back from memory).
SCAN_BYTES = 1 << 20
# A stream with a directory of its own has no place (the catalog's place column: design
# docs/design/small-streams.md, docs/FORMAT.md "Pack files").
NO_PLACE = -1
_GENERATION_MASK = (1 << 24) - 1
_FREE_HEADER = bytes(SLOT_HEADER_BYTES)
_ZEROS = memoryview(bytes(SLOT_SEGMENT_BYTES))  # a creation's zeros past its segment (sliced: no copy)
T = TypeVar("T")


def make_place(pack: int, slot: int, generation: int) -> int:
    return pack << 48 | slot << 24 | generation & _GENERATION_MASK


def split_place(place: int) -> tuple[int, int, int]:
    """(pack, slot, generation mod 2**24) of a place."""
    return place >> 48, (place >> 24) & 0xFFFFFF, place & _GENERATION_MASK


def _growth_sizes(end: int) -> list[int]:
    """The sizes a pack that must reach `end` bytes tries, in order: GROWTH_BYTES steps, then
    halves of them down to one slot's, the last `end` itself: a disk with less than a step free
    still takes slots until it is really full."""
    sizes: list[int] = []
    step = GROWTH_BYTES
    while step >= SLOT_BYTES:
        size = min(PACK_BYTES, -(-end // step) * step)
        if not sizes or size < sizes[-1]:
            sizes.append(size)
        step //= 2
    return sizes


def _allocate(reserve: Callable[[int], T], end: int) -> T:
    """`reserve(size)` with the first of `_growth_sizes(end)` the disk has room for (DiskFullError,
    from the last, when none fits: each failed try changed nothing)."""
    *larger, least = _growth_sizes(end)
    for size in larger:
        try:
            return reserve(size)
        except DiskFullError:
            continue
    return reserve(least)


class SlotFull(Exception):
    """A segment in a slot would grow past SLOT_SEGMENT_BYTES: the stream needs a directory."""


class SlotFile(SegmentFile):
    """`fs.SegmentFile`'s interface over one slot's segment: positions count from the segment's
    start (the slot's byte SLOT_HEADER_BYTES). Reads come from the copy its open read; each write
    is one pwrite into the pack (then copied), and marks the pack written for the next sync.

    A SegmentFile by type, as the engine holds a stream's files (dirty sets, the closer), but none
    of its state: every method is this class's own, so SegmentFile's constructor is not called."""

    def __init__(
        self, packs: Packs, pack: PackFile, place: int, content: bytearray, writable: bool, synced_by: int
    ) -> None:
        self.path = pack.path
        self.size = self.reserved = SLOT_SEGMENT_BYTES  # allocated with the pack's growth step
        self.writable = writable
        self.closed = False
        self.place = place
        self._packs = packs
        self._pack = pack
        self._pack_id = place >> 48
        self._start = (
            (place >> 24) & 0xFFFFFF
        ) * SLOT_BYTES + SLOT_HEADER_BYTES  # the segment's, in the pack
        self._content = content
        # The number of the last sync of the packs begun before this slot's last write (or its
        # open): a sync numbered past it covers every write of it (`Packs.begin_sync`).
        self.synced_by = synced_by

    @property
    def mapped(self) -> bool:
        return False  # (its close is the caller's, as an unmapped segment's)

    def read(self, pos: int, length: int) -> bytes:
        return bytes(self._content[pos : pos + length])

    def write(self, pos: int, data: bytes) -> None:
        if self.closed or not self.writable:
            raise ValueError(f"slot at byte {self._start} of {self.path.name} is not open for writing")
        if pos < 0 or pos + len(data) > SLOT_SEGMENT_BYTES:
            raise SlotFull(f"a write of {len(data)} bytes at {pos} does not fit the slot")
        self._pack.write(self._start + pos, data)
        self.synced_by = self._packs.written_to(self._pack_id)  # after the write: a later sync covers it
        self._content[pos : pos + len(data)] = data

    def reserve(self, size: int) -> None:
        if size > SLOT_SEGMENT_BYTES:
            raise SlotFull(f"a segment of {size} bytes does not fit a slot")

    def sync(self) -> None:
        """fdatasync the pack (every slot's writes in it so far; the GIL released while it waits)."""
        if not self.closed:
            self._pack.sync()

    def close(self) -> None:
        self.closed = True  # the pack's descriptor is shared: it stays open


class Packs:
    """The pack files of a data directory: take, open and free slots; sync; scan.

    Thread-safe: slots are taken and written under one lock (a creation is one pwrite); a sync
    holds it only to note what to sync and to release the slots the sync made reusable.
    With packs on disk, `adopt` must name the slots in use (the catalog's places) before a slot
    is taken: the packs do not record which of their slots a catalog row still refers to."""

    def __init__(self, fs: FileSystem, data_dir: Path) -> None:
        self._fs = fs
        self.directory = data_dir / PACKS_DIR
        self._lock = threading.Lock()
        self._files: dict[int, PackFile] = {}  # opened so far
        self._ids: list[int] | None = None  # the packs on disk, listed at first use
        self._adopted = False
        self._next = 1  # the last pack's first slot never taken
        # Free slots, (pack, slot) -> their last generation (0: unknown): reusable now, and freed
        # since the last sync began (reusable once one that began after their zeroing ends).
        self._free: dict[tuple[int, int], int] = {}
        self._freeing: dict[tuple[int, int], int] = {}
        self._dirty: set[int] = set()
        self._syncs_begun = 0  # `begin_sync` calls: the number of the last sync begun
        self._left_out: set[int] = set()  # packs whose header failed its checks (adopt), kept
        # Per pack, its slots not in `_free` (taken, or freed since the last sync began): a pack
        # at 0 is empty, its freeings durable.
        self._held: dict[int, int] = {}
        self._emptied = False  # a pack became empty (or was found so at adopt) since the last removal

    @property
    def written(self) -> bool:
        """Whether a sync has work: a pack written since the last sync began, or a pack found
        empty and not removed yet (`remove_empty` follows a sync)."""
        return bool(self._dirty) or self._emptied

    @property
    def syncs_begun(self) -> int:
        return self._syncs_begun

    def begin_sync(self) -> int:
        """Number the sync about to begin (SlotSync's, before its journal mark and `sync`): it covers
        every slot write whose `SlotFile.synced_by` is below its number."""
        with self._lock:
            self._syncs_begun += 1
            return self._syncs_begun

    def adopt(self, places: Iterable[int]) -> None:
        """Take `places` as the slots in use (start-up, from the catalog): every other slot of the
        packs is free (a creation whose record was lost left its slot to be taken again)."""
        used: dict[int, set[int]] = {}
        for place in places:
            if place != NO_PLACE:
                pack, slot, _ = split_place(place)
                used.setdefault(pack, set()).add(slot)
        with self._lock:
            ids = self._pack_ids()
            self._leave_out_damaged(ids, used)
            self._free.clear()
            self._next = 1
            for pack in ids:
                taken = used.get(pack, set())
                slots = self._open(pack).size // SLOT_BYTES
                if pack == ids[-1]:
                    self._next = max(taken, default=0) + 1
                    slots = min(slots, self._next)
                self._free.update(((pack, slot), 0) for slot in range(1, slots) if slot not in taken)
                self._held[pack] = len(taken)
            self._emptied = any(not self._held[pack] for pack in ids[:-1])
            self._adopted = True

    def clear_unnamed(self) -> int:
        """After `adopt` at a start-up that followed a crash: zero the header of every slot it
        found free that still names a stream (a creation whose record the crash lost, a freeing
        it cut short), and of those past the last taken one in the last pack, so that a later
        scan (a start-up with no trusted index) cannot bring them back. Returns how many;
        the zeroing is durable with the next sync."""
        cleared = 0
        with self._lock:
            ids = self._pack_ids()
            if not ids:
                return 0
            last = self._open(ids[-1])
            tail = last.read(self._next * SLOT_BYTES, max(0, last.size - self._next * SLOT_BYTES))
            past = [
                (ids[-1], self._next + i // SLOT_BYTES)
                for i in range(0, len(tail) - SLOT_BYTES + 1, SLOT_BYTES)
                if tail[i : i + SLOT_HEADER_BYTES] != _FREE_HEADER
            ]
            for pack, slot in [*self._free, *past]:
                file = self._open(pack)
                if file.read(slot * SLOT_BYTES, SLOT_HEADER_BYTES) != _FREE_HEADER:
                    file.write(slot * SLOT_BYTES, _FREE_HEADER)
                    self._dirty.add(pack)
                    cleared += 1
        return cleared

    def create_slot(self, name: str, created_ms: int, segment: bytes) -> SlotFile:
        """Write a new stream's slot (header, `segment` and zeros to the slot's end: one pwrite)
        and return it open for writing (its `place` says where), built from the bytes in hand:
        no read back."""
        if len(segment) > SLOT_SEGMENT_BYTES:
            raise SlotFull(f"a segment of {len(segment)} bytes does not fit a slot")
        with self._lock:
            pack, slot, generation = self._take()
            file = self._files[pack]
            try:
                # The whole slot: a reused one's old nodes past the new segment's end must read as
                # nothing, or a scan could take one for the new stream's next node.
                header = SlotHeader(name, generation, created_ms).encode()
                zeros = _ZEROS[: SLOT_SEGMENT_BYTES - len(segment)]
                file.write(slot * SLOT_BYTES, b"".join((header, segment, zeros)))
            except BaseException:
                self._give_back(pack, slot, generation)
                raise
            self._dirty.add(pack)
            content = bytearray(segment)
            content += zeros
            # synced_by read after the pwrite: a sync numbered past it covers the slot's write.
            return SlotFile(self, file, make_place(pack, slot, generation), content, True, self._syncs_begun)

    def open_slot(self, place: int, name: str, writable: bool) -> SlotFile:
        """The slot at `place` (one pread), which must hold `name` at the place's generation."""
        pack, slot, generation = split_place(place)
        where = f"slot {slot} of pack {pack}"
        if place < 0 or not 0 < slot < SLOTS_PER_PACK:
            raise CorruptionError(f"{where} is no slot of a stream (place {place})")
        with self._lock:
            if pack not in self._pack_ids():
                raise CorruptionError(f"{where}: there is no pack file {pack_name(pack)}")
            file = self._open(pack)
        raw = file.read(slot * SLOT_BYTES, SLOT_BYTES)
        if len(raw) < SLOT_BYTES:
            raise CorruptionError(f"{where} is past the pack's end ({file.size} bytes)")
        header = SlotHeader.decode(raw)  # CorruptionError if damaged
        if header is None:
            raise CorruptionError(f"{where} is free, not stream {name!r}'s")
        if header.name != name or header.generation & _GENERATION_MASK != generation:
            raise CorruptionError(
                f"{where} holds {header.name!r} at generation {header.generation}, "
                f"not {name!r} at {generation}"
            )
        # Covered by a sync begun after the open: what was written to the slot before it, by this
        # stream's last open, may be unsynced still (a close hands its writes to the round).
        return SlotFile(self, file, place, bytearray(raw[SLOT_HEADER_BYTES:]), writable, self._syncs_begun)

    def is_free(self, place: int) -> bool:
        """Whether the slot at `place` is free, its header all zeros (CorruptionError: its pack does
        not open); False past the pack's end or with no such pack."""
        pack, slot, _ = split_place(place)
        with self._lock:
            if pack not in self._pack_ids() or not 0 < slot < SLOTS_PER_PACK:
                return False
            file = self._open(pack)
        return file.read(slot * SLOT_BYTES, SLOT_HEADER_BYTES) == _FREE_HEADER

    def written_to(self, pack: int) -> int:
        """A slot of `pack` was just written (SlotFile.write): mark the pack for the next sync; the
        number of the last sync begun (one past it covers the write)."""
        with self._lock:
            self._dirty.add(pack)
            return self._syncs_begun

    def free_slot(self, place: int) -> None:
        """Zero the slot's header (one pwrite); the slot is taken again only after the next
        `sync` that begins after this."""
        pack, slot, generation = split_place(place)
        with self._lock:
            if not self._adopted:
                raise RuntimeError("Packs.adopt must name the slots in use before a slot is freed")
            if (pack, slot) in self._free or (pack, slot) in self._freeing:
                raise ValueError(f"slot {slot} of pack {pack} is already free")
            if pack not in self._pack_ids() or not 0 < slot < SLOTS_PER_PACK:
                raise ValueError(f"place {place} is no slot of these packs")
            self._open(pack).write(slot * SLOT_BYTES, _FREE_HEADER)
            self._dirty.add(pack)
            self._freeing[pack, slot] = generation

    def sync(self) -> None:
        """fdatasync every pack written since the last sync began (the GIL released while each
        waits, and the lock not held: slots are taken meanwhile); then the slots freed before it
        began may be taken again."""
        with self._lock:
            dirty = [self._files[pack] for pack in sorted(self._dirty)]
            self._dirty.clear()
            freed, self._freeing = self._freeing, {}
        try:
            for file in dirty:
                file.sync()
        except BaseException:
            with self._lock:
                self._dirty.update(pack for pack, file in self._files.items() if file in dirty)
                self._freeing.update(freed)
            raise
        with self._lock:
            self._free.update(freed)
            last = self._pack_ids()[-1] if freed else None
            for pack, _ in freed:
                self._held[pack] -= 1
                self._emptied = self._emptied or (not self._held[pack] and pack != last)

    def remove_empty(self, *, last: bool = False) -> list[int]:
        """Remove the packs none of whose slots is used (none taken, every freeing synced), but
        the last one unless `last` (unpack: no stream is left in a slot); returns their ids.
        Call after a sync of the packs *and* of the catalog journal records that freed their
        slots (SlotSync): then no place a start-up can trust names a slot of them. Each is
        taken out and unlinked under the lock (no slot of it is taken again, no new pack takes
        its name meanwhile), the packs directory synced; a crash before that sync leaves a pack of
        free slots, removed again."""
        with self._lock:
            if not self._adopted:
                return []  # (what is used is not known yet)
            ids = self._pack_ids()
            empty = [pack for pack in (ids if last else ids[:-1]) if not self._held.get(pack)]
            for pack in empty:
                self._take_out(pack)
                try:
                    self._fs.remove(self.directory / pack_name(pack))
                except (OSError, DurabilityError) as exc:  # back after a crash, its slots free: removed again
                    log.error("pack %s could not be removed: %s", pack_name(pack), exc)
                    continue
                log.info("pack %s removed: none of its slots is used", pack_name(pack))
            self._emptied = False
        return empty

    def scan(self, damaged: list[tuple[int, str]] | None = None) -> Iterator[tuple[int, SlotHeader, bytes]]:
        """(place, header, the segment's first SEGMENT_HEADER_SIZE bytes) of every used slot, pack
        by pack, read SCAN_BYTES at a time (the fallback with no trusted index, and inspect): no
        read of its own for a slot. A slot whose header fails its checks is skipped, and put in
        `damaged` (its place at generation 0, and why) when given."""
        with self._lock:
            ids = list(self._pack_ids())
        decode = SlotHeader.decode
        for pack in ids:
            with self._lock:
                try:
                    file = self._open(pack)
                except CorruptionError as exc:  # its slots cannot be found: none is taken as a stream's
                    if damaged is not None:
                        damaged.append((make_place(pack, 0, 0), str(exc)))
                    continue
            pos = SLOT_BYTES
            while pos < file.size:
                chunk = file.read(pos, min(SCAN_BYTES, file.size - pos))
                first = pos // SLOT_BYTES  # the chunk's first slot
                for at in range(0, len(chunk) - SLOT_BYTES + 1, SLOT_BYTES):
                    try:
                        header = decode(chunk, at)
                    except CorruptionError as exc:
                        if damaged is not None:
                            damaged.append((make_place(pack, first + at // SLOT_BYTES, 0), str(exc)))
                        continue
                    if header is not None:
                        segment = at + SLOT_HEADER_BYTES
                        yield (
                            make_place(pack, first + at // SLOT_BYTES, header.generation),
                            header,
                            chunk[segment : segment + SEGMENT_HEADER_SIZE],
                        )
                if len(chunk) < SLOT_BYTES:
                    break
                pos += len(chunk) - len(chunk) % SLOT_BYTES

    def close(self) -> None:
        with self._lock:
            for file in self._files.values():
                file.close()
            self._files.clear()
            self._ids = None
            self._adopted = False

    # ------------------------------------------------------------------ with the lock held

    def _pack_ids(self) -> list[int]:
        if self._ids is None:
            self._ids = sorted(i for i in map(pack_id_of, self._fs.listdir(self.directory)) if i is not None)
        return self._ids

    def _leave_out_damaged(self, ids: list[int], used: dict[int, set[int]]) -> None:
        """Take out of `ids` the packs whose header fails its checks (adopt). The last one, if no
        place names a slot of it, is a creation a crash cut short (a pack is durable, header and
        all, before a slot of it is written): removed. Any other stays for the operator; the
        streams it held are unreadable (their opens find no pack)."""
        for pack in list(ids):
            try:
                self._open(pack)
            except CorruptionError as exc:
                ids.remove(pack)
                if pack > max([*ids, *self._left_out], default=-1) and pack not in used:
                    log.warning("pack %s: %s; a creation cut short, removed", pack_name(pack), exc)
                    self._fs.remove(self.directory / pack_name(pack))
                else:
                    log.error("pack %s: %s; its slots are left alone", pack_name(pack), exc)
                    self._left_out.add(pack)  # its name is not reused

    def _take_out(self, pack: int) -> None:
        """Forget an empty pack: its free slots, its descriptor, its id (the last: `_next` too)."""
        file = self._files.pop(pack)
        for slot in range(1, file.size // SLOT_BYTES):
            self._free.pop((pack, slot), None)
        file.close()
        ids = self._pack_ids()
        if pack == ids[-1]:
            self._next = SLOTS_PER_PACK  # the next creation starts a pack
        ids.remove(pack)
        self._held.pop(pack, None)
        self._dirty.discard(pack)

    def _open(self, pack: int) -> PackFile:
        file = self._files.get(pack)
        if file is None:
            file = self._fs.open_pack(self.directory / pack_name(pack))
            try:
                if PackHeader.decode(file.read(0, SLOT_BYTES)).pack_id != pack:
                    raise CorruptionError(f"pack file {pack_name(pack)} names another pack")
            except CorruptionError:
                file.close()
                raise
            self._files[pack] = file
        return file

    def _take(self) -> tuple[int, int, int]:
        """A slot to write: (pack, slot, generation). A freed one first, else the next one of the
        last pack, its growth step allocated first (DiskFullError: nothing changed)."""
        ids = self._pack_ids()
        if ids and not self._adopted:
            raise RuntimeError("Packs.adopt must name the slots in use before a slot is taken")
        self._adopted = True
        if self._free:
            (pack, slot), generation = self._free.popitem()
            self._held[pack] += 1
            file = self._open(pack)
            if not generation:  # freed before this process: its last header, if any, tells
                try:
                    header = SlotHeader.decode(file.read(slot * SLOT_BYTES, SLOT_HEADER_BYTES))
                except CorruptionError:
                    header = None
                generation = header.generation if header is not None else 0
            return pack, slot, (generation + 1) & _GENERATION_MASK or 1
        if not ids or self._next == SLOTS_PER_PACK:
            self._new_pack(max([*ids, *self._left_out], default=-1) + 1)
        pack, slot = ids[-1], self._next
        file = self._open(pack)
        end = (slot + 1) * SLOT_BYTES
        if end > file.size:
            _allocate(file.grow, end)
        self._next += 1
        self._held[pack] = self._held.get(pack, 0) + 1
        return pack, slot, 1

    def _give_back(self, pack: int, slot: int, generation: int) -> None:
        """A taken slot whose write failed: free again (its last generation kept)."""
        self._held[pack] -= 1
        if (pack, slot) == (self._pack_ids()[-1], self._next - 1):
            self._next -= 1
        else:
            self._free[pack, slot] = generation - 1

    def _new_pack(self, pack: int) -> None:
        if pack >= MAX_PACKS:
            raise RuntimeError(f"{MAX_PACKS} packs of slots are in use: no place can name another")
        if pack == 0:
            self._fs.makedirs(self.directory)
        path, header = self.directory / pack_name(pack), PackHeader(pack).encode()
        self._files[pack] = _allocate(lambda size: self._fs.create_pack(path, size, header), 2 * SLOT_BYTES)
        self._pack_ids().append(pack)
        self._next = 1
