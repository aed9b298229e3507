"""Pack files of slots (storage/packs.py): places, one write per creation, a segment in a slot that
is byte for byte a `.seg` file, reuse after a sync, growth steps, a full disk, crashes, scans."""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path

import pytest

from storage import Engine, EngineConfig
from storage.errors import CorruptionError, DiskFullError, DurabilityError
from storage.format import SLOT_BYTES, SLOT_HEADER_BYTES, SLOT_SEGMENT_BYTES, SegmentHeader, SlotHeader
from storage.fs import FileSystem
from storage.growing import GrowingNode
from storage.inspect import main as inspect_main
from storage.layout import STREAMS_DIR, segment_name
from storage.names import dirname_for
from storage.packs import (
    GROWTH_BYTES,
    NO_PLACE,
    Packs,
    SlotFile,
    SlotFull,
    make_place,
    split_place,
)
from storage.records import encode_batch
from storage.segment import Segment
from storage.types import AppendBatch
from tests.storage.faultfs import Crash, FaultFS, PendingWrite

ROOT = Path("/faultfs/data")
PACK = ROOT / "packs" / "00000.pack"
MS = 1_700_000_000_000
SLOT_SEGMENT = SegmentHeader(0, 0, SLOT_SEGMENT_BYTES, MS).encode()


def fault_packs() -> tuple[FaultFS, Packs]:
    fs = FaultFS()
    fs.prepare_dir(ROOT)
    return fs, Packs(fs, ROOT)  # type: ignore[arg-type]  # FaultFS has FileSystem's interface


def append(file: SlotFile, payloads: list[bytes], first: int = 0) -> Segment:
    """A growing node with `payloads` in a new segment over `file`, as a new stream's first append
    writes it (storage/nodewriter.py), and a second batch after it."""
    segment = Segment(file, SegmentHeader.decode(file.read(0, 64)))
    node = GrowingNode.start(segment, 16, first)
    segment.nodes.append(node.ref)
    half = len(payloads) // 2
    for batch, start in ((payloads[:half], 0), (payloads[half:], half)):
        blob, positions = encode_batch(first + start, MS, AppendBatch(batch), node.positions[-1])
        assert node.make_room(len(batch), len(blob))
        node.append(blob, positions, MS, MS, 0)
    return segment


def test_a_place_is_pack_slot_and_generation_in_one_int64():
    place = make_place(32767, 262143, 7)
    assert 0 <= place < 2**63
    assert split_place(place) == (32767, 262143, 7)
    assert split_place(make_place(3, 1, 2**24 + 5)) == (3, 1, 5)  # the generation mod 2**24
    assert NO_PLACE < 0


def test_a_creation_is_one_write_and_its_slot_reads_back():
    fs, packs = fault_packs()
    first = packs.create_slot("a", MS, SLOT_SEGMENT).place  # makes the pack (its header, synced)
    writes = fs.writes
    created = packs.create_slot("b", MS + 1, SLOT_SEGMENT + b"xyz")
    place = created.place
    assert fs.writes == writes + 1 and fs.written[-1] == PACK
    assert split_place(first) == (0, 1, 1) and split_place(place) == (0, 2, 1)
    raw = fs.file_bytes(PACK)[2 * SLOT_BYTES : 3 * SLOT_BYTES]
    assert SlotHeader.decode(raw) == SlotHeader("b", 1, MS + 1)
    assert raw[SLOT_HEADER_BYTES:] == SLOT_SEGMENT + b"xyz" + bytes(
        SLOT_SEGMENT_BYTES - len(SLOT_SEGMENT) - 3
    )
    # The slot the creation returns, built from the bytes in hand, holds what the pack does.
    assert created.read(0, SLOT_SEGMENT_BYTES) == raw[SLOT_HEADER_BYTES:] and created.writable
    file = packs.open_slot(place, "b", writable=False)
    assert file.read(0, len(SLOT_SEGMENT) + 3) == SLOT_SEGMENT + b"xyz"
    assert (file.size, file.reserved, file.mapped) == (SLOT_SEGMENT_BYTES, SLOT_SEGMENT_BYTES, False)
    with pytest.raises(ValueError):
        file.write(0, b"no")
    with pytest.raises(SlotFull):
        packs.create_slot("c", MS, bytes(SLOT_SEGMENT_BYTES + 1))


def test_a_segment_in_a_slot_is_what_its_seg_file_holds_and_todays_engine_reads_it(tmp_path):
    fs = FileSystem()
    packs = Packs(fs, tmp_path / "data")
    payloads = [bytes([i]) * 100 for i in range(10)]
    place = packs.create_slot("small", MS, SLOT_SEGMENT).place
    append(packs.open_slot(place, "small", writable=True), payloads)
    # The same stream as a `.seg` file of the same capacity, written by the same code.
    (tmp_path / "seg").mkdir()
    segment = Segment.create(fs, tmp_path / "seg", 0, SLOT_SEGMENT_BYTES, SLOT_SEGMENT_BYTES, MS)
    segment.file.write(0, bytes(SLOT_SEGMENT_BYTES))  # (a new file's SYNCED slot is zeros: it stays so)
    segment.file.write(0, SLOT_SEGMENT)
    append(segment.file, payloads)
    segment.close()
    packs.sync()
    slot = (tmp_path / "data" / "packs" / "00000.pack").read_bytes()[SLOT_BYTES : 2 * SLOT_BYTES]
    seg_file = (tmp_path / "seg" / segment_name(0)).read_bytes()
    assert slot[SLOT_HEADER_BYTES:] == seg_file
    # What promotion does (design §6, checkslot): the slot's segment as a stream's first file.
    stream_dir = tmp_path / "data" / STREAMS_DIR / dirname_for("small")
    stream_dir.mkdir(parents=True)
    (stream_dir / segment_name(0)).write_bytes(slot[SLOT_HEADER_BYTES:])
    packs.close()
    engine = Engine(tmp_path / "data", EngineConfig(background=False))
    try:
        result = engine.read("small", 0, 100)
        assert [(e.offset, e.payload) for e in result.entries()] == list(enumerate(payloads))
        more = [b"more-%d" % i for i in range(40)]
        assert engine.append("small", AppendBatch(more)).first_offset == 10
        entries = [e.payload for e in engine.read("small", 0, 100).entries()]
        assert entries == payloads + more
    finally:
        engine.close()


def test_a_segment_cannot_grow_past_its_slot():
    _, packs = fault_packs()
    file = packs.open_slot(packs.create_slot("s", MS, SLOT_SEGMENT).place, "s", writable=True)
    segment = append(file, [b"x" * 100] * 4)
    node = GrowingNode.resume(segment.nodes[-1])
    assert not node.make_room(1, SLOT_SEGMENT_BYTES)  # the caller promotes the stream
    file.reserve(SLOT_SEGMENT_BYTES)
    with pytest.raises(SlotFull):
        file.reserve(SLOT_SEGMENT_BYTES + 1)
    with pytest.raises(SlotFull):
        file.write(SLOT_SEGMENT_BYTES - 1, b"ab")


def test_a_freed_slot_is_reused_after_a_sync_with_its_generation_up():
    fs, packs = fault_packs()
    a = packs.create_slot("a", MS, SLOT_SEGMENT).place
    packs.create_slot("b", MS, SLOT_SEGMENT)
    packs.sync()
    packs.free_slot(a)
    assert fs.file_bytes(PACK)[SLOT_BYTES : SLOT_BYTES + SLOT_HEADER_BYTES] == bytes(SLOT_HEADER_BYTES)
    assert packs.written
    c = packs.create_slot("c", MS, SLOT_SEGMENT).place
    assert split_place(c) == (0, 3, 1)  # not a's slot: its zeroing is not durable yet
    packs.sync()
    assert not packs.written
    d = packs.create_slot("a", MS, SLOT_SEGMENT).place  # a stream of the same name, recreated
    assert split_place(d) == (0, 1, 2)
    with pytest.raises(CorruptionError, match="generation 2, not 'a' at 1"):
        packs.open_slot(a, "a", writable=False)  # a stale place: the old generation
    with pytest.raises(CorruptionError, match="holds 'a'"):
        packs.open_slot(d, "b", writable=False)  # another name
    packs.open_slot(d, "a", writable=False)
    packs.free_slot(c)
    with pytest.raises(ValueError, match="already free"):
        packs.free_slot(c)


def test_a_slot_freed_while_a_sync_runs_waits_for_the_next():
    fs, packs = fault_packs()
    a = packs.create_slot("a", MS, SLOT_SEGMENT).place
    packs.create_slot("b", MS, SLOT_SEGMENT)
    fs.on_sync = lambda _: packs.free_slot(a) if fs.on_sync else None
    packs.sync()  # a's zeroing came after this sync began (at its fdatasync)
    fs.on_sync = None
    assert split_place(packs.create_slot("c", MS, SLOT_SEGMENT).place) == (0, 3, 1)
    packs.sync()
    assert split_place(packs.create_slot("d", MS, SLOT_SEGMENT).place) == (0, 1, 2)


def test_a_pack_grows_in_steps_before_a_step_is_written_and_a_full_pack_starts_the_next(monkeypatch):
    fs, packs = fault_packs()
    packs.create_slot("s0", MS, SLOT_SEGMENT)
    assert len(fs.file_bytes(PACK)) == GROWTH_BYTES
    step = GROWTH_BYTES // SLOT_BYTES
    for i in range(1, step - 1):  # slots 2 .. step-1: within the first step
        packs.create_slot(f"s{i}", MS, SLOT_SEGMENT)
    assert len(fs.file_bytes(PACK)) == GROWTH_BYTES and fs.pending_growths() == 0
    writes = fs.writes
    place = packs.create_slot("next", MS, SLOT_SEGMENT).place
    assert split_place(place) == (0, step, 1)
    assert len(fs.file_bytes(PACK)) == 2 * GROWTH_BYTES and fs.pending_growths() == 1
    assert fs.writes == writes + 1  # the growth (fallocate) is no write; then the slot's one
    packs.sync()
    assert fs.pending_growths() == 0
    # Packs of 10 slots growing 4 at a time: the last step is cut at the pack's size.
    monkeypatch.setattr("storage.packs.GROWTH_BYTES", 4 * SLOT_BYTES)
    monkeypatch.setattr("storage.packs.SLOTS_PER_PACK", 10)
    monkeypatch.setattr("storage.packs.PACK_BYTES", 10 * SLOT_BYTES)
    fs, packs = fault_packs()
    sizes = []
    for i in range(9):
        packs.create_slot(f"s{i}", MS, SLOT_SEGMENT)
        sizes.append(len(fs.file_bytes(PACK)) // SLOT_BYTES)
    assert sizes == [4, 4, 4, 8, 8, 8, 8, 10, 10]
    assert split_place(packs.create_slot("new pack", MS, SLOT_SEGMENT).place) == (1, 1, 1)
    assert fs.listdir(ROOT / "packs") == ["00000.pack", "00001.pack"]


def test_a_full_disk_at_a_growth_step_changes_nothing(monkeypatch):
    fs, packs = fault_packs()
    fs.disk_full = True
    with pytest.raises(DiskFullError):
        packs.create_slot("first", MS, SLOT_SEGMENT)  # the pack's creation
    assert fs.listdir(ROOT / "packs") == []
    fs.disk_full = False
    monkeypatch.setattr("storage.packs.GROWTH_BYTES", 4 * SLOT_BYTES)
    places = [packs.create_slot(f"s{i}", MS, SLOT_SEGMENT).place for i in range(3)]  # slots 1-3 of 4
    assert len(fs.file_bytes(PACK)) == 4 * SLOT_BYTES
    before, writes = fs.file_bytes(PACK), fs.writes
    fs.disk_full = True
    with pytest.raises(DiskFullError):
        packs.create_slot("no room", MS, SLOT_SEGMENT)
    assert (fs.file_bytes(PACK), fs.writes, packs.written) == (before, writes, True)
    packs.free_slot(places[0])
    packs.sync()
    assert split_place(packs.create_slot("reused", MS, SLOT_SEGMENT).place) == (0, 1, 2)  # no growth needed
    fs.disk_full = False
    assert split_place(packs.create_slot("grown", MS, SLOT_SEGMENT).place) == (0, 4, 1)  # no slot skipped
    assert len(fs.file_bytes(PACK)) == 8 * SLOT_BYTES


def test_a_disk_with_less_than_a_growth_step_free_takes_slots_until_it_is_full():
    """With less than GROWTH_BYTES free, a pack is made and grows in smaller steps, down to the
    slot's own: every slot the disk has room for is taken, then DiskFullError with nothing changed."""
    fs, packs = fault_packs()
    fs.capacity_bytes = 100 * SLOT_BYTES  # 400 KiB: no room for a 16 MiB step
    places = []
    with pytest.raises(DiskFullError):
        for i in range(200):  # a bound far above what fits
            places.append(packs.create_slot(f"s{i}", MS, SLOT_SEGMENT).place)
    assert len(places) == 99  # slot 0 is the pack's header
    assert len(fs.file_bytes(PACK)) == 100 * SLOT_BYTES and fs.listdir(ROOT / "packs") == ["00000.pack"]
    before, writes = fs.file_bytes(PACK), fs.writes
    with pytest.raises(DiskFullError):
        packs.create_slot("no room", MS, SLOT_SEGMENT)
    assert (fs.file_bytes(PACK), fs.writes) == (before, writes)
    for i, place in enumerate(places):
        assert packs.open_slot(place, f"s{i}", writable=False).read(0, len(SLOT_SEGMENT)) == SLOT_SEGMENT
    fs.capacity_bytes = None  # room again: the next growth is a whole step's
    assert split_place(packs.create_slot("grown", MS, SLOT_SEGMENT).place) == (0, 100, 1)
    assert len(fs.file_bytes(PACK)) == GROWTH_BYTES


def _restart(fs: FaultFS, places: list[int]) -> Packs:
    packs = Packs(fs, ROOT)  # type: ignore[arg-type]
    packs.adopt(places)
    return packs


def test_kill_keeps_the_page_cache_and_power_loss_keeps_what_a_sync_made_durable_by_byte_range():
    fs, packs = fault_packs()
    a = packs.create_slot("a", MS, SLOT_SEGMENT).place
    b = packs.create_slot("b", MS, SLOT_SEGMENT).place
    packs.sync()
    c = packs.create_slot("c", MS, SLOT_SEGMENT).place
    append(packs.open_slot(a, "a", writable=True), [b"after the sync"] * 2)
    a_bytes = packs.open_slot(a, "a", writable=False).read(0, SLOT_SEGMENT_BYTES)

    killed = _restart(fs.crashed_copy(mode="process"), [a, b, c])
    assert killed.open_slot(a, "a", writable=False).read(0, SLOT_SEGMENT_BYTES) == a_bytes
    killed.open_slot(c, "c", writable=False)

    lost = _restart(fs.crashed_copy(mode="lost"), [a, b])
    assert lost.open_slot(a, "a", writable=False).read(0, SLOT_SEGMENT_BYTES) == SLOT_SEGMENT + bytes(
        SLOT_SEGMENT_BYTES - len(SLOT_SEGMENT)
    )
    lost.open_slot(b, "b", writable=False)
    with pytest.raises(CorruptionError, match="free"):
        lost.open_slot(c, "c", writable=False)

    # Writes to one file, kept or lost by byte range: c's creation lands, a's appends do not.
    def c_only(write: PendingWrite) -> str:
        return "keep" if write.pos // SLOT_BYTES == 3 else "drop"

    power = _restart(fs.crashed_copy(random.Random(1), "power", fate=c_only), [a, b, c])
    power.open_slot(c, "c", writable=False)
    assert power.open_slot(a, "a", writable=False).read(0, SLOT_SEGMENT_BYTES) != a_bytes


def test_a_crash_at_the_sync_point_of_a_growth_step_loses_only_its_slots():
    fs, packs = fault_packs()
    places = [packs.create_slot(f"s{i}", MS, SLOT_SEGMENT).place for i in range(GROWTH_BYTES // SLOT_BYTES)]
    fs.crash_at_sync = fs.syncs + 1
    with pytest.raises(Crash):
        packs.sync()  # the growth and the last slot's write still pending
    restarted = _restart(fs.crashed_copy(mode="lost"), places[:-1])
    with pytest.raises(CorruptionError, match="past the pack's end"):
        restarted.open_slot(places[-1], f"s{len(places) - 1}", writable=False)
    assert split_place(restarted.create_slot("again", MS, SLOT_SEGMENT).place) == split_place(places[-1])


def test_start_up_takes_the_slots_in_use_from_the_catalog():
    fs, packs = fault_packs()
    a, b, c = (packs.create_slot(n, MS, SLOT_SEGMENT).place for n in "abc")
    packs.sync()
    packs.close()
    restarted = Packs(fs, ROOT)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="adopt"):
        restarted.create_slot("d", MS, SLOT_SEGMENT)
    restarted.adopt([a, c, NO_PLACE])  # b's record was lost: its slot is free, its header still there
    assert split_place(restarted.create_slot("d", MS, SLOT_SEGMENT).place) == (0, 2, 2)
    assert split_place(restarted.create_slot("e", MS, SLOT_SEGMENT).place) == (0, 4, 1)
    with pytest.raises(CorruptionError, match="holds 'd'"):
        restarted.open_slot(b, "b", writable=False)


def test_a_slot_is_refused_where_its_pack_or_slot_is_missing():
    fs, packs = fault_packs()
    place = packs.create_slot("a", MS, SLOT_SEGMENT).place
    with pytest.raises(CorruptionError, match=r"no pack file 00003\.pack"):
        packs.open_slot(make_place(3, 1, 1), "a", writable=False)
    with pytest.raises(CorruptionError, match="past the pack's end"):
        packs.open_slot(make_place(0, GROWTH_BYTES // SLOT_BYTES + 5, 1), "a", writable=False)
    with pytest.raises(CorruptionError, match="no slot"):
        packs.open_slot(make_place(0, 0, 1), "a", writable=False)  # the pack's header
    fs.poke(PACK, 0, b"junk")
    restarted = Packs(fs, ROOT)  # type: ignore[arg-type]
    restarted.adopt([place])  # a damaged pack is left out at start-up, which goes on
    with pytest.raises(CorruptionError, match=r"no pack file 00000\.pack"):
        restarted.open_slot(place, "a", writable=False)  # its streams unreadable
    assert fs.exists(PACK)  # named by a place: kept for the operator
    assert split_place(restarted.create_slot("b", MS, SLOT_SEGMENT).place)[0] == 1  # a new pack, not its name
    unnamed = Packs(fs, ROOT)  # type: ignore[arg-type]
    unnamed.adopt([])  # pack 0 is not the last now: kept, though no place names it
    assert fs.exists(PACK)
    fs.remove(ROOT / "packs" / "00001.pack")
    unnamed = Packs(fs, ROOT)  # type: ignore[arg-type]
    unnamed.adopt([])  # the last pack, no slot of it any stream's: a creation cut short
    assert not fs.exists(PACK)


def test_scan_lists_every_used_slot_and_the_damaged_ones(monkeypatch):
    monkeypatch.setattr("storage.packs.SCAN_BYTES", 3 * SLOT_BYTES)  # slots across reads
    fs, packs = fault_packs()
    places = [packs.create_slot(f"s{i}", MS + i, SLOT_SEGMENT).place for i in range(7)]
    packs.free_slot(places[2])
    fs.poke(PACK, 5 * SLOT_BYTES + 30, b"\xff")  # slot 5's header (s4) damaged
    damaged: list[tuple[int, str]] = []
    found = list(packs.scan(damaged))
    kept = [0, 1, 3, 5, 6]
    assert [(place, header) for place, header, _ in found] == [
        (places[i], SlotHeader(f"s{i}", 1, MS + i)) for i in kept
    ]
    assert all(SegmentHeader.decode(head) == SegmentHeader.decode(SLOT_SEGMENT) for _, _, head in found)
    assert damaged == [(make_place(0, 5, 0), "slot header CRC mismatch")]


class _HeldSync:
    """os.fdatasync that waits until released (a disk behind a long queue), then syncs."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self._real = os.fdatasync
        self.waited = False  # it stopped waiting (released, or after 5 s)

    def __call__(self, fd: int) -> None:
        self.entered.set()
        self.release.wait(5)
        self.waited = True
        self._real(fd)


@pytest.mark.parametrize("which", ["packs", "slot file"])
def test_a_sync_lets_other_threads_create_and_write_slots_while_it_waits(tmp_path, monkeypatch, which):
    packs = Packs(FileSystem(), tmp_path)
    place = packs.create_slot("a", MS, SLOT_SEGMENT).place
    file = packs.open_slot(place, "a", writable=True)
    held = _HeldSync()
    monkeypatch.setattr(os, "fdatasync", held)
    syncer = threading.Thread(target=packs.sync if which == "packs" else file.sync)
    syncer.start()
    try:
        assert held.entered.wait(10)
        other = packs.create_slot("b", MS, SLOT_SEGMENT).place  # neither the lock nor the GIL is held
        packs.open_slot(other, "b", writable=True).write(100, b"meanwhile")
        file.write(200, b"and here")
        assert packs.written
        assert not held.waited  # the sync still waits: nothing above waited for it
    finally:
        held.release.set()
        syncer.join(10)
    assert not syncer.is_alive()
    packs.close()


def test_inspect_lists_packs_and_checks_each_slots_segment(tmp_path, capsys):
    data = tmp_path / "data"
    (data / STREAMS_DIR).mkdir(parents=True)
    packs = Packs(FileSystem(), data)
    places = {
        name: packs.create_slot(name, MS, SLOT_SEGMENT).place
        for name in ("ok", "freed", "torn", "bad header")
    }
    for name in ("ok", "torn"):
        append(packs.open_slot(places[name], name, writable=True), [b"entry %d" % i for i in range(6)])
    packs.free_slot(places["freed"])
    packs.close()
    assert inspect_main(["verify", str(data)]) == 0
    assert inspect_main(["packs", str(data)]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == [
        "pack 00000  16777216 bytes  4095 slots: 3 used, 4092 free, 0 damaged"  # (after verify's "ok")
    ]
    with (data / "packs" / "00000.pack").open("r+b") as f:
        _, slot, _ = split_place(places["torn"])
        f.seek(slot * SLOT_BYTES + SLOT_HEADER_BYTES + 400)  # inside its node's blob (from 384)
        f.write(b"\xff\xff")
        f.seek(split_place(places["bad header"])[1] * SLOT_BYTES + 40)
        f.write(b"\xff")
    assert inspect_main(["packs", str(data)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "pack 00000  16777216 bytes  4095 slots: 2 used, 4092 free, 1 damaged"
    assert out[1:] == [
        "problem: stream 'torn' in slot 3 of pack 0: node at byte 192 (offset 0) failed its checks",
        "problem: slot 4 of pack 0: slot header CRC mismatch (the stream in it is unreadable)",
    ]
    assert inspect_main(["verify", str(data)]) == 1
    assert capsys.readouterr().out.splitlines() == out[1:]


def test_crashes_between_any_two_operations_keep_what_syncs_made_durable_slot_by_slot(monkeypatch):
    """A random run of creations, appends, frees and syncs over packs of 12 slots growing 4 at a
    time; after each operation, a kill -9, a power loss that loses everything pending and one that
    keeps, drops, garbles or tears each pending write must each find every stream as it should."""
    monkeypatch.setattr("storage.packs.GROWTH_BYTES", 4 * SLOT_BYTES)
    monkeypatch.setattr("storage.packs.SLOTS_PER_PACK", 12)
    monkeypatch.setattr("storage.packs.PACK_BYTES", 12 * SLOT_BYTES)
    rng = random.Random(7)
    fs, packs = fault_packs()
    live: dict[str, tuple[int, bytes]] = {}  # name -> (place, the segment's bytes)
    durable: dict[str, tuple[int, bytes]] = {}  # as of the last sync
    touched: set[str] = set()  # written or freed since the last sync
    created = 0
    for _ in range(150):
        op = rng.random()
        if op < 0.35 or not live:
            name, created = f"s{created}", created + 1
            segment = SLOT_SEGMENT + rng.randbytes(rng.randrange(200))
            live[name] = (
                packs.create_slot(name, MS, segment).place,
                segment.ljust(SLOT_SEGMENT_BYTES, b"\0"),
            )
            touched.add(name)
        elif op < 0.6:
            name = rng.choice(sorted(live))
            place, content = live[name]
            pos, data = rng.randrange(64, 3000), rng.randbytes(rng.randrange(1, 500))
            packs.open_slot(place, name, writable=True).write(pos, data)
            live[name] = place, content[:pos] + data + content[pos + len(data) :]
            touched.add(name)
        elif op < 0.75:
            name = rng.choice(sorted(live))
            packs.free_slot(live.pop(name)[0])
            touched.add(name)
        else:
            packs.sync()
            durable, touched = dict(live), set()
        _check_after_crashes(fs, live, durable, touched, rng)
    assert created > 40 and len(fs.listdir(ROOT / "packs")) >= 3


def _check_after_crashes(
    fs: FaultFS,
    live: dict[str, tuple[int, bytes]],
    durable: dict[str, tuple[int, bytes]],
    touched: set[str],
    rng: random.Random,
) -> None:
    def reads(packs: Packs, place: int, name: str) -> bytes | None:
        try:
            return packs.open_slot(place, name, writable=False).read(0, SLOT_SEGMENT_BYTES)
        except CorruptionError:
            return None

    killed = _restart(fs.crashed_copy(mode="process"), [place for place, _ in live.values()])
    for name, (place, content) in live.items():
        assert reads(killed, place, name) == content
    lost = _restart(fs.crashed_copy(mode="lost"), [place for place, _ in durable.values()])
    for name, (place, content) in durable.items():
        assert reads(lost, place, name) == content
    for name in live.keys() - durable.keys():
        assert reads(lost, live[name][0], name) is None  # a creation since the last sync: gone
    power = _restart(fs.crashed_copy(rng, "power"), [place for place, _ in durable.values()])
    for name, (place, content) in durable.items():
        if name not in touched:  # its neighbours' pending writes in the same pack never reach it
            assert reads(power, place, name) == content


def test_a_reused_slot_keeps_nothing_of_its_last_stream():
    _, packs = fault_packs()
    payloads = [b"p" * 50] * 16  # a full first node: the next one starts at offset 16
    old = packs.create_slot("old", MS, SLOT_SEGMENT).place
    segment = append(packs.open_slot(old, "old", writable=True), payloads)
    node = GrowingNode.start(segment, 16, 16)
    blob, positions = encode_batch(16, MS, AppendBatch([b"second node"]))
    assert node.make_room(1, len(blob))
    node.append(blob, positions, MS, MS, 0)
    packs.free_slot(old)
    packs.sync()
    new = packs.create_slot("new", MS, SLOT_SEGMENT).place
    assert split_place(new)[1] == split_place(old)[1]
    append(packs.open_slot(new, "new", writable=True), payloads)  # its first node as long as old's
    reopened, cut = Segment.over(packs.open_slot(new, "new", writable=False), verify=True)
    assert cut is None
    assert [ref.base_offset for ref in reopened.nodes] == [0]  # not old's node at offset 16


def test_a_real_pack_file_is_allocated_written_within_it_synced_and_reserved_again_if_sparse(tmp_path):
    fs = FileSystem()
    path = tmp_path / "00000.pack"
    pack = fs.create_pack(path, 4 * SLOT_BYTES, b"head")
    assert path.stat().st_size == 4 * SLOT_BYTES and path.stat().st_blocks * 512 >= 4 * SLOT_BYTES
    pack.write(SLOT_BYTES, b"slot one")
    with pytest.raises(DurabilityError, match="past the end"):
        pack.write(4 * SLOT_BYTES - 2, b"abc")
    syncs = fs.sync_times.count
    pack.sync()
    assert fs.sync_times.count == syncs + 1
    pack.grow(8 * SLOT_BYTES)
    assert (pack.size, path.stat().st_size) == (8 * SLOT_BYTES, 8 * SLOT_BYTES)
    pack.close()
    with pytest.raises(FileExistsError):
        fs.create_pack(path, SLOT_BYTES, b"again")
    sparse = tmp_path / "00001.pack"  # a copy whose unwritten tail became a hole (cp, a restore)
    with sparse.open("wb") as f:
        f.write(path.read_bytes()[: 2 * SLOT_BYTES])
        f.truncate(8 * SLOT_BYTES)
    if sparse.stat().st_blocks * 512 >= 8 * SLOT_BYTES:
        pytest.skip("this file system made no hole")
    copy = fs.open_pack(sparse)
    assert sparse.stat().st_blocks * 512 >= 8 * SLOT_BYTES  # every slot's block allocated again
    assert copy.read(SLOT_BYTES, 8) == b"slot one"
    copy.close()


def _tiny_packs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Packs of 3 slots (and the header's), grown whole."""
    monkeypatch.setattr("storage.packs.GROWTH_BYTES", 4 * SLOT_BYTES)
    monkeypatch.setattr("storage.packs.SLOTS_PER_PACK", 4)
    monkeypatch.setattr("storage.packs.PACK_BYTES", 4 * SLOT_BYTES)


def test_an_empty_pack_is_removed_after_the_sync_of_its_freeings_and_its_id_is_never_reused(monkeypatch):
    _tiny_packs(monkeypatch)
    fs, packs = fault_packs()
    places = [
        packs.create_slot(f"s{i}", MS, SLOT_SEGMENT).place for i in range(5)
    ]  # pack 0: s0-s2, pack 1: s3, s4
    packs.sync()
    for place in places[:3]:
        packs.free_slot(place)
    assert packs.remove_empty() == []  # the zeroings are not durable yet
    packs.sync()
    assert packs.remove_empty() == [0]
    assert fs.listdir(ROOT / "packs") == ["00001.pack"]
    assert not packs.written
    packs.free_slot(places[3])
    packs.free_slot(places[4])
    packs.sync()
    assert packs.remove_empty() == []  # the last pack stays: the next id is taken from it
    made = [split_place(packs.create_slot(f"n{i}", MS, SLOT_SEGMENT).place) for i in range(4)]
    assert [pack for pack, _, _ in made] == [1, 1, 1, 2]  # pack 1's freed slots, then pack 2, not 0
    with pytest.raises(ValueError, match="no slot of these packs"):
        packs.free_slot(places[0])
    with pytest.raises(CorruptionError, match="no pack file 00000"):
        packs.open_slot(places[0], "s0", writable=False)
    for pack, slot, generation in made:
        packs.free_slot(make_place(pack, slot, generation))
    packs.sync()
    assert packs.remove_empty() == [1]
    assert packs.remove_empty(last=True) == [2]  # unpack: no stream left in any slot
    assert fs.listdir(ROOT / "packs") == []


def test_a_slot_taken_from_an_emptied_pack_before_its_removal_keeps_it(monkeypatch):
    _tiny_packs(monkeypatch)
    fs, packs = fault_packs()
    places = [packs.create_slot(f"s{i}", MS, SLOT_SEGMENT).place for i in range(4)]
    for place in places[:3]:
        packs.free_slot(place)
    packs.sync()
    assert packs.written  # a pack to remove: the next sync's work
    again = packs.create_slot("again", MS, SLOT_SEGMENT).place
    assert split_place(again)[0] == 0
    assert packs.remove_empty() == []
    assert fs.exists(PACK)
    packs.open_slot(again, "again", writable=False)


def test_start_up_finds_an_empty_pack_for_the_next_sync_to_remove(monkeypatch):
    _tiny_packs(monkeypatch)
    fs, packs = fault_packs()
    places = [packs.create_slot(f"s{i}", MS, SLOT_SEGMENT).place for i in range(4)]
    packs.sync()
    packs.close()
    restarted = _restart(fs.crashed_copy(mode="process"), places[3:])  # s0-s2 deleted since the file
    assert restarted.written
    restarted.clear_unnamed()
    restarted.sync()
    assert restarted.remove_empty() == [0]
    assert restarted.open_slot(places[3], "s3", writable=False)
    assert split_place(restarted.create_slot("next", MS, SLOT_SEGMENT).place)[0] == 1


@pytest.mark.parametrize("mode", ["process", "power", "lost"])
def test_a_crash_at_every_step_of_a_packs_removal_keeps_every_stream_and_brings_no_deleted_one_back(
    monkeypatch, mode
):
    _tiny_packs(monkeypatch)
    fs = FaultFS()
    fs.prepare_dir(ROOT)
    config = EngineConfig(background=False, max_open_streams=1, small_streams="slots", fsync="always")
    engine = Engine(ROOT, config, fs=fs)  # type: ignore[arg-type]
    names = [f"s{i}" for i in range(5)]  # pack 0: s0-s2; pack 1: s3, s4
    for name in names:
        engine.append(name, AppendBatch([name.encode()] * 3))
    engine.delete_stream("s0")
    engine.delete_stream("s1")
    states: list[FaultFS] = []
    rng = random.Random(5)
    fs.on_sync = fs.on_write = lambda state: states.append(state.crashed_copy(rng, mode))
    engine.delete_stream("s2")  # pack 0 empty: removed once the freeing and its record are durable
    fs.on_sync = fs.on_write = None
    assert fs.listdir(ROOT / "packs") == ["00001.pack"]
    assert len(states) >= 4  # the zeroing, the pack's sync, the journal's, the unlink's directory sync
    packs_seen = set()
    for k, state in enumerate([*states, fs.crashed_copy(rng, mode)]):
        packs_seen.add(tuple(state.listdir(ROOT / "packs")))
        crashed = Engine(ROOT, config, fs=state)  # type: ignore[arg-type]
        for name in ("s3", "s4"):
            assert [e.payload for e in crashed.read(name, 0, 10).entries()] == [name.encode()] * 3, k
        assert not {"s0", "s1"} & set(crashed.list_streams()), k  # deleted durably before
        expected: dict[str, list[bytes]] = {name: [] for name in ("s2", "n0", "n1", "n2", "n3")}
        if crashed.exists("s2"):  # its deletion not done: whole
            expected["s2"] = [e.payload for e in crashed.read("s2", 0, 10).entries()]
            assert expected["s2"] == [b"s2"] * 3, k
        for name, entries in expected.items():  # appended to, or made in the slots freed or a new pack
            crashed.append(name, AppendBatch([b"new " + name.encode()]))
            entries.append(b"new " + name.encode())
        crashed.close()
        again = Engine(ROOT, config, fs=state)  # type: ignore[arg-type]
        for name, entries in expected.items():
            assert [e.payload for e in again.read(name, 0, 10).entries()] == entries, k
        again.close()
    # Crash points fell before the removal and after it.
    assert {("00000.pack", "00001.pack"), ("00001.pack",)} <= packs_seen


def test_inspect_checks_each_slot_the_catalog_places_a_stream_in(tmp_path, capsys):
    data = tmp_path / "data"
    config = EngineConfig(background=False, small_streams="slots", max_open_streams=1)
    engine = Engine(data, config)
    for name in ("a", "b", "c"):
        engine.append(name, AppendBatch([name.encode()] * 3))
    places = {name: split_place(engine._catalog.place(name)) for name in ("a", "b", "c")}
    # Open (a kill -9 now would leave this): the catalog file and its journal, replayed.
    assert inspect_main(["packs", str(data)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "pack 00000  16777216 bytes  4095 slots: 3 used, 4092 free, 0 damaged"
    ]
    engine.close()
    pack_file = data / "packs" / "00000.pack"
    with pack_file.open("r+b") as f:
        f.seek(places["a"][1] * SLOT_BYTES)  # a's slot now names another stream
        f.write(SlotHeader("other", 1, MS).encode())
        f.seek((places["c"][1] + 1) * SLOT_BYTES)  # a slot no catalog row names
        f.write(SlotHeader("lost record", 1, MS).encode() + SLOT_SEGMENT)
    mismatch = (
        "problem: stream 'a': slot 1 of pack 0 holds 'other' at generation 1, not 'a' at 1 "
        "(the catalog places it there: it is unreadable)"
    )
    assert inspect_main(["packs", str(data)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "pack 00000  16777216 bytes  4095 slots: 4 used, 4091 free, 0 damaged "
        "(1 in no catalog row: freed at the next start-up)",
        mismatch,
    ]
    size = places["b"][1] * SLOT_BYTES + 1000
    os.truncate(pack_file, size)  # b's slot and c's cut off
    problems = [
        mismatch,
        *(
            f"problem: stream {name!r}: slot {places[name][1]} of pack 0 is past the pack's end "
            f"({size} bytes) (the catalog places it there: it is unreadable)"
            for name in ("b", "c")
        ),
    ]
    assert inspect_main(["packs", str(data)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"pack 00000  {size} bytes  1 slots: 1 used, 0 free, 0 damaged",
        *problems,
    ]
    assert inspect_main(["verify", str(data)]) == 1
    assert capsys.readouterr().out.splitlines() == problems
