"""What the parts of the servicer share: the engine, the rule for calls that may block, the limits
every call applies.

The handlers run on the server's event loop. Reads call the engine directly (a
read is an in-memory slice under a per-stream lock). A call that may wait for a
stream's sync (an append, or a group call that journals its change, on a stream
whose fsync policy blocks: `Engine.fsync_policy(name).blocks`) runs in the
server's small thread pool instead, so a disk sync never stalls the loop;
concurrent ones then share one fdatasync inside the engine (group commit). Admin
calls that create, rename or delete files always run in the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from typing import Any, TypeVar

from service import validation
from service.callcontext import CallContext
from service.config import Settings
from service.errors import limit_exceeded, unavailable
from service.replybudget import ReplyBudget
from service.waiters import Waiters
from storage import Engine

T = TypeVar("T")

# A blocking call answers this long before its deadline, so that the empty reply
# reaches the client before the deadline does (else it sees DEADLINE_EXCEEDED):
# a tenth of the time left, within bounds that cover a busy machine's delays.
_DEADLINE_MARGIN_MIN_S = 0.005
_DEADLINE_MARGIN_MAX_S = 0.2


class Serving:
    """The state the servicer's parts share. Event loop thread only."""

    def __init__(self, settings: Settings, waiters: Waiters, executor: Executor) -> None:
        self.settings = settings
        self.waiters = waiters  # blocked plain reads and subscriptions, woken by appends
        self._executor = executor
        self._engine: Engine | None = None
        self.draining = False
        # Open Subscribe and Consume calls, bounded by max_subscriptions.
        self.subscriptions = 0
        # Bytes of replies not yet sent, per connection and in total: every read reserves room
        # for its reply before it reads (service/replybudget.py).
        self.replies = ReplyBudget.from_settings(settings)

    def attach_engine(self, engine: Engine) -> None:
        self._engine = engine

    def ready(self) -> Engine:
        """The engine, or UNAVAILABLE while the server starts or drains."""
        if self.draining:
            raise unavailable("server is shutting down; retry on another server or after restart")
        if self._engine is None:
            raise unavailable("server is starting: recovering its data; retry shortly")
        return self._engine

    async def in_thread(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(function, *args, **kwargs))

    async def may_block(
        self, engine: Engine, stream: str, function: Callable[..., T], *args: Any, **kwargs: Any
    ) -> T:
        """A call that may wait for `stream`'s sync: in a thread when its policy blocks, else here."""
        if engine.fsync_policy(stream).blocks:
            return await self.in_thread(function, *args, **kwargs)
        return function(*args, **kwargs)

    def reply_limits(self, request: Any, default_count: int) -> tuple[int, int]:
        """A read's count and max_bytes (0: the defaults), lowered to the server's maximums."""
        settings = self.settings
        count = validation.bounded("count", request.count, default_count, settings.max_read_entries)
        max_bytes = validation.bounded(
            "max_bytes", request.max_bytes, settings.default_read_bytes, settings.max_read_bytes
        )
        return count, max_bytes

    def wait_limit_s(self, context: CallContext, block_ms: int) -> float:
        """How long a blocking call may wait: block_ms, or less if the deadline comes first."""
        wait_s = block_ms / 1000
        remaining = context.time_remaining()
        if remaining is not None:
            margin = min(max(remaining * 0.1, _DEADLINE_MARGIN_MIN_S), _DEADLINE_MARGIN_MAX_S)
            wait_s = min(wait_s, remaining - margin)
        return max(wait_s, 0.0)

    @contextlib.contextmanager
    def subscription(self) -> Iterator[None]:
        """One of the server's max_subscriptions, held for the block (RESOURCE_EXHAUSTED if none is left)."""
        limit = self.settings.max_subscriptions
        if self.subscriptions >= limit:
            raise limit_exceeded("max_subscriptions", limit, "too many subscriptions on this server")
        self.subscriptions += 1
        try:
            yield
        finally:
            self.subscriptions -= 1
