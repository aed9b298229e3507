"""Start-up of slot streams after a power loss or an OS crash (docs/design/small-streams.md §5):
the catalog journal's prefix up to its last `r` record places them without a read (it was
synced with the packs); a creation past it is checked against its slot (kept whole, or dropped
as never durable); the scan of every slot header is the fallback when no journal can be
trusted. And the `c` records a slot stream's close no longer writes (§7)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from storage import AppendBatch, Engine, EngineConfig, StreamConfig
from storage.catalogjournal import journal_name, replay, replay_vouched
from storage.fs import FileSystem
from storage.layout import PACKS_DIR
from storage.packs import Packs
from tests.storage.conftest import SMALL
from tests.storage.faultfs import FaultFS, PendingWrite

ROOT = Path("/faultfs/data")
ENTRY = b"e" * 100


def config(fsync: str = "everysec") -> EngineConfig:
    return EngineConfig(**SMALL, fsync=fsync, max_open_streams=1, small_streams="slots")


def new_engine(fsync: str = "everysec") -> tuple[FaultFS, Engine]:
    fs = FaultFS()
    fs.prepare_dir(ROOT)
    return fs, Engine(ROOT, config(fsync), fs=fs)


def contents(engine: Engine, name: str) -> list[bytes]:
    return [e.payload for e in engine.read(name, 0, 10_000).entries()]


class SlotReads:
    """Counts the slots a start-up reads (`Packs.open_slot`) and whether it scans the packs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opened: list[int] = []
        self.scans = 0
        open_slot, scan = Packs.open_slot, Packs.scan

        def counted_open(packs: Packs, place: int, name: str, writable: bool):  # type: ignore[no-untyped-def]
            self.opened.append(place)
            return open_slot(packs, place, name, writable)

        def counted_scan(packs: Packs, damaged=None):  # type: ignore[no-untyped-def]
            self.scans += 1
            return scan(packs, damaged)

        monkeypatch.setattr(Packs, "open_slot", counted_open)
        monkeypatch.setattr(Packs, "scan", counted_scan)


def vouch(engine: Engine) -> None:
    """A round (packs, journal, then `r`), and a sync after it that makes its `r` durable."""
    engine.maintain()
    engine._slots.sync.journaled()
    engine.maintain()


def is_pack(write: PendingWrite) -> bool:
    return f"/{PACKS_DIR}/" in write.path


def test_a_power_loss_start_up_places_the_vouched_streams_without_reading_a_slot(monkeypatch):
    fs, engine = new_engine()
    for i in range(20):
        engine.append(f"v{i}", AppendBatch([ENTRY] * 3))
    vouch(engine)
    reads = SlotReads(monkeypatch)
    crashed = Engine(ROOT, config(), fs=fs.crashed_copy(mode="lost"))  # another boot, nothing pending kept
    assert reads.scans == 0 and reads.opened == []
    assert crashed.stream_count() == 20 and not crashed.unreadable
    assert all(contents(crashed, f"v{i}") == [ENTRY] * 3 for i in range(20))


@pytest.mark.parametrize("slots", ["kept", "lost"])
def test_a_creation_past_the_last_r_is_checked_against_its_slot(monkeypatch, slots):
    """Its `p` record reached the disk; its slot's write did or did not: kept whole, or dropped
    (never durable), never unreadable. Only those creations' slots are read."""
    fs, engine = new_engine()
    for i in range(10):
        engine.append(f"v{i}", AppendBatch([ENTRY] * 3))
    vouch(engine)
    for i in range(4):
        engine.append(f"u{i}", AppendBatch([ENTRY] * 2))  # past the last r: not synced
    fate = (lambda w: "drop" if is_pack(w) else "keep") if slots == "lost" else (lambda w: "keep")
    reads = SlotReads(monkeypatch)
    crashed = Engine(ROOT, config(), fs=fs.crashed_copy(mode="power", fate=fate, dir_ops_kept=10**6))
    assert reads.scans == 0 and len(reads.opened) == 4  # the four creations, not the ten before
    assert not crashed.unreadable
    assert all(contents(crashed, f"v{i}") == [ENTRY] * 3 for i in range(10))
    for i in range(4):
        if slots == "kept":
            assert contents(crashed, f"u{i}") == [ENTRY] * 2
        else:
            assert not crashed.exists(f"u{i}")


def test_a_deletion_past_the_last_r_is_settled_by_its_slot(monkeypatch):
    """A deletion journals `-`, zeroes the slot, then syncs: a power loss before the `r` finds the
    slot zeroed (the stream gone) with no read of any other slot."""
    fs, engine = new_engine()
    for name in ("a", "b", "c"):
        engine.append(name, AppendBatch([ENTRY]))
    vouch(engine)
    engine.delete_stream("b")  # synced before it returns; its r comes with the next round
    reads = SlotReads(monkeypatch)
    crashed = Engine(ROOT, config(), fs=fs.crashed_copy(mode="lost"))
    assert reads.scans == 0 and len(reads.opened) == 1
    assert sorted(crashed.list_streams()) == ["a", "c"] and not crashed.unreadable


def test_a_damaged_journal_before_its_r_falls_back_to_the_scan(monkeypatch):
    fs, engine = new_engine()
    for i in range(5):
        engine.append(f"v{i}", AppendBatch([ENTRY]))
    vouch(engine)
    state = fs.crashed_copy(mode="lost")
    generation = engine._catalog.journal_generation()
    journal = ROOT / journal_name(generation)
    raw = bytearray(state.read_file(journal))
    raw[60] ^= 0xFF  # a record before the r's length
    state.write_file_atomic(journal, bytes(raw))
    assert replay_vouched(state, ROOT, generation, [generation]) is None
    reads = SlotReads(monkeypatch)
    crashed = Engine(ROOT, config(), fs=state)
    assert reads.scans == 1
    assert all(contents(crashed, f"v{i}") == [ENTRY] for i in range(5))


def test_the_vouched_prefix_survives_random_power_losses(monkeypatch):
    """Under everysec: every stream created before the round's r is served whole after any
    power loss, with no scan of the packs; those after it are whole or gone, never unreadable."""
    fs, engine = new_engine()
    for i in range(8):
        engine.append(f"v{i}", AppendBatch([ENTRY] * 4))
    vouch(engine)
    engine.delete_stream("v0")
    for i in range(6):
        engine.append(f"u{i}", AppendBatch([ENTRY] * 2))
    engine.append("v1", AppendBatch([b"late"]))  # reopened past the r: its figures unknown
    reads = SlotReads(monkeypatch)
    for seed in range(12):
        crashed = Engine(ROOT, config(), fs=fs.crashed_copy(random.Random(seed), "power"))
        assert not crashed.unreadable and reads.scans == 0, seed
        assert all(contents(crashed, f"v{i}") == [ENTRY] * 4 for i in range(2, 8)), seed
        assert contents(crashed, "v1") in ([ENTRY] * 4, [ENTRY] * 4 + [b"late"]), seed
        for i in range(6):
            if crashed.exists(f"u{i}"):
                assert contents(crashed, f"u{i}") in ([], [ENTRY] * 2), seed
        crashed.close()


def test_a_slot_stream_close_journals_no_figures(tmp_path):
    """Its `p` record only (design §7): a directory stream's close still journals `c`."""
    engine = Engine(tmp_path, EngineConfig(**SMALL, max_open_streams=1, small_streams="slots"))
    engine.create_stream("dir", StreamConfig(max_entries=100))  # a config of its own: a directory
    for i in range(10):
        engine.append(f"s{i}", AppendBatch([ENTRY]))  # each closes the one before
    generation = engine._catalog.journal_generation()
    found = replay(FileSystem(), tmp_path, generation, [generation])
    assert found is not None and found.closed.keys() == {"dir"}
    assert engine._catalog.entries("s0") == 1  # its figures kept in memory all the same
    engine.close()


def test_after_a_kill_the_slot_streams_figures_come_back_from_their_slots_in_one_round():
    """With no `c` records their figures are unknown after a crash: the next round reads them
    from the slots (RECOUNT_BATCH a round, no stream opened), not UPKEEP_BATCH visits a round."""
    fs, engine = new_engine()
    for i in range(40):
        engine.append(f"s{i}", AppendBatch([ENTRY] * 3))
    crashed = Engine(ROOT, config(), fs=fs.crashed_copy(mode="process"))
    crashed.maintain()
    assert crashed._catalog.totals()["entries"] == 120 and crashed.open_streams() == 0
    assert crashed._catalog.due(2**62, 100) == []  # nothing left to visit
