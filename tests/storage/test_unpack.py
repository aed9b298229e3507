"""`python -m storage.inspect unpack DATA` (storage/unpack.py): every stream in a slot of a pack
file moves to a directory of its own and the packs go, so that a release before format 6, which
rebuilds its catalog from `streams/`, finds every entry; refused while a server holds the
directory; idempotent; a kill -9 or a power loss at any point of it, then a second run, loses
nothing; a stream whose slot is damaged stays, with its pack, and is reported."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from storage import AppendBatch, Engine, EngineConfig
from storage.format import SEGMENT_HEADER_SIZE, SLOT_BYTES, SegmentHeader
from storage.fs import FileSystem
from storage.inspect import main as inspect_main
from storage.layout import PACKS_DIR, stream_directory
from storage.packs import NO_PLACE, split_place
from storage.unpack import BATCH
from tests.storage.faultfs import FaultFS

ROOT = Path("/faultfs/data")
SLOTS = EngineConfig(background=False, max_open_streams=2, small_streams="slots")
LONG = "long " * 50  # its directory's name is a hash (storage/names.py)


@pytest.fixture(autouse=True)
def tiny_packs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Packs of 3 slots (and the header's), so that a few streams fill several."""
    monkeypatch.setattr("storage.packs.GROWTH_BYTES", 4 * SLOT_BYTES)
    monkeypatch.setattr("storage.packs.SLOTS_PER_PACK", 4)
    monkeypatch.setattr("storage.packs.PACK_BYTES", 4 * SLOT_BYTES)


def fill(engine: Engine) -> dict[str, list[bytes]]:
    """Streams in slots (several packs), one of a name too long for its directory's (kept in
    its `stream.meta`), one promoted by its size, one in a directory from its creation, one
    deleted; what each holds."""
    held: dict[str, list[bytes]] = {}
    for i in range(8):
        name = f"small {i}/x"  # (a name that is not its directory's)
        held[name] = [b"%d-%d" % (i, k) for k in range(i + 1)]
        engine.append(name, AppendBatch(held[name]))
    held[LONG] = [b"long"]
    engine.append(LONG, AppendBatch(held[LONG]))
    held["outgrown"] = [b"a" * 2000, b"b" * 2000]
    for entry in held["outgrown"]:
        engine.append("outgrown", AppendBatch([entry]))
    held["big"] = [b"c" * 1000] * 5  # too big for a slot from the first batch
    engine.append("big", AppendBatch(held["big"]))
    engine.append("deleted", AppendBatch([b"gone"]))
    engine.delete_stream("deleted")
    placed = engine._catalog.placed()
    assert len(placed) == 9 and len({split_place(p)[0] for p in placed.values()}) == 3
    return held


def as_an_older_release(data: Path, fs: FaultFS | None = None) -> Engine:
    """The directory as a release before format 6 opens it: no catalog it can read (its version
    is 2: rebuilt from streams/), no small streams."""
    files = fs or FileSystem()
    for name in files.listdir(data):
        if name.startswith("catalog"):
            files.remove(data / name)
    return Engine(data, EngineConfig(background=False, small_streams="off"), fs=fs)  # type: ignore[arg-type]


def contents(engine: Engine) -> dict[str, list[bytes]]:
    return {name: [e.payload for e in engine.read(name, 0, 100).entries()] for name in engine.list_streams()}


def test_unpack_moves_every_slot_stream_to_a_directory_and_removes_the_packs(tmp_path, capsys):
    data = tmp_path / "data"
    with Engine(data, SLOTS) as engine:
        held = fill(engine)
    assert inspect_main(["unpack", str(data)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "moved 9 streams from slots of pack files to directories of their own",
        "their segments grow to 64 MiB (segment_bytes: --segment-bytes)",
        "removed 00000.pack, 00001.pack, 00002.pack, 00003.pack",
        f"done: no stream is in a slot; a release before format 6 can open {data}",
    ]
    assert not (data / PACKS_DIR).exists()
    with Engine(data, EngineConfig(background=False, small_streams="off")) as engine:
        assert all(engine._catalog.place(name) == NO_PLACE for name in held)
    with as_an_older_release(data) as older:
        assert contents(older) == held
    assert inspect_main(["unpack", str(data), "--json"]) == 0  # again: nothing to do
    assert json.loads(capsys.readouterr().out) == {
        "promoted": 0,
        "unreadable": [],
        "removed": [],
        "kept": [],
        "segment_bytes": 64 << 20,
    }
    assert inspect_main(["verify", str(data)]) == 0


def capacity(segment: Path) -> int:
    """The size a growing segment may grow to, from its header."""
    return SegmentHeader.decode(segment.read_bytes()[:SEGMENT_HEADER_SIZE]).capacity


def test_unpack_gives_the_moved_streams_the_servers_segment_bytes(tmp_path, capsys):
    """Their segments grow to the operator's `segment_bytes`, as a stream the server promoted
    would, not to the default; a value the server would refuse moves nothing."""
    data = tmp_path / "data"
    with Engine(data, SLOTS) as engine:
        engine.append("s", AppendBatch([b"x"]))
    for bad in ("1000", "2TiB", "1 MB", "-1"):
        with pytest.raises(SystemExit) as exited:
            inspect_main(["unpack", str(data), "--segment-bytes", bad])
        assert exited.value.code == 2
        assert "argument --segment-bytes" in capsys.readouterr().err
    assert (data / PACKS_DIR).exists()
    assert inspect_main(["unpack", str(data), "--segment-bytes", "2MiB"]) == 0
    assert "their segments grow to 2 MiB" in capsys.readouterr().out
    (segment,) = stream_directory(data, "s").glob("*.seg")
    assert capacity(segment) == 2 << 20
    # The server, with that setting (and batch limits that fit it), appends past it: a new segment.
    config = EngineConfig(
        background=False, segment_bytes=2 << 20, max_batch_bytes=1 << 20, small_streams="off"
    )
    with Engine(data, config) as engine:
        for _ in range(3):
            engine.append("s", AppendBatch([b"y" * 1000] * 1000))
        assert len(list(stream_directory(data, "s").glob("*.seg"))) > 1
        assert [e.payload for e in engine.read("s", 0, 1).entries()] == [b"x"]
    with Engine(tmp_path / "other", SLOTS) as engine:
        engine.append("t", AppendBatch([b"x"]))
    assert inspect_main(["unpack", str(tmp_path / "other"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["segment_bytes"] == 64 << 20
    (segment,) = stream_directory(tmp_path / "other", "t").glob("*.seg")
    assert capacity(segment) == 64 << 20  # the server's default, with no flag
    with pytest.raises(SystemExit):
        inspect_main(["verify", str(data), "--segment-bytes", "2MiB"])  # only unpack takes it


def test_unpack_is_refused_while_a_server_holds_the_directory(tmp_path, capsys):
    data = tmp_path / "data"
    with Engine(data, SLOTS) as engine:
        engine.append("s", AppendBatch([b"x"]))
        assert inspect_main(["unpack", str(data)]) == 2
        assert "in use by another process: stop the server first" in capsys.readouterr().err
        assert engine._catalog.place("s") != NO_PLACE
    assert (data / PACKS_DIR / "00000.pack").exists()
    assert inspect_main(["unpack", str(tmp_path / "nothing")]) == 2
    assert "not a streamlog data directory" in capsys.readouterr().err
    assert not (tmp_path / "nothing").exists()


def test_a_stream_whose_slot_is_damaged_stays_with_its_pack_and_is_reported(tmp_path, capsys):
    data = tmp_path / "data"
    with Engine(data, SLOTS) as engine:
        held = fill(engine)
        pack, slot, _ = split_place(engine._catalog.place("small 4/x"))
    with (data / PACKS_DIR / f"{pack:05d}.pack").open("r+b") as f:
        f.seek(slot * SLOT_BYTES + 40)  # its slot header
        f.write(b"\xff")
    assert inspect_main(["unpack", str(data)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "moved 8 streams from slots of pack files to directories of their own"
    assert out[3:] == [
        "problem: stream 'small 4/x' is unreadable in its slot (see the log): left there",
        f"problem: kept in {data / PACKS_DIR}: {pack:05d}.pack",
    ]
    assert (data / PACKS_DIR / f"{pack:05d}.pack").read_bytes()[slot * SLOT_BYTES + 40] == 0xFF
    with as_an_older_release(data) as older:
        assert contents(older) == {name: entries for name, entries in held.items() if name != "small 4/x"}


def test_a_batch_of_streams_shares_its_syncs(monkeypatch):
    """One syncfs for the batch's directories, one sync of its pack and one of the journal: not
    a stream's four or five (storage/slothome.py's promotion, one stream at a time); and the
    streams closed again with their markers written, not left to the engine's close."""
    monkeypatch.setattr("storage.packs.SLOTS_PER_PACK", 64)  # one pack
    monkeypatch.setattr("storage.packs.PACK_BYTES", 64 * SLOT_BYTES)
    fs = FaultFS()
    fs.prepare_dir(ROOT)
    with Engine(ROOT, SLOTS, fs=fs) as engine:  # type: ignore[arg-type]
        for i in range(40):
            engine.append(f"s{i}", AppendBatch([b"x"]))
    with Engine(ROOT, SLOTS, fs=fs) as engine:  # type: ignore[arg-type]
        before = fs.syncs
        assert len(engine.unpack().promoted) == 40
        syncs = fs.syncs - before
        assert len(engine._unsynced) == 0  # their closes finished: none held till the engine's close
    # A syncfs, the pack's and the journal's syncs, the pack's and packs/'s removals (one at a
    # time: 203 syncs).
    assert syncs <= 6


@pytest.mark.parametrize("mode", ["process", "power"])
@pytest.mark.parametrize("batch", [3, BATCH])
def test_a_crash_at_any_point_of_an_unpack_then_a_second_one_loses_nothing(mode, batch):
    """Batches of 3 (the last of 3 streams too: 9 in all) and one of every stream: a kill -9 or
    a power loss at each write and sync of the first run, between batches and inside one, then
    a second run."""
    fs = FaultFS()
    fs.prepare_dir(ROOT)
    with Engine(ROOT, SLOTS, fs=fs) as engine:  # type: ignore[arg-type]
        held = fill(engine)  # a clean shutdown: every entry durable
    states: list[FaultFS] = []
    rng = random.Random(3)
    fs.on_sync = fs.on_write = lambda state: states.append(state.crashed_copy(rng, mode))
    with Engine(ROOT, SLOTS, fs=fs) as engine:  # type: ignore[arg-type]
        assert len(engine.unpack(batch).promoted) == 9
    fs.on_sync = fs.on_write = None
    assert len(states) > 9 * 5  # each promotion's writes, the batches' syncs, the packs' removals
    moved = set()
    for k, state in enumerate(states):
        with Engine(ROOT, SLOTS, fs=state) as again:  # type: ignore[arg-type]
            moved.add(9 - len(again._catalog.placed()))  # (how far the first run went)
            done = again.unpack(batch)
            assert not done.unreadable and not done.kept, k
        assert not state.exists(ROOT / PACKS_DIR), k
        with as_an_older_release(ROOT, state) as older:
            assert contents(older) == held, k
    assert {0, 9} <= moved and len(moved) > 4  # crash points before, during and after the moves
    if batch == 3:
        assert {3, 6} <= moved  # between batches
