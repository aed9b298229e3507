"""Crash sweep, in the spirit of SQLite's crash tests.

A seeded workload (appends of random sizes and batch sizes, maintenance that
syncs and packs, trims, evictions, retention, compaction, a second stream that
is deleted and recreated, clean restarts) runs against the engine on a
`FaultFS`. At randomly chosen sync points (and, for kill -9, write points) the
file system's post-crash state is snapshotted; the workload goes on. Each
snapshot is then reopened and checked:

- the engine opens, nothing is unreadable, nothing is reported damaged;
- every entry read back decodes, sits at the offset it was appended at and is
  byte-identical to what was appended there; nothing that was never appended;
- offsets run contiguously from first_offset to end_offset (compaction may
  leave holes, only where a later entry with the same tag survives);
- in "always" mode every acknowledged entry is there, timestamp included;
- in every mode every entry acknowledged before the last completed sync of its
  stream (a maintenance round under everysec, a clean close) is there: a
  power loss takes back only what came after it;
- first_offset only moved if a trim or retention was under way;
- streams are closed by the open-stream cache (`max_open_streams` is 1) and
  reopened on demand as the workload turns from one to another;
- a clean close followed by a power loss gives the same content back (the
  recovery's own writes were made durable), the stream accepts new appends
  (enough to roll a segment) which read back, and they survive a further crash.

Segments grow in steps (storage/segment.py): every power-loss variant (but
the merge one, whose crash points are taken during compaction) checks
that some of its crash points fall while a growth step is not yet durable
(the file's new length may be lost, kept, or kept with some of the writes
into it).

The merge variant takes its crash points while compaction runs, where runs of
small compacted segments are merged, and checks that some of them fall
between a merge and the removal of its source segments (the case recovery
finishes).

CI runs 1,440 crash points over twelve variants (about 50 s on two cores);
`STREAMLOG_CRASH_POINTS=N` spreads about N over them for a long run, and
`python -m bench.crashsweep` runs the pre-merge one (9,000, three variants). A failure
names the variant, seed and crash point; rerun one seed with
`STREAMLOG_CRASH_SEED=... pytest tests/storage/test_crash_sweep.py -k VARIANT`.
The single-scenario tests at the end pin each engine defect the sweep found.
"""

from __future__ import annotations

import itertools
import os
import random
import tempfile
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from storage import (
    AppendBatch,
    CorruptionError,
    DiskFullError,
    DurabilityError,
    Engine,
    EngineConfig,
    GroupReadOptions,
    StreamConfig,
    inspect,
)
from storage.format import SegmentHeader
from tests.storage.conftest import SMALL as CONFTEST_SMALL
from tests.storage.faultfs import Crash, FaultFS, FaultSegmentFile

ROOT = Path("/faultfs/data")
MAIN = "main"
GROUP = "g"
AUX = "aux"
# One open stream at a time: whenever the workload turns from one stream to the other, the cache
# closes one (synced, SYNCED marker) and the other is reopened (the part past its marker checked).
SMALL = {**CONFTEST_SMALL, "compression": True, "compaction_interval_ms": 1, "max_open_streams": 1}
TAGS = [f"key-{i}" for i in range(6)]
FIRST_MOVERS = {"trim", "evict", "keep_last", "maintain", "compact"}


class Clock:
    def __init__(self, now_ms: int = 1_700_000_000_000) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms


def open_engine(fs: FaultFS, fsync: str, clock: Clock, small_streams: str = "off") -> Engine:
    return Engine(ROOT, EngineConfig(**SMALL, fsync=fsync, small_streams=small_streams), clock=clock, fs=fs)


# ---------------------------------------------------------------------- variants


@dataclass(frozen=True)
class Variant:
    id: str
    fsync: str
    crash: str  # "power" or "process"
    points: int  # crash points in a CI run
    ops: frozenset[str] = frozenset()  # besides append and maintain
    tagged: bool = False  # entries carry tags from a small set (compaction has work)
    write_share: float = 0.0  # share of crash points taken at write points rather than sync points
    per_run: int = 10  # crash points sampled from one workload run
    steps: int = 110  # operations per workload run
    merges: bool = False  # some crash points must leave a merge's source segments behind
    focus: frozenset[str] = frozenset()  # take crash points only while these ops run (empty: any)
    small_streams: str = "off"  # "slots": new small streams in slots of packs (storage/slothome.py)


VARIANTS = [
    Variant("always-power", "always", "power", 190),
    Variant("always-kill9", "always", "process", 150, write_share=0.8),
    Variant(
        "always-power-ops",
        "always",
        "power",
        195,
        ops=frozenset({"trim", "evict", "keep_last", "retention", "compact", "aux", "reopen"}),
        tagged=True,
        write_share=0.2,
    ),
    Variant(
        "everysec-power-ops",
        "everysec",
        "power",
        150,
        ops=frozenset({"trim", "retention", "aux", "reopen"}),
        write_share=0.3,
    ),
    Variant("everysec-power-compaction", "everysec", "power", 100, ops=frozenset({"compact"}), tagged=True),
    # Appends and syncs, the open-stream cache closing main unsynced and taking it back, restarts:
    # what a completed sync covered must survive every crash point (the check every variant makes).
    Variant(
        "everysec-power-synced", "everysec", "power", 140, ops=frozenset({"aux", "reopen"}), write_share=0.5
    ),
    Variant("no-power", "no", "power", 100, ops=frozenset({"evict", "reopen"}), write_share=0.5),
    Variant(
        "always-power-groups", "always", "power", 135, ops=frozenset({"group", "reopen"}), write_share=0.2
    ),
    Variant(
        "always-power-merge",
        "always",
        "power",
        120,
        ops=frozenset({"compact", "reopen"}),
        tagged=True,
        steps=220,
        merges=True,
        focus=frozenset({"compact", "maintain"}),
    ),
    # Small streams in slots: main starts in one and is promoted to a directory as it grows, aux
    # is created, deleted and created again in slots (a freed slot reused after a sync).
    Variant(
        "slots-always-power", "always", "power", 60, ops=frozenset({"aux", "reopen"}), small_streams="slots"
    ),
    Variant(
        "slots-everysec-power",
        "everysec",
        "power",
        40,
        ops=frozenset({"aux", "reopen"}),
        write_share=0.3,
        small_streams="slots",
    ),
    Variant(
        "slots-everysec-kill9",
        "everysec",
        "process",
        60,
        ops=frozenset({"aux", "reopen"}),
        write_share=0.7,
        small_streams="slots",
    ),
]


def points_for(variant: Variant) -> int:
    total = os.environ.get("STREAMLOG_CRASH_POINTS")
    if not total:
        return variant.points
    share = variant.points / sum(v.points for v in VARIANTS)
    return max(1, round(int(total) * share))


def seeds_for(variant: Variant) -> list[int]:
    if os.environ.get("STREAMLOG_CRASH_SEED"):
        return [int(os.environ["STREAMLOG_CRASH_SEED"])]
    base = sum(map(ord, variant.id)) * 1_000_003
    runs = -(-points_for(variant) // variant.per_run)
    return [base + i for i in range(runs)]


# ---------------------------------------------------------------------- the model


Record = tuple[str, bytes, tuple[tuple[str, bytes], ...], int]  # tag, payload, headers, deliver_at_ms


@dataclass
class AuxModel:
    entries: dict[int, Record] = field(default_factory=dict)
    acked: int = 0
    attempted: int = 0
    exists: bool = False
    durable: bool = False  # a sync came after its creation (before one, a power loss may take it back)
    synced: int = 0  # entries acknowledged before the last completed sync of the stream


@dataclass
class Model:
    entries: dict[int, Record] = field(default_factory=dict)  # every entry ever attempted, by offset
    ts: dict[int, int] = field(default_factory=dict)  # acknowledged entries' timestamps
    acked_next: int = 0
    attempted_next: int = 0
    synced_next: int = 0  # entries acknowledged before the last completed sync of the stream
    committed_first: int = 0
    created: bool = False
    inflight: str | None = None
    aux: AuxModel = field(default_factory=AuxModel)
    aux_inflight: str | None = None
    group_created: bool = False
    delivered: frozenset[int] = frozenset()  # group reads whose reply came back
    acked: frozenset[int] = frozenset()  # acks whose reply came back
    acking: frozenset[int] = frozenset()  # the ack under way, if any


@dataclass(frozen=True)
class Snapshot:
    acked_next: int
    attempted_next: int
    committed_first: int
    created: bool
    inflight: str | None
    aux: AuxModel
    aux_acked: int
    aux_attempted: int
    aux_exists: bool
    aux_inflight: str | None
    aux_durable: bool
    group_created: bool = False
    delivered: frozenset[int] = frozenset()
    acked: frozenset[int] = frozenset()
    acking: frozenset[int] = frozenset()
    synced_next: int = 0
    aux_synced: int = 0


def snapshot(model: Model) -> Snapshot:
    aux = model.aux
    return Snapshot(
        model.acked_next,
        model.attempted_next,
        model.committed_first,
        model.created,
        model.inflight,
        aux,
        aux.acked,
        aux.attempted,
        aux.exists,
        model.aux_inflight,
        aux.durable,
        model.group_created,
        model.delivered,
        model.acked,
        model.acking,
        model.synced_next,
        aux.synced,
    )


@dataclass
class Case:
    variant: Variant
    seed: int
    point: str
    fs: FaultFS
    snap: Snapshot
    now_ms: int
    model_entries: dict[int, Record]  # shared with the run's model: offsets are never reused
    model_ts: dict[int, int]
    growing: bool = False  # a segment's growth step was not yet durable at the crash

    def label(self) -> str:
        return f"{self.variant.id} seed={self.seed} {self.point} (in flight: {self.snap.inflight})"


class Reservoir:
    """Keep k crash points chosen uniformly among all the points offered (Algorithm R)."""

    def __init__(self, k: int, rng: random.Random) -> None:
        self.k = k
        self.rng = rng
        self.seen = 0
        self.items: list[Case] = []

    def slot(self) -> int | None:
        """Where the next point goes if it is taken, else None (decide before paying for a snapshot)."""
        self.seen += 1
        if len(self.items) < self.k:
            return len(self.items)
        j = self.rng.randrange(self.seen)
        return j if j < self.k else None

    def put(self, slot: int, case: Case) -> None:
        if slot == len(self.items):
            self.items.append(case)
        else:
            self.items[slot] = case


# ---------------------------------------------------------------------- the workload


def make_payload(rng: random.Random) -> bytes:
    size = rng.randint(1000, 3000) if rng.random() < 0.1 else rng.randint(1, 300)
    if rng.random() < 0.5:
        return rng.randbytes(size)
    word = f'{{"ride": {rng.randint(0, 99999)}, "city": "San Francisco"}} '.encode()
    return (word * (size // len(word) + 1))[:size]


def make_batch(rng: random.Random, tagged: bool) -> list[Record]:
    n = rng.choice([1, 1, 2, 3, 5, 7, 8, 9, 16, 24])
    batch: list[Record] = []
    total = 0
    for _ in range(n):
        payload = make_payload(rng)
        if batch and total + len(payload) + 64 > 15_000:
            break
        total += len(payload) + 64
        tag = rng.choice(TAGS) if tagged and rng.random() < 0.8 else ""
        headers = (("trace", rng.randbytes(8)),) if rng.random() < 0.1 else ()
        due = rng.randint(1, 10**12) if rng.random() < 0.05 else 0
        batch.append((tag, payload, headers, due))
    return batch


def append(engine: Engine, name: str, batch: list[Record]):
    return engine.append(
        name,
        AppendBatch(
            [r[1] for r in batch],
            tags=[r[0] for r in batch] if any(r[0] for r in batch) else None,
            headers=[dict(r[2]) or None for r in batch] if any(r[2] for r in batch) else None,
            deliver_at_ms=[r[3] for r in batch] if any(r[3] for r in batch) else None,
        ),
    )


def run_workload(variant: Variant, seed: int, k: int) -> list[Case]:
    """Run one seeded workload and return up to k crash states sampled along it, plus the final state."""
    rng = random.Random(seed)
    pick = random.Random(seed ^ 0x5EED)
    fs = FaultFS()
    fs.prepare_dir(ROOT)
    clock = Clock()
    model = Model()
    reservoir = Reservoir(k, pick)

    def offer(kind: str) -> None:
        share = variant.write_share if kind == "write" else 1 - variant.write_share
        if share <= 0 or pick.random() >= share:
            return
        if variant.focus and model.inflight not in variant.focus:
            return
        slot = reservoir.slot()
        if slot is None:
            return
        index = fs.syncs if kind == "sync" else fs.writes
        crash_rng = random.Random(f"{seed}/{kind}/{index}")
        torn = variant.crash == "process" and kind == "write"
        state = fs.crashed_copy(crash_rng, variant.crash, torn_inflight=torn)
        reservoir.put(
            slot,
            Case(
                variant,
                seed,
                f"{kind} point {index}",
                state,
                snapshot(model),
                clock.now_ms,
                model.entries,
                model.ts,
                growing=fs.pending_growths() > 0,
            ),
        )

    fs.on_sync = lambda _fs: offer("sync")
    fs.on_write = lambda _fs: offer("write")

    engine = open_engine(fs, variant.fsync, clock, variant.small_streams)
    config = StreamConfig(
        max_entries=rng.choice([None, 150, 400]) if "retention" in variant.ops else None,
        max_bytes=rng.choice([None, 120_000]) if "retention" in variant.ops else None,
        max_age_ms=rng.choice([None, 4_000]) if "retention" in variant.ops else None,
        compaction=variant.tagged,
    )
    model.inflight = "create"
    engine.create_stream(MAIN, config)
    model.created, model.inflight = True, None
    if "group" in variant.ops:
        model.inflight = "create_group"
        engine.create_group(MAIN, GROUP)
        model.group_created, model.inflight = True, None

    weights = {"append": 70, "maintain": 10}
    weights.update(
        {
            op: w
            for op, w in dict(trim=2, evict=2, keep_last=2, compact=3, aux=6, reopen=2, group=25).items()
            if op in variant.ops
        }
    )
    ops, op_weights = list(weights), list(weights.values())
    for _ in range(variant.steps):
        clock.now_ms += rng.randint(0, 60)
        op = rng.choices(ops, op_weights)[0]
        model.inflight = op
        if op == "append":
            batch = make_batch(rng, variant.tagged)
            first = model.attempted_next
            for i, record in enumerate(batch):
                model.entries[first + i] = record
            model.attempted_next = first + len(batch)
            result = append(engine, MAIN, batch)
            assert result.first_offset == first, (
                f"seed {seed}: append got offset {result.first_offset}, not {first}"
            )
            for i in range(len(batch)):
                model.ts[first + i] = result.timestamp_ms
            model.acked_next = model.attempted_next
        elif op == "maintain":
            engine.maintain()
        elif op in ("trim", "evict"):
            info = engine.info(MAIN)
            target = rng.randint(info.first_offset, info.end_offset)
            (engine.trim if op == "trim" else engine.evict)(MAIN, target)
        elif op == "keep_last":
            engine.keep_last(MAIN, rng.randint(0, 300))
        elif op == "compact":
            engine.compact(MAIN)
        elif op == "reopen":
            engine.close()
            engine = open_engine(fs, variant.fsync, clock, variant.small_streams)
            info = engine.info(MAIN)
            assert info.end_offset == model.acked_next, f"seed {seed}: clean reopen lost entries"
        elif op == "aux":
            model.inflight = None
            aux_op(engine, model, rng)
        elif op == "group":
            group_op(engine, model, rng)
        if op in FIRST_MOVERS | {"reopen"}:
            model.committed_first = engine.info(MAIN).first_offset
        if op == "reopen" or (op == "maintain" and variant.fsync == "everysec"):
            # A completed sync of every stream (a clean close syncs whatever the policy): what was
            # acknowledged before it survives a power loss.
            model.synced_next, model.aux.synced = model.acked_next, model.aux.acked
        if op == "reopen" or (op == "maintain" and variant.fsync == "everysec") or variant.fsync == "always":
            model.aux.durable = model.aux.exists  # a new stream's creation is durable after its first sync
        model.inflight = None
    fs.on_sync = fs.on_write = None
    final = Case(
        variant,
        seed,
        "end of run",
        fs.crashed_copy(random.Random(seed), variant.crash),
        snapshot(model),
        clock.now_ms,
        model.entries,
        model.ts,
    )
    return [*reservoir.items, final]


def group_op(engine: Engine, model: Model, rng: random.Random) -> None:
    """A group read, then an ack of some of what is pending: each change waits for its journal sync."""
    taken = engine.read_group(MAIN, GROUP, GroupReadOptions(rng.choice(["c1", "c2"]), rng.randint(1, 20)))
    model.delivered = model.delivered | set(taken.offsets)
    unacked = sorted(model.delivered - model.acked)
    chosen = frozenset(o for o in unacked if rng.random() < 0.6)
    if chosen:
        model.inflight, model.acking = "ack", chosen
        engine.ack(MAIN, GROUP, offsets=sorted(chosen))
        model.acked, model.acking = model.acked | chosen, frozenset()


def check_group(case: Case, engine: Engine, problems: list[str]) -> None:
    """In "always" mode, a delivery or ack whose reply came back survives any crash."""
    snap = case.snap
    if not snap.group_created or case.variant.fsync != "always":
        return
    pending = {row.offset for row in engine.pending(MAIN, GROUP, count=1_000_000).rows}
    lost = (snap.delivered - snap.acked - snap.acking) - pending
    if lost:
        problems.append(f"delivered, unacknowledged entries are no longer pending: {sorted(lost)[:10]}")
    back = (snap.acked & pending) - snap.acking
    if back:
        problems.append(f"acknowledged entries are pending again: {sorted(back)[:10]}")


def aux_op(engine: Engine, model: Model, rng: random.Random) -> None:
    aux = model.aux
    if aux.exists and rng.random() < 0.25:
        model.aux_inflight = "delete"
        engine.delete_stream(AUX)
        model.aux = AuxModel()
    else:
        model.aux_inflight = "append" if aux.exists else "create"
        batch = [("", rng.randbytes(rng.randint(1, 40)), (), 0) for _ in range(rng.randint(1, 3))]
        for i, record in enumerate(batch):
            aux.entries[aux.attempted + i] = record
        aux.attempted += len(batch)
        result = append(engine, AUX, batch)
        assert result.first_offset == aux.attempted - len(batch)
        aux.acked, aux.exists = aux.attempted, True
    model.aux_inflight = None


# ---------------------------------------------------------------------- checks


def key(entry) -> tuple:
    return (
        entry.offset,
        entry.timestamp_ms,
        entry.tag,
        entry.payload,
        tuple(sorted(entry.headers.items())),
        entry.deliver_at_ms,
    )


def read_all(engine: Engine, name: str, problems: list[str]) -> tuple[int, int, list, list]:
    """Every entry from first_offset to end_offset, in forward reads of up to 97 entries."""
    info = engine.info(name)
    first, nxt = info.first_offset, info.end_offset
    entries, gaps = [], []
    cursor = first
    for _ in range(nxt - first + 10):
        if cursor >= nxt:
            break
        result = engine.read(name, cursor, 97)
        try:
            got = result.entries()
        except CorruptionError as exc:
            problems.append(f"{name}: garbage: the records read at {cursor} do not decode ({exc})")
            break
        if (result.first_offset, result.end_offset) != (first, nxt):
            problems.append(
                f"{name}: read at {cursor} reports bounds {result.first_offset}..{result.end_offset}, "
                f"info says {first}..{nxt}"
            )
        if result.count != len(got) or (got and result.last_offset != got[-1].offset):
            problems.append(f"{name}: read at {cursor}: count/last_offset disagree with the records")
        if result.gap is not None:
            gaps.append(result.gap)
        if not got:
            if result.gap is not None and result.gap.end_offset > cursor:
                cursor = result.gap.end_offset
                continue
            problems.append(f"{name}: read at {cursor} returned nothing, before end_offset {nxt}")
            break
        if got[0].offset < cursor:
            problems.append(f"{name}: read at {cursor} returned offset {got[0].offset}")
            break
        entries.extend(got)
        cursor = got[-1].offset + 1
    return first, nxt, entries, gaps


def check_main(case: Case, engine: Engine, problems: list[str]) -> tuple:
    snap, variant, model_entries = case.snap, case.variant, case.model_entries
    if not engine.exists(MAIN):
        if snap.created:
            problems.append("the stream is gone")
        return ()
    first, nxt, entries, gaps = read_all(engine, MAIN, problems)
    info = engine.info(MAIN)
    if info.damaged:
        problems.append(f"a crash left damage reported: {info.damaged}")
    if first < snap.committed_first or (snap.inflight not in FIRST_MOVERS and first != snap.committed_first):
        problems.append(
            f"first_offset is {first}; it was {snap.committed_first} with {snap.inflight} in flight"
        )
    if nxt > max(snap.attempted_next, first):
        problems.append(f"end_offset {nxt} is beyond anything appended ({snap.attempted_next})")
    if variant.fsync == "always" and nxt < snap.acked_next:
        problems.append(f"acknowledged entries lost: end_offset {nxt} < {snap.acked_next} acknowledged")
    if nxt < snap.synced_next:
        problems.append(f"synced entries lost: end_offset {nxt} < {snap.synced_next} synced")
    offsets = [e.offset for e in entries]
    if offsets != sorted(set(offsets)):
        problems.append("offsets read back are not strictly increasing")
    for e in entries:
        want = model_entries.get(e.offset)
        if e.offset >= snap.attempted_next or want is None:
            problems.append(f"offset {e.offset} was never appended")
            break
        if (e.tag, e.payload, tuple(sorted(e.headers.items())), e.deliver_at_ms) != want:
            problems.append(f"offset {e.offset} reads back different bytes than were appended")
            break
        if e.offset < snap.acked_next and e.timestamp_ms != case.model_ts[e.offset]:
            problems.append(
                f"offset {e.offset} has timestamp {e.timestamp_ms}, acknowledged {case.model_ts[e.offset]}"
            )
            break
    present = set(offsets)
    if not variant.tagged:
        if offsets != list(range(first, nxt)):
            missing = sorted(set(range(first, nxt)) - present)
            problems.append(
                f"offsets not contiguous from {first} to {nxt}: {len(missing)} missing, "
                f"first few {missing[:5]}; gaps {gaps[:3]}"
            )
    else:
        for gap in gaps:
            if gap.reason != "compacted":
                problems.append(f"unexpected gap {gap}")
        later_tags: dict[str, int] = {}
        for e in entries:
            later_tags[e.tag] = max(later_tags.get(e.tag, -1), e.offset)
        for offset in range(first, nxt):
            if offset in present:
                continue
            tag = model_entries[offset][0] if offset in model_entries else ""
            if not tag or later_tags.get(tag, -1) <= offset:
                problems.append(
                    f"offset {offset} is missing and no later entry with its tag {tag!r} survives"
                )
                break
    if engine.count(MAIN, first, nxt) != len(entries):
        problems.append(
            f"count({first}, {nxt}) = {engine.count(MAIN, first, nxt)}, read {len(entries)} entries"
        )
    if entries:
        back = engine.read(MAIN, nxt - 1, 5, reverse=True)
        try:
            if [key(e) for e in back.entries()] != [key(e) for e in entries[::-1][:5]]:
                problems.append("a reverse read of the tail disagrees with the forward read")
        except CorruptionError as exc:
            problems.append(f"garbage in a reverse read: {exc}")
    return (first, nxt, [key(e) for e in entries])


def check_aux(case: Case, engine: Engine, problems: list[str]) -> tuple:
    snap = case.snap
    if not engine.exists(AUX):
        if (
            snap.aux_exists
            and snap.aux_inflight != "delete"
            and (snap.aux_durable or case.variant.crash != "power")
        ):
            problems.append("stream aux is gone though it was never deleted")
        return ()
    if not snap.aux_exists and snap.aux_inflight not in ("create", "delete"):
        problems.append("stream aux exists though it was deleted")
        return ()
    first, nxt, entries, _ = read_all(engine, AUX, problems)
    got = [(e.offset, e.payload) for e in entries]
    want = [(o, snap.aux.entries[o][1]) for o in range(len(got)) if o in snap.aux.entries]
    if first != 0 or got != want or nxt != len(got) or nxt > snap.aux_attempted:
        problems.append(f"aux holds {first}..{nxt}, {len(got)} entries, not a prefix of what was appended")
    elif case.variant.fsync == "always" and nxt < snap.aux_acked:
        problems.append(f"aux lost acknowledged entries: {nxt} < {snap.aux_acked}")
    elif nxt < snap.aux_synced:
        problems.append(f"aux lost synced entries: {nxt} < {snap.aux_synced}")
    return (first, nxt, [key(e) for e in entries])


def content(engine: Engine, problems: list[str]) -> tuple:
    out = []
    for name in engine.list_streams():
        first, nxt, entries, gaps = read_all(engine, name, problems)
        out.append((name, first, nxt, [key(e) for e in entries], [tuple(g.__repr__()) for g in gaps]))
    return tuple(out)


def offline_verify(state: FaultFS) -> list[str]:
    """What `python -m storage.inspect verify` finds in a state left by a clean close: nothing."""
    with tempfile.TemporaryDirectory() as tmp:
        state.export(ROOT, Path(tmp))
        return [f"storage.inspect verify: {p}" for p in inspect.verify(Path(tmp))]


def verify(case: Case) -> list[str]:
    """Reopen a crash state and check it; returns the problems found (empty when all is well)."""
    problems: list[str] = []
    variant = case.variant
    clock = Clock(case.now_ms + 10_000)
    phase = "recovery"

    def note(found: list[str]) -> None:
        problems.extend(f"[{phase}] {p}" for p in found)

    try:
        found: list[str] = []
        engine = open_engine(case.fs, variant.fsync, clock, variant.small_streams)
        if engine.unreadable:
            found.append(f"unreadable after a crash: {engine.unreadable}")
        check_main(case, engine, found)
        check_aux(case, engine, found)
        check_group(case, engine, found)
        recovered = content(engine, found)
        note(found)
        phase, found = "clean close + power loss", []
        engine.close()
        state = case.fs.crashed_copy(mode="lost")
        engine = open_engine(state, variant.fsync, clock, variant.small_streams)
        if content(engine, found) != recovered:
            found.append("the content differs from what recovery gave")
        found.extend(offline_verify(state))
        note(found)
        phase, found = "appending after recovery", []
        rng = random.Random(case.seed)
        before = engine.info(MAIN).end_offset if engine.exists(MAIN) else 0
        added = []
        for _ in range(6):  # ~72 KiB: at least one new segment
            batch = [("", rng.randbytes(1500), (), 0) for _ in range(8)]
            clock.now_ms += 1
            result = append(engine, MAIN, batch)
            if result.first_offset != before + len(added):
                found.append(f"an append got offset {result.first_offset}, not {before + len(added)}")
            added.extend(r[1] for r in batch)
        tail = engine.read(MAIN, before, len(added) + 1).entries()
        if [e.payload for e in tail] != added or [e.offset for e in tail] != [
            before + i for i in range(len(added))
        ]:
            found.append("entries appended after recovery do not read back")
        expected = content(engine, found)
        note(found)
        phase, found = "second crash", []
        state = state.crashed_copy(mode="lost" if variant.fsync == "always" else "process")
        engine = open_engine(state, variant.fsync, clock, variant.small_streams)
        if content(engine, found) != expected:
            found.append("the content differs from before the crash")
        engine.close()
        note(found)
    except Exception as exc:
        where = traceback.extract_tb(exc.__traceback__)[-1]
        problems.append(
            f"[{phase}] {type(exc).__name__}: {exc} at {Path(where.filename).name}:{where.lineno}"
        )
    return problems


# ---------------------------------------------------------------------- the fault layer itself


def test_faultfs_keeps_only_what_was_synced_through_a_power_loss():
    fs = FaultFS()
    fs.prepare_dir(ROOT)
    seg = fs.create_segment(ROOT / "a.seg", 4096, bytes(64))
    seg.write(0, b"synced")
    seg.sync()
    seg.write(100, b"pending")
    fs.write_file_atomic(ROOT / "meta", b"m1")
    directory = ROOT / "sub"
    fs.makedirs(directory)
    late = FaultSegmentFile(fs, fs._file(ROOT / "a.seg"), ROOT / "a.seg", writable=True)
    late.write(200, b"x" * 1000)
    lost = fs.crashed_copy(mode="lost")
    assert lost.file_bytes(ROOT / "a.seg")[:6] == b"synced" and not any(lost.file_bytes(ROOT / "a.seg")[6:])
    assert lost.read_file(ROOT / "meta") == b"m1" and lost.exists(directory)
    kept = fs.crashed_copy(mode="process")
    assert kept.file_bytes(ROOT / "a.seg")[100:107] == b"pending"
    torn = fs.crashed_copy(random.Random(3), "power", fate=lambda w: "torn" if w.pos == 200 else "drop")
    image = torn.file_bytes(ROOT / "a.seg")
    assert not any(image[6:200]) and not any(image[1200:])  # nothing outside the torn write's range
    for sector in range(0, 4096, 512):  # each 512-byte sector is all old or all new
        part = image[max(sector, 200) : min(sector + 512, 1200)]
        assert part in (b"", b"x" * len(part), bytes(len(part)))
    # Directory changes are pending until the directory is synced: snapshot just before that sync.
    snaps: list[list[FaultFS]] = []
    fs.on_sync = lambda f: snaps.append(
        [f.crashed_copy(mode="power", dir_ops_kept=k) for k in (0, 1, 2)] + [f.crashed_copy(mode="process")]
    )
    fs.write_file_atomic(ROOT / "meta", b"m2")  # tmp written, fsync, rename, sync of the directory
    fs.on_sync = None
    views = snaps[-1]  # just before the directory sync: the creation of tmp and the rename are pending
    assert [v.read_file(ROOT / "meta") for v in views] == [b"m1", b"m1", b"m2", b"m2"]
    assert [v.exists(ROOT / "meta.tmp") for v in views] == [False, True, False, False]


def test_faultfs_crash_points_failures_and_full_disk():
    fs = FaultFS()
    fs.prepare_dir(ROOT)
    seg = fs.create_segment(ROOT / "a.seg", 1024, bytes(64))  # sync points 1 (file) and 2 (directory)
    assert fs.syncs == 2
    fs.crash_at_sync = 3
    seg.write(0, b"abc")
    with pytest.raises(Crash):
        seg.sync()
    fs.crash_at_sync, fs.fail_at_sync = None, 4
    with pytest.raises(DurabilityError):
        seg.sync()
    assert fs.failed_syncs == 1 and fs.pending_writes() == 0  # fsyncgate: the dirty data is gone
    seg.sync()
    assert fs.crashed_copy(mode="lost").file_bytes(ROOT / "a.seg")[:3] == bytes(3)
    assert fs.crashed_copy(mode="process").file_bytes(ROOT / "a.seg")[:3] == b"abc"
    fs.crash_at_write = fs.writes + 1
    with pytest.raises(Crash):
        seg.write(10, b"never")
    fs.disk_full = True
    with pytest.raises(DiskFullError):
        fs.create_segment(ROOT / "b.seg", 1024, bytes(64))
    with pytest.raises(DiskFullError):
        fs.write_file_atomic(ROOT / "meta", b"m")
    fs.disk_full, fs.capacity_bytes = False, 1500
    with pytest.raises(DiskFullError):
        fs.create_segment(ROOT / "b.seg", 1024, bytes(64))
    fs.remove(ROOT / "a.seg")
    fs.create_segment(ROOT / "b.seg", 1024, bytes(64))
    assert fs.listdir(ROOT) == ["b.seg"]


# ---------------------------------------------------------------------- the sweep


def merge_left_behind(state: FaultFS) -> bool:
    """Whether a segment of the main stream lies inside the packed segment before it: a merge wrote
    the packed one, and the crash came before its other sources were removed."""
    directory = ROOT / "streams" / MAIN
    names = [n for n in state.listdir(directory) if n.endswith(".seg")]
    for before, after in itertools.pairwise(names):
        header = SegmentHeader.decode(state.file_bytes(directory / before)[:64])
        if header.packed and int(after.split(".")[0]) < header.end_offset:
            return True
    return False


def sweep(variant: Variant) -> tuple[int, list[str], int, int]:
    """Crash points checked, the failures, and how many crash points left a merge's sources behind
    and fell amid a segment's growth step."""
    wanted = points_for(variant)
    checked = merges = growing = 0
    failures: list[str] = []
    for seed in seeds_for(variant):
        cases = run_workload(variant, seed, min(variant.per_run, max(wanted - checked - 1, 1)))
        for case in cases:
            merges += merge_left_behind(case.fs)
            growing += case.growing
            problems = verify(case)
            checked += 1
            if problems:
                failures.append(f"{case.label()}: {'; '.join(problems[:3])}")
    return checked, failures, merges, growing


@pytest.mark.parametrize(
    "variant",
    [pytest.param(v, id=v.id) for v in VARIANTS],
)
def test_crash_sweep(variant: Variant):
    checked, failures, merges, growing = sweep(variant)
    print(
        f"{variant.id}: {checked} crash points checked, {len(failures)} failed, {merges} amid a merge, "
        f"{growing} amid a growth step"
    )
    assert checked >= points_for(variant) or os.environ.get("STREAMLOG_CRASH_SEED")
    assert not failures, f"{len(failures)} of {checked} crash points failed:\n" + "\n".join(failures[:12])
    if variant.merges and not os.environ.get("STREAMLOG_CRASH_SEED"):
        assert merges, "no crash point fell between a merge and the removal of its source segments"
    if variant.crash == "power" and not variant.focus and not os.environ.get("STREAMLOG_CRASH_SEED"):
        assert growing, "no crash point fell while a segment's growth step was not yet durable"


# ---------------------------------------------------------------------- one scenario per defect found
#
# Each of these pins one crash scenario the sweep runs into, so a fix can be checked on its own.


def fresh(fsync: str = "always", **stream_config) -> tuple[FaultFS, Engine, Clock]:
    fs = FaultFS()
    fs.prepare_dir(ROOT)
    clock = Clock()
    engine = open_engine(fs, fsync, clock)
    if stream_config:
        engine.create_stream(MAIN, StreamConfig(**stream_config))
    return fs, engine, clock


def ack(engine: Engine, acked: list[bytes], items: list[bytes]) -> None:
    result = engine.append(MAIN, AppendBatch(items))
    assert result.first_offset == len(acked)
    acked.extend(items)


def assert_recovers(state: FaultFS, fsync: str, acked: list[bytes], attempted: list[bytes]) -> None:
    """Reopen a crash state: a prefix of what was attempted, at least what was acknowledged, no
    damage, no garbage; the same after a clean close and a power loss; appends (a roll) work."""
    clock = Clock(1_800_000_000_000)
    engine = open_engine(state, fsync, clock)
    problems: list[str] = []
    first, nxt, entries, gaps = read_all(engine, MAIN, problems)
    assert not problems, problems
    got = [e.payload for e in entries]
    assert (first, gaps, engine.info(MAIN).damaged) == (0, [], ())
    assert [e.offset for e in entries] == list(range(nxt)), "offsets not contiguous"
    assert got == attempted[: len(got)], "not a prefix of what was appended"
    assert len(got) >= len(acked), f"{len(acked) - len(got)} acknowledged entries lost"
    engine.close()
    state = state.crashed_copy(mode="lost")
    engine = open_engine(state, fsync, clock)
    again: list[str] = []
    assert [e.payload for e in read_all(engine, MAIN, again)[2]] == got and not again, (
        "a clean close and a power loss changed the content"
    )
    for i in range(6):
        assert engine.append(MAIN, AppendBatch([b"after-%d" % i * 180] * 8)).first_offset == len(got) + 8 * i
    assert engine.info(MAIN).end_offset == len(got) + 48
    engine.close()


def small_items(start: int, n: int) -> list[bytes]:
    return [b"entry-%06d" % (start + i) for i in range(n)]


@pytest.mark.parametrize("write", [2, 3], ids=["after the blob", "after the offset table"])
def test_kill9_in_the_middle_of_an_append_keeps_every_acknowledged_entry(write):
    """kill -9 between the writes of one append (blob, offset table, header): page cache survives."""
    fs, engine, _ = fresh()
    acked: list[bytes] = []
    for _ in range(40):
        ack(engine, acked, small_items(len(acked), 3))
    attempted = acked + small_items(len(acked), 2)  # fits the active node: the same node grows
    fs.crash_at_write = fs.writes + write
    with pytest.raises(Crash):
        engine.append(MAIN, AppendBatch(attempted[len(acked) :]))
    assert_recovers(fs.crashed_copy(random.Random(write), "process"), "always", acked, attempted)


@pytest.mark.parametrize("mode", ["lost", "power"])
def test_power_loss_at_every_sync_point_of_a_rolling_append(mode):
    _, engine, _ = fresh()
    acked: list[bytes] = []
    for _ in range(100):  # fill the first segment to the brim: the last batch rolls
        ack(engine, acked, [b"%06d" % len(acked) * 250] * 8)
        if engine.info(MAIN).segments == 2:
            break
    assert engine.info(MAIN).segments == 2
    # `acked`'s last batch rolled into segment 2; replay that roll with a crash at each of its sync points.
    states = []
    fs2, engine2, _ = fresh()
    replay: list[bytes] = []
    for start in range(0, len(acked) - 8, 8):
        ack(engine2, replay, acked[start : start + 8])
    first_sync = fs2.syncs
    fs2.on_sync = lambda f: states.append(
        (f.syncs - first_sync, f.crashed_copy(random.Random(f.syncs), mode))
    )
    ack(engine2, replay, acked[-8:])
    fs2.on_sync = None
    assert len(states) >= 3
    failures = []
    for k, state in states:
        try:
            assert_recovers(state, "always", acked[:-8], acked)
        except Exception as exc:
            failures.append(f"sync point {k} of the roll: {type(exc).__name__}: {exc}")
    assert not failures, "\n".join(failures)


def keep_only_headers(write) -> str:
    """A power loss that kept a node header write but none of the data it describes."""
    return "keep" if len(write.data) == 64 and write.data[:4] == b"SLND" else "drop"


@pytest.mark.parametrize("then", ["clean restart", "roll, then power loss"])
def test_a_header_slot_rejected_by_recovery_is_never_trusted_later(then):
    fs, engine, _ = fresh()
    acked: list[bytes] = []
    for _ in range(10):
        ack(engine, acked, small_items(len(acked), 2))
    ack(engine, acked, small_items(len(acked), 2))  # the active node now holds 2 of its 8 slots
    attempted = acked + small_items(len(acked), 2)
    fs.crash_at_sync = fs.syncs + 1
    with pytest.raises(Crash):
        engine.append(MAIN, AppendBatch(attempted[len(acked) :]))
    state = fs.crashed_copy(mode="power", fate=keep_only_headers)
    if then == "clean restart":
        assert_recovers(state, "always", acked, attempted)
        return
    clock = Clock(1_800_000_000_000)
    engine = open_engine(state, "always", clock)
    assert engine.info(MAIN).end_offset == len(acked)
    for i in range(20):  # new nodes, then a new segment: the damaged node's segment is no longer last
        ack(engine, acked, [b"roll-%03d" % i * 200] * 8)
        if engine.info(MAIN).segments == 2:
            break
    assert engine.info(MAIN).segments == 2
    assert_recovers(state.crashed_copy(mode="lost"), "always", acked, acked)


def test_the_repair_of_a_torn_tail_is_durable_before_the_clean_marker():
    fs, engine, _ = fresh()
    acked: list[bytes] = []
    for _ in range(10):
        ack(engine, acked, small_items(len(acked), 8))  # full nodes: the next append starts a new one
    attempted = acked + small_items(len(acked), 3)
    fs.crash_at_sync = fs.syncs + 1
    with pytest.raises(Crash):
        engine.append(MAIN, AppendBatch(attempted[len(acked) :]))
    assert_recovers(fs.crashed_copy(mode="power", fate=keep_only_headers), "always", acked, attempted)


def test_power_loss_after_a_roll_in_everysec_mode_keeps_a_prefix():
    fs, engine, _ = fresh("everysec")
    acked: list[bytes] = []
    for _ in range(3):
        ack(engine, acked, [b"a" * 1500] * 8)
    engine.sync()  # an everysec tick: all of the above is durable
    attempted = list(acked)
    first_segment = ROOT / "streams" / MAIN / "00000000000000000000.seg"
    for _ in range(100):  # into a second segment
        items = [b"b%05d" % len(attempted) * 250] * 8
        engine.append(MAIN, AppendBatch(items))
        attempted.extend(items)
        if engine.info(MAIN).segments == 2:
            break
    assert engine.info(MAIN).segments == 2
    for _ in range(2):
        items = [b"c%05d" % len(attempted) * 250] * 8
        engine.append(MAIN, AppendBatch(items))
        attempted.extend(items)
    # The pages of the new segment reached the disk, those of the old one did not.
    state = fs.crashed_copy(mode="power", fate=lambda w: "drop" if w.path == str(first_segment) else "keep")
    assert_recovers(state, "everysec", acked, attempted)


def test_compaction_never_removes_an_entry_whose_successor_is_not_durable():
    fs, engine, _ = fresh("everysec", compaction=True)
    engine.append(MAIN, AppendBatch([b"old value"], tags=["key"]))
    for _ in range(100):  # the old value's segment gets sealed
        engine.append(MAIN, AppendBatch([b"x" * 1500] * 8))
        if engine.info(MAIN).segments == 2:
            break
    assert engine.info(MAIN).segments == 2
    engine.sync()
    engine.append(MAIN, AppendBatch([b"new value"], tags=["key"]))  # not yet synced
    assert engine.compact(MAIN) == 1
    engine = open_engine(fs.crashed_copy(mode="lost"), "everysec", Clock())
    problems: list[str] = []
    entries = read_all(engine, MAIN, problems)[2]
    assert not problems
    assert [e.payload for e in entries if e.tag == "key"], "both values of the tag are gone"


def test_a_read_starting_in_a_compacted_range_at_the_end_reports_the_gap():
    fs, engine, clock = fresh("always", compaction=True, tombstone_retention_ms=0)
    for _ in range(5):
        engine.append(MAIN, AppendBatch([b"x" * 1500] * 8))
    engine.append(
        MAIN, AppendBatch([b""] * 8, tags=["gone"] * 8)
    )  # tombstones, expired at once, at the segment's end
    assert engine.info(MAIN).segments == 1
    end = engine.info(MAIN).end_offset
    engine.append(MAIN, AppendBatch([b"y" * 1500] * 8))
    assert engine.info(MAIN).segments == 2
    clock.now_ms += 1  # the tombstones are now older than their retention
    assert engine.compact(MAIN) == 8
    # The new segment's nodes never reached the disk (as in a power loss with fsync everysec).
    second = ROOT / "streams" / MAIN / f"{end:020d}.seg"
    fs.poke(second, 64, bytes(len(fs.file_bytes(second)) - 64))
    engine = open_engine(fs.crashed_copy(mode="lost"), "always", Clock())
    assert engine.info(MAIN).end_offset == end
    result = engine.read(MAIN, end - 8, 10)
    assert result.count == 0
    assert result.gap is not None and (result.gap.start_offset, result.gap.reason) == (end - 8, "compacted")


def synced_then_one_more() -> tuple[FaultFS, Engine, list[bytes], list[bytes]]:
    """everysec: one append, a sync (an everysec tick: it is reported durable), one more append into
    the same node. Returns the file system, the engine, what was synced and what was appended."""
    fs, engine, _ = fresh("everysec")
    synced: list[bytes] = []
    ack(engine, synced, small_items(0, 2))
    engine.sync()
    attempted = list(synced)
    ack(engine, attempted, small_items(2, 1))
    return fs, engine, synced, attempted


@pytest.mark.parametrize("body", ["drop", "torn"])
def test_a_power_loss_after_two_unsynced_appends_keeps_every_synced_entry(body):
    """everysec: two appends after a sync rewrite both header slots of the active node unless the
    synced header's slot is kept; a power loss that keeps their headers but not (all of) their
    bodies must fall back to the synced header, not lose the node."""
    fs, engine, synced, attempted = synced_then_one_more()
    ack(engine, attempted, small_items(3, 1))  # the same node: its two header slots both written
    assert engine.info(MAIN).nodes == 1

    def fate(write) -> str:
        return "keep" if len(write.data) == 64 and write.data[:4] == b"SLND" else body

    assert_recovers(fs.crashed_copy(random.Random(7), mode="power", fate=fate), "everysec", synced, attempted)


def test_after_a_kill9_the_recovered_tail_is_synced_before_appends_go_on():
    """A kill -9 leaves the last append in the page cache, not on disk; the next process recovers
    it, and its appends must not take its header for a durable one (and overwrite the synced one)."""
    fs, engine, synced, attempted = synced_then_one_more()
    # kill -9: the process is gone, the page cache is not; a new process opens the same files.
    engine = open_engine(fs, "everysec", Clock(1_750_000_000_000))
    ack(engine, attempted, small_items(3, 1))
    assert engine.info(MAIN).nodes == 1
    state = fs.crashed_copy(mode="power", fate=keep_only_headers)
    assert_recovers(state, "everysec", synced, attempted)


def test_a_stream_taken_back_from_its_unsynced_close_keeps_its_synced_header():
    """The open-stream cache closes a stream without syncing it (everysec) and the stream is reopened
    before the round: its last durable header is the one its last sync covered, not its current one."""
    fs, engine, synced, attempted = synced_then_one_more()
    engine.append(AUX, AppendBatch([b"aux"]))  # max_open_streams is 1: main's close is handed off
    assert len(engine._unsynced) == 1
    ack(engine, attempted, small_items(3, 1))  # main is reopened and takes its close back
    assert len(engine._unsynced) == 1 and engine.info(MAIN).nodes == 1  # aux's close waits now
    state = fs.crashed_copy(mode="power", fate=keep_only_headers)
    assert_recovers(state, "everysec", synced, attempted)


def test_an_append_while_a_sync_runs_goes_to_a_new_node_and_the_sync_covers_what_came_before():
    """everysec: an append into the node while its sync runs would rewrite the slot of the header the
    sync began with (the other slot keeps the last durable one), and the disk could then hold that
    header without all of its body: it goes to a new node, and everything before the sync survives."""
    fs, engine, synced, attempted = synced_then_one_more()
    file = engine._stream(MAIN).segments[-1].file
    real_sync = file.sync

    def sync_then_append() -> None:
        real_sync()
        engine.append(MAIN, AppendBatch(small_items(3, 1)))  # after the flush, before the sync returns

    file.sync = sync_then_append
    synced = list(attempted)
    engine.sync()
    file.sync = real_sync
    attempted += small_items(3, 1)
    ack(engine, attempted, small_items(4, 1))
    assert engine.info(MAIN).nodes == 2
    state = fs.crashed_copy(mode="power", fate=keep_only_headers)
    assert_recovers(state, "everysec", synced, attempted)


def test_under_always_an_append_during_a_sync_waits_for_it_and_every_acknowledged_entry_survives():
    """always, appends from several threads: B's append comes while the sync of A's runs. It waits
    for that sync (rewriting the slot of the header the sync began with would leave the sync
    vouching for nothing newer than the header before A), then takes the next sync with C, in the
    same node. A power loss at any point keeps every entry whose append returned: taken while
    B's and C's sync runs, with only the headers of what was not yet synced kept."""
    fs, engine, _ = fresh("always")
    acked: list[bytes] = []
    ack(engine, acked, small_items(0, 2))
    stream = engine._stream(MAIN)
    file = stream.segments[-1].file
    real_sync, real_wait = file.sync, stream.sync_ended.wait
    waiting = threading.Semaphore(0)  # released each time an append starts waiting for a sync

    def wait_for_sync(*args) -> bool:
        waiting.release()
        return real_wait(*args)

    appenders: list[threading.Thread] = []

    def append_meanwhile(i: int) -> None:
        appenders.append(threading.Thread(target=engine.append, args=(MAIN, AppendBatch(small_items(i, 1)))))
        appenders[-1].start()

    images: list[FaultFS] = []

    def sync() -> None:
        if not hasattr(sync, "a"):
            sync.a = True  # A's sync: B and C come meanwhile, and wait
            append_meanwhile(3)
            append_meanwhile(4)
            for _ in range(2):
                assert waiting.acquire(timeout=60)
            assert stream.end_offset == 3  # A written, neither B nor C during the sync
            real_sync()
        elif not images:  # B's and C's sync: the power fails before it ends
            images.append(fs.crashed_copy(mode="power", fate=keep_only_headers))
            real_sync()
        else:
            real_sync()

    stream.sync_ended.wait, file.sync = wait_for_sync, sync
    ack(engine, acked, small_items(2, 1))  # A: returns once its sync has
    for appender in appenders:
        appender.join(60)
    assert not any(appender.is_alive() for appender in appenders)
    assert engine.info(MAIN).end_offset == 5 and engine.info(MAIN).nodes == 1 and images
    problems: list[str] = []
    written = [entry.payload for entry in read_all(engine, MAIN, problems)[2]]  # B and C in either order
    assert not problems and written[:3] == acked and sorted(written[3:]) == small_items(3, 2)
    # B and C were not acknowledged when the power failed: A and what came before must be there.
    assert_recovers(images[0], "always", acked, written)
