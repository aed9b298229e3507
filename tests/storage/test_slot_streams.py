"""Small streams in slots of pack files (storage/slothome.py, `small_streams = "slots"`): a new
stream costs no directory; its entries survive a close, a restart, a kill -9 and, as its
policy promises, a power loss; it moves to a directory of its own when it outgrows its slot or
needs one, whole at every crash point of the move; a replicated stream never gets a slot."""

from __future__ import annotations

import gc
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from storage import AppendBatch, Engine, EngineConfig, InvalidArgumentError, StreamConfig
from storage.durability import SyncGate
from storage.format import SLOT_SEGMENT_BYTES
from storage.layout import PACKS_DIR, stream_directory
from storage.packs import NO_PLACE
from storage.slothome import SlotSync
from tests.storage.conftest import SMALL
from tests.storage.faultfs import FaultFS, FaultPackFile

ROOT = Path("/faultfs/data")
REPO = Path(__file__).resolve().parents[2]
ENTRY = b"e" * 100


def config(fsync: str = "everysec", max_open_streams: int = 1, small_streams: str = "slots") -> EngineConfig:
    return EngineConfig(**SMALL, fsync=fsync, max_open_streams=max_open_streams, small_streams=small_streams)


def new_engine(fsync: str = "everysec", max_open_streams: int = 1) -> tuple[FaultFS, Engine]:
    fs = FaultFS()
    fs.prepare_dir(ROOT)
    return fs, Engine(ROOT, config(fsync, max_open_streams), fs=fs)


def restart(fs: FaultFS, fsync: str = "everysec") -> Engine:
    return Engine(ROOT, config(fsync), fs=fs)


def contents(engine: Engine, name: str) -> list[bytes]:
    return [e.payload for e in engine.read(name, 0, 10_000).entries()]


def in_slot(engine: Engine, name: str) -> bool:
    return engine._catalog.place(name) != NO_PLACE


def test_a_slot_stream_round_trips_without_a_directory():
    fs, engine = new_engine()
    for name in ("a", "b", "c"):  # each closes the one before (max_open_streams 1)
        engine.append(name, AppendBatch([ENTRY] * 10))
    assert contents(engine, "a") == [ENTRY] * 10  # reopened from its slot
    engine.append("a", AppendBatch([b"more"]))
    assert engine.read("a", 10, 1).entries()[0].offset == 10
    assert fs.listdir(ROOT / "streams") == []  # not one directory, not one segment file
    assert fs.listdir(ROOT / PACKS_DIR) == ["00000.pack"]
    assert all(in_slot(engine, name) for name in ("a", "b", "c"))
    engine.close()
    again = restart(fs)
    assert contents(again, "a") == [ENTRY] * 10 + [b"more"]
    assert contents(again, "b") == contents(again, "c") == [ENTRY] * 10
    assert again.list_streams() == ["a", "b", "c"]


def test_the_setting_off_makes_directories_and_a_bad_value_is_refused():
    fs = FaultFS()
    fs.prepare_dir(ROOT)
    engine = Engine(ROOT, config(small_streams="off"), fs=fs)
    engine.append("a", AppendBatch([ENTRY]))
    assert fs.exists(stream_directory(ROOT, "a")) and not in_slot(engine, "a")
    with pytest.raises(InvalidArgumentError, match="small_streams"):
        EngineConfig(small_streams="packs")


def test_a_kill_9_after_acknowledged_appends_keeps_every_one():
    fs, engine = new_engine()
    engine.append("synced", AppendBatch([ENTRY] * 3))
    engine.maintain()
    for i in range(6):  # none synced: in the page cache only, some closed by the cache
        engine.append(f"s{i}", AppendBatch([ENTRY] * (i + 1)))
    engine.append("synced", AppendBatch([b"late"]))
    crashed = restart(fs.crashed_copy(mode="process"))
    assert contents(crashed, "synced") == [ENTRY] * 3 + [b"late"]
    assert all(contents(crashed, f"s{i}") == [ENTRY] * (i + 1) for i in range(6))


def test_a_power_loss_under_everysec_keeps_what_the_round_vouched():
    fs, engine = new_engine()
    for i in range(5):
        engine.append(f"v{i}", AppendBatch([ENTRY] * 4))
    engine.maintain()  # the round: packs, journal, r
    for i in range(5):
        engine.append(f"u{i}", AppendBatch([ENTRY] * 2))  # after it: a power loss may take them
    for seed in range(8):
        crashed = restart(fs.crashed_copy(random.Random(seed), "power"))
        for i in range(5):
            assert contents(crashed, f"v{i}") == [ENTRY] * 4, seed
        for name in (f"u{i}" for i in range(5)):
            if crashed.exists(name):  # never damaged or garbled: whole, or gone as never durable
                try:
                    assert contents(crashed, name) in ([], [ENTRY], [ENTRY] * 2), seed
                except Exception as exc:  # its slot's write lost: unreadable, never served wrong
                    assert "damaged" in str(exc), seed


def test_under_always_every_acknowledged_append_survives_a_power_loss():
    fs, engine = new_engine("always")
    acknowledged = {}
    for i in range(6):
        name = f"s{i}"
        engine.append(name, AppendBatch([ENTRY] * 3))
        engine.append(name, AppendBatch([b"x"]))
        acknowledged[name] = [ENTRY] * 3 + [b"x"]
    engine.create_stream("empty")  # exists, durably, when the call returns
    lost = restart(fs.crashed_copy(mode="lost"), "always")
    for name, entries in acknowledged.items():
        assert contents(lost, name) == entries
    assert lost.exists("empty") and contents(lost, "empty") == []


class _BlockingPacks:
    """Packs whose sync waits for `release` (the first caller's sync is in flight meanwhile)."""

    def __init__(self) -> None:
        self.written = True
        self.syncs = 0
        self.syncs_begun = 0
        self.entered = threading.Event()
        self.release = threading.Event()

    def begin_sync(self) -> int:
        self.syncs_begun += 1
        return self.syncs_begun

    def sync(self) -> None:
        self.syncs += 1
        self.written = False
        self.entered.set()
        self.release.wait(10)

    def remove_empty(self) -> list[int]:
        return []


class _NoJournal:
    def journal_mark(self) -> None:
        return None


def test_callers_waiting_together_share_one_sync_begun_after_their_writes():
    packs = _BlockingPacks()
    sync = SlotSync(packs, _NoJournal())  # type: ignore[arg-type]
    first = threading.Thread(target=sync.wait)
    first.start()
    assert packs.entered.wait(10)  # its sync is in flight: those who come now need the next one
    packs.written = True  # (their writes)
    waiters = [threading.Thread(target=sync.wait) for _ in range(7)]
    for waiter in waiters:
        waiter.start()
    while sum(w.is_alive() for w in waiters) < 7:
        pass
    threading.Event().wait(0.05)  # all seven queued behind the sync in flight
    packs.release.set()
    for thread in (first, *waiters):
        thread.join(10)
    assert packs.syncs == 2  # the first's, then one for the seven together
    sync.wait()  # nothing written since, no sync running: returns without one
    assert packs.syncs == 2


def test_a_stream_written_before_a_sync_began_is_not_synced_again_for_writes_that_came_after():
    """The round syncs the slots, then each open stream written since its last upkeep: those
    written before its sync began need no other, whatever other streams wrote meanwhile (calls
    landing during the round: each stream's sync was a sync of the packs and the journal)."""
    fs, engine = new_engine(max_open_streams=8)
    engine.append("before", AppendBatch([ENTRY]))
    packs = engine._slots.packs
    sync, syncs = packs.sync, []

    def sync_with_a_call_landing() -> None:
        syncs.append(1)
        if len(syncs) == 1:
            engine.append("during", AppendBatch([ENTRY]))  # a call while the round's sync runs
        sync()

    packs.sync = sync_with_a_call_landing
    engine._slots.sync.wait()  # the round's sync of the slots
    assert len(syncs) == 1
    for name, more in (("before", 0), ("during", 1)):  # the round's syncs of the streams written
        stream = engine._open.pin(name)
        try:
            stream.sync()
        finally:
            engine._open.unpin(stream)
        assert len(syncs) == 1 + more, name  # "during" came after the sync began: it needs one
    lost = restart(fs.crashed_copy(mode="lost"))  # what the syncs made durable, nothing else
    assert contents(lost, "before") == [ENTRY] and contents(lost, "during") == [ENTRY]
    lost.close()


def fill_until_promoted(engine: Engine, name: str) -> list[bytes]:
    written = [b"0000" + ENTRY]
    engine.append(name, AppendBatch(written[:]))
    while in_slot(engine, name):
        entry = b"%04d" % len(written) + ENTRY
        engine.append(name, AppendBatch([entry]))
        written.append(entry)
    return written


def test_a_stream_that_outgrows_its_slot_moves_to_a_directory_with_every_entry():
    fs, engine = new_engine()
    written = fill_until_promoted(engine, "big")
    assert len(written) > 20  # ~3.5 KiB of 104-byte entries first went to the slot
    assert fs.exists(stream_directory(ROOT, "big") / "00000000000000000000.seg")
    for _ in range(200):  # on past the slot's size, in the directory
        engine.append("big", AppendBatch([ENTRY]))
    assert contents(engine, "big") == written + [ENTRY] * 200
    engine.append("other", AppendBatch([ENTRY]))  # closes "big"
    assert contents(engine, "big") == written + [ENTRY] * 200
    engine.close()
    assert contents(restart(fs), "big") == written + [ENTRY] * 200


@pytest.mark.parametrize("mode", ["process", "power"])
def test_a_crash_at_every_step_of_a_promotion_keeps_the_stream_whole(mode: str):
    fs, engine = new_engine("always")
    written = [b"%04d" % i + ENTRY for i in range(15)]
    for entry in written:  # each acknowledged, durably (always)
        engine.append("p", AppendBatch([entry]))
    assert in_slot(engine, "p")
    states: list[FaultFS] = []
    rng = random.Random(7)

    def snapshot(state: FaultFS) -> None:
        states.append(state.crashed_copy(rng, mode))

    fs.on_sync = fs.on_write = snapshot
    engine.append("p", AppendBatch([b"x" * 2000]))  # does not fit: promoted first
    fs.on_sync = fs.on_write = None
    assert not in_slot(engine, "p")
    assert len(states) >= 6  # M, the directory, the segment, its syncs, m and the journal's sync
    for k, state in enumerate(states):
        crashed = restart(state, "always")
        got = contents(crashed, "p")
        assert got in (written, [*written, b"x" * 2000]), k
        crashed.append("p", AppendBatch([b"after"]))
        crashed.append("p", AppendBatch([b"y" * 3000]))  # a promotion again, if the crash undid it
        assert contents(crashed, "p") == [*got, b"after", b"y" * 3000], k
        assert not in_slot(crashed, "p")


def test_a_config_a_group_or_a_trim_moves_the_stream_to_a_directory_first():
    fs, engine = new_engine(max_open_streams=8)
    for name in ("configured", "grouped", "trimmed"):
        engine.append(name, AppendBatch([ENTRY] * 5))
    engine.set_stream_config("configured", StreamConfig(max_entries=100))
    engine.create_group("grouped", "g")
    engine.trim("trimmed", 2)
    for name in ("configured", "grouped", "trimmed"):
        assert not in_slot(engine, name)
        assert fs.exists(stream_directory(ROOT, name))
    assert engine.stream_config("configured") == StreamConfig(max_entries=100)
    assert engine.read("trimmed", 0, 100).entries()[0].offset == 2
    assert engine.read_group("grouped", "g", _options()).entries
    engine.close()
    again = restart(fs)
    assert contents(again, "configured") == contents(again, "grouped") == [ENTRY] * 5
    assert contents(again, "trimmed") == [ENTRY] * 3


def _options():
    from storage.grouptypes import GroupReadOptions

    return GroupReadOptions(consumer="c", count=10)


def test_a_deleted_slot_stream_frees_its_slot_and_its_name_can_be_made_again():
    fs, engine = new_engine()
    engine.append("a", AppendBatch([ENTRY] * 3))
    engine.delete_stream("a")
    assert not engine.exists("a")
    engine.maintain()  # the freeing synced: the slot may be taken again
    engine.append("a", AppendBatch([b"new"]))
    assert contents(engine, "a") == [b"new"]
    engine.close()
    assert contents(restart(fs), "a") == [b"new"]


def test_a_replicated_stream_never_gets_a_slot():
    fs, engine = new_engine()
    engine.create_stream("replicated", incarnation=3)
    engine.append("replicated", AppendBatch([ENTRY]))
    assert not in_slot(engine, "replicated")
    assert fs.exists(stream_directory(ROOT, "replicated"))
    engine.append("plain", AppendBatch([ENTRY]))
    assert in_slot(engine, "plain")


def test_a_first_batch_too_big_for_a_slot_starts_in_a_directory():
    fs, engine = new_engine(max_open_streams=4)
    engine.append("big", AppendBatch([ENTRY] * 40))  # ~4.9 KiB
    engine.append("tagged", AppendBatch([ENTRY], tags=["t"]))
    assert not in_slot(engine, "big") and not in_slot(engine, "tagged")
    assert fs.exists(stream_directory(ROOT, "big") / "00000000000000000000.seg")  # never a promotion
    assert contents(engine, "big") == [ENTRY] * 40


def test_a_stream_promoted_after_the_catalog_file_survives_a_power_loss():
    fs, engine = new_engine("always")
    engine.append("p", AppendBatch([ENTRY]))
    engine.close()  # the catalog file names "p" in its slot
    engine = restart(fs, "always")
    engine.append("p", AppendBatch([b"y" * 3500]))  # promoted: its slot freed, durably
    assert not in_slot(engine, "p")
    lost = restart(fs.crashed_copy(mode="lost"), "always")  # no journal to trust: a listing and a scan
    assert contents(lost, "p") == [ENTRY, b"y" * 3500]
    assert not in_slot(lost, "p")


def test_a_pack_whose_creation_a_crash_cut_short_is_removed_at_start_up():
    fs, engine = new_engine()
    engine.append("a", AppendBatch([ENTRY]))
    engine.close()
    # A second pack whose header never reached the disk: no slot of it is any stream's.
    fs.write_file(ROOT / PACKS_DIR / "00001.pack", bytes(4096 * 4))
    again = restart(fs.crashed_copy(mode="process"))
    assert fs.exists(ROOT / PACKS_DIR / "00001.pack")
    assert not again._fs.exists(ROOT / PACKS_DIR / "00001.pack")
    assert contents(again, "a") == [ENTRY]
    again.append("b", AppendBatch([ENTRY]))  # a slot of pack 0 again, or a new pack 1
    assert contents(again, "b") == [ENTRY]


def test_after_a_power_loss_a_slot_whose_segment_never_reached_the_disk_is_no_stream():
    fs, engine = new_engine()
    engine.append("whole", AppendBatch([ENTRY]))
    engine.append("torn", AppendBatch([ENTRY]))
    engine.maintain()
    place = engine._catalog.place("torn")
    pack, slot = place >> 48, (place >> 24) & 0xFFFFFF
    # As a power loss may leave a creation's one write: the slot header's sector, not the segment's.
    fs.poke(ROOT / PACKS_DIR / f"{pack:05d}.pack", slot * 4096 + 512, bytes(512))
    lost = restart(fs.crashed_copy(mode="lost"))  # no journal to trust: the scan
    assert lost.list_streams() == ["whole"] and lost.unreadable == []
    assert contents(lost, "whole") == [ENTRY]


def test_a_stream_reopened_before_the_round_keeps_the_header_its_last_sync_made_durable():
    fs, engine = new_engine()
    engine.append("a", AppendBatch([b"synced"]))
    engine.maintain()  # the node's header durable
    engine.append("a", AppendBatch([b"unsynced"]))  # the same node: its other header slot
    engine.append("b", AppendBatch([ENTRY]))  # closes "a", nothing synced
    engine.append("a", AppendBatch([b"after"]))  # reopened: must not write over the durable header
    state = fs.crashed_copy(random.Random(1), "power", fate=lambda write: "garble")
    assert contents(restart(state), "a")[:1] == [b"synced"]


def test_a_creation_reads_nothing_back_from_the_pack_it_wrote(monkeypatch):
    fs, engine = new_engine(max_open_streams=8)
    engine.append("first", AppendBatch([ENTRY]))  # the pack made and opened
    reads: list[int] = []
    read = FaultPackFile.read
    monkeypatch.setattr(FaultPackFile, "read", lambda self, pos, n: reads.append(pos) or read(self, pos, n))
    for name in ("a", "b", "c"):
        engine.append(name, AppendBatch([ENTRY] * 10))
    assert reads == []  # (a read back cost a pread of 4 KiB per creation)
    with engine._use("c") as stream:  # the copy reads come from is the slot's bytes on disk
        file = stream.segments[0].file
        assert file.read(0, SLOT_SEGMENT_BYTES) == read(file._pack, file._start, SLOT_SEGMENT_BYTES)
    engine.close()
    assert contents(restart(fs), "c") == [ENTRY] * 10


def test_a_new_slot_stream_makes_no_directory_path_or_sync_gate_and_closes_its_file_in_place(monkeypatch):
    fs, engine = new_engine(max_open_streams=1)
    handed: list[object] = []
    engine._closer.close = handed.append  # the closer's thread is for files with a mapping or descriptor
    named: list[str] = []
    monkeypatch.setattr("storage.engine.dirname_for", lambda name: named.append(name) or name)
    engine.append("a", AppendBatch([ENTRY] * 10))
    assert named == []  # no directory's name worked out either (none is unreadable)
    with engine._use("a") as stream:
        file = stream.segments[0].file
        # None is made until used: a promotion or an open joins the path, a sync makes the others.
        assert "directory" not in stream.home.__dict__ and not stream.made("sync_ended")
        assert not any(isinstance(part, SyncGate) for part in vars(stream).values())
    engine.append("b", AppendBatch([ENTRY]))  # closes "a"
    assert handed == [] and file.closed
    assert contents(engine, "a") == [ENTRY] * 10  # reopened: its directory known, and none made
    assert not fs.exists(stream_directory(ROOT, "a"))


def has_instance_dict(obj: object) -> bool:
    """Whether CPython built `obj` a dict of its fields (instead of keeping them inline)."""
    return any(isinstance(part, dict) and "name" in part for part in gc.get_referents(obj))


def test_a_new_slot_stream_keeps_its_fields_inline_through_its_eviction():
    """A stream's fields stay in the object, with no dict of their own (one object fewer for the
    collector to walk per open stream, issue 17): 30 fields in __init__ built one for every
    stream, and so did the sync gate's lookup in `__dict__` at every append and close. Checked
    in a process of its own: CPython keeps a class's fields inline only while its instances so
    far were given them alike, so a test before this one in the same process (the crash sweep's)
    could change the answer."""
    check = "from tests.storage.test_slot_streams import fields_inline_through_eviction as f; f()"
    done = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def fields_inline_through_eviction() -> None:
    _fs, engine = new_engine(max_open_streams=1)
    engine.append_many("a", [(AppendBatch([ENTRY] * 10), None)])
    stream = engine._open.glance("a")
    assert stream is not None and not has_instance_dict(stream)
    engine.append("b", AppendBatch([ENTRY]))  # closes "a": its summary, flags and close are set
    assert stream.closed and stream.closed_summary is not None
    assert not has_instance_dict(stream)
    stream.sync_ended  # noqa: B018 (a part made on first use: the dict is built for it then)
    assert has_instance_dict(stream)
    assert contents(engine, "a") == [ENTRY] * 10
    engine.close()
