"""Storage's side of replicating consumer-group state (storage/groupstore.py, issue 15).

A leader's groups number their op batches (`group_seq`, durable with the journal),
keep recent batches once a follower took a snapshot (`group_ops_since`), and a
follower's passive groups apply them (`apply_group_ops`, `install_group_snapshot`)
without acting on their own until they are made active.
"""

from __future__ import annotations

import pytest

from storage import AppendBatch, Engine, EngineConfig, GroupConfig, GroupReadOptions, groupstore
from storage.catalog import NO_PLACE
from storage.errors import CorruptionError, InvalidArgumentError, PreconditionError
from storage.groupops import encode_ops

from .conftest import SMALL


def _engine(path, clock, **overrides) -> Engine:
    return Engine(path, EngineConfig(**{**SMALL, **overrides}), clock=clock)


def _calls(engine: Engine) -> None:
    """A few group calls of every kind that changes state."""
    engine.read_group("s", "g", GroupReadOptions("a", 8))
    engine.ack("s", "g", ranges=[(0, 3)])
    engine.nack("s", "g", [4], delay_ms=10)
    engine.claim("s", "g", "b", 0, [5, 6])
    engine.delete_consumer("s", "g", "a")
    engine.set_group_config("s", "g", GroupConfig(retry_ms=70, max_deliveries=4))


@pytest.fixture
def leader(tmp_path, clock):
    engine = _engine(tmp_path / "leader", clock)
    engine.append("s", AppendBatch([b"x"] * 20))
    engine.create_group("s", "g", config=GroupConfig(retry_ms=50, max_deliveries=3))
    yield engine
    engine.close()


def test_the_op_seq_counts_batches_and_survives_restart_and_checkpoints(tmp_path, clock):
    engine = _engine(tmp_path / "d", clock)
    engine.append("s", AppendBatch([b"x"] * 20))
    assert engine.group_seq("s") == 0
    engine.create_group("s", "g")
    assert engine.group_seq("s") == 1
    _calls(engine)
    assert engine.group_seq("s") == 7
    engine.close()
    engine = _engine(tmp_path / "d", clock)
    assert engine.group_seq("s") == 7  # snapshot (1) + 6 journal records replayed
    engine._groups.stores.get("s").maintain_journal(engine.fsync_policy("s"))
    engine._groups.stores.get("s").log.checkpoint(engine._groups.stores.snapshot_ops("s"), 7)
    engine.read_group("s", "g", GroupReadOptions("c", 2))
    engine.close()
    engine = _engine(tmp_path / "d", clock)
    assert engine.group_seq("s") == 8
    engine.close()


def test_a_full_journal_checkpoints_and_the_seq_goes_on(tmp_path, clock):
    engine = _engine(tmp_path / "d", clock)
    engine.append("s", AppendBatch([b"x"] * 60))
    engine.create_group("s", "g")
    for i in range(400):  # each read a record; the journal (segment_bytes caps it) fills and checkpoints
        engine.read_group("s", "g", GroupReadOptions(f"consumer-{i}-{'x' * 200}", 1))
    assert engine._groups.stores.get("s").log.generation > 1
    assert engine.group_seq("s") == 401
    engine.close()
    engine = _engine(tmp_path / "d", clock)
    assert engine.group_seq("s") == 401
    engine.close()


def test_no_batch_is_retained_until_a_follower_takes_a_snapshot(leader):
    """The single-node path keeps nothing for followers it does not have."""
    _calls(leader)
    assert leader._groups.stores.get("s").retained is None
    assert leader.group_ops_since("s", 3) is None
    assert leader.group_ops_since("s", leader.group_seq("s")) == []


def test_snapshots_of_streams_with_no_group_make_no_store_on_either_side(tmp_path, clock):
    """A cluster leader snapshots every stream it replicates and its followers install each
    snapshot: for the many with no group, no store (memory, files) on either side, and the
    streams stay in their slots."""
    leader = _engine(tmp_path / "leader", clock)
    follower = _engine(tmp_path / "follower", clock, groups_passive=True)
    names = [f"s{i}" for i in range(50)]
    for name in names:
        leader.append(name, AppendBatch([b"x"]))
        follower.append(name, AppendBatch([b"x"]))
        seq, body = leader.group_snapshot(name)
        assert (seq, body) == (0, encode_ops([]))
        follower.install_group_snapshot(name, seq, body)
        assert leader.group_seq(name) == follower.group_seq(name) == 0
        assert leader.group_ops_since(name, 0) == []
    assert leader._groups.stores.all() == follower._groups.stores.all() == []
    assert all(engine._catalog.place(name) != NO_PLACE for engine in (leader, follower) for name in names)
    assert follower._groups.dump("s0") == {}
    leader.close()
    follower.close()


def test_a_group_made_after_a_snapshot_of_none_ships_as_a_batch(tmp_path, clock):
    """The snapshot of a stream with no store still starts the retention of its batches: the
    store its first group makes keeps them, and tells the batch listeners (a waiting fetch)."""
    leader = _engine(tmp_path / "leader", clock)
    leader.append("s", AppendBatch([b"x"] * 5))
    made: list[tuple[str, int]] = []
    leader.add_group_batch_listener(lambda stream, seq: made.append((stream, seq)))
    seq, _ = leader.group_snapshot("s")
    leader.create_group("s", "g")
    leader.read_group("s", "g", GroupReadOptions("a", 2))
    assert made == [("s", 1), ("s", 2)]
    batches = leader.group_ops_since("s", seq)
    assert [n for n, _ in batches] == [1, 2]
    follower = _engine(tmp_path / "follower", clock, groups_passive=True)
    follower.append("s", AppendBatch([b"x"] * 5))
    follower.install_group_snapshot("s", seq, encode_ops([]))  # the one taken before the group
    for n, ops in batches:
        follower.apply_group_ops("s", n, ops)
    assert follower._groups.dump("s") == leader._groups.dump("s")
    leader.append("u", AppendBatch([b"x"]))
    leader.group_snapshot("u")
    leader.set_groups_active("u", False)  # a leader no more: it keeps no batches for that snapshot
    leader.set_groups_active("u", True)
    leader.create_group("u", "g")
    assert leader.group_ops_since("u", 0) is None  # a snapshot is needed
    assert made == [("s", 1), ("s", 2)]
    leader.close()
    follower.close()


def test_a_follower_follows_snapshot_then_batches_and_restarts_at_the_same_seq(leader, tmp_path, clock):
    follower = _engine(tmp_path / "follower", clock, groups_passive=True)
    follower.append("s", AppendBatch([b"x"] * 20))
    seq, body = leader.group_snapshot("s")
    follower.install_group_snapshot("s", seq, body)
    assert follower.group_seq("s") == seq == 1
    _calls(leader)
    batches = leader.group_ops_since("s", seq)
    assert [n for n, _ in batches] == list(range(2, 8))
    assert leader.group_ops_since("s", 4) == batches[3:]
    for n, ops in batches:
        follower.apply_group_ops("s", n, ops)
    expected = leader._groups.dump("s")
    assert follower._groups.dump("s") == expected
    assert follower.group_seq("s") == 7
    follower.close()
    follower = _engine(tmp_path / "follower", clock, groups_passive=True)
    assert follower.group_seq("s") == 7
    assert follower._groups.dump("s") == expected
    follower.close()


@pytest.mark.parametrize("first", ["snapshot", "ops"])
def test_a_followers_stream_in_a_slot_moves_to_a_directory_before_its_groups_land(
    leader, tmp_path, clock, first
):
    """Group files live in a stream's directory: a stream in a slot (a new small stream's place by
    default) is promoted first, whether a snapshot or an op batch brings its first group."""
    follower = _engine(tmp_path / "follower", clock, groups_passive=True)
    follower.append("s", AppendBatch([b"x"] * 20))
    assert follower._catalog.place("s") != NO_PLACE
    if first == "snapshot":
        follower.install_group_snapshot("s", *leader.group_snapshot("s"))
    else:
        follower.apply_group_ops("s", 1, encode_ops(leader._groups.stores.snapshot_ops("s")))
    assert follower._catalog.place("s") == NO_PLACE and follower.group_seq("s") == 1
    expected = leader._groups.dump("s")
    assert follower._groups.dump("s") == expected
    follower.close()
    follower = _engine(tmp_path / "follower", clock, groups_passive=True)
    assert follower._groups.dump("s") == expected
    assert [e.payload for e in follower.read("s", 0, 30).entries()] == [b"x"] * 20
    follower.close()


def test_batches_out_of_sequence_or_malformed_are_refused(leader, tmp_path, clock):
    follower = _engine(tmp_path / "follower", clock, groups_passive=True)
    follower.append("s", AppendBatch([b"x"] * 20))
    follower.install_group_snapshot("s", *leader.group_snapshot("s"))
    _calls(leader)
    batches = leader.group_ops_since("s", 1)
    with pytest.raises(PreconditionError):
        follower.apply_group_ops("s", *batches[1])  # batch 3 before batch 2
    with pytest.raises(CorruptionError):
        follower.apply_group_ops("s", 2, b"\x01\x63")  # unknown op code
    with pytest.raises(InvalidArgumentError):
        follower.apply_group_ops("s", 2, encode_ops([]))
    with pytest.raises(CorruptionError):
        follower.install_group_snapshot("s", 9, b"\xff\xff")
    assert follower.group_seq("s") == 1
    follower.apply_group_ops("s", *batches[0])
    assert follower.group_seq("s") == 2
    follower.close()


def test_a_snapshot_replaces_whatever_the_follower_held(leader, tmp_path, clock):
    follower = _engine(tmp_path / "follower", clock)
    follower.append("s", AppendBatch([b"x"] * 20))
    follower.create_group("s", "stale")
    follower.create_group("s", "other")
    follower.set_groups_active("s", False)
    _calls(leader)
    follower.install_group_snapshot("s", *leader.group_snapshot("s"))
    assert follower._groups.dump("s") == leader._groups.dump("s")
    assert follower.group_seq("s") == leader.group_seq("s")
    leader.delete_group("s", "g")
    follower.install_group_snapshot("s", *leader.group_snapshot("s"))  # no groups: the files go
    assert follower._groups.dump("s") == {}
    follower.close()
    follower = _engine(tmp_path / "follower", clock)
    assert follower._groups.dump("s") == {}
    follower.close()


def test_retention_is_bounded_by_bytes_then_a_snapshot_is_needed(leader, monkeypatch):
    monkeypatch.setattr(groupstore, "RETAINED_BATCH_BYTES", 200)
    start, _ = leader.group_snapshot("s")
    for i in range(40):
        leader.read_group("s", "g", GroupReadOptions(f"c{i}", 1))
    store = leader._groups.stores.get("s")
    assert store.retained_bytes <= 200 and len(store.retained) < 40
    assert leader.group_ops_since("s", start) is None
    first = store.retained[0][0]
    assert [n for n, _ in leader.group_ops_since("s", first - 1)] == list(range(first, start + 41))
    assert len(leader.group_ops_since("s", first - 1, max_bytes=1)) == 1  # at least one
    assert leader.group_ops_since("s", start + 40) == []
    assert leader.group_ops_since("s", start + 41) is None  # not one of its seqs


def test_a_passive_store_acts_on_nothing_until_made_active(leader, tmp_path, clock):
    """No deliveries, no expiry, no dead letters on a follower; active, it carries on from its state."""
    leader.set_group_config(
        "s", "g", GroupConfig(retry_ms=50, expire_ms=1000, max_deliveries=3, dead_letter_stream="dead")
    )
    leader.read_group("s", "g", GroupReadOptions("a", 5))
    follower = _engine(tmp_path / "follower", clock, groups_passive=True)
    follower.append("s", AppendBatch([b"x"] * 20))
    follower.install_group_snapshot("s", *leader.group_snapshot("s"))
    clock.advance(5000)  # past every entry's expiry
    follower._groups.maintain()
    assert follower._groups.dump("s") == leader._groups.dump("s")
    assert not follower.exists("dead")
    assert follower.group_streams() == []
    for call in (
        lambda: follower.read_group("s", "g", GroupReadOptions("a", 5)),
        lambda: follower.ack("s", "g", [0]),
        lambda: follower.list_groups("s"),
        lambda: follower.create_group("s", "h"),
    ):
        with pytest.raises(PreconditionError):
            call()
    follower.set_groups_active("s", True)
    assert follower.group_streams() == ["s"]
    follower._groups.maintain()  # now it expires them, dead-lettering them as the leader would
    assert follower.group_info("s", "g").pending == 0
    assert follower.read("dead", 0, 10).count == 5
    follower.close()
    follower = _engine(tmp_path / "follower", clock, groups_passive=True)
    with pytest.raises(PreconditionError):  # passive again after a restart: the cluster says when it leads
        follower.ack("s", "g", [0])
    follower.close()
