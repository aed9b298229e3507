"""The group registry (storage/groupregistry.py): start-up loads the consumer groups of the streams
that have some without looking into the directory of any other stream; a data directory of an
earlier version (no registry) is probed once and gets one; crashes leave nothing lost or stale."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from storage import AppendBatch, Engine, EngineConfig, GroupReadOptions
from storage.fs import FileSystem
from storage.grouplog import journal_name
from storage.groupregistry import GROUPS_DIR
from storage.layout import STREAMS_DIR
from tests.storage.conftest import SMALL
from tests.storage.faultfs import FaultFS

ROOT = Path("/faultfs/data")
CONFIG = EngineConfig(**SMALL, max_open_streams=4)
# Every stream in a directory of its own, as a version before the registry (and before slots) left it.
DIRECTORIES = EngineConfig(**SMALL, max_open_streams=4, small_streams="off")


class WatchingFS(FileSystem):
    """The real file system, noting every stream directory a call looked into."""

    def __init__(self) -> None:
        super().__init__()
        self.looked_into: set[str] = set()

    def _note(self, path: Path) -> None:
        parts = path.parts
        if STREAMS_DIR in parts and parts.index(STREAMS_DIR) + 2 <= len(parts) - 1:
            self.looked_into.add(parts[parts.index(STREAMS_DIR) + 1])

    def exists(self, path: Path) -> bool:
        self._note(path)
        return super().exists(path)

    def listdir(self, path: Path) -> list[str]:
        self._note(path / "*")
        return super().listdir(path)

    def read_file(self, path: Path) -> bytes:
        self._note(path)
        return super().read_file(path)


def grouped_engine(data: Path, config: EngineConfig = CONFIG) -> Engine:
    """40 streams, consumer groups on two of them (one delivered an entry)."""
    engine = Engine(data, config)
    for i in range(40):
        engine.append(f"room-{i:02d}", AppendBatch([b"a", b"b"]))
    engine.create_group("room-07", "g")
    engine.create_group("room-31", "h")
    assert len(engine.read_group("room-07", "g", GroupReadOptions("c", 1)).entries()) == 1
    return engine


def pending_of(engine: Engine, stream: str, group: str) -> int:
    return engine.group_info(stream, group).pending


def test_start_up_looks_into_the_directories_of_the_streams_with_groups_only(tmp_path):
    grouped_engine(tmp_path / "data").close()
    fs = WatchingFS()
    engine = Engine(tmp_path / "data", CONFIG, fs=fs)
    assert fs.looked_into == {"room-07", "room-31"}
    assert pending_of(engine, "room-07", "g") == 1
    assert [g.name for g in engine.list_groups("room-31")] == ["h"]
    engine.close()


def test_a_data_directory_without_a_registry_is_probed_once_and_gets_one(tmp_path):
    grouped_engine(tmp_path / "data", DIRECTORIES).close()
    registry = tmp_path / "data" / GROUPS_DIR
    for entry in registry.iterdir():  # as an earlier version left it: no registry at all
        entry.unlink()
    registry.rmdir()
    leftover = tmp_path / "data" / STREAMS_DIR / "room-03" / journal_name(1)
    leftover.write_bytes(b"a first checkpoint that crashed, under the earlier version")
    fs = WatchingFS()
    engine = Engine(tmp_path / "data", CONFIG, fs=fs)
    assert len(fs.looked_into) == 40  # the probe, once
    assert not leftover.exists()
    assert pending_of(engine, "room-07", "g") == 1
    engine.close()
    assert sorted(p.name for p in registry.iterdir()) == ["room-07", "room-31"]
    fs = WatchingFS()
    Engine(tmp_path / "data", CONFIG, fs=fs).close()
    assert fs.looked_into == {"room-07", "room-31"}


def test_stale_entries_go_and_streams_whose_groups_all_went_leave_the_registry(tmp_path):
    engine = grouped_engine(tmp_path / "data")
    engine.delete_group("room-31", "h")  # its last group: the entry goes with its files
    engine.delete_stream("room-07")  # its entry stays until start-up finds it stale
    registry = tmp_path / "data" / GROUPS_DIR
    assert sorted(p.name for p in registry.iterdir()) == ["room-07"]
    engine.close()
    engine = Engine(tmp_path / "data", CONFIG)
    assert list(registry.iterdir()) == []
    engine.append("room-07", AppendBatch([b"new"]))  # recreated: no groups of its old self
    assert engine.list_groups("room-07") == []
    engine.create_group("room-07", "again")
    engine.close()
    engine = Engine(tmp_path / "data", CONFIG)
    assert [g.name for g in engine.list_groups("room-07")] == ["again"]
    engine.close()


@pytest.mark.parametrize("seed", range(12))
def test_a_power_loss_around_a_first_group_loses_no_group_the_call_returned(seed):
    """Every sync point of a stream's first group (its registry entry, then its files) and of
    its last group's deletion: after a power loss the groups are there if the call returned,
    and start-up leaves neither a stale entry nor orphaned group files."""
    rng = random.Random(seed)
    fs = FaultFS()
    fs.prepare_dir(ROOT)
    engine = Engine(ROOT, EngineConfig(**SMALL, fsync="always", max_open_streams=2), fs=fs)
    for i in range(4):
        engine.append(f"s{i}", AppendBatch([b"x"]))
    base = fs.syncs
    states: list[tuple[FaultFS, set[str]]] = []
    done: set[str] = set()

    def snapshot(state: FaultFS) -> None:
        if rng.random() < 0.3:
            states.append((state.crashed_copy(random.Random(rng.random()), "power"), set(done)))

    fs.on_sync = snapshot
    for i in range(4):
        engine.create_group(f"s{i}", "g")
        done.add(f"s{i}")
    engine.delete_group("s1", "g")
    done.discard("s1")
    fs.on_sync = None
    assert fs.syncs > base and states
    for state, returned in states:
        after = Engine(ROOT, EngineConfig(**SMALL, fsync="always"), fs=state)
        with_groups = {f"s{i}" for i in range(4) if after.list_groups(f"s{i}")}
        assert returned - {"s1"} <= with_groups, (returned, with_groups)
        registered = set(state.listdir(ROOT / GROUPS_DIR))
        assert registered == with_groups  # no stale entry survives a start-up
        after.close()
