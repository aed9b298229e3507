"""Moves as rules: the controller's steps (cluster/reassign.py), the CLI's plans (clients/_rebalance.py)."""

from __future__ import annotations

import collections
import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from clients import _rebalance
from clients.types import StreamPlacement as Described
from cluster.errors import PlacementError
from cluster.etcd import KeyValue
from cluster.placement import StreamPlacement
from cluster.reassign import cancelled, copying, next_step, replace_dead, replica_load


def record(
    replicas: str, leader: str, isr: str, target: str = "", epoch: int = 5, added: str = ""
) -> StreamPlacement:
    return StreamPlacement(
        "s", 1, 1, tuple(replicas), leader, epoch, tuple(isr), {}, tuple(target), tuple(added)
    )


def test_a_target_survives_the_round_trip_through_etcd_and_an_old_record_has_none() -> None:
    moving = record("abc", "a", "abc", target="dbc")
    kv = KeyValue(b"/test/streams/s", moving.to_json(), 1, 1, 0)
    assert StreamPlacement.from_kv("s", kv) == moving
    old = json.dumps({"replicas": ["a"], "leader": "a", "epoch": 1, "isr": ["a"], "config": {}}).encode()
    assert StreamPlacement.from_kv("s", KeyValue(b"/test/streams/s", old, 1, 1, 0)).target == ()
    assert b"target" not in record("abc", "a", "abc").to_json()  # records without a move are unchanged
    in_progress = record("abcd", "a", "abc", target="dbc", added="d")
    kv = KeyValue(b"/test/streams/s", in_progress.to_json(), 1, 1, 0)
    assert StreamPlacement.from_kv("s", kv) == in_progress
    for broken in (record("abc", "a", "abc", target="dbc", added="d"), record("abcd", "a", "abc", added="d")):
        with pytest.raises(PlacementError, match="added"):
            broken.check()


def test_a_move_adds_the_new_replicas_outside_the_in_sync_set_then_waits_for_them() -> None:
    moving = record("abc", "a", "abc", target="dbc")
    assert next_step(moving, set("abcd"), may_start=False) is None  # no slot: it waits
    added = next_step(moving, set("abcd"), may_start=True)
    assert (added.replicas, added.isr, added.leader, added.epoch) == (tuple("abcd"), tuple("abc"), "a", 5)
    assert added.added == ("d",)  # what a cancel drops
    assert copying(added) and not copying(moving)
    assert added.replica_count == 3  # acks=quorum still needs 2 of 3, not 3 of 4
    assert next_step(added, set("abcd"), may_start=True) is None  # d is catching up


def test_a_move_finishes_once_the_target_is_in_sync_the_leader_moving_at_a_new_epoch() -> None:
    caught_up = record("abcd", "a", "abcd", target="dbc")
    done = next_step(caught_up, set("abcd"), may_start=False)
    assert (done.replicas, done.isr, done.leader, done.epoch, done.target) == (
        tuple("dbc"),
        tuple("dbc"),
        "d",
        6,
        (),
    )
    # The preferred node is down: a leader in the target stays, at the same epoch.
    stays = next_step(record("abcd", "b", "abcd", target="dbc"), set("abc"), may_start=False)
    assert (stays.leader, stays.epoch) == ("b", 5)
    # A leader only (the same replicas in another order): a preferred leader election.
    swapped = next_step(record("abc", "a", "abc", target="bac"), set("abc"), may_start=False)
    assert (swapped.replicas, swapped.leader, swapped.epoch) == (tuple("bac"), "b", 6)


def test_a_move_to_another_replica_count_records_it_as_the_replication_factor() -> None:
    """As kafka-reassign-partitions: the target's size is the stream's replica count from then on."""
    config = {"replication_factor": 3, "acks": "quorum", "stream": {"max_entries": 10}}
    growing = dataclasses.replace(record("abcde", "a", "abcde", target="abcde"[::-1]), config=config)
    shrinking = dataclasses.replace(record("abc", "a", "a", target="a"), config=config)
    for moving, count in ((growing, 5), (shrinking, 1)):
        done = next_step(moving, set("abcde"), may_start=False)
        assert done.config == {**config, "replication_factor": count}
        assert done.replica_count == count
    # Moving to as many replicas leaves it as it was.
    same = dataclasses.replace(record("abcd", "a", "abcd", target="dbc"), config={"replication_factor": 3})
    assert next_step(same, set("abcd"), may_start=False).config == {"replication_factor": 3}


def test_a_cancel_drops_what_the_move_added_and_keeps_the_replicas_and_leader_it_had() -> None:
    # Moving a,b,c to d,e,c: d and e added, d caught up, e copying; a still leads.
    moving = record("abcde", "a", "abcd", target="dec", added="de")
    back = cancelled(moving)
    assert (back.replicas, back.isr, back.leader, back.epoch, back.target, back.added) == (
        tuple("abc"),
        tuple("abc"),
        "a",
        5,
        (),
        (),
    )
    # Nothing added yet (no slot): only the target goes.
    waiting = record("abc", "a", "ab", target="dbc")
    assert cancelled(waiting) == record("abc", "a", "ab")
    # A move that finished (or none): nothing to undo.
    assert cancelled(record("dec", "d", "dec")) is None
    # The leader is one the move added (the old ones failed meanwhile): an in-sync old one leads,
    # at a new epoch; with none in sync, undoing it would lose what is committed.
    taken_over = cancelled(record("abd", "d", "bd", target="d", added="d"))
    assert (taken_over.replicas, taken_over.isr, taken_over.leader, taken_over.epoch) == (
        ("a", "b"),
        ("b",),
        "b",
        6,
    )
    with pytest.raises(PlacementError, match="cannot be undone"):
        cancelled(record("abd", "d", "d", target="d", added="d"))


def test_a_stream_without_a_leader_does_not_move() -> None:
    assert next_step(record("abc", "", "abc", target="dbc"), set("bcd"), may_start=True) is None


def test_a_dead_nodes_replicas_go_to_the_least_loaded_live_nodes_that_lack_them() -> None:
    load = {"d": 5, "e": 1, "f": 1}
    moved = replace_dead(record("abc", "a", "ab"), {"c"}, "abdef", load)
    assert moved.target == tuple("abe")
    # A moving stream's target is what gets repaired.
    assert replace_dead(record("abc", "a", "abc", target="abd"), {"d"}, "abcef", load).target == tuple("abe")
    assert replace_dead(record("abc", "a", "ab"), {"c"}, "abc", load) is None  # no live node to take it
    assert replace_dead(record("abc", "a", "abc"), {"z"}, "abcd", load) is None  # nothing on a dead node
    assert replica_load([record("abc", "a", "abc", target="abd")]) == collections.Counter("abcd")


def described(name: str, replicas: str, leader: str | None = None, target: str = "") -> Described:
    return Described(
        name,
        replicas[0] if leader is None else leader,
        list(replicas),
        list(replicas),
        1,
        len(replicas),
        "quorum",
        target_replicas=list(target),
    )


def apply(streams: list[Described], moves: list[_rebalance.Move]) -> dict[str, tuple[str, ...]]:
    placed = {s.name: tuple(s.replicas) for s in streams}
    placed.update({m.stream: m.target for m in moves})
    return placed


@given(st.integers(min_value=1, max_value=40), st.integers(min_value=2, max_value=6), st.data())
def test_a_rebalance_evens_out_replicas_and_leaders_per_node(
    streams: int, nodes: int, data: st.DataObject
) -> None:
    old_nodes = "abcdef"[: nodes - 1] or "a"
    factor = min(3, len(old_nodes))
    layout = [
        described(f"s{i}", "".join(data.draw(st.permutations(old_nodes))[:factor])) for i in range(streams)
    ]
    sizes = {s.name: data.draw(st.integers(0, 1000)) for s in layout}
    live = "abcdef"[:nodes]
    moves = _rebalance.rebalance(layout, live, sizes)
    placed = apply(layout, moves)
    counts = collections.Counter(node for replicas in placed.values() for node in replicas)
    assert max(counts[n] for n in live) - min(counts[n] for n in live) <= 1
    assert all(len(set(r)) == len(r) == factor for r in placed.values())  # no stream loses or doubles one
    leaders = collections.Counter(replicas[0] for replicas in placed.values())
    assert max(leaders.values()) <= -(-streams // nodes)
    for move in moves:  # a stream that only changes leader keeps its replicas
        assert set(move.target) != set(move.replicas) or move.target[0] != move.leader


def test_a_rebalance_evens_out_bytes_when_counts_are_even() -> None:
    layout = [
        described("big1", "a"),
        described("big2", "a"),
        described("small1", "b"),
        described("small2", "b"),
    ]
    sizes = {"big1": 1000, "big2": 1000, "small1": 10, "small2": 10}
    placed = apply(layout, _rebalance.rebalance(layout, "ab", sizes))
    on = collections.defaultdict(int)
    for name, replicas in placed.items():
        on[replicas[0]] += sizes[name]
    assert on["a"] == on["b"] == 1010


def test_an_even_cluster_is_left_alone() -> None:
    layout = [described("s1", "abc"), described("s2", "bca"), described("s3", "cab")]
    assert _rebalance.rebalance(layout, "abc", {}) == []


def test_a_drain_moves_every_replica_off_the_node_and_nothing_else() -> None:
    layout = [described("s1", "abc"), described("s2", "bcd"), described("s3", "cda"), described("s4", "dab")]
    moves, stuck = _rebalance.drain(layout, "abcde", {}, "a")
    placed = apply(layout, moves)
    assert stuck == [] and {m.stream for m in moves} == {"s1", "s3", "s4"}
    assert all("a" not in replicas and len(set(replicas)) == 3 for replicas in placed.values())
    assert placed["s3"][0] == "c" and placed["s4"][0] == "d"  # leaders that stay, stay
    assert placed["s1"][0] in "bc"  # a leader that goes hands over to a replica in sync now


@pytest.mark.parametrize(
    ("stream", "reason"),
    [(described("s1", "abc", leader=""), "no leader"), (described("s1", "abc", target="abd"), "moving")],
)
def test_a_drain_reports_what_it_cannot_move(stream: Described, reason: str) -> None:
    assert _rebalance.drain([stream], "abcd", {}, "a") == ([], ["s1"]), reason
    assert _rebalance.drain([described("s1", "abc")], "abc", {}, "a") == ([], ["s1"])  # nowhere to go
