"""The reply budget: bytes of replies built and not yet sent, bounded per connection and per server.

A reply (to Read, Subscribe, Consume, Claim, AutoClaim) holds memory from when it is
built until gRPC has finished sending it: the reply's bytes, and gRPC core's copy of
them, both kept until the send completes (measured: a reply of N bytes that the
client does not take holds about 2N of resident memory). A client that stops
reading would make the server hold one reply per open call without this budget:
100 unary Reads of 8 MiB held 1.6 GB.

So a read first reserves room for its reply (its `max_bytes`) in its connection's
budget and in the server's; the reply, once built, replaces the reservation with
its real size (which may pass it by one entry: a read returns at least one); and
the call gives the bytes back when gRPC is done with them:

- a unary call, when the call ends: grpc.aio runs `context.add_done_callback`
  callbacks after the batch that sends the reply and the status has completed,
  or failed because the client went away;
- a streaming call, when `context.write` of the reply returns (a stream has one
  reply in flight at a time), or at the call's end for a reply whose send never
  completed (the call was cut off, or the client went away).

A read that finds no room waits up to `queued_reply_wait_ms`, served as room comes
back in arrival order, then gets RESOURCE_EXHAUSTED naming the limit. Blocked group
readers are read for by their group's dispatcher (service/groupwaits.py), which
reserves for the reader at the head of the line: those behind it wait with it, in
arrival order as RCP 11 asks, at most that long. Claim and AutoClaim, whose reply
size is known only once claimed, reserve `max_read_bytes`. Everything
here runs on the event loop thread: plain integers, no locks. The per-reply cost is
a few integer operations and one dict lookup.
"""

from __future__ import annotations

import asyncio
from typing import Any

from service.config import Settings
from service.errors import ServiceError, limit_exceeded


class ReplyCharge:
    """One call's share of the budget: the reply (or reservation) it holds now, in bytes."""

    __slots__ = ("_budget", "held", "peer")

    def __init__(self, budget: ReplyBudget, peer: str) -> None:
        self._budget = budget
        self.peer = peer
        self.held = 0

    async def reserve(self, nbytes: int) -> None:
        """Room for a reply of up to `nbytes`, in place of what the call holds (wait for it, or
        raise RESOURCE_EXHAUSTED)."""
        extra = nbytes - self.held
        budget = self._budget
        if extra <= 0 or budget.fits(self.peer, extra):
            self.settle(nbytes)
            return
        await budget.wait_for_room(self, nbytes)

    def settle(self, nbytes: int) -> None:
        """The call now holds `nbytes`: its built reply's size, or 0 once the reply is sent."""
        delta = nbytes - self.held
        if delta:
            self.held = nbytes
            self._budget.add(self.peer, delta)

    def hold(self, reply: bytes) -> bytes:
        """`reply`, now counted at its size (in place of the room reserved for it)."""
        self.settle(len(reply))
        return reply

    def release(self, *_: Any) -> None:
        """Give back everything (the signature of a done callback)."""
        self.settle(0)


class ReplyBudget:
    """Queued reply bytes: in total, and per client connection (its peer address)."""

    def __init__(self, total: int, per_connection: int, wait_ms: int) -> None:
        self.total = total
        self.per_connection = per_connection
        self._wait_s = wait_ms / 1000
        self.queued = 0
        self.refused = 0
        self._by_peer: dict[str, int] = {}
        self._granting = False
        # Reads waiting for room, in arrival order: (charge, bytes it asks to hold, future).
        self._waiting: list[tuple[ReplyCharge, int, asyncio.Future[None]]] = []

    @classmethod
    def from_settings(cls, settings: Settings) -> ReplyBudget:
        return cls(
            settings.max_queued_reply_bytes,
            settings.max_connection_queued_reply_bytes,
            settings.queued_reply_wait_ms,
        )

    def charge(self, context: Any) -> ReplyCharge:
        """The budget of the call `context` belongs to; all it holds is given back when the call ends."""
        charge = ReplyCharge(self, context.peer())
        context.add_done_callback(charge.release)
        return charge

    def on_peer(self, peer: str) -> int:
        return self._by_peer.get(peer, 0)

    def fits(self, peer: str, extra: int) -> bool:
        return self.queued + extra <= self.total and self._by_peer.get(peer, 0) + extra <= self.per_connection

    def add(self, peer: str, delta: int) -> None:
        self.queued += delta
        held = self._by_peer.get(peer, 0) + delta
        if held:
            self._by_peer[peer] = held
        else:
            del self._by_peer[peer]  # connections come and go: keep no entry for an idle one
        if delta < 0 and self._waiting and not self._granting:
            self._grant()

    async def wait_for_room(self, charge: ReplyCharge, nbytes: int) -> None:
        """Wait until `charge` can hold `nbytes` (the grant settles it), or raise RESOURCE_EXHAUSTED."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((charge, nbytes, future))
        try:
            async with asyncio.timeout(self._wait_s):
                await future
        except TimeoutError:
            self.refused += 1
            raise self._refusal(charge, nbytes) from None
        finally:
            if not future.done():
                future.cancel()  # the grant skips it; the list drops it at the next grant
                self._waiting = [entry for entry in self._waiting if entry[2] is not future]

    def _grant(self) -> None:
        """Hand the room given back to the reads waiting for it, in arrival order."""
        waiting = []
        self._granting = True  # the settles below change what is held: no grant within this one
        try:
            for entry in self._waiting:
                charge, nbytes, future = entry
                if future.done():
                    continue
                extra = nbytes - charge.held
                if extra <= 0 or self.fits(charge.peer, extra):
                    charge.settle(nbytes)
                    future.set_result(None)
                else:
                    waiting.append(entry)
        finally:
            self._granting = False
        self._waiting = waiting

    def _refusal(self, charge: ReplyCharge, nbytes: int) -> ServiceError:
        if self.on_peer(charge.peer) + nbytes - charge.held > self.per_connection:
            return limit_exceeded(
                "max_connection_queued_reply_bytes",
                self.per_connection,
                f"max_bytes: replies this connection has not yet taken hold {self.on_peer(charge.peer)} "
                f"bytes; waited {self._wait_s:g} s for room for {nbytes} more (read what was sent, or "
                "ask for less)",
            )
        return limit_exceeded(
            "max_queued_reply_bytes",
            self.total,
            f"max_bytes: replies waiting to be sent hold {self.queued} bytes on this server; waited "
            f"{self._wait_s:g} s for room for {nbytes} more; retry later",
        )
