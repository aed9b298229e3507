"""The catalog's journal (storage/catalogjournal.py): a start-up after a process crash lists no
directory, yet knows every stream created, deleted or opened since the catalog file; after a
reboot (a power loss) or with a damaged journal it lists the streams directory as before. And
the catalog's lock is not held while a file of many streams is built."""

from __future__ import annotations

import heapq
import threading
from pathlib import Path

import pytest

import storage.catalog as catalog_module
import storage.maintenance as maintenance_module
from storage import AppendBatch, Engine, EngineConfig, StreamNotFoundError
from storage.catalog import Catalog, StreamSummary
from storage.catalogjournal import journal_generations, journal_name
from storage.layout import META_FILE, stream_directory
from tests.storage.conftest import SMALL
from tests.storage.faultfs import FaultFS
from tests.storage.test_catalog import CountingFS, contents, fill

ROOT = Path("/faultfs/data")
CONFIG = EngineConfig(**SMALL, max_open_streams=4)


def killed_after_changes(data: Path, clock, fs) -> dict[str, list[bytes]]:
    """A clean shutdown, then streams created, deleted, appended to and read, and a kill -9 (the
    engine dropped unclosed: with its own fs it holds no lock)."""
    with Engine(data, CONFIG, clock=clock, fs=fs) as engine:
        written = fill(engine, 10)
    engine = Engine(data, CONFIG, clock=clock, fs=fs)
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


@pytest.mark.parametrize("damage", ["torn record", "missing generation", "relist"])
def test_a_journal_that_cannot_be_trusted_makes_start_up_list(tmp_path, clock, damage):
    data = tmp_path / "data"
    written = killed_after_changes(data, clock, CountingFS())
    generations = journal_generations(p.name for p in data.iterdir())
    last = data / journal_name(generations[-1])
    if damage == "torn record":
        last.write_bytes(last.read_bytes()[:-3])
    elif damage == "missing generation":
        (data / journal_name(generations[0])).unlink()
    else:  # a stream found unreadable asks for a listing, which finds it unreadable again
        engine = Engine(data, CONFIG, clock=clock, fs=CountingFS())
        # A meta file that fails its checks (a segment cut below its header would be taken for a
        # creation a crash cut short, and dropped: docs/FORMAT.md, "Recovery rules").
        (stream_directory(data, "room-004") / META_FILE).write_bytes(b"damaged")
        with pytest.raises(StreamNotFoundError, match="damaged"):
            engine.read("room-004", 0, 10)
        assert "room-004" not in engine.list_streams()
        del written["room-004"]
    fs = CountingFS()
    engine = Engine(data, CONFIG, clock=clock, fs=fs)
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


def test_streams_opened_at_large_make_the_file_due(tmp_path, clock, monkeypatch):
    monkeypatch.setattr(catalog_module, "JOURNAL_RECORDS_MAX", 3)
    monkeypatch.setattr(maintenance_module, "CATALOG_SAVE_S", 0)  # maintenance writes the file when due

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
    killed_after_changes(data, clock, CountingFS())
    (stream_directory(data, "new-1") / META_FILE).write_bytes(b"damaged")  # the journal names it
    for listings in (0, 1):  # found by the journal's check, then by the listing it asked for
        fs = CountingFS()
        engine = Engine(data, CONFIG, clock=clock, fs=fs)  # dropped unclosed: a kill -9 each time
        assert fs.stream_listings == listings and engine.unreadable == ["new-1"]
        assert "new-1" not in engine.list_streams()


def test_deletions_on_two_threads_set_the_catalog_file_aside_once(tmp_path, clock):
    """A cluster node drops copies on several threads: the second deletion must not try to
    move the file the first is moving (FileNotFoundError left its copy half deleted)."""
    engine = Engine(tmp_path / "data", CONFIG, clock=clock)
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
    reopened and appended to since it closed: its CLOSED record is stale) count once recovered."""
    data = tmp_path / "data"
    # No catalog file yet: every stream is in the journal. Its own fs: it takes no lock (a kill -9 frees it).
    engine = Engine(data, CONFIG, clock=clock, fs=CountingFS())
    counts = {f"room-{i:03d}": i + 1 for i in range(12)}
    for name, count in counts.items():
        engine.append(name, AppendBatch([name.encode()] * count))
    engine.append("room-000", AppendBatch([b"more"] * 5))  # reopened: room-008 closes
    counts["room-000"] += 5
    open_at_crash = {"room-000", "room-009", "room-010", "room-011"}  # the cache's 4 (max_open_streams)
    assert engine.stats()["entries"] == sum(counts.values())
    engine = Engine(data, CONFIG, clock=clock, fs=CountingFS())  # the first dropped unclosed: a kill -9
    closed = sum(n for name, n in counts.items() if name not in open_at_crash)
    assert engine.stats()["entries"] == closed
    assert contents(engine, "room-000") == [b"room-000"] + [b"more"] * 5  # recovered: counted
    assert engine.stats()["entries"] == closed + counts["room-000"]
    engine.maintain()  # visits the other streams of unknown figures
    assert engine.stats()["entries"] == sum(counts.values())
    engine.close()
    with Engine(data, CONFIG, clock=clock, fs=CountingFS()) as engine:  # a clean restart: the file's figures
        assert engine.stats()["entries"] == sum(counts.values())
