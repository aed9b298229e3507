"""Durable group state: the op codec, snapshots, and the journal's recovery rules.

The journal is trusted up to its first invalid record: truncation at every
byte of the last record and a bit flip in each of its bytes must give back
exactly the state before that record, never garbage. Crashes at every sync
point of a workload that checkpoints must give back the state before or after
the call under way.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
from crc32c import crc32c

import storage.engine
from storage import (
    AppendBatch,
    CorruptionError,
    Engine,
    EngineConfig,
    GroupConfig,
    GroupCounters,
    GroupReadOptions,
    grouplog,
)
from storage import groupops as o
from storage.fs import FileSystem
from storage.grouplog import (
    HEADER_SIZE,
    SNAPSHOT_FILE,
    GroupLog,
    decode_snapshot,
    encode_snapshot,
    journal_name,
    scan_journal,
)
from storage.groupops import decode_ops, encode_ops
from storage.groupregistry import GROUPS_DIR
from storage.groupstate import GroupSet
from tests.storage.faultfs import FaultFS

from .conftest import SMALL

ROOT = Path("/faultfs/data")

EVERY_OP = [
    o.CreateGroup(
        "grp",
        GroupConfig(retry_ms=5, dead_letter_stream="d", retention_hold=True),
        7,
        3,
        1_700_000_000_000,
    ),
    o.DropGroup("grp"),
    o.Seek("grp", 0, 0),
    o.SetConfig("grp", GroupConfig()),
    o.Seen("grp", "consumer é", 1_700_000_000_123, True),
    o.Touch("grp", 5),
    o.Deliver("grp", "c", 10, None, 30, (5, 6, 7, 100, 3, 2**40)),
    o.Deliver("grp", "c", 10, 0, None, range(1000, 2000)),
    o.DeliverUntracked("grp", ()),
    o.Schedule("grp", ((9, 100), (4, 2**50), (4, 0))),
    o.Advance("grp", 2**62, False),
    o.Remove("grp", o.RemoveReason.EVICTED, (3, 1)),
    o.AckUnknown("grp", 2**63),
    o.Release("grp", 77, (1,)),
    o.Claim("grp", "c", 0, (8, 9)),
    o.DeleteConsumer("grp", "c"),
    o.RestoreGroup("grp", 12, GroupCounters(1, 2, 3, 4, 5, 6, 7)),
    o.RestoreConsumer("grp", "c", 10, None),
    o.RestorePending(
        "grp",
        (
            o.PendingRecord(5, "a", 1, 2, 3, None, 4, None),
            o.PendingRecord(2, None, 9, 8, 7, 6, 5, 4),
            o.PendingRecord(9, "b", 1, 1, 1, 0, 0, 0),
        ),
    ),
]

# The bytes of each op of EVERY_OP (after the body's count), as version 1 of the format wrote
# them before ops were typed records: data directories and replicated batches depend on them.
PINNED = [
    "0103677270aa017b22646561645f6c65747465725f73747265616d223a202264222c202264656c61795f6d73223a"
    "20302c20226578706972655f6d73223a206e756c6c2c202269646c655f72656c656173655f6d73223a206e756c6c"
    "2c20226d61785f64656c69766572696573223a206e756c6c2c20226d61785f70656e64696e67223a206e756c6c2c"
    "2022726574656e74696f6e5f686f6c64223a20747275652c202272657472795f6d73223a20357d070380d095ffbc31",
    "0203677270",
    "03036772700000",
    "0403677270af017b22646561645f6c65747465725f73747265616d223a206e756c6c2c202264656c61795f6d73223a"
    "20302c20226578706972655f6d73223a206e756c6c2c202269646c655f72656c656173655f6d73223a206e756c6c"
    "2c20226d61785f64656c69766572696573223a206e756c6c2c20226d61785f70656e64696e67223a206e756c6c2c"
    "2022726574656e74696f6e5f686f6c64223a2066616c73652c202272657472795f6d73223a206e756c6c7d",
    "05036772700b636f6e73756d657220c3a9fbd095ffbc3101",
    "060367727005",
    "070367727001630a001f040a03b80101c30101f8ffffffff3f01",
    "070367727001630a010001d00fe807",
    "080367727000",
    "09036772700312640980808080808080020000",
    "0a0367727080808080808080804000",
    "0b03677270030206010501",
    "0c0367727080808080808080808001",
    "0d036772704d010201",
    "0e03677270016300011002",
    "0f036772700163",
    "10036772700c01020304050607",
    "110367727001630a00",
    "12036772700201610162030a0101020300050005000908070706050e02010101010101",
]


def normalise(op: o.GroupOp) -> o.GroupOp:
    """The op as decoding gives it back: offsets as a tuple."""
    offsets = getattr(op, "offsets", None)
    return dataclasses.replace(op, offsets=tuple(offsets)) if isinstance(offsets, range) else op


def test_every_op_round_trips():
    assert {type(op) for op in EVERY_OP} == set(o.OP_TYPES)
    assert sorted(cls.CODE for cls in o.OP_TYPES) == list(range(1, len(o.OP_TYPES) + 1))
    decoded = decode_ops(encode_ops(EVERY_OP))
    assert decoded == [normalise(op) for op in EVERY_OP]


def test_the_bytes_of_every_op_are_pinned():
    for op, pinned in zip(EVERY_OP, PINNED, strict=True):
        assert encode_ops([op]) == b"\x01" + bytes.fromhex(pinned), type(op).__name__
        assert decode_ops(b"\x01" + bytes.fromhex(pinned)) == [normalise(op)]


def test_a_contiguous_delivery_encodes_in_a_few_bytes():
    small = encode_ops([o.Deliver("g", "c", 0, None, None, range(1_000_000, 1_001_000))])
    assert len(small) < 16


def test_malformed_op_bytes_raise_corruption_error():
    body = encode_ops(EVERY_OP)
    for cut in (1, len(body) // 2, len(body) - 1):
        with pytest.raises(CorruptionError):
            decode_ops(body[:cut])
    with pytest.raises(CorruptionError):
        decode_ops(b"\x01\x63")  # unknown op code 99
    with pytest.raises(CorruptionError):
        decode_ops(body + b"\x00")


def test_snapshot_round_trip_and_damage():
    raw = encode_snapshot(4, EVERY_OP, 77)
    generation, ops, op_seq = decode_snapshot(raw)
    assert (generation, ops, op_seq) == (4, [normalise(op) for op in EVERY_OP], 77)
    for pos in (0, 9, HEADER_SIZE - 1, HEADER_SIZE, len(raw) - 1):
        damaged = bytearray(raw)
        damaged[pos] ^= 0x10
        with pytest.raises(CorruptionError):
            decode_snapshot(bytes(damaged))
    with pytest.raises(CorruptionError):
        decode_snapshot(raw[:-1])


def test_a_version_1_snapshot_stands_at_op_seq_0():
    """Snapshots written before the op sequence number existed still load."""
    body = encode_ops(EVERY_OP)
    head = grouplog._SNAPSHOT_HEADER.pack(b"SLGS", 1, 0, 3, len(body), crc32c(body))
    raw = head + grouplog._U32.pack(crc32c(head)) + body
    assert decode_snapshot(raw) == (3, [normalise(op) for op in EVERY_OP], 0)


# ---------------------------------------------------------------------- the journal's valid prefix


def build_journal(tmp_path: Path) -> tuple[GroupLog, list[dict], list[int]]:
    """A journal of several records; returns the log, the state after each record, and record starts."""
    directory = tmp_path / "s"
    directory.mkdir()
    state = GroupSet()
    journal = GroupLog(FileSystem(), directory, 8192)
    group = state.create("g", GroupConfig(retry_ms=100, max_deliveries=3), 0, 0, 1000)
    journal.checkpoint(state.snapshot_ops(), 0)
    state.drain()
    states = [state.dump()]
    starts = []
    calls = [
        lambda: group.deliver("a", 1001, 100, None, range(0, 10)),
        lambda: group.ack(1002, [1, 3], [(5, 7)]),
        lambda: group.nack(1003, [0, 9], 50),
        lambda: (group.schedule([(12, 5000)]), group.advance(13, True)),
        lambda: group.deliver("b", 1004, None, 2000, [0, 2, 12]),
    ]
    for call in calls:
        call()
        starts.append(journal.used_bytes)
        journal.append(encode_ops(state.drain()))
        states.append(state.dump())
    starts.append(journal.used_bytes)
    return journal, states, starts


def recover(snapshot: bytes, journal_raw: bytes) -> dict:
    generation, ops, _ = decode_snapshot(snapshot)
    journal_ops, _, _, _ = scan_journal(journal_raw, generation)
    state = GroupSet()
    for op in ops + journal_ops:
        state.apply(op)
    return state.dump()


def test_truncation_at_every_byte_of_the_last_record_cuts_it(tmp_path):
    journal, states, starts = build_journal(tmp_path)
    directory = journal.directory
    snapshot = (directory / SNAPSHOT_FILE).read_bytes()
    raw = (directory / journal_name(journal.generation)).read_bytes()
    journal.close()
    assert recover(snapshot, raw) == states[-1]
    first, end = starts[-2], starts[-1]
    for k in range(first, end):
        zeroed = raw[:k] + bytes(len(raw) - k)  # torn write into the preallocated file
        assert recover(snapshot, zeroed) == states[-2], k
        assert recover(snapshot, raw[:k]) == states[-2], k  # the file itself cut short


def test_a_bit_flip_in_the_last_record_cuts_it(tmp_path):
    journal, states, starts = build_journal(tmp_path)
    directory = journal.directory
    snapshot = (directory / SNAPSHOT_FILE).read_bytes()
    raw = (directory / journal_name(journal.generation)).read_bytes()
    journal.close()
    first, end = starts[-2], starts[-1]
    for k in range(first, end):
        for bit in (0x01, 0x80):
            flipped = bytearray(raw)
            flipped[k] ^= bit
            assert recover(snapshot, bytes(flipped)) == states[-2], (k, bit)


def test_damage_in_the_middle_cuts_everything_after_it(tmp_path):
    journal, states, starts = build_journal(tmp_path)
    raw = bytearray((journal.directory / journal_name(journal.generation)).read_bytes())
    snapshot = (journal.directory / SNAPSHOT_FILE).read_bytes()
    journal.close()
    raw[starts[2] + 9] ^= 0xFF
    assert recover(snapshot, bytes(raw)) == states[2]
    _, records, end, cut = scan_journal(bytes(raw), decode_snapshot(snapshot)[0])
    assert (records, end) == (2, starts[2]) and "CRC" in cut


def test_a_journal_of_another_generation_is_not_replayed(tmp_path):
    journal, _, _ = build_journal(tmp_path)
    raw = (journal.directory / journal_name(journal.generation)).read_bytes()
    journal.close()
    ops, records, _, cut = scan_journal(raw, journal.generation + 1)
    assert (ops, records) == ([], 0) and "generation" in cut


# ---------------------------------------------------------------------- through the engine


def fault_engine(fs: FaultFS, clock, fsync: str = "always") -> Engine:
    return Engine(ROOT, EngineConfig(**{**SMALL, "fsync": fsync}), clock=clock, fs=fs)


def durable_view(state: dict) -> dict:
    """Group state without what a crash may legitimately roll back: seen and activity times."""
    return {
        name: {k: v for k, v in group.items() if k not in ("consumers", "active_ms")}
        for name, group in state.items()
    }


def test_engine_recovers_a_torn_journal_and_starts_a_fresh_one(tmp_path, clock):
    config = EngineConfig(**SMALL)
    engine = Engine(tmp_path, config, clock=clock)
    engine.append("s", AppendBatch([b"x"] * 10))
    engine.create_group("s", "g")
    engine.read_group("s", "g", GroupReadOptions("a", 4))
    before = engine._groups.dump("s")
    engine.ack("s", "g", [0, 1])
    engine.close()
    directory = tmp_path / "streams" / "s"
    (journal_path,) = directory.glob("*.journal")
    raw = bytearray(journal_path.read_bytes())
    last = raw.rstrip(b"\x00")
    raw[len(last) - 3] ^= 0x04  # damage the ack's record
    journal_path.write_bytes(bytes(raw))
    engine = Engine(tmp_path, config, clock=clock)
    assert engine._groups.dump("s") == before
    (fresh,) = directory.glob("*.journal")
    assert fresh.name != journal_path.name  # appends never land in front of the cut tail
    assert engine.ack("s", "g", [0, 1]).acknowledged == 2
    engine.close()


def test_a_lost_record_never_resurrects_the_ones_after_it(clock):
    fs = FaultFS()
    fs.prepare_dir(ROOT)
    engine = fault_engine(fs, clock, "no")
    engine.append("s", AppendBatch([b"x"] * 10))
    engine.create_group("s", "g")  # a checkpoint: durable
    engine.read_group("s", "g", GroupReadOptions("a", 4))  # record 1: its write is dropped by the crash
    engine.ack("s", "g", [0, 1, 2, 3])  # record 2: its write survives the crash

    def fate(write) -> str:
        return "drop" if write.path.endswith(".journal") and write.index == 0 else "keep"

    crashed = fs.crashed_copy(mode="power", fate=fate)
    engine = fault_engine(crashed, clock, "no")
    assert engine.pending("s", "g").count == 0 and engine.group_info("s", "g").cursor == 0
    engine.read_group("s", "g", GroupReadOptions("b", 1))  # lands at the start of the new journal
    again = fault_engine(crashed.crashed_copy(mode="process"), clock, "no")
    state = again._groups.dump("s")["g"]
    assert sorted(state["pending"]) == [0] and state["counters"]["acked"] == 0


def test_crash_at_every_sync_point_gives_the_state_before_or_after_the_call(clock, monkeypatch):
    monkeypatch.setattr(storage.engine, "GROUP_JOURNAL_BYTES", 2048)  # checkpoint every few dozen calls
    fs = FaultFS()
    fs.prepare_dir(ROOT)
    engine = fault_engine(fs, clock, "always")
    engine.append("s", AppendBatch([b"e%d" % i for i in range(60)]))
    engine.create_group("s", "g", config=GroupConfig(retry_ms=30))
    states = [durable_view(engine._groups.dump("s"))]
    crashes: list[tuple[FaultFS, int]] = []
    rng = random.Random(7)
    fs.on_sync = lambda f: crashes.append(
        (f.crashed_copy(rng, rng.choice(["lost", "power"])), len(states) - 1)
    )
    calls = 0
    while calls < 150:
        step = calls % 3
        if step == 0:
            engine.read_group("s", "g", GroupReadOptions(f"c{calls % 2}", 2))
        elif step == 1:
            engine.ack("s", "g", [o for o in range(60) if rng.random() < 0.1])
        else:
            engine.nack("s", "g", [rng.randrange(60)], delay_ms=5)
            clock.advance(10)
        states.append(durable_view(engine._groups.dump("s")))
        calls += 1
    fs.on_sync = None
    generations = {name for name in fs.listdir(ROOT / "streams" / "s") if name.endswith(".journal")}
    assert len(generations) == 1 and journal_name(3) <= min(generations)  # several checkpoints
    assert len(crashes) > 150
    for crashed, done in crashes:
        recovered = durable_view(fault_engine(crashed, clock, "always")._groups.dump("s"))
        allowed = states[done : done + 2]
        assert recovered in allowed, f"crash after call {done}"


def test_a_damaged_snapshot_leaves_the_stream_readable_and_groups_refusing(tmp_path, clock):
    config = EngineConfig(**SMALL)
    engine = Engine(tmp_path, config, clock=clock)
    engine.append("s", AppendBatch([b"x"] * 3))
    engine.create_group("s", "g")
    engine.close()
    path = tmp_path / "streams" / "s" / SNAPSHOT_FILE
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01
    path.write_bytes(bytes(raw))
    engine = Engine(tmp_path, config, clock=clock)
    assert engine.read("s", 0, 10).count == 3
    with pytest.raises(CorruptionError):
        engine.read_group("s", "g", GroupReadOptions("a", 1))
    engine.close()
    assert path.read_bytes() == bytes(raw)  # left alone for whoever repairs it


def test_leftover_journals_are_removed_at_start_up(tmp_path, clock):
    config = EngineConfig(**SMALL, small_streams="off")  # "t", with no group, has a directory
    engine = Engine(tmp_path, config, clock=clock)
    engine.append("s", AppendBatch([b"x"]))
    engine.append("t", AppendBatch([b"x"]))
    engine.create_group("s", "g")
    engine.close()
    s_dir, t_dir = tmp_path / "streams" / "s", tmp_path / "streams" / "t"
    (s_dir / journal_name(9)).write_bytes(b"stale")  # a checkpoint that crashed part-way
    # A first checkpoint that never wrote its snapshot (its registry entry came first: groupregistry.py).
    (t_dir / journal_name(1)).write_bytes(b"stale")
    (tmp_path / GROUPS_DIR / "t").write_bytes(b"t")
    engine = Engine(tmp_path, config, clock=clock)
    assert sorted(p.name for p in s_dir.glob("*.journal")) == [journal_name(1)]
    assert list(t_dir.glob("*.journal")) == []
    assert sorted(p.name for p in (tmp_path / GROUPS_DIR).iterdir()) == ["s"]
    assert [i.name for i in engine.list_groups("s")] == ["g"]
    engine.close()


def test_a_journal_is_at_least_twice_the_snapshot_before_it(tmp_path):
    """So rewriting a long pending list costs in proportion to the calls made since the last one."""
    state = GroupSet()
    group = state.create("g", GroupConfig(), 0, 0, 1000)
    group.deliver("a", 1000, 5, 60_000, list(range(0, 20_000, 3)))
    journal = GroupLog(FileSystem(), tmp_path, 2048)
    journal.checkpoint(state.snapshot_ops(), 0)
    snapshot_bytes = (tmp_path / SNAPSHOT_FILE).stat().st_size
    assert snapshot_bytes > 2048
    assert journal.capacity_bytes >= 2 * (snapshot_bytes - HEADER_SIZE)
    assert (tmp_path / journal_name(1)).stat().st_size == journal.capacity_bytes
    journal.close()


def test_a_replica_rebuilds_group_state_from_a_snapshot_and_the_same_ops(tmp_path, clock, monkeypatch):
    """What replication will rely on: another node's store, given the leader's snapshot ops and
    then the ops of later calls, holds the same groups, durably (issue 15)."""
    config = EngineConfig(**SMALL)
    leader = Engine(tmp_path / "leader", config, clock=clock)
    replica = Engine(tmp_path / "replica", config, clock=clock)
    for engine in (leader, replica):
        engine.append("s", AppendBatch([b"x"] * 20, deliver_at_ms=[0] * 19 + [clock() + 60_000]))
    leader.create_group("s", "g", config=GroupConfig(retry_ms=50, max_deliveries=3))
    leader.read_group("s", "g", GroupReadOptions("a", 8))
    leader.ack("s", "g", ranges=[(0, 3)])
    replica._groups.stores.apply_ops("s", leader._groups.stores.snapshot_ops("s"))
    assert replica._groups.dump("s") == leader._groups.dump("s")
    shipped: list[o.GroupOp] = []  # the ops of the leader's calls from here on, as its journal gets them
    state = leader._groups.stores.get("s").state
    drain = state.drain

    def drain_and_ship() -> list[o.GroupOp]:
        ops = drain()
        shipped.extend(ops)
        return ops

    monkeypatch.setattr(state, "drain", drain_and_ship)
    leader.nack("s", "g", [4], delay_ms=10)
    leader.read_group("s", "g", GroupReadOptions("b", 30))
    leader.delete_consumer("s", "g", "a")
    leader.create_group("s", "h", start="newest")
    assert {type(op) for op in shipped} >= {o.Release, o.Deliver, o.Schedule, o.DeleteConsumer, o.CreateGroup}
    replica._groups.stores.apply_ops("s", shipped)
    expected = leader._groups.dump("s")
    assert replica._groups.dump("s") == expected
    replica.close()
    assert Engine(tmp_path / "replica", config, clock=clock)._groups.dump("s") == expected
    leader.close()
