"""A byte rate shared by several tasks: the throttle on the copies that moves make (Kafka's
replication throttle, `move_bytes_per_s`).

Each task reports the bytes it just moved and waits until everything moved so far fits the
rate: n bytes add n / rate seconds to a debt paid in turn, so the tasks together stay at the
rate however many there are, and a task that moved nothing for a while starts with no debt
(the idle time is not banked into a burst).
"""

from __future__ import annotations

import asyncio
import time


class Pace:
    """A cap of `bytes_per_s` on what the tasks that call `took` move together. Event loop only."""

    def __init__(self, bytes_per_s: int) -> None:
        if bytes_per_s < 1:
            raise ValueError(f"a pace needs a positive rate, got {bytes_per_s}")
        self.bytes_per_s = bytes_per_s
        self._paid_at = 0.0  # monotonic time by which the bytes taken so far are paid for

    async def took(self, nbytes: int) -> None:
        """`nbytes` were just moved: return once the rate allows them."""
        now = time.monotonic()
        self._paid_at = max(self._paid_at, now) + nbytes / self.bytes_per_s
        await asyncio.sleep(self._paid_at - now)
