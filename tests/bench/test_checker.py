"""The chaos checker on synthetic histories: a clean run passes, and each rule catches its breach.

Every test builds a small history by hand (what clients saw) and the final logs
(what the replicas hold), and asserts the exact rule, offset, node and operation
the report names; the clean baseline shows that the same shapes pass when nothing
is wrong, so no rule fires by accident.
"""

from __future__ import annotations

import pytest

from bench.checker import FinalStream, HistoryError, ReplicaLog, check, logical_appends
from bench.history import Appended, History, LogEntry, Operation

S = "s"
TS = 1_000


class Run:
    """A history under construction: each helper records one completed operation."""

    def __init__(self) -> None:
        self.history = History()

    def append(
        self,
        payloads: list[bytes],
        first: int | None = None,
        *,
        status: str = "ok",
        ts: int = TS,
        producer: str | None = None,
        sequence: int | None = None,
        stream: str = S,
        duplicate: bool = False,
    ) -> Operation:
        op = self.history.invoke(
            "producer", "append", stream, payloads=payloads, producer=producer, sequence=sequence
        )
        self._end(
            op,
            status,
            Appended(first, first + len(payloads) - 1, ts, duplicate) if first is not None else None,
        )
        return op

    def read(self, entries: list[LogEntry], *, offset: int = 0, status: str = "ok") -> Operation:
        op = self.history.invoke("reader", "read", S, offset=offset)
        self._end(op, status, entries)
        return op

    def group_read(self, entries: list[LogEntry], *, group: str = "g", status: str = "ok") -> Operation:
        op = self.history.invoke("worker", "group_read", S, group=group, consumer="c1")
        self._end(op, status, entries)
        return op

    def ack(self, offsets: list[int], *, group: str = "g", status: str = "ok") -> Operation:
        op = self.history.invoke("worker", "ack", S, group=group, offsets=offsets)
        self._end(op, status, len(offsets))
        return op

    def drain(self, end: int, *, group: str = "g") -> Operation:
        op = self.history.invoke("worker", "drain", S, group=group)
        self._end(op, "ok", end)
        return op

    def _end(self, op: Operation, status: str, result: object) -> None:
        if status == "ok":
            self.history.ok(op, result)
        elif status == "fail":
            self.history.failed(op, "RESOURCE_EXHAUSTED", "disk full")
        elif status == "unknown":
            self.history.failed(op, "UNAVAILABLE", "connection lost")
        # "in flight": never completed


def entries(payloads: list[bytes], first: int = 0, ts: int = TS) -> list[LogEntry]:
    return [LogEntry(first + i, ts, "", p) for i, p in enumerate(payloads)]


def final(
    logs: dict[str, list[LogEntry]],
    *,
    leader: str = "n1",
    isr: tuple[str, ...] | None = None,
    committed: int | None = None,
    first: int = 0,
) -> dict[str, FinalStream]:
    replica_logs = {node: ReplicaLog(node, first, log) for node, log in logs.items()}
    lead = logs.get(leader, [])
    end = lead[-1].offset + 1 if lead else first
    return {
        S: FinalStream(
            S,
            leader,
            isr if isr is not None else tuple(logs),
            end if committed is None else committed,
            replica_logs,
        )
    }


def rules(report) -> list[tuple[str, int | None, str, int | None]]:
    return [(v.rule, v.offset, v.node, v.op) for v in report.violations]


ABC = [b"a", b"b", b"c"]
DE = [b"d", b"e"]


def clean_run() -> tuple[Run, dict[str, FinalStream]]:
    """Appends (one retried after an unknown outcome), reads, a group that acks and drains: all true."""
    run = Run()
    run.append(ABC, 0, producer="p", sequence=1)
    run.append(DE, status="unknown", producer="p", sequence=2)
    run.append(DE, 3, producer="p", sequence=2, duplicate=True)
    run.append([b"f"], status="fail", producer="p", sequence=3)
    run.append([b"g"], status="unknown", producer="q", sequence=1)  # never written: allowed
    log = entries(ABC + DE)
    run.read(log[:2])
    run.read(log[2:], offset=2)
    run.group_read(log[:3])
    run.ack([0, 1, 2])
    run.group_read(log[3:])
    run.ack([3, 4])
    run.drain(5)
    return run, final({"n1": log, "n2": list(log)})


def test_a_clean_run_passes_every_rule():
    run, streams = clean_run()
    report = check(run.history, streams)
    assert report.ok, report.text(run.history)
    assert report.text(run.history) == "no violations"
    assert report.stats["appends_ok"] == 2 and report.stats["appends_fail"] == 1
    assert report.stats["appends_unknown"] == 1 and report.stats["append_retries"] == 1
    assert report.stats["entries_acked"] == 5 and report.stats["entries_read"] == 10


def test_retries_fold_into_one_append_and_a_mismatched_retry_is_a_history_error():
    run, _ = clean_run()
    batches = logical_appends(run.history)
    assert [(b.payloads, b.status, len(b.attempts)) for b in batches] == [
        (ABC, "ok", 1),
        (DE, "ok", 2),
        ([b"f"], "fail", 1),
        ([b"g"], "unknown", 1),
    ]
    run.append([b"x"], 9, producer="p", sequence=2)
    with pytest.raises(HistoryError, match="other payloads"):
        logical_appends(run.history)


def test_the_same_payload_in_two_appends_cannot_be_checked():
    run = Run()
    run.append([b"a"], 0)
    run.append([b"a"], 1)
    with pytest.raises(HistoryError, match="appended twice"):
        check(run.history, final({"n1": entries([b"a", b"a"])}))


# ---------------------------------------------------------------------- (a) acknowledged appends


def test_an_acknowledged_entry_missing_on_an_in_sync_follower_is_lost():
    run = Run()
    op = run.append(ABC, 0)
    log = entries(ABC)
    report = check(run.history, final({"n1": log, "n2": log[:2]}, committed=3))
    assert ("lost", 2, "n2", op.id) in rules(report)
    assert ("not-prefix", 2, "n2", None) in rules(report)


def test_a_replica_outside_the_in_sync_set_may_lag():
    run = Run()
    run.append(ABC, 0)
    log = entries(ABC)
    assert check(run.history, final({"n1": log, "n2": log[:1]}, isr=("n1",))).ok


def test_an_acknowledged_entry_missing_on_the_leader_is_lost():
    run = Run()
    op = run.append(ABC, 0)
    report = check(run.history, final({"n1": entries(ABC[:1])}, committed=1))
    assert rules(report)[:2] == [("torn", 0, "n1", op.id), ("uncommitted", 2, "", op.id)]
    assert ("lost", 1, "n1", op.id) in rules(report) and ("lost", 2, "n1", op.id) in rules(report)


def test_an_acknowledged_entry_at_another_offset_or_time_is_changed():
    run = Run()
    run.append([b"x"], 0)
    moved = run.append(ABC, 1)
    log = entries([b"x", b"b", b"a", b"c"])
    report = check(run.history, final({"n1": log}))
    assert ("changed", 1, "n1", moved.id) in rules(report) and ("changed", 2, "n1", moved.id) in rules(report)
    assert ("torn", 1, "n1", moved.id) in rules(report)
    run = Run()
    late = run.append(ABC, 0, ts=TS)
    report = check(run.history, final({"n1": entries(ABC, ts=TS + 1)}))
    assert rules(report) == [("changed", o, "n1", late.id) for o in range(3)]


def test_an_acknowledgement_past_the_committed_offset_is_uncommitted():
    run = Run()
    op = run.append(ABC, 0)
    log = entries(ABC)
    assert rules(check(run.history, final({"n1": log}, committed=2))) == [("uncommitted", 2, "", op.id)]


# ---------------------------------------------------------------------- (b) one entry per offset


def test_replicas_holding_different_entries_at_one_offset_diverge():
    run = Run()
    run.append(ABC, 0)
    run.append([b"z"], status="unknown")
    follower = entries([b"a", b"b", b"z"])
    report = check(run.history, final({"n1": entries(ABC), "n2": follower}, isr=("n1",)))
    assert rules(report) == [("torn", 0, "n2", 0), ("divergent", 2, "n2", None)]
    assert "b'z'" in report.violations[1].message and "b'c' at 1000 ms on n1" in report.violations[1].message


def test_a_read_of_an_entry_the_final_log_lacks_or_holds_differently():
    run = Run()
    run.append(ABC, 0)
    run.append([b"z"], status="unknown")
    vanished = run.read([LogEntry(3, TS, "", b"z")], offset=3)
    changed = run.read([LogEntry(1, TS + 5, "", b"b")], offset=1)
    report = check(run.history, final({"n1": entries(ABC)}))
    assert rules(report) == [("read-vanished", 3, "n1", vanished.id), ("read-changed", 1, "n1", changed.id)]


def test_a_group_delivery_is_checked_like_a_read():
    run = Run()
    run.append(ABC, 0)
    op = run.group_read([LogEntry(0, TS, "", b"b")])
    assert rules(check(run.history, final({"n1": entries(ABC)}))) == [("read-changed", 0, "n1", op.id)]


def test_reads_that_failed_or_whose_outcome_is_unknown_carry_nothing_to_check():
    run = Run()
    run.append(ABC, 0)
    run.read([], status="unknown")
    run.group_read([], status="fail")
    assert check(run.history, final({"n1": entries(ABC)})).ok


# ---------------------------------------------------------------------- (c) prefixes


def test_a_leader_whose_log_ends_below_the_committed_offset_is_not_a_prefix():
    run = Run()
    run.append(ABC, status="unknown")
    report = check(run.history, final({"n1": entries(ABC[:2])}, committed=3))
    assert rules(report) == [("torn", 0, "n1", 0), ("not-prefix", 2, "n1", None)]


def test_a_stream_without_its_leaders_log_or_an_in_sync_replicas_copy():
    run = Run()
    run.append(ABC, status="unknown")
    report = check(run.history, final({"n2": []}, leader="n1", isr=("n1", "n2"), committed=1))
    assert ("not-prefix", None, "", None) in rules(report)
    assert ("not-prefix", None, "n1", None) in rules(report)
    assert ("not-prefix", 0, "n2", None) in rules(report)


# ---------------------------------------------------------------------- (d) failed and unknown appends


def test_an_entry_of_a_failed_append_in_a_log_or_a_read():
    run = Run()
    failed = run.append([b"x"], status="fail")
    read = run.read(entries([b"x"]))
    report = check(run.history, final({"n1": entries([b"x"])}))
    assert rules(report) == [("failed-present", 0, "n1", failed.id), ("failed-present", 0, "", read.id)]


def test_an_unknown_append_written_twice_is_duplicated():
    run = Run()
    op = run.append(DE, status="unknown", producer="p", sequence=1)
    run.append(DE, status="unknown", producer="p", sequence=1)
    report = check(run.history, final({"n1": entries(DE + DE)}))
    assert rules(report) == [("duplicated", 2, "n1", op.id), ("duplicated", 3, "n1", op.id)]


def test_two_acknowledgements_of_one_idempotent_batch_at_different_offsets():
    run = Run()
    run.append(DE, 0, producer="p", sequence=1)
    again = run.append(DE, 2, producer="p", sequence=1)
    report = check(run.history, final({"n1": entries(DE)}))
    assert rules(report) == [("duplicated", 2, "", again.id)]


def test_part_of_a_batch_is_torn():
    run = Run()
    op = run.append(ABC, status="unknown")
    report = check(run.history, final({"n1": entries([b"a", b"c"])}))
    assert rules(report) == [("torn", 0, "n1", op.id)]
    assert "2 of the batch's 3 entries, at offsets [0, None, 1]" in report.violations[0].message


def test_an_entry_nobody_wrote_is_a_phantom_in_a_log_and_in_a_read():
    run = Run()
    run.append([b"a"], 0)
    read = run.read([LogEntry(1, TS, "", b"ghost")])
    run.append([b"y"], 0, stream="t")
    logs = final({"n1": entries([b"a", b"ghost"])})
    logs["t"] = FinalStream("t", "n1", ("n1",), 1, {"n1": ReplicaLog("n1", 0, entries([b"y"]))})
    report = check(run.history, logs)
    assert rules(report) == [("phantom", 1, "n1", None), ("phantom", 1, "", read.id)]


def test_an_entry_appended_to_another_stream_is_a_phantom_here():
    run = Run()
    run.append([b"y"], 0, stream="t")
    logs = final({"n1": entries([b"y"])})
    logs["t"] = FinalStream("t", "n1", ("n1",), 1, {"n1": ReplicaLog("n1", 0, entries([b"y"]))})
    assert rules(check(run.history, logs)) == [("phantom", 0, "n1", None)]


# ---------------------------------------------------------------------- (e) groups


def test_an_entry_delivered_after_its_ack_was_answered_is_an_undone_ack():
    run = Run()
    run.append(ABC, 0)
    log = entries(ABC)
    run.group_read(log)
    ack = run.ack([0, 1])
    again = run.group_read(log[1:2])
    report = check(run.history, final({"n1": log}))
    assert rules(report) == [("ack-undone", 1, "", again.id)]
    assert f"after op {ack.id} acknowledged it" in report.violations[0].message


def test_a_delivery_invoked_before_the_ack_was_answered_is_no_breach():
    run = Run()
    run.append(ABC, 0)
    log = entries(ABC)
    ack = run.history.invoke("worker", "ack", S, group="g", offsets=[0])
    read = run.history.invoke("worker", "group_read", S, group="g", consumer="c2")
    run.history.ok(ack, 1)
    run.history.ok(read, log[:1])
    other_group = run.group_read(log[:1], group="h")
    failed_ack = run.ack([2], status="unknown")
    run.group_read(log[2:])
    assert other_group.status == "ok" and failed_ack.status == "unknown"
    assert check(run.history, final({"n1": log})).ok


def test_a_drained_group_that_never_got_a_committed_entry():
    run = Run()
    run.append(ABC + DE, 0)
    log = entries(ABC + DE)
    run.group_read(log[:1])
    run.group_read(log[3:4])
    run.group_read(log[1:2], status="unknown")
    drain = run.drain(5)
    report = check(run.history, final({"n1": log}))
    assert rules(report) == [("undelivered", 1, "", drain.id)]
    assert (
        "3 committed entries below 5" in report.violations[0].message
        and "1..2, 4" in report.violations[0].message
    )


def test_a_drain_only_vouches_for_what_is_committed_and_a_group_that_never_drained_vouches_for_nothing():
    run = Run()
    run.append(ABC, 0)
    log = entries(ABC)
    run.group_read(log[:2])
    run.drain(3)
    assert rules(check(run.history, final({"n1": log}, committed=2))) == [("uncommitted", 2, "", 0)]
    run = Run()
    run.append(ABC, 0)
    run.group_read(log[:1])
    assert check(run.history, final({"n1": log})).ok


# ---------------------------------------------------------------------- (f) log shape


def test_a_hole_in_a_log_and_a_timestamp_going_back():
    run = Run()
    run.append([b"a"], 0, ts=5)
    run.append([b"b"], status="unknown")
    run.append([b"c"], 2, ts=3)
    log = [LogEntry(0, 5, "", b"a"), LogEntry(2, 3, "", b"c")]
    report = check(run.history, final({"n1": log}))
    assert rules(report) == [("gap", 2, "n1", None), ("time-backwards", 2, "n1", None)]
    assert report.violations[0].message == "the log goes from offset 0 to 2"


def test_a_log_that_starts_later_than_its_first_offset_says_so():
    run = Run()
    run.append([b"a"], status="unknown")
    report = check(run.history, final({"n1": [LogEntry(3, TS, "", b"a")]}, first=1))
    assert rules(report) == [("gap", 3, "n1", None)]


# ---------------------------------------------------------------------- the report


def test_the_report_names_the_operation_and_the_faults_around_it():
    run = Run()
    early = run.history.fault_started("kill", "n9", "long ago")
    run.history.fault_ended(early)
    for i in range(3):
        run.append([bytes([65 + i])], status="unknown")
    fault = run.history.fault_started("power", "n1", "lost")
    op = run.append(ABC, 3)
    run.history.fault_ended(fault)
    since = run.history.fault_started("disk-full", "n1")
    report = check(run.history, final({"n1": entries([b"A", b"B", b"C"])}))
    text = report.text(run.history, window_s=60)
    lines = text.splitlines()
    assert lines[0] == "4 violations: {'uncommitted': 1, 'lost': 3}"
    assert lines[2] == f"    {op.describe()}"
    assert "append('s', payloads=[b'a', b'b', b'c'], producer=None, sequence=None)" in lines[2]
    assert lines[3].startswith("    before it: fault 0 kill n9")  # begun within the window
    assert lines[4].startswith("    before it: fault 1 power n1") and lines[4].endswith("(lost)")
    assert lines[5] == f"    since: {since.describe()}"
    assert lines[6].startswith("[a:lost] acknowledged b'a' at 1000 ms; the log has nothing")
    assert len(lines) == 9  # the three lost entries share the operation: it is named once
    short = report.text(run.history, window_s=0.0, limit=1, after=0)
    assert "fault 0 kill" not in short and "fault 1 power" in short and "since:" not in short
    assert short.splitlines()[-1] == "... and 2 more lost"


def test_long_payloads_are_shortened_in_messages():
    long = b"p0-chaos-0:17:3:" + b"." * 100
    run = Run()
    run.append([b"x"], 0)
    run.read([LogEntry(0, TS, "", long)])
    text = check(run.history, final({"n1": entries([b"x"])})).text(run.history)
    assert (
        "read b'p0-chaos-0:17:3:................'+84B at 1000 ms; the final log holds b'x' at 1000 ms" in text
    )
    assert "a read returned an entry no client appended: b'p0-chaos-0:17:3:................'+84B" in text
