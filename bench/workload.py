"""The clients of a chaos run: producers, readers and a consumer group, every call recorded in the history.

- Producers append batches of unique payloads (`<producer>:<sequence>:<index>`,
  padded) with a producer id and a sequence, so a retry is idempotent. A batch
  whose outcome is unknown is retried with the same sequence until it is
  acknowledged or refused; a refused batch is dropped and the next one gets the
  next sequence.
- Readers follow each stream with blocking reads from offset 0.
- Group workers read as consumers of one group (claiming the pending entries of
  consumers idle for a while) and acknowledge what they got; now and then one
  "crashes": it drops a batch without acknowledging it and comes back under a
  new consumer name, so the group must deliver those entries again.
- `drain` reads the group to the end once the faults are over: at-least-once
  delivery is then checkable (bench/checker.py, rule `undelivered`).

Each client dials the nodes in turn: after a call whose outcome is unknown (the
node is down, paused or cut off) it moves to the next node; any node serves any
stream (a node that does not lead it forwards the call).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from bench.history import Appended, History, LogEntry, Operation
from clients import AsyncClient, GroupConfig
from clients.errors import AlreadyExistsError, StreamlogError
from clients.types import ReadResult

T = TypeVar("T")
BACKOFF_S = (0.05, 1.0)  # first and largest pause between the attempts of one call


@dataclass(frozen=True)
class WorkloadConfig:
    streams: tuple[str, ...] = ("chaos-0", "chaos-1")
    producers_per_stream: int = 1
    readers_per_stream: int = 1
    group: str = "chaos"
    workers_per_stream: int = 1
    batch_entries: tuple[int, int] = (1, 20)  # a batch holds this many entries (inclusive range)
    payload_bytes: int = 100
    pace_s: float = 0.02  # a producer's pause between batches
    call_timeout_s: float = 5.0
    block_ms: int = 500  # blocking reads wait this long for new entries
    group_retry_ms: int = 2000  # unacknowledged group entries come back after this
    claim_idle_ms: int = 3000  # a worker takes over entries idle this long (a crashed consumer's)
    crash_chance: float = 0.05  # a worker drops a batch unacknowledged
    seed: int = 0


class Caller:
    """One client of the workload: every call through `call` becomes one operation in the history."""

    def __init__(
        self, history: History, addresses: Sequence[str], process: str, timeout_s: float, first: int = 0
    ) -> None:
        self.history = history
        self.process = process
        self.timeout_s = timeout_s
        self._addresses = list(addresses)
        self._turn = first  # index of the node it calls now
        self._clients: dict[str, AsyncClient] = {}

    @property
    def client(self) -> AsyncClient:
        address = self._addresses[self._turn % len(self._addresses)]
        if address not in self._clients:
            self._clients[address] = AsyncClient(address, timeout=self.timeout_s)
        return self._clients[address]

    def next_node(self) -> None:
        self._turn += 1

    async def call(
        self,
        kind: str,
        stream: str,
        send: Callable[[AsyncClient], Awaitable[T]],
        result: Callable[[T], Any],
        **args: Any,
    ) -> tuple[Operation, T | None]:
        """Invoke `send`, record how it ended (`result(reply)` for an acknowledgement); the operation and
        the reply (None unless ok)."""
        op = self.history.invoke(self.process, kind, stream, **args)
        try:
            reply = await send(self.client)
        except StreamlogError as exc:
            code = exc.code.name if exc.code is not None else "UNKNOWN"
            self.history.failed(op, code, exc.details)
            if op.status == "unknown":
                self.next_node()
            return op, None
        except asyncio.CancelledError:
            self.history.unknown(op, "cancelled: the run stopped")
            raise
        self.history.ok(op, result(reply))
        return op, reply

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()


def _entries(reply: ReadResult) -> list[LogEntry]:
    return [LogEntry(e.offset, e.timestamp_ms, e.tag, e.payload) for e in reply.entries]


class Backoff:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.delay_s = BACKOFF_S[0]

    async def wait(self) -> None:
        await asyncio.sleep(self.rng.uniform(self.delay_s / 2, self.delay_s))
        self.delay_s = min(self.delay_s * 2, BACKOFF_S[1])

    def reset(self) -> None:
        self.delay_s = BACKOFF_S[0]


class Workload:
    """The producers, readers and group workers of one run, on the streams of `config`."""

    def __init__(self, history: History, addresses: Sequence[str], config: WorkloadConfig) -> None:
        self.history = history
        self.addresses = list(addresses)
        self.config = config
        self.stopping = asyncio.Event()
        self.acked_entries = 0
        self._progress = asyncio.Condition()
        self._tasks: list[asyncio.Task[None]] = []
        self._callers: list[Caller] = []

    def caller(self, process: str) -> Caller:
        first = len(self._callers)  # spread the clients over the nodes
        caller = Caller(self.history, self.addresses, process, self.config.call_timeout_s, first)
        self._callers.append(caller)
        return caller

    async def setup(self, timeout_s: float = 60) -> None:
        """Create the streams and the group (retried until a node answers)."""
        caller = self.caller("setup")
        config = GroupConfig(retry_ms=self.config.group_retry_ms)
        deadline = time.monotonic() + timeout_s
        for stream in self.config.streams:
            while True:
                try:
                    await caller.client.create_group(
                        stream, self.config.group, "oldest", config=config, create_stream=True
                    )
                    break
                except AlreadyExistsError:
                    break  # an earlier attempt whose reply was lost made it
                except StreamlogError:
                    if time.monotonic() > deadline:
                        raise
                    caller.next_node()
                    await asyncio.sleep(0.2)

    def start(self) -> None:
        cfg = self.config
        for stream in cfg.streams:
            for i in range(cfg.producers_per_stream):
                self._spawn(self.produce(stream, f"p{i}-{stream}"))
            for i in range(cfg.readers_per_stream):
                self._spawn(self.follow(stream, f"r{i}-{stream}"))
            for i in range(cfg.workers_per_stream):
                self._spawn(self.work(stream, f"w{i}-{stream}"))

    def _spawn(self, loop: Awaitable[None]) -> None:
        self._tasks.append(asyncio.ensure_future(loop))

    async def wait_acked(self, entries: int, timeout_s: float = 120) -> None:
        """Wait until the producers have had at least `entries` entries acknowledged in all."""
        await self.wait_until(lambda: self.acked_entries >= entries, timeout_s)

    async def wait_until(self, condition: Callable[[], bool], timeout_s: float = 120) -> None:
        """Wait until `condition()` holds, checked after every append's outcome."""
        async with asyncio.timeout(timeout_s), self._progress:
            await self._progress.wait_for(condition)

    async def stop(self) -> None:
        """Stop every loop (each ends after its call in flight) and wait for them."""
        self.stopping.set()
        await asyncio.gather(*self._tasks)
        self._tasks.clear()

    async def close(self) -> None:
        for caller in self._callers:
            await caller.close()

    # ------------------------------------------------------------------ the loops

    def _client(self, process: str) -> tuple[Caller, random.Random, Backoff]:
        """A loop's caller, its own random numbers (seeded by its name) and its backoff."""
        rng = random.Random(f"{self.config.seed}:{process}")
        return self.caller(process), rng, Backoff(rng)

    async def produce(self, stream: str, producer: str) -> None:
        cfg = self.config
        caller, rng, backoff = self._client(producer)
        sequence = 0
        while not self.stopping.is_set():
            sequence += 1
            payloads = [
                f"{producer}:{sequence}:{i}:".encode().ljust(cfg.payload_bytes, b".")
                for i in range(rng.randint(*cfg.batch_entries))
            ]
            while True:
                op, reply = await caller.call(
                    "append",
                    stream,
                    lambda c, p=payloads, s=sequence: c.append(
                        stream, p, producer_id=producer, producer_sequence=s
                    ),
                    lambda r: Appended(r.first_offset, r.last_offset, r.timestamp_ms, r.duplicate),
                    payloads=payloads,
                    producer=producer,
                    sequence=sequence,
                )
                async with self._progress:
                    self.acked_entries += len(payloads) if reply is not None else 0
                    self._progress.notify_all()
                if reply is not None:
                    backoff.reset()
                    break
                if op.status == "fail" or self.stopping.is_set():
                    break  # refused: the batch is not written; or the run is over (it stays unknown)
                await backoff.wait()
            await asyncio.sleep(cfg.pace_s)

    async def follow(self, stream: str, reader: str) -> None:
        cfg = self.config
        caller, _, backoff = self._client(reader)
        offset = 0
        while not self.stopping.is_set():
            _, reply = await caller.call(
                "read",
                stream,
                lambda c, o=offset: c.read(stream, o, count=500, block_ms=cfg.block_ms),
                _entries,
                offset=offset,
            )
            if reply is None:
                await backoff.wait()
                continue
            backoff.reset()
            offset = reply.next_offset

    async def work(self, stream: str, worker: str) -> None:
        cfg = self.config
        caller, rng, backoff = self._client(worker)
        lives = 0
        while not self.stopping.is_set():
            consumer = f"{worker}.{lives}"
            reply = await self.read_group(caller, stream, consumer, cfg.claim_idle_ms)
            if reply is None:
                await backoff.wait()
                continue
            backoff.reset()
            if not reply.entries:
                continue
            if rng.random() < cfg.crash_chance:
                lives += 1  # crashed holding these: they stay pending until claimed or due
                continue
            await self.ack(caller, stream, [e.offset for e in reply.entries])

    async def read_group(
        self, caller: Caller, stream: str, consumer: str, claim_idle_ms: int
    ) -> ReadResult | None:
        group, block_ms = self.config.group, self.config.block_ms
        _, reply = await caller.call(
            "group_read",
            stream,
            lambda c: c.read_group(
                stream, group, consumer, count=100, block_ms=block_ms, claim_idle_ms=claim_idle_ms
            ),
            _entries,
            group=group,
            consumer=consumer,
        )
        return reply

    async def ack(self, caller: Caller, stream: str, offsets: list[int]) -> None:
        group = self.config.group
        await caller.call(
            "ack",
            stream,
            lambda c: c.ack(stream, group, offsets),
            lambda r: r.acknowledged,
            group=group,
            offsets=offsets,
        )

    # ------------------------------------------------------------------ the end

    async def drain(self, timeout_s: float = 120) -> bool:
        """Read the group to the end of every stream, with nothing left pending: recorded as `drain`
        operations (ok with the group's next offset). False if some stream did not drain in time.
        A run without group workers has nothing to drain."""
        if self.config.workers_per_stream == 0:
            return True
        results = await asyncio.gather(*(self._drain(stream, timeout_s) for stream in self.config.streams))
        return all(results)

    async def _drain(self, stream: str, timeout_s: float) -> bool:
        group = self.config.group
        caller = self.caller(f"drain-{stream}")
        op = self.history.invoke(caller.process, "drain", stream, group=group)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            reply = await self.read_group(caller, stream, "drain", claim_idle_ms=0)
            if reply is None:
                await asyncio.sleep(0.2)
                continue
            if reply.entries:
                await self.ack(caller, stream, [e.offset for e in reply.entries])
                continue
            with contextlib.suppress(StreamlogError):
                info = await caller.client.group_info(stream, group)
                if info.pending == 0 and info.next_offset >= reply.end_offset:
                    self.history.ok(op, info.next_offset)
                    return True
        self.history.unknown(op, f"the group did not drain within {timeout_s} s")
        return False
