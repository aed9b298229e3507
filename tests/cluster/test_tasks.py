"""Stopping background tasks that lose a cancellation, and bounded waits that cancel nothing outside."""

from __future__ import annotations

import asyncio
import contextlib

from cluster.tasks import cancel_and_wait, within
from tests.cluster.helpers import run


async def swallows_one_cancellation(reached: asyncio.Event) -> None:
    # What asyncio.wait_for does on Python 3.11 when the cancellation and the result meet.
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.Event().wait()
    reached.set()
    await asyncio.Event().wait()  # carries on, e.g. into a watch that may never yield


def test_a_task_that_swallowed_its_cancellation_is_cancelled_again_until_it_ends() -> None:
    async def scenario() -> None:
        reached = asyncio.Event()
        task = asyncio.get_running_loop().create_task(swallows_one_cancellation(reached))
        await asyncio.sleep(0)
        await cancel_and_wait([task])
        assert reached.is_set() and task.cancelled()

    run(scenario(), timeout_s=10)


def test_a_bounded_wait_returns_the_result_or_gives_up_and_stops_the_work() -> None:
    async def answer() -> int:
        return 42

    async def scenario() -> None:
        assert await within(5, answer()) == (True, 42)
        reached = asyncio.Event()
        assert await within(0.05, swallows_one_cancellation(reached)) == (False, None)
        assert reached.is_set()  # it was cancelled (twice) before `within` returned

    run(scenario(), timeout_s=10)
