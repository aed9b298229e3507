"""The catalog's journal (storage/catalogjournal.py): a start-up after a process crash lists no
directory, yet knows every stream created, deleted or opened since the catalog file; after a
reboot (a power loss) or with a damaged journal it lists the streams directory as before. And
the catalog's lock is not held while a file of many streams is built."""

from __future__ import annotations

import heapq
import threading
from pathlib import Path

import pytest
from crc32c import crc32c

import storage.catalog as catalog_module
import storage.maintenance as maintenance_module
from storage import AppendBatch, Engine, EngineConfig, StreamNotFoundError
from storage.catalog import NO_PLACE, Catalog, StreamSummary
from storage.catalogjournal import Journal, journal_generations, journal_name, replay
from storage.fs import FileSystem
from storage.layout import META_FILE, stream_directory
from tests.storage.conftest import SMALL
from tests.storage.faultfs import FaultFS
from tests.storage.test_catalog import CountingFS, contents, fill

ROOT = Path("/faultfs/data")
CONFIG = EngineConfig(**SMALL, max_open_streams=4)
# Streams in directories of their own (not the default slots): for the tests that damage a meta file.
DIRECTORIES = EngineConfig(**SMALL, max_open_streams=4, small_streams="off")


def killed_after_changes(data: Path, clock, fs, config: EngineConfig = CONFIG) -> dict[str, list[bytes]]:
    """A clean shutdown, then streams created, deleted, appended to and read, and a kill -9 (the
    engine dropped unclosed: with its own fs it holds no lock)."""
    with Engine(data, config, clock=clock, fs=fs) as engine:
        written = fill(engine, 10)
    engine = Engine(data, config, clock=clock, fs=fs)
    for name in ["new-1", "new-2", "room-003"]:
        items = [name.encode()] * 2
        engine.append(name, AppendBatch(items))
        written[name] = written.get(name, []) + items
    engine.delete_stream("room-000")
    del written["room-000"]
    engine.delete_stream("new-2")  # created and deleted since the file
    del written["new-2"]
    assert contents(engine, "room-005") == written["room-005"]  # opened, unchanged
    return written


def test_a_start_up_after_kill_9_lists_no_directory_and_knows_every_stream(tmp_path, clock):
    data = tmp_path / "data"
    written = killed_after_changes(data, clock, CountingFS())
    fs = CountingFS()
    engine = Engine(data, CONFIG, clock=clock, fs=fs)
    assert fs.stream_listings == 0
    assert engine.list_streams() == sorted(written)
    assert not any(p.name.startswith(("room-000", "new-2")) for p in (data / "streams").iterdir())
    for _ in range(3):  # the streams opened since the file are visited for their figures
        engine.maintain()
    assert engine.stats()["entries"] == sum(len(items) for items in written.values())
    assert all(contents(engine, name) == items for name, items in written.items())
    engine.close()
    assert len(journal_generations(p.name for p in data.iterdir())) == 1  # the one the file names


@pytest.mark.parametrize("mode", ["process", "power"])
def test_only_a_process_crash_trusts_the_journal(mode):
    fs = FaultFS()
    fs.prepare_dir(ROOT)
    with Engine(ROOT, CONFIG, fs=fs) as engine:
        engine.append("a", AppendBatch([b"1"]))
    engine = Engine(ROOT, CONFIG, fs=fs)
    engine.append("b", AppendBatch([b"2"]))
    engine.sync()  # durable, so that a power loss keeps it too
    state = fs.crashed_copy(mode=mode)
    listings = []
    listdir = state.listdir

    def counting(path: Path) -> list[str]:
        listings.append(path.name)
        return listdir(path)

    state.listdir = counting  # type: ignore[method-assign]
    again = Engine(ROOT, CONFIG, fs=state)
    assert again.list_streams() == ["a", "b"]
    assert listings.count("streams") == (0 if mode == "process" else 1)  # a reboot: listed
    again.close()


@pytest.mark.parametrize("damage", ["damaged record", "missing generation", "relist"])
def test_a_journal_that_cannot_be_trusted_makes_start_up_list(tmp_path, clock, damage):
    data = tmp_path / "data"
    config = DIRECTORIES if damage == "relist" else CONFIG  # relist damages a meta file
    written = killed_after_changes(data, clock, CountingFS(), config)
    generations = journal_generations(p.name for p in data.iterdir())
    last = data / journal_name(generations[-1])
    if damage == "damaged record":  # whole, but failing its CRC
        raw = bytearray(last.read_bytes())
        raw[-3] ^= 0x10
        last.write_bytes(bytes(raw))
    elif damage == "missing generation":
        (data / journal_name(generations[0])).unlink()
    else:  # a stream found unreadable asks for a listing, which finds it unreadable again
        engine = Engine(data, config, clock=clock, fs=CountingFS())
        # A meta file that fails its checks (a segment cut below its header would be taken for a
        # creation a crash cut short, and dropped: docs/FORMAT.md, "Recovery rules").
        (stream_directory(data, "room-004") / META_FILE).write_bytes(b"damaged")
        with pytest.raises(StreamNotFoundError, match="damaged"):
            engine.read("room-004", 0, 10)
        assert "room-004" not in engine.list_streams()
        del written["room-004"]
    fs = CountingFS()
    engine = Engine(data, config, clock=clock, fs=fs)
    assert fs.stream_listings == 1
    assert engine.list_streams() == sorted(written)
    if damage == "relist":
        assert engine.unreadable == [stream_directory(data, "room-004").name]
    engine.close()


def test_a_catalog_of_many_streams_is_built_outside_its_lock(monkeypatch):
    catalog = Catalog()
    for i in range(1000):
        catalog.add_closed(f"s{i:04d}", StreamSummary(1, 10, 1, 1))
    catalog.remove("s0001")
    free: list[bool] = []
    merge = heapq.merge

    def watched(*args, **kwargs):
        took = catalog.lock.acquire(blocking=False)
        free.append(took)
        if took:
            catalog.lock.release()
        return merge(*args, **kwargs)

    monkeypatch.setattr(catalog_module.heapq, "merge", watched)
    raw = catalog.encode(set(), {})
    assert free == [True]  # the names were merged with the lock free: creations went on meanwhile
    assert catalog_module.decode_catalog(raw).names == [f"s{i:04d}" for i in range(1000) if i != 1]


def test_a_full_journal_makes_the_file_due_at_once(tmp_path, clock, monkeypatch):
    """Streams opened and closed at large change no stream's presence, yet fill the journal (two
    records each): the round that finds it full rewrites the file, not the minute after the last
    rewrite (at 10,000 records a second that let a replay grow to 1.2M records, design §7)."""
    monkeypatch.setattr(catalog_module, "JOURNAL_RECORDS_MAX", 3)

    def generations() -> list[int]:
        return journal_generations(p.name for p in data.iterdir())

    data = tmp_path / "data"
    with Engine(data, CONFIG, clock=clock) as engine:
        fill(engine, 5)
    with Engine(data, CONFIG, clock=clock) as engine:
        first = generations()
        for name in ["room-000", "room-001"]:
            engine.read(name, 0, 1)
        engine.maintain()
        assert generations() == first  # reads change nothing the file holds
        engine.read("room-002", 0, 1)  # the third stream opened in this generation
        engine.maintain()
        assert generations() == [first[-1] + 1]


def test_many_streams_created_make_the_file_due_before_its_minute(tmp_path, clock, monkeypatch):
    """A start-up after a kill -9 checks the directory of each stream created since the file: a
    load's creations must not wait the minute between saves to be taken into a new one."""
    monkeypatch.setattr(maintenance_module, "CATALOG_SAVE_CHANGES", 3)

    def generations() -> list[int]:
        return journal_generations(p.name for p in data.iterdir())

    data = tmp_path / "data"
    with Engine(data, CONFIG, clock=clock) as engine:
        first = generations()
        fill(engine, 2)
        engine.maintain()
        assert generations() == first  # two creations, within the minute: not due yet
        fill(engine, 3)  # the third creation
        engine.maintain()
        assert generations() == [first[-1] + 1]


def test_a_stream_created_since_the_file_and_found_unreadable_is_reported_by_every_start_up(tmp_path, clock):
    data = tmp_path / "data"
    killed_after_changes(data, clock, CountingFS(), DIRECTORIES)
    (stream_directory(data, "new-1") / META_FILE).write_bytes(b"damaged")  # the journal names it
    for listings in (0, 1):  # found by the journal's check, then by the listing it asked for
        fs = CountingFS()
        engine = Engine(data, DIRECTORIES, clock=clock, fs=fs)  # dropped unclosed: a kill -9 each time
        assert fs.stream_listings == listings and engine.unreadable == ["new-1"]
        assert "new-1" not in engine.list_streams()


def test_deletions_on_two_threads_set_the_catalog_file_aside_once(tmp_path, clock):
    """A cluster node drops copies on several threads: the second deletion must not try to
    move the file the first is moving (FileNotFoundError left its copy half deleted). Directory
    streams: a slot stream's deletion sets no file aside (it syncs its record instead)."""
    engine = Engine(tmp_path / "data", DIRECTORIES, clock=clock)
    for name in ("a", "b"):
        engine.append(name, AppendBatch([name.encode()]))
    real_rename = engine._fs.rename
    second: list[threading.Thread] = []
    failures: list[BaseException] = []

    def delete_b() -> None:
        try:
            engine.delete_stream("b")
        except BaseException as exc:  # reported below, not lost in the thread
            failures.append(exc)

    def rename(src: Path, dst: Path) -> None:
        if src.name == "catalog" and not second:  # the first deletion, as it sets the file aside
            second.append(threading.Thread(target=delete_b))
            second[0].start()
            second[0].join(0.5)  # the second deletion runs as far as it can meanwhile
        real_rename(src, dst)

    engine._fs.rename = rename  # type: ignore[method-assign]
    engine.delete_stream("a")
    second[0].join(10)
    assert not second[0].is_alive() and failures == []
    assert engine.list_streams() == []
    assert (tmp_path / "data" / "catalog.set-aside").exists()
    engine.close()


def test_after_kill_9_the_totals_hold_the_figures_streams_closed_with_and_open_ones_once_recovered(
    tmp_path, clock
):
    """Streams created since the catalog file, closed by the cache: their CLOSED records give
    their figures to a start-up after a kill -9; the streams open at the crash (one of them
    reopened and appended to since it closed: its CLOSED record is stale) count once recovered.
    Directory streams: a slot stream's close journals no CLOSED record (test_slot_recovery.py)."""
    data = tmp_path / "data"
    # No catalog file yet: every stream is in the journal. Its own fs: it takes no lock (a kill -9 frees it).
    engine = Engine(data, DIRECTORIES, clock=clock, fs=CountingFS())
    counts = {f"room-{i:03d}": i + 1 for i in range(12)}
    for name, count in counts.items():
        engine.append(name, AppendBatch([name.encode()] * count))
    engine.append("room-000", AppendBatch([b"more"] * 5))  # reopened: room-008 closes
    counts["room-000"] += 5
    open_at_crash = {"room-000", "room-009", "room-010", "room-011"}  # the cache's 4 (max_open_streams)
    assert engine.stats()["entries"] == sum(counts.values())
    engine = Engine(data, DIRECTORIES, clock=clock, fs=CountingFS())  # the first dropped unclosed: a kill -9
    closed = sum(n for name, n in counts.items() if name not in open_at_crash)
    assert engine.stats()["entries"] == closed
    assert contents(engine, "room-000") == [b"room-000"] + [b"more"] * 5  # recovered: counted
    assert engine.stats()["entries"] == closed + counts["room-000"]
    engine.maintain()  # visits the other streams of unknown figures
    assert engine.stats()["entries"] == sum(counts.values())
    engine.close()  # then a clean restart: the file's figures
    with Engine(data, DIRECTORIES, clock=clock, fs=CountingFS()) as engine:
        assert engine.stats()["entries"] == sum(counts.values())


P1, P2, P3, P4 = (1 << 48 | slot << 24 | 1 for slot in range(1, 5))  # pack 1, slots 1 to 4


def journaled(data: Path, generation: int = 1) -> Journal:
    data.mkdir(parents=True, exist_ok=True)
    return Journal(FileSystem(), data, generation)


def test_each_record_of_version_3_is_replayed(tmp_path):
    data = tmp_path / "data"
    journal = journaled(data)
    journal.placed("slot", P1)  # created in a slot
    journal.placed("promoting", P2)
    journal.promoting("promoting", P2)  # begun, not done: the crash came before its end
    journal.placed("promoted", P3)
    journal.promoting("promoted", P3)
    journal.promoted("promoted")  # in its directory now
    journal.placed("gone", P4)
    journal.deleted("gone")
    journal.created("dir")
    journal.placed("closed", P4)
    journal.closed("closed", StreamSummary(2, 4096, 1, 1))
    journal.promoted("old")  # a stream the file names, promoted since
    mark = journal.length()
    journal.vouch(mark)
    journal.close()
    found = replay(FileSystem(), data, 1, [1])
    assert found is not None
    assert found.last == {
        "slot": True,
        "promoting": True,
        "promoted": True,
        "gone": False,
        "dir": True,
        "closed": True,
    }
    assert found.places == {"slot": P1, "promoting": P2, "promoted": NO_PLACE, "closed": P4, "old": NO_PLACE}
    assert found.promoting == {"promoting": P2}
    assert found.closed == {"closed": StreamSummary(2, 4096, 1, 1)}
    r_bytes = 1 + 2 + 8 + 4  # kind, name length (0), L, CRC
    assert found.vouched == {1: mark} and mark == (data / journal_name(1)).stat().st_size - r_bytes


def test_the_last_vouched_length_of_each_generation_is_replayed_and_a_false_one_distrusted(tmp_path):
    data = tmp_path / "data"
    first = journaled(data, 1)
    first.placed("a", P1)
    first.vouch(first.length())
    first.placed("b", P2)
    second_mark = first.length()
    first.vouch(second_mark)  # the last one counts
    first.close()
    second = journaled(data, 2)
    second.placed("c", P3)
    second.close()
    found = replay(FileSystem(), data, 1, [1, 2])
    assert (
        found is not None
        and found.vouched == {1: second_mark}
        and found.places == {"a": P1, "b": P2, "c": P3}
    )
    third = journaled(data, 3)
    third.vouch(third.length() + 1)  # names bytes after its own
    third.close()
    assert replay(FileSystem(), data, 1, [1, 2, 3]) is None


def test_the_catalog_vouches_in_the_journal_it_marked_only(tmp_path):
    data = tmp_path / "data"
    catalog = Catalog()
    catalog.start_journal(journaled(data, 1))
    catalog.add("a", P1)
    mark = catalog.journal_mark()
    assert mark is not None
    journal, length = mark
    journal.sync()
    catalog.vouch(journal, length)
    catalog.encode(set(), {}, journaled(data, 2))  # a new generation meanwhile: the file holds "a"
    catalog.vouch(journal, length)  # dropped: not the journal of now
    catalog.close_journal()
    found = replay(FileSystem(), data, 1, [1, 2])
    assert found is not None and found.vouched == {1: length} and found.places == {"a": P1}


def test_a_synced_journal_survives_a_power_loss_up_to_its_sync():
    fs = FaultFS()
    fs.prepare_dir(ROOT)
    journal = Journal(fs, ROOT, 1)
    journal.placed("a", P1)
    journal.sync()
    synced = fs.read_file(ROOT / journal_name(1))
    journal.placed("b", P2)
    lost = fs.crashed_copy(mode="lost")  # nothing unsynced survives
    assert lost.read_file(ROOT / journal_name(1)) == synced


@pytest.mark.parametrize("cut", [1, 2, 3, 9, 14])
def test_a_torn_last_record_is_left_out(tmp_path, cut):
    """A kill -9 during a record's write keeps a prefix of it: what it announced never happened."""
    data = tmp_path / "data"
    journal = journaled(data, 1)
    journal.placed("a", P1)
    journal.close()
    journal = journaled(data, 2)
    journal.placed("b", P2)
    whole = journal.length()
    journal.placed("torn", P3)  # 1 + 2 + 4 + 8 + 4 bytes
    journal.close()
    path = data / journal_name(2)
    path.write_bytes(path.read_bytes()[: whole + cut])
    found = replay(FileSystem(), data, 1, [1, 2])
    assert found is not None and found.places == {"a": P1, "b": P2} and "torn" not in found.last
    # Whole but for its CRC: damage, not a write cut short.
    raw = bytearray(path.read_bytes()[:whole])
    raw[-1] ^= 0x01
    path.write_bytes(bytes(raw))
    assert replay(FileSystem(), data, 1, [1, 2]) is None


def test_a_torn_record_left_by_one_kill_9_does_not_make_the_start_up_after_the_next_list(tmp_path, clock):
    """The start-up after the first crash replays the torn generation and goes on in the next
    one, keeping the torn one until the file is next written: the second crash's start-up
    replays both."""
    data = tmp_path / "data"
    written = killed_after_changes(data, clock, CountingFS())
    last = data / journal_name(journal_generations(p.name for p in data.iterdir())[-1])
    last.write_bytes(last.read_bytes()[:-2])  # the crash cut the last record's write short
    engine = Engine(data, CONFIG, clock=clock, fs=CountingFS())
    engine.append("after", AppendBatch([b"x"]))
    written["after"] = [b"x"]
    fs = CountingFS()
    engine = Engine(data, CONFIG, clock=clock, fs=fs)  # the first dropped unclosed: a second kill -9
    assert fs.stream_listings == 0 and engine.list_streams() == sorted(written)
    assert all(contents(engine, name) == items for name, items in written.items())
    engine.close()


def test_a_version_2_journal_replays_as_before_and_holds_no_place(tmp_path):
    """Left by the previous version's kill -9: its records are version 3's but for the new kinds."""
    data = tmp_path / "data"
    journal = journaled(data, 1)
    journal.created("a")
    journal.closed("a", StreamSummary(1, 10, 1, 1))
    journal.opened("b")
    journal.close()
    path = data / journal_name(1)
    raw = bytearray(path.read_bytes())
    raw[4:6] = (2).to_bytes(2, "little")  # the header's version (no CRC over the header)
    path.write_bytes(bytes(raw))
    found = replay(FileSystem(), data, 1, [1])
    assert found is not None and found.last == {"a": True} and found.opened == {"b"} and found.places == {}
    assert found.closed == {"a": StreamSummary(1, 10, 1, 1)}
    journal = journaled(data, 2)
    journal.placed("c", P1)
    journal.close()
    raw = bytearray((data / journal_name(2)).read_bytes())
    raw[4:6] = (2).to_bytes(2, "little")
    (data / journal_name(2)).write_bytes(bytes(raw))
    assert replay(FileSystem(), data, 1, [1, 2]) is None  # version 2 wrote no place: damage


def test_a_promotion_done_since_the_file_moves_the_stream_to_its_directory_at_start_up(tmp_path, clock):
    """The engine does not promote yet (design step 4): the records are made by the journal's API
    as the engine will, after a kill -9 the start-up takes the place from the journal."""
    data = tmp_path / "data"
    with Engine(data, CONFIG, clock=clock) as engine:
        fill(engine, 2)
        engine._catalog.add("slotted", P1)
        engine._catalog.closed("slotted", StreamSummary(1, 4096, 1, 1))
    engine = Engine(data, CONFIG, clock=clock, fs=CountingFS())
    assert engine._catalog.place("slotted") == P1
    engine._catalog.promoting("slotted")
    engine._catalog.set_place("slotted", NO_PLACE)  # its directory would be whole by now
    engine = Engine(data, CONFIG, clock=clock, fs=CountingFS())  # the first dropped unclosed: a kill -9
    assert engine._catalog.place("slotted") == NO_PLACE and "slotted" in engine.list_streams()
    engine.close()


def test_the_version_3_records_are_laid_out_as_docs_format_says(tmp_path):
    data = tmp_path / "data"
    journal = journaled(data)
    start = journal.length()
    journal.placed("ab", P1)
    journal.promoting("ab", P1)
    journal.promoted("ab")
    journal.vouch(start)
    journal.close()
    raw = (data / journal_name(1)).read_bytes()
    assert raw[:8] == b"SLCJ" + (3).to_bytes(2, "little") + raw[6:8] and start == 8 + raw[6]

    def record(kind: bytes, name: bytes, payload: bytes) -> bytes:
        body = kind + len(name).to_bytes(2, "little") + name + payload
        return body + crc32c(body).to_bytes(4, "little")

    place = P1.to_bytes(8, "little", signed=True)
    assert raw[start:] == (
        record(b"p", b"ab", place)
        + record(b"M", b"ab", place)
        + record(b"m", b"ab", b"")
        + record(b"r", b"", start.to_bytes(8, "little"))
    )


def test_a_journal_record_that_fails_to_write_leaves_no_older_generation_to_trust(tmp_path, clock):
    """A kill -9's start-up goes on in a new generation beside the old one (the file names the
    old). If a record of the new one then fails to be written, that generation is removed: the
    older ones must go with it, or the next start-up after a kill -9 trusts them alone and knows
    nothing of what the removed one recorded (here a slot stream created and acknowledged)."""
    data = tmp_path / "data"
    written = killed_after_changes(data, clock, CountingFS())
    engine = Engine(data, CONFIG, clock=clock, fs=CountingFS())  # replays, goes on in the next one
    assert len(journal_generations(p.name for p in data.iterdir())) == 2

    def failing(record: bytes) -> None:
        raise OSError(5, "Input/output error")

    engine._catalog._journal._file.append = failing  # the disk refuses the next record
    engine.append("created-after", AppendBatch([b"kept"]))  # acknowledged: its data is written
    written["created-after"] = [b"kept"]
    assert journal_generations(p.name for p in data.iterdir()) == []
    engine = Engine(data, CONFIG, clock=clock, fs=CountingFS())  # the first dropped unclosed: a kill -9
    assert engine.list_streams() == sorted(written)
    assert all(contents(engine, name) == items for name, items in written.items())
    engine.close()
