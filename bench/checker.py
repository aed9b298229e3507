"""Check a chaos run: its history (bench/history.py) against the final log of every replica.

Input: the `History` the clients recorded, and per stream a `FinalStream`: the
log each replica's data directory holds once every node has stopped (read
offline, bench/replicalogs.py), which node led the stream at the end, its
in-sync replicas and its committed offset (entries below it are committed; a
single server commits everything it holds). The rules, each a `Violation.rule`:

(a) acknowledged appends
- `lost`: an acknowledged entry is missing at its acknowledged offset on the
  leader or on an in-sync replica;
- `changed`: that offset holds another entry there (other payload or timestamp);
- `uncommitted`: an acknowledged offset is at or past the committed offset.
(b) one entry per offset
- `divergent`: two replicas hold different entries at one offset;
- `read-vanished`: a read (plain or group) returned an entry at an offset the
  final log does not hold;
- `read-changed`: a read returned an entry the final log holds differently.
(c) replicas
- `not-prefix`: an in-sync replica lacks an offset below the committed offset,
  or the leader's log ends below it, or the stream has no leader's log at all.
(d) failed and unknown appends
- `failed-present`: an entry of an append that definitely failed is in a log or
  was read;
- `duplicated`: one entry (payload) at two offsets of one log, or two
  acknowledgements of one idempotent batch at different offsets;
- `torn`: part of a batch is in a log and part is not, or not in order at
  consecutive offsets (a batch is atomic);
- `phantom`: a log or a read holds an entry no client appended.
(e) consumer groups
- `ack-undone`: the group delivered an entry again in a read invoked after an
  acknowledgement naming it had been answered;
- `undelivered`: a group that consumed to the end (a `drain` that succeeded)
  never received a committed entry below where it ended.
(f) each replica's log
- `gap`: offsets are not contiguous from the log's first offset;
- `time-backwards`: a timestamp is lower than the one before it.

Payloads identify entries, so every entry of the history must carry a payload
of its own (`HistoryError` otherwise: that is the workload's bug, not the
server's). Pure logic: no I/O.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from bench.history import Appended, History, LogEntry, Operation

RULES = {
    "lost": "a",
    "changed": "a",
    "uncommitted": "a",
    "divergent": "b",
    "read-vanished": "b",
    "read-changed": "b",
    "not-prefix": "c",
    "failed-present": "d",
    "duplicated": "d",
    "torn": "d",
    "phantom": "d",
    "ack-undone": "e",
    "undelivered": "e",
    "gap": "f",
    "time-backwards": "f",
}


class HistoryError(ValueError):
    """The history cannot be checked: two appends carried the same payload, or retries differ."""


@dataclass(slots=True)
class ReplicaLog:
    """One replica's copy of a stream, as its data directory holds it: entries in log order."""

    node: str
    first_offset: int
    entries: list[LogEntry]


@dataclass(slots=True)
class FinalStream:
    """A stream at the end of a run: its leader, in-sync replicas, committed offset, every replica's log."""

    name: str
    leader: str
    in_sync: tuple[str, ...]
    committed: int
    logs: dict[str, ReplicaLog]


@dataclass(frozen=True, slots=True)
class Violation:
    rule: str
    message: str
    stream: str = ""
    offset: int | None = None
    node: str = ""
    op: int | None = None  # the operation that broke the rule (its id), when one did

    def describe(self) -> str:
        where = [f"stream {self.stream!r}"] if self.stream else []
        if self.offset is not None:
            where.append(f"offset {self.offset}")
        if self.node:
            where.append(f"node {self.node}")
        return f"[{RULES[self.rule]}:{self.rule}] {self.message} ({', '.join(where)})"


@dataclass(slots=True)
class LogicalAppend:
    """One batch with all its attempts (retries share the producer id and sequence)."""

    stream: str
    payloads: list[bytes]
    attempts: list[Operation]

    @property
    def status(self) -> str:
        statuses = {op.status for op in self.attempts}
        if "ok" in statuses:
            return "ok"
        return "fail" if statuses == {"fail"} else "unknown"  # in flight counts as unknown

    @property
    def acked(self) -> tuple[Operation, Appended] | None:
        for op in self.attempts:
            if op.status == "ok":
                return op, op.result
        return None


@dataclass
class Report:
    violations: list[Violation]
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations

    def by_rule(self) -> dict[str, int]:
        counts: dict[str, int] = defaultdict(int)
        for violation in self.violations:
            counts[violation.rule] += 1
        return dict(counts)

    def text(self, history: History, limit: int = 20, window_s: float = 10.0, after: int = 3) -> str:
        """The violations (the first `limit` of each rule), each with the operation that broke the rule,
        the faults under way or begun within `window_s` before it, and the first `after` since."""
        if self.ok:
            return "no violations"
        lines = [f"{len(self.violations)} violations: {self.by_rule()}"]
        shown: dict[str, int] = defaultdict(int)
        last_op = None
        for violation in self.violations:
            shown[violation.rule] += 1
            if shown[violation.rule] > limit:
                continue
            lines.append(violation.describe())
            if violation.op is None or violation.op == last_op:
                continue  # the same operation as the line before: said already
            last_op = violation.op
            op = history.operations[violation.op]
            lines.append(f"    {op.describe()}")
            before, since = history.faults_around(op, window_s, after)
            lines += [f"    before it: {fault.describe()}" for fault in before]
            lines += [f"    since: {fault.describe()}" for fault in since]
        for rule, count in shown.items():
            if count > limit:
                lines.append(f"... and {count - limit} more {rule}")
        return "\n".join(lines)


def logical_appends(history: History) -> list[LogicalAppend]:
    """The history's appends, retries folded in (same stream, producer id and sequence)."""
    batches: dict[object, LogicalAppend] = {}
    for op in history.of_kind("append"):
        producer, sequence = op.args.get("producer"), op.args.get("sequence")
        key = (op.stream, producer, sequence) if producer is not None else op.id
        batch = batches.get(key)
        if batch is None:
            batches[key] = LogicalAppend(op.stream, list(op.args["payloads"]), [op])
        elif batch.payloads != list(op.args["payloads"]):
            raise HistoryError(f"op {op.id} retries {producer!r} #{sequence} with other payloads")
        else:
            batch.attempts.append(op)
    return list(batches.values())


def check(history: History, streams: dict[str, FinalStream]) -> Report:
    return _Check(history, streams).run()


class _Check:
    def __init__(self, history: History, streams: dict[str, FinalStream]) -> None:
        self.history = history
        self.streams = streams
        self.violations: list[Violation] = []
        self.appends = logical_appends(history)
        # payload -> (its batch, its index in the batch)
        self.origin: dict[bytes, tuple[LogicalAppend, int]] = {}
        for batch in self.appends:
            for index, payload in enumerate(batch.payloads):
                if payload in self.origin:
                    raise HistoryError(f"payload {payload!r} is appended twice: entries must be unique")
                self.origin[payload] = (batch, index)

    def add(
        self,
        rule: str,
        message: str,
        *,
        stream: str,
        offset: int | None = None,
        node: str = "",
        op: int | None = None,
    ) -> None:
        self.violations.append(Violation(rule, message, stream, offset, node, op))

    def run(self) -> Report:
        for stream in self.streams.values():
            for log in stream.logs.values():
                self.check_log_shape(stream.name, log)
                self.check_log_contents(stream.name, log, stream.leader)
            self.check_replicas(stream)
        for batch in self.appends:
            self.check_append(batch)
        reads = [op for op in self.history.operations if op.kind in ("read", "group_read")]
        for op in reads:
            if op.status == "ok":
                self.check_read(op)
        self.check_groups()
        return Report(self.violations, self.stats(reads))

    # ------------------------------------------------------------------ (f) and (d) per log

    def check_log_shape(self, stream: str, log: ReplicaLog) -> None:
        expected, last_time = log.first_offset, None
        for entry in log.entries:
            if entry.offset != expected:
                self.add(
                    "gap",
                    f"the log goes from offset {expected - 1} to {entry.offset}",
                    stream=stream,
                    offset=entry.offset,
                    node=log.node,
                )
            if last_time is not None and entry.timestamp_ms < last_time:
                self.add(
                    "time-backwards",
                    f"timestamp {entry.timestamp_ms} after {last_time}",
                    stream=stream,
                    offset=entry.offset,
                    node=log.node,
                )
            expected, last_time = entry.offset + 1, entry.timestamp_ms

    def check_log_contents(self, stream: str, log: ReplicaLog, leader: str) -> None:
        """Phantoms, failed appends, duplicates and torn batches in one replica's log."""
        where: dict[bytes, int] = {}
        for entry in log.entries:
            origin = self.origin.get(entry.payload)
            if origin is None or origin[0].stream != stream:
                self.add(
                    "phantom",
                    f"an entry no client appended: {_payload(entry.payload)}",
                    stream=stream,
                    offset=entry.offset,
                    node=log.node,
                )
                continue
            batch, _ = origin
            if batch.status == "fail":
                self.add(
                    "failed-present",
                    "an entry of an append that failed is in the log",
                    stream=stream,
                    offset=entry.offset,
                    node=log.node,
                    op=batch.attempts[-1].id,
                )
            if entry.payload in where:
                self.add(
                    "duplicated",
                    f"the entry at offset {where[entry.payload]} is here again",
                    stream=stream,
                    offset=entry.offset,
                    node=log.node,
                    op=batch.attempts[0].id,
                )
            else:
                where[entry.payload] = entry.offset
        # A batch is whole and in order; only a follower's copy may end inside one (still copying).
        end = log.entries[-1].offset + 1 if log.entries else log.first_offset
        tail_ok = log.node != leader
        batches = {id(self.origin[p][0]): self.origin[p][0] for p in where}
        for batch in batches.values():
            offsets = [where.get(p) for p in batch.payloads]
            first = offsets[0]
            whole = first is not None and all(
                offset == first + i or (offset is None and tail_ok and first + i >= end)
                for i, offset in enumerate(offsets)
            )
            if not whole:
                present = sum(o is not None for o in offsets)
                self.add(
                    "torn",
                    f"{present} of the batch's {len(offsets)} entries, at offsets {offsets}",
                    stream=stream,
                    offset=min(o for o in offsets if o is not None),
                    node=log.node,
                    op=batch.attempts[0].id,
                )

    # ------------------------------------------------------------------ (b), (c) across replicas

    def check_replicas(self, stream: FinalStream) -> None:
        leader = stream.logs.get(stream.leader)
        if leader is None:
            self.add(
                "not-prefix", f"no log of the leader {stream.leader!r} to check against", stream=stream.name
            )
        seen: dict[int, tuple[LogEntry, str]] = {}
        ordered = ([leader] if leader is not None else []) + [
            log for node, log in sorted(stream.logs.items()) if node != stream.leader
        ]
        for log in ordered:
            for entry in log.entries:
                first = seen.setdefault(entry.offset, (entry, log.node))
                if first[0] != entry:
                    self.add(
                        "divergent",
                        f"{_entry(entry)} here, {_entry(first[0])} on {first[1]}",
                        stream=stream.name,
                        offset=entry.offset,
                        node=log.node,
                    )
        for node in stream.in_sync:
            log = stream.logs.get(node)
            if log is None:
                if stream.committed > 0:
                    self.add(
                        "not-prefix",
                        f"the in-sync replica holds no copy; committed {stream.committed}",
                        stream=stream.name,
                        node=node,
                    )
                continue
            end = log.entries[-1].offset + 1 if log.entries else log.first_offset
            if end < stream.committed:
                self.add(
                    "not-prefix",
                    f"the log ends at {end}, below the committed offset {stream.committed}",
                    stream=stream.name,
                    offset=end,
                    node=node,
                )

    # ------------------------------------------------------------------ (a), (d) per append

    def check_append(self, batch: LogicalAppend) -> None:
        acks = [(op, op.result) for op in batch.attempts if op.status == "ok"]
        for op, result in acks[1:]:
            if result.first_offset != acks[0][1].first_offset:
                self.add(
                    "duplicated",
                    f"acknowledged at {acks[0][1].first_offset} (op {acks[0][0].id}) "
                    f"and again at {result.first_offset}",
                    stream=batch.stream,
                    offset=result.first_offset,
                    op=op.id,
                )
        if not acks:
            return
        op, result = acks[0]
        if result.last_offset - result.first_offset + 1 != len(batch.payloads):
            self.add(
                "changed",
                f"{len(batch.payloads)} entries acknowledged at offsets "
                f"{result.first_offset}..{result.last_offset}",
                stream=batch.stream,
                offset=result.first_offset,
                op=op.id,
            )
            return
        stream = self.streams.get(batch.stream)
        if stream is None:
            self.add("lost", "the stream of an acknowledged append is gone", stream=batch.stream, op=op.id)
            return
        if result.last_offset >= stream.committed:
            self.add(
                "uncommitted",
                f"acknowledged up to {result.last_offset}, committed below {stream.committed}",
                stream=batch.stream,
                offset=result.last_offset,
                op=op.id,
            )
        for node in dict.fromkeys((stream.leader, *stream.in_sync)):
            log = stream.logs.get(node)
            if log is None:
                continue  # reported by check_replicas
            for index, payload in enumerate(batch.payloads):
                offset = result.first_offset + index
                held = _at(log, offset)
                if held is None or (held.payload, held.timestamp_ms) != (payload, result.timestamp_ms):
                    rule, holds = ("lost", "nothing") if held is None else ("changed", _entry(held))
                    self.add(
                        rule,
                        f"acknowledged {_payload(payload)} at {result.timestamp_ms} ms; the log has {holds}",
                        stream=batch.stream,
                        offset=offset,
                        node=node,
                        op=op.id,
                    )

    # ------------------------------------------------------------------ (b), (d) per read

    def check_read(self, op: Operation) -> None:
        stream = self.streams.get(op.stream)
        if stream is None and op.result:
            self.add(
                "read-vanished",
                f"read {len(op.result)} entries of a stream that is gone",
                stream=op.stream,
                offset=op.result[0].offset,
                op=op.id,
            )
        leader = stream.logs.get(stream.leader) if stream is not None else None
        for entry in op.result:
            origin = self.origin.get(entry.payload)
            if origin is None or origin[0].stream != op.stream:
                self.add(
                    "phantom",
                    f"a read returned an entry no client appended: {_payload(entry.payload)}",
                    stream=op.stream,
                    offset=entry.offset,
                    op=op.id,
                )
            elif origin[0].status == "fail":
                self.add(
                    "failed-present",
                    "a read returned an entry of an append that failed",
                    stream=op.stream,
                    offset=entry.offset,
                    op=op.id,
                )
            if leader is None or entry.offset < leader.first_offset:
                continue  # no leader: reported once by check_replicas; below the log: evicted since
            held = _at(leader, entry.offset)
            if held != entry:
                rule, holds = (
                    ("read-vanished", "has no such offset")
                    if held is None
                    else ("read-changed", f"holds {_entry(held)}")
                )
                self.add(
                    rule,
                    f"read {_entry(entry)}; the final log {holds}",
                    stream=op.stream,
                    offset=entry.offset,
                    node=leader.node,
                    op=op.id,
                )

    # ------------------------------------------------------------------ (e) groups

    def check_groups(self) -> None:
        acked_at: dict[tuple[str, str], dict[int, Operation]] = defaultdict(dict)
        for op in self.history.of_kind("ack"):
            if op.status != "ok":
                continue
            earliest = acked_at[op.stream, op.args["group"]]
            for offset in op.args["offsets"]:
                if offset not in earliest or op.completed < earliest[offset].completed:
                    earliest[offset] = op
        delivered: dict[tuple[str, str], set[int]] = defaultdict(set)
        for op in self.history.of_kind("group_read"):
            if op.status != "ok":
                continue
            key = (op.stream, op.args["group"])
            acks = acked_at.get(key, {})
            for entry in op.result:
                delivered[key].add(entry.offset)
                ack = acks.get(entry.offset)
                if ack is not None and op.invoked > ack.completed:
                    self.add(
                        "ack-undone",
                        f"delivered again after op {ack.id} acknowledged it "
                        f"(answered at {ack.completed_s:.3f}s)",
                        stream=op.stream,
                        offset=entry.offset,
                        op=op.id,
                    )
        for op in self.history.of_kind("drain"):
            if op.status != "ok":
                continue
            stream = self.streams.get(op.stream)
            end = min(op.result, stream.committed) if stream is not None else 0
            leader = stream.logs.get(stream.leader) if stream is not None else None
            start = leader.first_offset if leader is not None else 0
            missing = [o for o in range(start, end) if o not in delivered[op.stream, op.args["group"]]]
            if missing:
                self.add(
                    "undelivered",
                    f"{len(missing)} committed entries below {end} never delivered "
                    f"to group {op.args['group']!r}, from offset {missing[0]}: {_ranges(missing)}",
                    stream=op.stream,
                    offset=missing[0],
                    op=op.id,
                )

    # ------------------------------------------------------------------ figures

    def stats(self, reads: list[Operation]) -> dict[str, int]:
        stats = {"appends_ok": 0, "appends_fail": 0, "appends_unknown": 0, "entries_acked": 0}
        for batch in self.appends:
            stats[f"appends_{batch.status}"] += 1
            if batch.status == "ok":
                stats["entries_acked"] += len(batch.payloads)
        stats["append_retries"] = sum(len(b.attempts) - 1 for b in self.appends)
        stats["entries_read"] = sum(len(op.result) for op in reads if op.status == "ok")
        stats["log_entries"] = sum(
            len(s.logs[s.leader].entries) for s in self.streams.values() if s.leader in s.logs
        )
        return stats


def _at(log: ReplicaLog, offset: int) -> LogEntry | None:
    """The entry at `offset`, found by position when the log is contiguous (it nearly always is)."""
    index = offset - log.first_offset
    if 0 <= index < len(log.entries) and log.entries[index].offset == offset:
        return log.entries[index]
    for entry in log.entries:  # a log with gaps (reported as such): search it
        if entry.offset == offset:
            return entry
    return None


def _payload(payload: bytes, limit: int = 32) -> str:
    """A payload as a short repr: the workload's carry their identity first, then padding."""
    return repr(payload) if len(payload) <= limit else f"{payload[:limit]!r}+{len(payload) - limit}B"


def _entry(entry: LogEntry) -> str:
    tag = f" tag {entry.tag!r}" if entry.tag else ""
    return f"{_payload(entry.payload)} at {entry.timestamp_ms} ms{tag}"


def _ranges(offsets: Iterable[int], limit: int = 5) -> str:
    spans: list[list[int]] = []
    for offset in offsets:
        if spans and spans[-1][1] == offset - 1:
            spans[-1][1] = offset
        else:
            spans.append([offset, offset])
    text = ", ".join(f"{a}..{b}" if a != b else f"{a}" for a, b in spans[:limit])
    return text + (f", ... ({len(spans)} ranges)" if len(spans) > limit else "")
