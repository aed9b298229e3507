"""The chaos history recorder: outcomes by status code, one order for everything, files that round-trip."""

from __future__ import annotations

import threading

import pytest

from bench.history import Appended, History, LogEntry


def test_a_status_code_decides_between_a_definite_failure_and_an_unknown_outcome():
    history = History()
    outcomes = {}
    codes = ["RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "FAILED_PRECONDITION", "UNAVAILABLE"]
    codes += ["DEADLINE_EXCEEDED", "CANCELLED", "INTERNAL", "UNKNOWN"]
    for code in codes:
        op = history.invoke("p", "append", "s", payloads=[code.encode()])
        history.failed(op, code, "details")
        outcomes[code] = op.status
        assert op.error == f"{code}: details"
    assert {code for code, status in outcomes.items() if status == "fail"} == {
        "RESOURCE_EXHAUSTED",
        "INVALID_ARGUMENT",
        "FAILED_PRECONDITION",
    }
    assert history.counts() == {"append": {"fail": 3, "unknown": 5}}


def test_every_operation_and_fault_takes_a_position_in_one_order():
    history = History()
    read = history.invoke("r", "read", "s", offset=0)
    fault = history.fault_started("pause", "n1", "SIGSTOP")
    ack = history.invoke("w", "ack", "s", group="g", offsets=[1])
    history.ok(ack, 1)
    history.fault_ended(fault)
    history.unknown(read, "DEADLINE_EXCEEDED")
    assert (read.invoked, fault.started, ack.invoked, ack.completed, fault.ended, read.completed) == (
        1,
        2,
        3,
        4,
        5,
        6,
    )
    assert read.invoked_s <= fault.started_s <= ack.completed_s <= read.completed_s
    with pytest.raises(ValueError, match="completed twice"):
        history.ok(read, [])
    with pytest.raises(ValueError, match="unknown operation kind"):
        history.invoke("r", "scan", "s")
    assert history.counts() == {"read": {"unknown": 1}, "ack": {"ok": 1}}


def test_positions_stay_unique_when_threads_record_at_once():
    history = History()

    def record(name: str) -> None:
        for _ in range(500):
            history.ok(history.invoke(name, "read", "s"), [])

    threads = [threading.Thread(target=record, args=(f"t{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    positions = [p for op in history.operations for p in (op.invoked, op.completed)]
    assert sorted(positions) == list(range(1, 4001))
    assert [op.id for op in history.operations] == list(range(2000))


def test_the_faults_around_an_operation_are_those_under_way_or_just_before_and_the_next_ones_after():
    history = History()
    old = history.fault_started("kill", "n1")
    history.fault_ended(old)
    active = history.fault_started("partition", "n2")
    op = history.invoke("p", "append", "s", payloads=[b"x"])
    history.unknown(op, "UNAVAILABLE")
    history.fault_ended(active)
    later = [history.fault_started(kind, "n3") for kind in ("pause", "power", "reset")]
    history.fault_ended(later[0])
    history.fault_ended(later[1])
    assert history.faults_around(op, window_s=0.0, after=2) == ([active], later[:2])
    assert history.faults_around(op, window_s=3600, after=5) == ([old, active], later)
    in_flight = history.invoke("p", "read", "s")
    assert history.faults_around(in_flight, window_s=0.0, after=5) == ([later[2]], [])
    assert "never healed" in later[2].describe() and "until" in old.describe()


def test_a_saved_history_loads_back_equal(tmp_path):
    history = History()
    append = history.invoke("p", "append", "s", payloads=[b"\x00a", b"b"], producer="p1", sequence=7)
    history.ok(append, Appended(0, 1, 1234, False))
    lost = history.invoke("p", "append", "s", payloads=[b"c"], producer="p1", sequence=8)
    history.unknown(lost, "UNAVAILABLE: gone")
    read = history.invoke("r", "read", "s", offset=0)
    history.ok(read, [LogEntry(0, 1234, "tag", b"\x00a"), LogEntry(1, 1234, "", b"b")])
    group = history.invoke("w", "group_read", "s", group="g", consumer="c")
    history.ok(group, [LogEntry(1, 1234, "", b"b")])
    ack = history.invoke("w", "ack", "s", group="g", offsets=[1])
    history.ok(ack, 1)
    drain = history.invoke("w", "drain", "s", group="g")
    history.ok(drain, 2)
    history.invoke("r", "read", "s", offset=2)  # in flight at the end
    fault = history.fault_started("power", "n1", "lost")
    history.fault_ended(fault)
    history.fault_started("disk-full", "n2")
    path = tmp_path / "history.jsonl"
    history.save(path)
    loaded = History.load(path)
    assert loaded.operations == history.operations
    assert loaded.faults == history.faults
    assert isinstance(loaded.operations[0].result, Appended)
    later = loaded.invoke("p", "read", "s")
    assert later.invoked == history.faults[-1].started + 1
