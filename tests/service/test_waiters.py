"""Waiters: who is woken by an append, a delete or a close, and when waits end by themselves."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

from service.waiters import Waiters, Wake


def run(scenario: Callable[[Waiters], Awaitable[None]]) -> None:
    async def main() -> None:
        await scenario(Waiters())

    asyncio.run(main())


async def settle() -> None:
    """Let every ready task take its step."""
    for _ in range(3):
        await asyncio.sleep(0)


def test_an_append_wakes_only_readers_whose_offset_it_reaches() -> None:
    async def scenario(waiters: Waiters) -> None:
        near = asyncio.create_task(waiters.wait("s", 5, None))
        far = asyncio.create_task(waiters.wait("s", 9, None))
        other = asyncio.create_task(waiters.wait("t", 0, None))
        await settle()
        assert waiters.count() == 3
        waiters.on_append("s", 5)  # end_offset 5: offset 5 does not exist yet
        await settle()
        assert not near.done()
        waiters.on_append("s", 6)
        await settle()
        assert near.result() is Wake.APPENDED and not far.done() and not other.done()
        assert waiters.count("s") == 1
        waiters.on_append("s", 100)
        await settle()
        assert far.result() is Wake.APPENDED and waiters.count("s") == 0
        other.cancel()
        await settle()
        assert waiters.count() == 0  # a cancelled wait unregisters itself

    run(scenario)


def test_wait_times_out() -> None:
    async def scenario(waiters: Waiters) -> None:
        assert await waiters.wait("s", 0, 0.05) is Wake.TIMEOUT
        assert await waiters.wait("s", 0, 0) is Wake.TIMEOUT
        assert waiters.count() == 0

    run(scenario)


def test_an_append_from_another_thread_wakes_the_loop() -> None:
    async def scenario(waiters: Waiters) -> None:
        waiting = asyncio.create_task(waiters.wait("s", 0, 5))
        await settle()
        thread = threading.Thread(target=waiters.on_append, args=("s", 1))
        thread.start()
        assert await asyncio.wait_for(waiting, 2) is Wake.APPENDED
        thread.join()

    run(scenario)


def test_delete_and_close_end_waits_with_their_reason() -> None:
    async def scenario(waiters: Waiters) -> None:
        deleted = asyncio.create_task(waiters.wait("s", 0, None))
        closed = asyncio.create_task(waiters.wait("t", 0, None))
        await settle()
        waiters.on_delete("s")
        await settle()
        assert deleted.result() is Wake.DELETED and not closed.done()
        waiters.close()
        await settle()
        assert closed.result() is Wake.CLOSED
        # After close, a new wait ends at once instead of hanging a shutdown.
        assert await waiters.wait("u", 0, None) is Wake.CLOSED
        assert waiters.closed

    run(scenario)


def test_many_waiters_on_one_stream_are_all_woken_by_one_append() -> None:
    async def scenario(waiters: Waiters) -> None:
        tasks = [asyncio.create_task(waiters.wait("s", 0, 5)) for _ in range(2000)]
        await settle()
        assert waiters.count("s") == 2000
        waiters.on_append("s", 1)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 5)
        assert set(results) == {Wake.APPENDED}
        assert waiters.count() == 0

    run(scenario)
