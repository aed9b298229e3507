"""Stopping the layer's background tasks for certain, and waiting without cancelling.

Why: on Python 3.11, `asyncio.wait_for` (which aetcd uses while it creates a watch)
returns normally when a cancellation arrives just as what it waits for completes: the
cancellation is lost and the task carries on, e.g. into a watch that may never yield.
So a task is cancelled again until it has ended, and a bounded wait on such a task is
done with `asyncio.wait` (which cancels nothing) rather than a timeout that cancels.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

log = logging.getLogger("streamlog.cluster")

T = TypeVar("T")

# How long a cancelled task gets before it is cancelled again.
_RECANCEL_S = 0.1


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel the tasks and return once all have ended (the caller's own cancellation still works)."""
    tasks = list(tasks)
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=_RECANCEL_S)
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            log.error("background task %s had failed", task.get_name(), exc_info=task.exception())


async def within(timeout_s: float, coroutine: Coroutine[Any, Any, T]) -> tuple[bool, T | None]:
    """Run `coroutine` for at most `timeout_s`: (True, its result), or (False, None) if it took longer."""
    task = asyncio.get_running_loop().create_task(coroutine)
    try:
        done, _ = await asyncio.wait({task}, timeout=max(0.0, timeout_s))
    finally:
        if not task.done():
            await cancel_and_wait([task])
    return (True, task.result()) if done else (False, None)
