"""The history of a chaos run: every operation the clients invoked, how each ended, and every fault.

Jepsen's model. An operation is *invoked*, then completes exactly once as

- `ok`: the server acknowledged it; `result` holds what it said (the offsets an
  append took, the entries a read returned, how many entries an ack acknowledged);
- `fail`: definitely not done: the server refused it before doing anything
  (a status in `DEFINITE_FAILURES`);
- `unknown`: maybe done, maybe not: a timeout, a lost connection, UNAVAILABLE
  from a server that may have written before it failed, any other status.

An append retried after `unknown` is a new operation with the same producer id
and sequence (the idempotency key); bench/checker.py folds the attempts into one
logical append. Faults (bench/nemesis.py) are recorded beside the operations, on
the same clock, so a report can say what the nemesis did before a violation.

Every operation and fault gets a position on one counter (`invoked`,
`completed`, `started`, `ended`): a total order consistent with real time for
everything recorded by this process. "An operation invoked after another one
completed" compares these positions.

Pure bookkeeping: no I/O but `save`/`load` (JSON lines, payloads in base64), so
a run can be checked again later.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

# Statuses after which the operation certainly did nothing: the server checks these
# before it changes anything (validation, limits and a full disk are refused up front,
# as are a conditional append's mismatch and an idempotent retry outside the window).
DEFINITE_FAILURES = frozenset(
    {
        "INVALID_ARGUMENT",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "FAILED_PRECONDITION",
        "OUT_OF_RANGE",
        "RESOURCE_EXHAUSTED",
        "PERMISSION_DENIED",
        "UNAUTHENTICATED",
    }
)

KINDS = ("append", "read", "group_read", "ack", "drain")
STATUSES = ("ok", "fail", "unknown")


class LogEntry(NamedTuple):
    """An entry as a read returned it or a replica's log holds it."""

    offset: int
    timestamp_ms: int
    tag: str
    payload: bytes


class Appended(NamedTuple):
    """What an acknowledged append said: where its batch went (the first attempt's, for a duplicate)."""

    first_offset: int
    last_offset: int
    timestamp_ms: int
    duplicate: bool = False


@dataclass(slots=True)
class Operation:
    """One call by one client. `args` and `result` depend on `kind`:

    - append: args `payloads` (list of bytes), `producer`, `sequence` (None when not
      idempotent); result an `Appended`.
    - read / group_read: args `offset` (read) or `group`, `consumer` (group_read);
      result the entries returned, a list of `LogEntry`.
    - ack: args `group`, `offsets` (list of int); result the number acknowledged.
    - drain: args `group`; result the stream's end offset when the group had read up to
      it with nothing pending (the group consumed everything before it).
    """

    id: int
    process: str
    kind: str
    stream: str
    args: dict[str, Any]
    invoked: int
    invoked_s: float
    status: str | None = None  # None while in flight
    completed: int | None = None
    completed_s: float | None = None
    result: Any = None
    error: str = ""

    def describe(self) -> str:
        """One line: what was called, by whom, when, and how it ended."""
        args = ", ".join(f"{key}={_short(value)}" for key, value in self.args.items())
        ended = f"{self.status} at {self.completed_s:.3f}s" if self.completed_s is not None else "in flight"
        outcome = f" -> {_short(self.result)}" if self.status == "ok" else ""
        error = f" ({self.error})" if self.error else ""
        return (
            f"op {self.id} {self.process}: {self.kind}({self.stream!r}, {args}) "
            f"invoked at {self.invoked_s:.3f}s, {ended}{outcome}{error}"
        )


@dataclass(slots=True)
class Fault:
    """One fault the nemesis injected: what, on which target, when (`ended` None: never healed)."""

    id: int
    kind: str
    target: str
    started: int
    started_s: float
    detail: str = ""
    ended: int | None = None
    ended_s: float | None = None

    def describe(self) -> str:
        until = f"until {self.ended_s:.3f}s" if self.ended_s is not None else "never healed"
        detail = f" ({self.detail})" if self.detail else ""
        return f"fault {self.id} {self.kind} {self.target} from {self.started_s:.3f}s {until}{detail}"


def _short(value: Any, limit: int = 80) -> str:
    if isinstance(value, list) and len(value) > 4:
        text = f"[{_short(value[0])}, ... {len(value)} items ..., {_short(value[-1])}]"
    else:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class History:
    """Operations and faults in the order they happened; safe to record from several threads."""

    operations: list[Operation] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    _clock: int = 0
    _start: float = field(default_factory=time.monotonic)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _tick(self) -> tuple[int, float]:
        self._clock += 1
        return self._clock, time.monotonic() - self._start

    # ------------------------------------------------------------------ operations

    def invoke(self, process: str, kind: str, stream: str, **args: Any) -> Operation:
        if kind not in KINDS:
            raise ValueError(f"unknown operation kind {kind!r}")
        with self._lock:
            position, now = self._tick()
            op = Operation(len(self.operations), process, kind, stream, args, position, now)
            self.operations.append(op)
        return op

    def ok(self, op: Operation, result: Any) -> None:
        self._complete(op, "ok", result, "")

    def fail(self, op: Operation, error: str) -> None:
        self._complete(op, "fail", None, error)

    def unknown(self, op: Operation, error: str) -> None:
        self._complete(op, "unknown", None, error)

    def failed(self, op: Operation, code: str, details: str = "") -> None:
        """Complete `op` after an error with gRPC status `code` (its name): fail or unknown by the code."""
        error = f"{code}: {details}" if details else code
        self._complete(op, "fail" if code in DEFINITE_FAILURES else "unknown", None, error)

    def _complete(self, op: Operation, status: str, result: Any, error: str) -> None:
        with self._lock:
            if op.status is not None:
                raise ValueError(f"operation {op.id} completed twice ({op.status}, then {status})")
            op.completed, op.completed_s = self._tick()
            op.status, op.result, op.error = status, result, error

    # ------------------------------------------------------------------ faults

    def fault_started(self, kind: str, target: str, detail: str = "") -> Fault:
        with self._lock:
            position, now = self._tick()
            fault = Fault(len(self.faults), kind, target, position, now, detail)
            self.faults.append(fault)
        return fault

    def fault_ended(self, fault: Fault) -> None:
        with self._lock:
            fault.ended, fault.ended_s = self._tick()

    # ------------------------------------------------------------------ views

    def of_kind(self, kind: str) -> Iterator[Operation]:
        return (op for op in self.operations if op.kind == kind)

    def faults_around(self, op: Operation, window_s: float, after: int) -> tuple[list[Fault], list[Fault]]:
        """The faults around `op`: those under way while it ran or begun within `window_s` before it,
        and the first `after` begun once it had completed (what may have undone it since)."""
        end = op.completed if op.completed is not None else op.invoked
        before = [
            fault
            for fault in self.faults
            if fault.started <= end
            and (
                fault.ended is None or fault.ended >= op.invoked or fault.started_s >= op.invoked_s - window_s
            )
        ]
        since = [fault for fault in self.faults if fault.started > end][:after]
        return before, since

    def counts(self) -> dict[str, dict[str, int]]:
        """kind -> status -> operations (status "in flight" for those never completed)."""
        out: dict[str, dict[str, int]] = {}
        for op in self.operations:
            by_status = out.setdefault(op.kind, {})
            status = op.status or "in flight"
            by_status[status] = by_status.get(status, 0) + 1
        return out

    # ------------------------------------------------------------------ files

    def save(self, path: Path) -> None:
        """Write the history as JSON lines: one per operation, then one per fault."""
        with path.open("w") as out:
            for op in self.operations:
                out.write(json.dumps({"op": _encode_op(op)}) + "\n")
            for fault in self.faults:
                out.write(json.dumps({"fault": _fields(fault)}) + "\n")

    @classmethod
    def load(cls, path: Path) -> History:
        history = cls()
        with path.open() as lines:
            for line in lines:
                record = json.loads(line)
                if "op" in record:
                    history.operations.append(_decode_op(record["op"]))
                else:
                    history.faults.append(Fault(**record["fault"]))
        history._clock = max(
            [op.completed or op.invoked for op in history.operations]
            + [fault.ended or fault.started for fault in history.faults]
            + [0]
        )
        return history


def _fields(item: Any) -> dict[str, Any]:
    return {name: getattr(item, name) for name in item.__slots__}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _entries_out(entries: Iterable[LogEntry]) -> list[list[Any]]:
    return [[e.offset, e.timestamp_ms, e.tag, _b64(e.payload)] for e in entries]


def _encode_op(op: Operation) -> dict[str, Any]:
    record = _fields(op)
    if op.kind == "append":
        record["args"] = {**op.args, "payloads": [_b64(p) for p in op.args["payloads"]]}
    if op.status == "ok" and op.kind in ("read", "group_read"):
        record["result"] = _entries_out(op.result)
    return record


def _decode_op(record: dict[str, Any]) -> Operation:
    op = Operation(**record)
    if op.kind == "append":
        op.args["payloads"] = [base64.b64decode(p) for p in op.args["payloads"]]
        if op.status == "ok":
            op.result = Appended(*op.result)
    if op.status == "ok" and op.kind in ("read", "group_read"):
        op.result = [LogEntry(o, t, tag, base64.b64decode(p)) for o, t, tag, p in op.result]
    return op
