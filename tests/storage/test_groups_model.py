"""Consumer groups against a plain model, driven by hypothesis.

Several consumers read from two groups of one stream (one with bounded
pending and a delivery limit; reads may set retry, expiry, NOACK and
claim-on-read), acknowledge, nack, claim and auto-claim, get deleted, while
the clock moves, entries with deliver_at_ms arrive, group positions are moved
back and forth (SetGroupOffset, over pending and scheduled entries), the
stream is trimmed to an offset (evicting pending entries, scheduled entries
before they fall due, and entries ahead of a position), and the engine
restarts cleanly or loses power. The model is a dict of pending entries per
group, a cursor and a set of scheduled entries, with the rules written out
plainly; every read must return exactly the offsets, in the order, with the
delivery counts, the gap and the next due time the model predicts, each
offset at most once, with the delivery counts GetPending then shows. Checked
after every step:

- pending entries (owner, delivery count), cursor, scheduled entries and
  counters equal the model's, so no entry is pending for two consumers;
- nothing is lost: every entry still in the stream is unread, scheduled,
  pending, or done (acknowledged, delivered without ack, or retired by expiry
  or max_deliveries); an evicted one was reported (a gap) or handed out before;
- no entry is both pending and scheduled;
- the pending list never exceeds max_pending.

fsync is "always", so a power loss ("lost": nothing unsynced survives) must
give back the exact state of every call that returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from storage import AppendBatch, Engine, EngineConfig, GroupConfig, GroupReadOptions
from tests.storage.faultfs import FaultFS

from .conftest import SMALL, FakeClock, model_test_cases

ROOT = Path("/faultfs/data")
CONSUMERS = ["a", "b", "c"]
GROUPS = {
    "g": GroupConfig(max_pending=6, max_deliveries=3),
    "h": GroupConfig(),
}


@dataclass
class Pending:
    consumer: str | None
    count: int
    delivered_ms: int
    retry_ms: int | None
    retry_at: int | None
    expire_at: int | None = None


class GroupModel:
    """One group's rules, written plainly (RCP 11 RETRY, bounded pending, Redis PEL and claims)."""

    def __init__(self, config: GroupConfig) -> None:
        self.max_pending = config.max_pending
        self.max_deliveries = config.max_deliveries
        self.cursor = 0
        self.pending: dict[int, Pending] = {}
        self.idle: list[int] = []  # pending offsets, least recently delivered first
        self.scheduled: dict[int, int] = {}
        self.done: set[int] = set()
        self.skipped: set[int] = set()  # passed over by a SetGroupOffset forward
        self.consumers: set[str] = set()
        self.counters = dict(delivered=0, redelivered=0, acked=0, ack_unknown=0, expired=0, evicted=0)

    def exhausted(self, entry: Pending) -> bool:
        return self.max_deliveries is not None and entry.count >= self.max_deliveries

    def drop(self, offset: int, counter: str) -> None:
        del self.pending[offset]
        self.idle.remove(offset)
        self.done.add(offset)
        self.counters[counter] += 1

    def retire(self, offset: int, first: int) -> None:
        """Expired or exhausted: dropped (no dead-letter stream), or evicted if the stream lost it."""
        self.drop(offset, "evicted" if offset < first else "expired")

    def settle(self, now: int, first: int) -> None:
        """An entry leaves at its expiry, or, once exhausted, when it would be retried."""
        for offset, entry in list(self.pending.items()):
            expired = entry.expire_at is not None and entry.expire_at <= now
            if expired or (self.exhausted(entry) and entry.retry_at is not None and entry.retry_at <= now):
                self.retire(offset, first)

    @staticmethod
    def released_waiting(entry: Pending, now: int) -> bool:
        return entry.consumer is None and entry.retry_at is not None and entry.retry_at > now

    def next_due(self, now: int, *, noack: bool, claim_idle_ms: int | None) -> int | None:
        """When a read with these options next finds something not deliverable now."""
        times = []
        if not noack:
            times += [
                e.retry_at for e in self.pending.values() if e.retry_at is not None and not self.exhausted(e)
            ]
            if claim_idle_ms is not None:
                for offset in self.idle:
                    entry = self.pending[offset]
                    if not self.released_waiting(entry, now):
                        times.append(entry.delivered_ms + claim_idle_ms)
                        break
        if noack or self.max_pending is None or len(self.pending) < self.max_pending:
            times += self.scheduled.values()
        return min(times) if times else None

    def hand_over(self, offset: int, consumer: str, now: int, retry_ms: int | None) -> None:
        entry = self.pending[offset]
        entry.consumer, entry.count, entry.delivered_ms = consumer, entry.count + 1, now
        entry.retry_ms = retry_ms
        entry.retry_at = None if retry_ms is None else now + retry_ms
        self.idle.remove(offset)
        self.idle.append(offset)
        self.counters["redelivered"] += 1

    def deliver_new(self, offset, consumer, now, retry_ms, expire_ms, noack) -> None:
        """A delivery as a new entry: a first one, or of an entry still pending (a cursor moved back)."""
        self.scheduled.pop(offset, None)
        if noack:  # untracked: a pending entry stays as it is
            self.counters["delivered"] += 1
            self.done.add(offset)
            return
        if offset in self.pending:
            self.hand_over(offset, consumer, now, retry_ms)
            return
        self.counters["delivered"] += 1
        retry_at = None if retry_ms is None else now + retry_ms
        expire_at = None if expire_ms is None else now + expire_ms
        self.pending[offset] = Pending(consumer, 1, now, retry_ms, retry_at, expire_at)
        self.idle.append(offset)

    def read(
        self,
        deliver_at: list[int],
        first: int,
        consumer,
        count,
        now,
        retry_ms,
        expire_ms,
        noack,
        claim_idle_ms,
    ) -> tuple[list[int], bool, tuple[int, int] | None]:
        """The offsets a read returns, whether pending is full, and its gap as (start, end)."""
        self.settle(now, first)
        self.consumers.add(consumer)
        out: list[int] = []
        # Delayed entries evicted before they fell due were never the group's: a gap spans them.
        evicted = sorted(o for o in self.scheduled if o < first)
        for offset in evicted:
            del self.scheduled[offset]
            self.counters["evicted"] += 1
        gap = (evicted[0], evicted[-1] + 1) if evicted else None
        if not noack and count:
            due = sorted(
                (e.retry_at, o)
                for o, e in self.pending.items()
                if e.retry_at is not None and e.retry_at <= now and not self.exhausted(e)
            )
            due_offsets = [o for _, o in due[:count]]
            claims: list[int] = []
            if claim_idle_ms is not None and len(due_offsets) < count:
                for offset in list(self.idle):
                    if len(claims) >= count - len(due_offsets):
                        break
                    entry = self.pending[offset]
                    if now - entry.delivered_ms < claim_idle_ms:
                        break
                    if offset in due_offsets or self.released_waiting(entry, now):
                        continue
                    if self.exhausted(entry):
                        self.retire(offset, first)
                    else:
                        claims.append(offset)
            for offset in due_offsets + claims:
                if offset < first:
                    self.drop(offset, "evicted")  # pending, but the stream no longer has it
                else:
                    self.hand_over(offset, consumer, now, retry_ms)
                    out.append(offset)
        room = count - len(out)
        full = False
        if not noack and self.max_pending is not None:
            free = self.max_pending - len(self.pending)
            if free < room:
                full, room = True, free
        if room > 0:
            ready = sorted((due, o) for o, due in self.scheduled.items() if due <= now)[:room]
            for _, offset in ready:
                self.deliver_new(offset, consumer, now, retry_ms, expire_ms, noack)
                out.append(offset)
            room -= len(ready)
        if room > 0:
            if self.cursor < first:  # evicted ahead of the position: one gap spans both
                gap = (self.cursor, first) if gap is None else (min(gap[0], self.cursor), first)
                self.cursor = first
            while room > 0 and self.cursor < len(deliver_at):
                offset = self.cursor
                self.cursor += 1
                if deliver_at[offset] > now:
                    self.scheduled[offset] = deliver_at[offset]
                    continue
                if offset in out:
                    continue  # handed out by this read already (the position was moved back over it)
                self.deliver_new(offset, consumer, now, retry_ms, expire_ms, noack)
                out.append(offset)
                room -= 1
        return out, full, gap

    def ack(self, now: int, first: int, offsets: list[int], ranges: list[tuple[int, int]]) -> tuple[int, int]:
        self.settle(now, first)
        taken: list[int] = []
        unknown = 0
        for offset in offsets:
            if offset in self.pending and offset not in taken:
                taken.append(offset)
            else:
                unknown += 1
        for start, end in ranges:
            hits = [o for o in sorted(self.pending) if start <= o < end and o not in taken]
            taken += hits
            unknown += (end - start) - len(hits)
        for offset in taken:
            del self.pending[offset]
            self.idle.remove(offset)
            self.done.add(offset)
        self.counters["acked"] += len(taken)
        self.counters["ack_unknown"] += unknown
        return len(taken), unknown

    def nack(self, now: int, first: int, offsets: list[int], delay_ms: int) -> int:
        self.settle(now, first)
        released = 0
        for offset in dict.fromkeys(offsets):
            if offset in self.pending:
                entry = self.pending[offset]
                entry.consumer, entry.retry_at = None, now + delay_ms
                released += 1
        return released

    def claim(self, now: int, first: int, consumer: str, min_idle_ms: int, offsets: list[int]) -> list[int]:
        self.settle(now, first)
        self.consumers.add(consumer)
        claims: list[int] = []
        seen: set[int] = set()
        for offset in offsets:
            entry = self.pending.get(offset)
            if entry is None or offset in seen or now - entry.delivered_ms < min_idle_ms:
                continue
            seen.add(offset)
            if self.exhausted(entry):
                self.retire(offset, first)
            else:
                claims.append(offset)
        return self.take_over(claims, first, consumer, now)

    def take_over(self, claims: list[int], first: int, consumer: str, now: int) -> list[int]:
        """Claimed entries go to `consumer`, except those the stream no longer has (dropped)."""
        taken = []
        for offset in claims:
            if offset < first:
                self.drop(offset, "evicted")
            else:
                self.hand_over(offset, consumer, now, self.pending[offset].retry_ms)
                taken.append(offset)
        return taken

    def autoclaim(
        self, now: int, first: int, consumer: str, min_idle_ms: int, cursor: int, count: int
    ) -> tuple[int, list[int]]:
        """Scan pending offsets from `cursor`, looking at no more than 10 x count of them."""
        self.settle(now, first)
        self.consumers.add(consumer)
        order = sorted(self.pending)
        i = next((k for k, o in enumerate(order) if o >= cursor), len(order))
        budget = max(count, 1) * 10
        claims: list[int] = []
        while i < len(order) and len(claims) < count and budget > 0:
            offset = order[i]
            i += 1
            budget -= 1
            entry = self.pending[offset]
            if now - entry.delivered_ms < min_idle_ms or self.released_waiting(entry, now):
                continue
            if self.exhausted(entry):
                self.retire(offset, first)
            else:
                claims.append(offset)
        return (order[i] if i < len(order) else 0), self.take_over(claims, first, consumer, now)

    def delete_consumer(self, now: int, first: int, consumer: str) -> int:
        self.settle(now, first)
        if consumer not in self.consumers:
            return 0
        self.consumers.discard(consumer)
        owned = [o for o, e in self.pending.items() if e.consumer == consumer]
        for offset in owned:
            self.pending[offset].consumer = None
            self.pending[offset].retry_at = now
        return len(owned)


class GroupsModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.fs = FaultFS()
        self.fs.prepare_dir(ROOT)
        self.engine = self._open()
        self.engine.create_stream("s")
        self.deliver_at: list[int] = []
        self.first = 0  # the stream's first offset (trims move it)
        self.models = {name: GroupModel(config) for name, config in GROUPS.items()}
        for name, config in GROUPS.items():
            self.engine.create_group("s", name, config=config)

    def _open(self) -> Engine:
        return Engine(ROOT, EngineConfig(**{**SMALL, "fsync": "always"}), clock=self.clock, fs=self.fs)

    def teardown(self) -> None:
        self.engine.close()

    # ------------------------------------------------------------------ rules

    @rule(
        n=st.integers(1, 12), delays=st.lists(st.sampled_from([0, 0, 0, 40, 300]), min_size=12, max_size=12)
    )
    def append(self, n, delays):
        now = self.clock.now_ms
        due = [now + d if d else 0 for d in delays[:n]]
        first = self.engine.append(
            "s", AppendBatch([b"e%d" % (len(self.deliver_at) + i) for i in range(n)], deliver_at_ms=due)
        )
        assert first.first_offset == len(self.deliver_at)
        self.deliver_at += due

    @rule(
        group=st.sampled_from(sorted(GROUPS)),
        consumer=st.sampled_from(CONSUMERS),
        count=st.integers(0, 8),
        retry_ms=st.sampled_from([None, None, 0, 50, 200]),
        expire_ms=st.sampled_from([None, None, None, 300]),
        noack=st.sampled_from([False, False, False, True]),
        claim_idle_ms=st.sampled_from([None, None, 0, 100]),
    )
    def read(self, group, consumer, count, retry_ms, expire_ms, noack, claim_idle_ms):
        self._read(group, consumer, count, retry_ms, expire_ms, noack, claim_idle_ms)

    @precondition(lambda self: any(m.pending for m in self.models.values()))
    @rule(
        group=st.sampled_from(sorted(GROUPS)),
        consumer=st.sampled_from(CONSUMERS),
        count=st.integers(1, 8),
        claim_idle_ms=st.sampled_from([None, 0]),
    )
    def replay(self, group, consumer, count, claim_idle_ms):
        """Move the position back to the oldest pending entry and read at once (a consumer replaying):
        the read meets entries it may also take as redeliveries."""
        pending = self.models[group].pending
        self._seek(group, min(pending) if pending else "oldest")
        self._read(group, consumer, count, None, None, False, claim_idle_ms)

    def _read(self, group, consumer, count, retry_ms, expire_ms, noack, claim_idle_ms):
        model = self.models[group]
        now = self.clock.now_ms
        want, full, gap = model.read(
            self.deliver_at, self.first, consumer, count, now, retry_ms, expire_ms, noack, claim_idle_ms
        )
        result = self.engine.read_group(
            "s",
            group,
            GroupReadOptions(
                consumer,
                count,
                retry_ms=retry_ms,
                expire_ms=expire_ms,
                noack=noack,
                claim_idle_ms=claim_idle_ms,
            ),
        )
        assert result.offsets == want
        assert len(set(result.offsets)) == len(result.offsets)  # each offset at most once per reply
        assert result.pending_full == full
        assert (None if result.gap is None else (result.gap.start_offset, result.gap.end_offset)) == gap
        counts = [model.pending[o].count if o in model.pending else 1 for o in want]
        assert result.delivery_counts == counts
        # As GetPending then shows them (entries retired at once, e.g. exhausted with retry_ms 0, aside).
        shown = {r.offset: r.delivery_count for r in self.engine.pending("s", group, count=10_000).rows}
        assert all(shown[o] == n for o, n in zip(result.offsets, counts, strict=True) if o in shown)
        assert [e.payload for e in result.entries()] == [b"e%d" % o for o in want]
        assert result.next_due_ms == model.next_due(now, noack=noack, claim_idle_ms=claim_idle_ms)
        if result.next_due_ms is not None and count and not result.count and not result.gone:
            # A waiting reader's timer never fires for nothing due now. (Due entries found gone from
            # the stream use up a read's count: then more may be due at once, for the next read.)
            assert result.next_due_ms > now

    @rule(group=st.sampled_from(sorted(GROUPS)), data=st.data())
    def ack(self, group, data):
        model = self.models[group]
        known = [*sorted(model.pending), len(self.deliver_at) + 5]
        offsets = data.draw(st.lists(st.sampled_from(known), max_size=4))
        ranges = []
        if data.draw(st.booleans()):
            start = data.draw(st.integers(0, len(self.deliver_at) + 2))
            ranges.append((start, start + data.draw(st.integers(0, 5))))
        want = model.ack(self.clock.now_ms, self.first, offsets, ranges)
        result = self.engine.ack("s", group, offsets, ranges)
        assert (result.acknowledged, result.unknown) == want

    @precondition(lambda self: any(m.pending for m in self.models.values()))
    @rule(group=st.sampled_from(sorted(GROUPS)), data=st.data(), delay_ms=st.sampled_from([0, 30, 500]))
    def nack(self, group, data, delay_ms):
        model = self.models[group]
        offsets = data.draw(st.lists(st.sampled_from(sorted(model.pending) or [0]), max_size=3))
        released = model.nack(self.clock.now_ms, self.first, offsets, delay_ms)
        result = self.engine.nack("s", group, offsets, delay_ms)
        assert (result.released, result.unknown) == (released, len(offsets) - released)

    @precondition(lambda self: any(m.pending for m in self.models.values()))
    @rule(
        group=st.sampled_from(sorted(GROUPS)),
        consumer=st.sampled_from(CONSUMERS),
        min_idle_ms=st.sampled_from([0, 50, 1000]),
        data=st.data(),
    )
    def claim(self, group, consumer, min_idle_ms, data):
        model = self.models[group]
        offsets = data.draw(st.lists(st.sampled_from(sorted(model.pending) or [0]), max_size=3))
        want = model.claim(self.clock.now_ms, self.first, consumer, min_idle_ms, offsets)
        result = self.engine.claim("s", group, consumer, min_idle_ms, offsets)
        assert result.offsets == want
        assert result.delivery_counts == [model.pending[o].count for o in want]

    @rule(
        group=st.sampled_from(sorted(GROUPS)),
        consumer=st.sampled_from(CONSUMERS),
        min_idle_ms=st.sampled_from([0, 100]),
        count=st.integers(1, 4),
        data=st.data(),
    )
    def autoclaim(self, group, consumer, min_idle_ms, count, data):
        model = self.models[group]
        cursor = data.draw(st.sampled_from([0, *sorted(model.pending)]))
        want_cursor, want = model.autoclaim(
            self.clock.now_ms, self.first, consumer, min_idle_ms, cursor, count
        )
        next_cursor, result = self.engine.autoclaim("s", group, consumer, min_idle_ms, cursor, count)
        assert (next_cursor, result.offsets) == (want_cursor, want)
        assert result.delivery_counts == [model.pending[o].count for o in want]

    @rule(group=st.sampled_from(sorted(GROUPS)), consumer=st.sampled_from(CONSUMERS))
    def delete_consumer(self, group, consumer):
        want = self.models[group].delete_consumer(self.clock.now_ms, self.first, consumer)
        assert self.engine.delete_consumer("s", group, consumer) == want

    @rule(group=st.sampled_from(sorted(GROUPS)), data=st.data())
    def set_group_offset(self, group, data):
        """Move the position anywhere from 0 to the end, often back to a pending or scheduled entry."""
        end = len(self.deliver_at)
        model = self.models[group]
        behind = sorted({*model.pending, *model.scheduled})
        places = st.sampled_from(["oldest", "newest", *behind[:2]])
        self._seek(group, data.draw(st.one_of(places, places, st.integers(0, end))))

    def _seek(self, group, target):
        self.engine.set_group_offset("s", group, target)
        model = self.models[group]
        cursor = {"oldest": self.first, "newest": len(self.deliver_at)}.get(target, target)
        model.skipped.update(range(model.cursor, cursor))  # moved forward: passed over on purpose
        model.cursor = cursor

    @rule(data=st.data())
    def trim(self, data):
        """trim_to_offset: evicts pending entries, delayed ones not yet due, and unread ones."""
        end = len(self.deliver_at)
        target = data.draw(st.integers(self.first, min(self.first + 10, end)))
        assert self.engine.trim("s", target) == target  # no group holds retention
        self.first = target

    @rule(ms=st.sampled_from([1, 10, 30, 60, 150, 400]))
    def advance(self, ms):
        self.clock.advance(ms)

    @rule()
    def maintain(self):
        self.engine.maintain()
        for model in self.models.values():
            model.settle(self.clock.now_ms, self.first)

    @rule()
    def restart(self):
        self.engine.close()
        self.engine = self._open()

    @rule()
    def power_loss(self):
        self.fs = self.fs.crashed_copy(mode="lost")  # the old engine is abandoned mid-flight
        self.engine = self._open()

    # ------------------------------------------------------------------ invariants

    @invariant()
    def engine_matches_model(self):
        for name, model in self.models.items():
            rows = self.engine.pending("s", name, count=10_000).rows
            model.settle(self.clock.now_ms, self.first)  # pending() retires what is due, as the model does
            assert {r.offset: (r.consumer, r.delivery_count) for r in rows} == {
                o: (e.consumer, e.count) for o, e in model.pending.items()
            }
            info = self.engine.group_info("s", name)
            assert info.cursor == model.cursor
            assert info.scheduled == len(model.scheduled)
            counters = info.counters
            assert {k: getattr(counters, k) for k in model.counters} == model.counters
            assert info.pending <= (model.max_pending or info.pending)

    @invariant()
    def nothing_is_lost(self):
        """Each entry is somewhere; after a position moved back, in more than one place (done, and
        unread again). Evicted entries are exempt: reads report them as gaps (checked in `read`)."""
        for model in self.models.values():
            assert model.pending.keys().isdisjoint(model.scheduled)
            for offset in range(self.first, len(self.deliver_at)):
                places = [
                    offset >= model.cursor,
                    offset in model.scheduled,
                    offset in model.pending,
                    offset in model.done,
                    offset in model.skipped,
                ]
                assert any(places), offset


# 250 examples of up to 50 steps, in 5 parts: one part takes about 7 s idle.
TestGroupsModel1, TestGroupsModel2, TestGroupsModel3, TestGroupsModel4, TestGroupsModel5 = model_test_cases(
    GroupsModel, parts=5, examples=50, steps=50
)
