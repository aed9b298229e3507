"""Consumer groups against a plain model, driven by hypothesis.

Several consumers read from two groups of one stream (one with bounded
pending and a delivery limit; reads may set retry, expiry, NOACK and
claim-on-read), acknowledge, nack, claim and auto-claim, get deleted, while
the clock moves, entries with deliver_at_ms arrive, and the engine restarts
cleanly or loses power. The model is a dict of pending entries per group, a
cursor and a set of scheduled entries, with the rules written out plainly;
every read must return exactly the offsets, in the order, with the delivery
counts and the next due time the model predicts. Checked after every step:

- pending entries (owner, delivery count), cursor, scheduled entries and
  counters equal the model's, so no entry is pending for two consumers;
- nothing is lost: every entry is unread, scheduled, pending, or done
  (acknowledged, delivered without ack, or retired by expiry or max_deliveries);
- the pending list never exceeds max_pending.

fsync is "always", so a power loss ("lost": nothing unsynced survives) must
give back the exact state of every call that returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from storage import Engine, EngineConfig, GroupConfig
from tests.storage.faultfs import FaultFS

from .conftest import SMALL, FakeClock

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
        self.consumers: set[str] = set()
        self.counters = dict(delivered=0, redelivered=0, acked=0, ack_unknown=0, expired=0)

    def exhausted(self, entry: Pending) -> bool:
        return self.max_deliveries is not None and entry.count >= self.max_deliveries

    def retire(self, offset: int) -> None:
        del self.pending[offset]
        self.idle.remove(offset)
        self.done.add(offset)
        self.counters["expired"] += 1

    def settle(self, now: int) -> None:
        """An entry leaves at its expiry, or, once exhausted, when it would be retried."""
        for offset, entry in list(self.pending.items()):
            expired = entry.expire_at is not None and entry.expire_at <= now
            if expired or (self.exhausted(entry) and entry.retry_at is not None and entry.retry_at <= now):
                self.retire(offset)

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
        self.counters["delivered"] += 1
        self.scheduled.pop(offset, None)
        if noack:
            self.done.add(offset)
            return
        retry_at = None if retry_ms is None else now + retry_ms
        expire_at = None if expire_ms is None else now + expire_ms
        self.pending[offset] = Pending(consumer, 1, now, retry_ms, retry_at, expire_at)
        self.idle.append(offset)

    def read(
        self, deliver_at: list[int], consumer, count, now, retry_ms, expire_ms, noack, claim_idle_ms
    ) -> tuple[list[int], bool]:
        self.settle(now)
        self.consumers.add(consumer)
        out: list[int] = []
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
                        self.retire(offset)
                    else:
                        claims.append(offset)
            for offset in due_offsets + claims:
                self.hand_over(offset, consumer, now, retry_ms)
            out += due_offsets + claims
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
            while room > 0 and self.cursor < len(deliver_at):
                offset = self.cursor
                self.cursor += 1
                if deliver_at[offset] > now:
                    self.scheduled[offset] = deliver_at[offset]
                    continue
                self.deliver_new(offset, consumer, now, retry_ms, expire_ms, noack)
                out.append(offset)
                room -= 1
        return out, full

    def ack(self, now: int, offsets: list[int], ranges: list[tuple[int, int]]) -> tuple[int, int]:
        self.settle(now)
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

    def nack(self, now: int, offsets: list[int], delay_ms: int) -> int:
        self.settle(now)
        released = 0
        for offset in dict.fromkeys(offsets):
            if offset in self.pending:
                entry = self.pending[offset]
                entry.consumer, entry.retry_at = None, now + delay_ms
                released += 1
        return released

    def claim(self, now: int, consumer: str, min_idle_ms: int, offsets: list[int]) -> list[int]:
        self.settle(now)
        self.consumers.add(consumer)
        claims: list[int] = []
        seen: set[int] = set()
        for offset in offsets:
            entry = self.pending.get(offset)
            if entry is None or offset in seen or now - entry.delivered_ms < min_idle_ms:
                continue
            seen.add(offset)
            if self.exhausted(entry):
                self.retire(offset)
            else:
                claims.append(offset)
        for offset in claims:
            self.hand_over(offset, consumer, now, self.pending[offset].retry_ms)
        return claims

    def autoclaim(
        self, now: int, consumer: str, min_idle_ms: int, cursor: int, count: int
    ) -> tuple[int, list[int]]:
        """Scan pending offsets from `cursor`, looking at no more than 10 x count of them."""
        self.settle(now)
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
                self.retire(offset)
            else:
                claims.append(offset)
        for offset in claims:
            self.hand_over(offset, consumer, now, self.pending[offset].retry_ms)
        return (order[i] if i < len(order) else 0), claims

    def delete_consumer(self, now: int, consumer: str) -> int:
        self.settle(now)
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
            "s", [b"e%d" % (len(self.deliver_at) + i) for i in range(n)], deliver_at_ms=due
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
        model = self.models[group]
        now = self.clock.now_ms
        want, full = model.read(
            self.deliver_at, consumer, count, now, retry_ms, expire_ms, noack, claim_idle_ms
        )
        result = self.engine.read_group(
            "s",
            group,
            consumer,
            count,
            retry_ms=retry_ms,
            expire_ms=expire_ms,
            noack=noack,
            claim_idle_ms=claim_idle_ms,
        )
        assert result.offsets == want
        assert result.pending_full == full
        counts = [1 if noack and o not in model.pending else model.pending[o].count for o in want]
        assert result.delivery_counts == counts
        assert [e.payload for e in result.entries()] == [b"e%d" % o for o in want]
        assert result.next_due_ms == model.next_due(now, noack=noack, claim_idle_ms=claim_idle_ms)
        if result.next_due_ms is not None and count and not result.count:
            assert result.next_due_ms > now  # a waiting reader's timer never fires for nothing due now

    @rule(group=st.sampled_from(sorted(GROUPS)), data=st.data())
    def ack(self, group, data):
        model = self.models[group]
        known = [*sorted(model.pending), len(self.deliver_at) + 5]
        offsets = data.draw(st.lists(st.sampled_from(known), max_size=4))
        ranges = []
        if data.draw(st.booleans()):
            start = data.draw(st.integers(0, len(self.deliver_at) + 2))
            ranges.append((start, start + data.draw(st.integers(0, 5))))
        want = model.ack(self.clock.now_ms, offsets, ranges)
        result = self.engine.ack("s", group, offsets, ranges)
        assert (result.acked, result.unknown) == want

    @precondition(lambda self: any(m.pending for m in self.models.values()))
    @rule(group=st.sampled_from(sorted(GROUPS)), data=st.data(), delay_ms=st.sampled_from([0, 30, 500]))
    def nack(self, group, data, delay_ms):
        model = self.models[group]
        offsets = data.draw(st.lists(st.sampled_from(sorted(model.pending) or [0]), max_size=3))
        released = model.nack(self.clock.now_ms, offsets, delay_ms)
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
        want = model.claim(self.clock.now_ms, consumer, min_idle_ms, offsets)
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
        want_cursor, want = model.autoclaim(self.clock.now_ms, consumer, min_idle_ms, cursor, count)
        next_cursor, result = self.engine.autoclaim("s", group, consumer, min_idle_ms, cursor, count)
        assert (next_cursor, result.offsets) == (want_cursor, want)
        assert result.delivery_counts == [model.pending[o].count for o in want]

    @rule(group=st.sampled_from(sorted(GROUPS)), consumer=st.sampled_from(CONSUMERS))
    def delete_consumer(self, group, consumer):
        want = self.models[group].delete_consumer(self.clock.now_ms, consumer)
        assert self.engine.delete_consumer("s", group, consumer) == want

    @rule(ms=st.sampled_from([1, 10, 30, 60, 150, 400]))
    def advance(self, ms):
        self.clock.advance(ms)

    @rule()
    def maintain(self):
        self.engine.maintain()
        for model in self.models.values():
            model.settle(self.clock.now_ms)

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
            model.settle(self.clock.now_ms)  # pending() retires what is due, as the model does here
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
        for model in self.models.values():
            for offset in range(len(self.deliver_at)):
                places = [
                    offset >= model.cursor and offset not in model.scheduled,
                    offset in model.scheduled,
                    offset in model.pending,
                    offset in model.done,
                ]
                assert places.count(True) == 1, offset


TestGroupsModel = GroupsModel.TestCase
TestGroupsModel.settings = settings(
    max_examples=250,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
