"""The throttle on moves' copies (cluster/replication/pace.py), on a clock the test moves."""

from __future__ import annotations

import asyncio

import pytest

from cluster.replication import pace as pace_module
from cluster.replication.pace import Pace


class Clock:
    """A monotonic clock that only asyncio.sleep moves: each sleep records its length."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += max(seconds, 0.0)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(pace_module.time, "monotonic", fake.monotonic)
    monkeypatch.setattr(pace_module.asyncio, "sleep", fake.sleep)
    return fake


def test_bytes_taken_wait_until_they_fit_the_rate_however_many_tasks_take_them(clock: Clock) -> None:
    pace = Pace(1000)

    async def copies() -> None:
        await pace.took(500)  # half a second's worth
        await pace.took(2000)
        # Two copies at once share the rate (this clock runs the first's sleep before the
        # second takes: each waits a second, where at one instant they would wait 1 and 2).
        await asyncio.gather(pace.took(1000), pace.took(1000))

    asyncio.run(copies())
    assert clock.sleeps == [0.5, 2.0, 1.0, 1.0]
    assert clock.now == 104.5  # 4,500 bytes at 1,000 bytes/s


def test_idle_time_is_not_banked_into_a_burst(clock: Clock) -> None:
    pace = Pace(1000)
    asyncio.run(pace.took(1000))
    clock.now += 60  # a minute with nothing to copy
    asyncio.run(pace.took(1000))
    assert clock.sleeps == [1.0, 1.0]


def test_a_pace_needs_a_positive_rate() -> None:
    with pytest.raises(ValueError, match="positive"):
        Pace(0)
