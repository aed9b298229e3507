"""The engine against a plain in-memory model, driven by hypothesis.

The model is a dict offset -> entry plus first/next offsets. Operations whose
exact effect depends on node boundaries (evict, keep-last, compaction) are
checked by the rules they promise instead: evict and keep-last drop only whole
nodes and never more than asked; compaction removes only superseded entries.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from storage import AppendBatch, Engine, EngineConfig, StreamConfig

from .conftest import SMALL, FakeClock, model_test_cases

# The model checks what the engine answers, not what survives a crash (the crash sweep does): in
# memory (tmpfs) where there is one, every reopen's syncs cost nothing, so a run's time is its CPU.
MEMORY_DIR = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
payloads = st.binary(min_size=0, max_size=300)
tags = st.sampled_from(["", "", "a", "b", "c"])
batches = st.lists(st.tuples(payloads, tags), min_size=1, max_size=20)


class EngineModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="streamlog-model-", dir=MEMORY_DIR))
        self.clock = FakeClock()
        self.compression = True
        self.engine = self._open()
        self.entries: dict[int, tuple[bytes, str, int]] = {}  # offset -> (payload, tag, timestamp)
        self.first = 0
        self.next = 0

    def _open(self) -> Engine:
        config = EngineConfig(**{**SMALL, "compression": self.compression})
        return Engine(self.dir, config, clock=self.clock)

    def teardown(self) -> None:
        self.engine.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _live(self) -> list[int]:
        return sorted(o for o in self.entries if o >= self.first)

    @rule(batch=batches, step=st.integers(0, 50))
    def append(self, batch, step):
        self.clock.advance(step)
        result = self.engine.append("s", AppendBatch([p for p, _ in batch], tags=[t for _, t in batch]))
        assert result.first_offset == self.next
        for i, (payload, tag) in enumerate(batch):
            self.entries[self.next + i] = (payload, tag, result.timestamp_ms)
        self.next += len(batch)

    @precondition(lambda self: self.next > 0)
    @rule(data=st.data(), count=st.integers(0, 60), max_bytes=st.sampled_from([0, 0, 1, 500, 5000]))
    def read_forward(self, data, count, max_bytes):
        offset = data.draw(st.integers(0, self.next + 2))
        result = self.engine.read("s", offset, count, max_bytes=max_bytes)
        want = [o for o in self._live() if o >= offset][:count]
        got = result.entries()
        assert [e.offset for e in got] == want[: len(got)]
        if not max_bytes:
            assert len(got) == len(want)
        elif want and count:
            assert got  # at least one entry, whatever the byte bound
        for entry in got:
            assert (entry.payload, entry.tag, entry.timestamp_ms) == self.entries[entry.offset]
        assert (result.first_offset, result.end_offset) == (self.first, self.next)
        if offset < self.first and count:
            assert result.gap is not None and result.gap.start_offset == offset

    @precondition(lambda self: self.next > 0)
    @rule(data=st.data(), count=st.integers(1, 40))
    def read_backward(self, data, count):
        offset = data.draw(st.integers(0, self.next + 2))
        got = self.engine.read("s", offset, count, reverse=True).entries()
        want = [o for o in reversed(self._live()) if o <= offset][:count]
        assert [e.offset for e in got] == want

    @precondition(lambda self: self.next > 0)
    @rule(data=st.data())
    def seek_time(self, data):
        live = self._live()
        stamps = sorted({self.entries[o][2] for o in live}) or [0]
        target = data.draw(st.sampled_from([*stamps, stamps[-1] + 1, 0]))
        want = next((o for o in live if self.entries[o][2] >= target), self.next)
        assert self.engine.seek_time("s", target) == want

    @precondition(lambda self: self.next > 0)
    @rule(data=st.data())
    def count(self, data):
        a = data.draw(st.integers(0, self.next + 1))
        b = data.draw(st.integers(a, self.next + 2))
        assert self.engine.count("s", a, b) == len([o for o in self._live() if a <= o < b])

    @precondition(lambda self: self.next > 0)
    @rule(data=st.data())
    def trim(self, data):
        target = data.draw(st.integers(0, self.next))
        first = self.engine.trim("s", target)
        assert first == max(self.first, target)
        self.first = first

    @precondition(lambda self: self.next > 0)
    @rule(data=st.data())
    def evict(self, data):
        up_to = data.draw(st.integers(0, self.next))
        first = self.engine.evict("s", up_to)
        assert self.first <= first <= max(self.first, up_to + 1)
        self.first = first

    @precondition(lambda self: self.next > 0)
    @rule(keep=st.integers(0, 100))
    def keep_last(self, keep):
        first = self.engine.keep_last("s", keep)
        assert first >= self.first
        assert self.next - first >= min(keep, self.next - self.first)
        self.first = first

    @precondition(lambda self: self.next > 0)
    @rule()
    def compact(self):
        self.engine.set_stream_config("s", StreamConfig(compaction=True, tombstone_retention_ms=10**12))
        self.engine.compact("s")
        survivors = {e.offset for e in self.engine.read("s", 0, 10**6).entries()}
        latest: dict[str, int] = {}
        for offset in self._live():
            tag = self.entries[offset][1]
            if tag:
                latest[tag] = offset
        for offset in self._live():
            tag = self.entries[offset][1]
            if offset not in survivors:
                assert tag and latest[tag] != offset  # only superseded entries may go
                del self.entries[offset]
        for offset in latest.values():
            assert offset in survivors

    @rule()
    def maintain(self):
        self.engine.maintain()

    @rule(compression=st.booleans())
    def reopen(self, compression):
        self.engine.close()
        self.compression = compression
        self.engine = self._open()

    @invariant()
    def bounds_hold(self):
        if self.next:
            info = self.engine.info("s")
            assert (info.first_offset, info.end_offset, info.entries_added) == (
                self.first,
                self.next,
                self.next,
            )
            assert info.entries == len(self._live())


# 150 examples of up to 60 steps, in 6 parts: one part takes 2-3 s of CPU.
TestEngineModel1, TestEngineModel2, TestEngineModel3, TestEngineModel4, TestEngineModel5, TestEngineModel6 = (
    model_test_cases(EngineModel, parts=6, examples=25, steps=60)
)
