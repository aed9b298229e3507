"""A full disk and a failing fsync: clean errors, an intact stream, and recovery once the cause is gone.

Disk full runs on a real 1 MiB tmpfs (mounted here: we are root in CI; skipped
with the reason when mounting is not permitted) and on FaultFS's disk-full
switch. Segment space is reserved before it is mapped, when a segment is
created and at each step of its growth, so a full disk shows up as
DiskFullError there, never as SIGBUS inside a write.
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import threading
from pathlib import Path

import pytest

import storage.maintenance as maintenance_module
from storage import AppendBatch, DiskFullError, DurabilityError, Engine, EngineConfig, StorageError
from tests.storage.conftest import SMALL
from tests.storage.faultfs import FaultFS

ROOT = Path("/faultfs/data")


class Clock:
    def __init__(self) -> None:
        self.now_ms = 1_700_000_000_000

    def __call__(self) -> int:
        self.now_ms += 1
        return self.now_ms


def batch(rng: random.Random, n: int = 8, size: int = 1500) -> list[bytes]:
    return [rng.randbytes(size) for _ in range(n)]


def read_all(engine: Engine, name: str) -> list[tuple[int, bytes]]:
    info = engine.info(name)
    out: list[tuple[int, bytes]] = []
    cursor = info.first_offset
    for _ in range(info.end_offset - info.first_offset + 1):
        if cursor >= info.end_offset:
            break
        result = engine.read(name, cursor, 100)
        entries = result.entries()
        assert entries and result.gap is None, f"read at {cursor} of {name}: gap {result.gap}"
        out.extend((e.offset, e.payload) for e in entries)
        cursor = entries[-1].offset + 1
    return out


def fill_until_full(engine: Engine, name: str, rng: random.Random) -> list[tuple[int, bytes]]:
    """Append 12 KiB batches until DiskFullError; returns what was acknowledged."""
    acked: list[tuple[int, bytes]] = []
    for _ in range(1000):  # a bound far above what fits
        items = batch(rng)
        try:
            result = engine.append(name, AppendBatch(items))
        except DiskFullError:
            return acked
        acked.extend((result.first_offset + i, p) for i, p in enumerate(items))
    pytest.fail("the disk never filled up")


# ---------------------------------------------------------------------- a real tmpfs


@pytest.fixture
def tmpfs(tmp_path):
    """A 1 MiB tmpfs mounted on a fresh directory; always unmounted afterwards."""
    mountpoint = tmp_path / "tmpfs"
    mountpoint.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mountpoint)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot run mount: {exc}")
    if done.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here: {done.stderr.strip() or done.returncode}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", str(mountpoint)], capture_output=True, timeout=30)
        if os.path.ismount(mountpoint):
            subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, timeout=30)


@pytest.mark.parametrize("fsync", ["always", "no"])
def test_real_full_disk_fails_cleanly_at_segment_creation_and_recovers(tmpfs, fsync):
    rng = random.Random(7)
    data = tmpfs / "data"
    engine = Engine(data, EngineConfig(**SMALL, fsync=fsync), clock=Clock())
    spare = []
    for _ in range(15):  # ~180 KiB in a second stream, to be deleted later
        result = engine.append("spare", AppendBatch(batch(rng)))
        spare.append(result.first_offset)
    acked = fill_until_full(engine, "main", rng)
    assert len(acked) > 100
    files = sorted(p.name for p in (data / "streams" / "main").iterdir())
    # No partial file (stream.meta.new: under "no" with no maintenance thread, the creation is not
    # committed until the stream is closed, storage/creation.py).
    assert all(name.endswith(".seg") or name in ("stream.meta", "stream.meta.new") for name in files), files

    # The failure is clean and repeatable, the stream intact and readable.
    for _ in range(3):
        with pytest.raises(DiskFullError):
            engine.append("main", AppendBatch(batch(rng)))
    assert sorted(p.name for p in (data / "streams" / "main").iterdir()) == files
    assert read_all(engine, "main") == acked
    assert engine.info("main").end_offset == len(acked)

    # Free space: appends go on where they stopped.
    engine.delete_stream("spare")
    more = batch(rng)
    result = engine.append("main", AppendBatch(more))
    assert result.first_offset == len(acked)
    acked.extend((result.first_offset + i, p) for i, p in enumerate(more))
    assert read_all(engine, "main") == acked
    engine.close()

    engine = Engine(data, EngineConfig(**SMALL, fsync=fsync), clock=Clock())
    assert read_all(engine, "main") == acked and engine.list_streams() == ["main"]
    engine.close()


def test_real_full_disk_at_a_growth_step_fails_cleanly_and_recovers(tmpfs):
    data = tmpfs / "data"
    # A segment file's growth step (small_streams off: a pack's first 16 MiB do not fit this disk).
    engine = Engine(data, EngineConfig(**SMALL, fsync="always", small_streams="off"), clock=Clock())
    acked = [(0, b"first")]
    engine.append("main", AppendBatch([b"first"]))
    segment = data / "streams" / "main" / f"{0:020d}.seg"
    filler = os.open(tmpfs / "filler", os.O_WRONLY | os.O_CREAT)
    with contextlib.suppress(OSError):  # ENOSPC: the disk is full, the segment still one page
        while True:
            os.write(filler, bytes(4096))
    os.close(filler)
    rng = random.Random(9)
    with pytest.raises(DiskFullError):
        for _ in range(100):
            items = batch(rng, n=2, size=300)
            result = engine.append("main", AppendBatch(items))
            acked.extend((result.first_offset + i, p) for i, p in enumerate(items))
    assert segment.stat().st_size < SMALL["segment_bytes"]  # refused growing the segment, no SIGBUS
    assert read_all(engine, "main") == acked
    (tmpfs / "filler").unlink()
    items = batch(rng, n=2, size=300)
    first = engine.append("main", AppendBatch(items)).first_offset
    assert first == len(acked)
    acked.extend((first + i, p) for i, p in enumerate(items))
    engine.close()
    with Engine(data, EngineConfig(**SMALL), clock=Clock()) as engine:
        assert read_all(engine, "main") == acked


def test_real_small_disk_takes_slot_streams_until_it_is_full(tmpfs):
    """A disk with less than a pack's 16 MiB growth step free (1 MiB) still takes slot streams,
    its pack grown in smaller steps, until it is really full: then DiskFullError (the service's
    RESOURCE_EXHAUSTED), no SIGBUS, every stream acknowledged readable, before and after a restart."""
    data = tmpfs / "data"
    (tmpfs / "spare").write_bytes(bytes(64 << 10))  # removed before the restart: its journal needs room
    payloads = [b"p" * 100] * 10
    created: list[str] = []
    with Engine(data, EngineConfig(fsync="always", background=False), clock=Clock()) as engine:
        with pytest.raises(DiskFullError):
            for i in range(1000):  # a bound far above what fits
                engine.append_many(f"s{i}", [(AppendBatch(payloads), None)])
                created.append(f"s{i}")
        assert len(created) > 20  # the pack's first slots fit in what the disk had left
        assert (data / "packs").is_dir() and not any((data / "streams").iterdir())
        for name in created[:: len(created) // 10]:
            assert [p for _, p in read_all(engine, name)] == payloads
    (tmpfs / "spare").unlink()
    with Engine(data, EngineConfig(background=False), clock=Clock()) as engine:
        assert sorted(engine.list_streams()) == sorted(created)
        assert [p for _, p in read_all(engine, created[-1])] == payloads


def test_real_full_disk_restarts_and_serves_reads_until_there_is_room(tmpfs, monkeypatch):
    """A server whose disk filled up restarts on it: no room for a new catalog journal generation
    (nor the catalog file its close could not save), so it starts without one; reads go on, a
    creation is DiskFullError; once there is room maintenance saves the catalog and the journal
    is back, and a restart finds every stream."""
    data = tmpfs / "data"
    (tmpfs / "spare").write_bytes(bytes(64 << 10))
    payloads = [b"p" * 100] * 10
    created: list[str] = []
    config = EngineConfig(fsync="always", background=False)
    with Engine(data, config, clock=Clock()) as engine, pytest.raises(DiskFullError):
        for i in range(1000):  # a bound far above what fits
            engine.append_many(f"s{i}", [(AppendBatch(payloads), None)])
            created.append(f"s{i}")
    with Engine(data, config, clock=Clock()) as engine:
        assert sorted(engine.list_streams()) == sorted(created)
        assert [p for _, p in read_all(engine, created[-1])] == payloads
        with pytest.raises(DiskFullError):  # (the journals it removed gave back a page or so)
            for i in range(len(created), 1000):
                engine.append_many(f"s{i}", [(AppendBatch(payloads), None)])
                created.append(f"s{i}")
        assert not [p for p in data.iterdir() if p.name.endswith(".log")]  # none this run continues
        (tmpfs / "spare").unlink()
        monkeypatch.setattr(maintenance_module, "CATALOG_SAVE_S", 0)  # not a minute from now
        engine.maintain()
        assert [p for p in data.iterdir() if p.name.endswith(".log")]  # saved: a journal again
        engine.append("one-more", AppendBatch(payloads))
    with Engine(data, EngineConfig(background=False), clock=Clock()) as engine:
        assert sorted(engine.list_streams()) == sorted([*created, "one-more"])
        assert [p for _, p in read_all(engine, "one-more")] == payloads


# ---------------------------------------------------------------------- the same through FaultFS


def faultfs_engine(fs: FaultFS, fsync: str = "always") -> Engine:
    return Engine(ROOT, EngineConfig(**SMALL, fsync=fsync), clock=Clock(), fs=fs)


def new_fs() -> FaultFS:
    fs = FaultFS()
    fs.prepare_dir(ROOT)
    return fs


@pytest.mark.parametrize("how", ["switch", "capacity"])
def test_faultfs_full_disk_fails_cleanly_and_recovers(how):
    rng = random.Random(11)
    fs = new_fs()
    engine = faultfs_engine(fs)
    for _ in range(15):
        engine.append("spare", AppendBatch(batch(rng)))
    acked: list[tuple[int, bytes]] = []
    for _ in range(10):
        items = batch(rng)
        result = engine.append("main", AppendBatch(items))
        acked.extend((result.first_offset + i, p) for i, p in enumerate(items))
    if how == "switch":
        fs.disk_full = True
        more = fill_until_full(engine, "main", rng)  # the rest of the current segment still fits
    else:
        fs.capacity_bytes = 700 * 1024
        more = fill_until_full(engine, "main", rng)
    acked.extend(more)
    with pytest.raises(DiskFullError):
        engine.append("main", AppendBatch(batch(rng)))
    assert read_all(engine, "main") == acked

    # A power loss now loses nothing acknowledged.
    crashed = faultfs_engine(fs.crashed_copy(random.Random(1), "lost"))
    assert read_all(crashed, "main") == acked

    if how == "switch":
        fs.disk_full = False
    else:
        engine.delete_stream("spare")
    items = batch(rng)
    result = engine.append("main", AppendBatch(items))
    assert result.first_offset == len(acked)
    acked.extend((result.first_offset + i, p) for i, p in enumerate(items))
    assert read_all(engine, "main") == acked
    engine.close()
    assert read_all(faultfs_engine(fs.crashed_copy(random.Random(2), "lost")), "main") == acked


def test_trim_on_a_full_disk_changes_nothing():
    rng = random.Random(3)
    fs = new_fs()
    engine = faultfs_engine(fs, fsync="no")
    for _ in range(20):
        engine.append("main", AppendBatch(batch(rng, size=200)))
    before = read_all(engine, "main")
    fs.disk_full = True
    with pytest.raises(DiskFullError):
        engine.trim("main", 100)
    assert engine.info("main").first_offset == 0
    assert read_all(engine, "main") == before


def test_segments_not_packed_for_lack_of_space_are_packed_later():
    rng = random.Random(4)
    fs = new_fs()
    engine = faultfs_engine(fs, fsync="no")
    for _ in range(60):
        engine.append("main", AppendBatch([rng.choice([b"a", b"b"]) * 1500 for _ in range(8)]))
    sealed = engine.info("main").segments - 1
    assert sealed >= 3
    fs.disk_full = True
    engine.maintain()  # packing needs room for the packed copy: it fails, and says so in the log
    fs.disk_full = False
    engine.maintain()
    stream_dir = ROOT / "streams" / "main"
    sizes = [
        len(fs.file_bytes(stream_dir / name)) for name in fs.listdir(stream_dir) if name.endswith(".seg")
    ]
    assert sum(size < SMALL["segment_bytes"] for size in sizes) == sealed, f"segment sizes {sizes}"


def test_an_io_error_during_maintenance_is_reported_not_raised():
    rng = random.Random(5)
    fs = new_fs()
    engine = faultfs_engine(fs, fsync="no")
    for _ in range(40):
        engine.append("main", AppendBatch(batch(rng)))
    fs.fail_at_sync = fs.syncs + 1  # the fsync of the first packed copy
    errors: list[BaseException] = []
    worker = threading.Thread(target=_catch, args=(engine.maintain, errors))  # as the background thread
    worker.start()
    worker.join()
    assert fs.failed_syncs == 1
    assert not errors, f"maintain() raised {errors[0]!r}"
    engine.append("main", AppendBatch(batch(rng)))


def _catch(fn, errors: list[BaseException]) -> None:
    try:
        fn()
    except BaseException as exc:
        errors.append(exc)


# ---------------------------------------------------------------------- fsync failure


@pytest.mark.parametrize("crash", ["lost", "process"])
def test_fsync_failure_in_always_mode_stops_appends_and_keeps_what_was_acknowledged(crash):
    rng = random.Random(6)
    fs = new_fs()
    engine = faultfs_engine(fs, fsync="always")
    acked: list[tuple[int, bytes]] = []
    for _ in range(30):  # across segments and packing
        items = batch(rng, n=rng.randint(1, 8))
        result = engine.append("main", AppendBatch(items))
        acked.extend((result.first_offset + i, p) for i, p in enumerate(items))
    engine.maintain()
    engine.append("other", AppendBatch([b"unaffected"]))

    fs.fail_at_sync = fs.syncs + 1  # the sync of the next append's segment
    failed = batch(rng, n=3)
    with pytest.raises(DurabilityError):
        engine.append("main", AppendBatch(failed))
    assert fs.failed_syncs == 1
    for _ in range(3):  # no retry that could lie: every later append is refused
        with pytest.raises(DurabilityError):
            engine.append("main", AppendBatch(batch(rng, n=1)))
    with pytest.raises(DurabilityError):
        engine.sync()
    assert fs.failed_syncs == 1, "the engine retried a failed fsync"
    # Reads still work and show exactly what was acknowledged.
    assert read_all(engine, "main") == acked
    assert engine.info("main").end_offset == len(acked)
    assert engine.append("other", AppendBatch([b"still fine"])).first_offset == 1  # other streams go on
    with contextlib.suppress(StorageError):  # reporting the failure again on close is fine
        engine.close()

    state = fs.crashed_copy(random.Random(8), crash)
    engine = faultfs_engine(state)
    got = read_all(engine, "main")
    if crash == "lost":  # only synced bytes survive: the failed batch never reached the disk
        assert got == acked
    else:  # the page cache survived: the failed batch may be there, whole
        assert got in (acked, acked + [(len(acked) + i, p) for i, p in enumerate(failed)])
    result = engine.append("main", AppendBatch([b"after restart"]))
    assert result.first_offset == len(got)
    assert [e.payload for e in engine.read("other", 0, 5).entries()] == [b"unaffected", b"still fine"]
    engine.close()


@pytest.mark.parametrize("crash", ["process", "power"])
def test_faultfs_start_up_on_a_full_disk_runs_without_a_journal(crash, monkeypatch):
    """A start-up with no room for a journal generation, after a kill -9 (the journals trusted) or
    a power loss (the streams listed and the packs scanned: a catalog file is due too): it serves
    reads; the journals on disk go, as this run's changes are in none, so a crash then lists and
    scans and finds what was there; once there is room the catalog is saved with a journal."""
    fs = new_fs()
    with faultfs_engine(fs) as engine:
        engine.append("a", AppendBatch([b"a"]))
        engine.append("big", AppendBatch([b"x" * 3000] * 5))  # past a slot: a directory of its own
    engine = faultfs_engine(fs)
    engine.append("b", AppendBatch([b"b"]))
    engine.sync()
    state = fs.crashed_copy(random.Random(1), crash)
    state.disk_full = True
    engine = faultfs_engine(state)
    assert engine.list_streams() == ["a", "b", "big"]
    assert [p for _, p in read_all(engine, "b")] == [b"b"]
    engine.append("c", AppendBatch([b"c"]))  # a slot: the pack's growth step has room for it
    engine.sync()
    with pytest.raises(DiskFullError):
        engine.append("d", AppendBatch([b"x" * 3000] * 5))  # a directory's segment has none
    assert not [n for n in state.listdir(ROOT) if n.endswith(".log")]
    again = faultfs_engine(state.crashed_copy(random.Random(2), "process"))
    assert again.list_streams() == ["a", "b", "big", "c"]  # "c" in no journal: found by the scan
    state.disk_full = False
    monkeypatch.setattr(maintenance_module, "CATALOG_SAVE_S", 0)  # not a minute from now
    engine.maintain()
    assert [n for n in state.listdir(ROOT) if n.endswith(".log")]
    engine.append("d", AppendBatch([b"x" * 3000] * 5))
    engine.sync()
    restarted = faultfs_engine(state.crashed_copy(random.Random(3), "process"))
    assert restarted.list_streams() == ["a", "b", "big", "c", "d"]
    assert [p for _, p in read_all(restarted, "c")] == [b"c"]
