"""The streaming calls of AsyncClient: AsyncSubscription, AsyncConsumeSession, AsyncPublishSession (grpc.aio).

With clients/_streaming_sync.py, this is the part of the two clients written twice,
because it differs: a task awaits `read()` on a call (EOF at its end; reading a call
that cancel() cancelled raises asyncio.CancelledError) where a thread blocks in
`next()`, and a Consume session writes its requests on the call where gRPC's sync
API reads them from an iterator. The books they keep are shared
(clients/_subscription.py, clients/_consume.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import grpc

from clients._connection import call_timeout
from clients._consume import ConsumeSessionBase
from clients._publish import PublishSessionBase, Unanswered
from clients._subscription import SubscriptionBase
from clients.errors import GapError, ProducerClosedError, StreamlogError, from_rpc_error
from clients.types import AckResult, AppendResult, Entry, Gap, ReadResult, Record


async def sleep(seconds: float) -> None:
    """Wait before a call's retry (clients/aio.py; the sync client's is time.sleep)."""
    await asyncio.sleep(seconds)


async def _entries(
    batches: AsyncIterator[ReadResult], on_gap: Callable[[Gap], None] | None
) -> AsyncIterator[Entry]:
    async for batch in batches:
        if batch.gap is not None:
            if on_gap is None:
                raise GapError(batch.gap)
            on_gap(batch.gap)
        for entry in batch.entries:
            yield entry


class AsyncSubscription(SubscriptionBase):
    """An open Subscribe call: `async for` it for batches, or `entries()` for entries.

    As the sync Subscription: reopened on a cluster's new leader after a leader change (else
    resume from `next_offset`), and `cancel()` (or leaving `async with`) ends iteration quietly.
    """

    def __aiter__(self) -> AsyncSubscription:
        return self

    async def __anext__(self) -> ReadResult:
        if self._cancelled:
            raise StopAsyncIteration
        while True:
            try:
                reply = await self._call.read()
            except asyncio.CancelledError:
                # read() of a call cancelled by cancel() raises this; a cancellation of the
                # task itself must propagate.
                if self._cancelled:
                    raise StopAsyncIteration from None
                raise
            except grpc.RpcError as exc:
                if self._cancelled_here(exc):
                    raise StopAsyncIteration from None
                error = from_rpc_error(exc)
                reopen = self._reopener()
                call = None if reopen is None else await reopen(error)
                if call is None:
                    raise error from exc
                self._call = call
                continue
            break
        if reply is grpc.aio.EOF:
            raise StopAsyncIteration
        return self._batch(reply)

    def entries(self, on_gap: Callable[[Gap], None] | None = None) -> AsyncIterator[Entry]:
        """The entries one by one. A gap calls `on_gap`, or raises GapError when there is none."""
        return _entries(self, on_gap)

    async def __aenter__(self) -> AsyncSubscription:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.cancel()


class AsyncConsumeSession(ConsumeSessionBase):
    """An open Consume call (grpc.aio): `async for` it for batches; as the sync ConsumeSession.

        async with client.consume("orders", "billing", "worker-1", count=100) as session:
            async for batch in session:
                await handle(batch.entries)
                session.ack([entry.offset for entry in batch])

    ack() queues (it is not awaited); flush() and close() are. There is no stop():
    close() from the task that iterates, or cancel() from anywhere.
    """

    def __init__(
        self,
        start: Callable[[], Any],
        opening: Any,
        ahead: int,
        ack_call: Callable[[Any], Awaitable[Any]],
        close_timeout: float | None,
    ) -> None:
        super().__init__(opening, ahead)
        self._ack_call = ack_call
        self._close_timeout = close_timeout
        self._call = start()

    async def _send(self, credit: bool) -> None:
        if self._half_closed:
            return
        for seq, request in self._next_requests(credit):
            try:
                await self._call.write(request)
            except asyncio.InvalidStateError:
                return  # the call has ended: reading says how
            except grpc.RpcError as exc:
                raise self._fail(exc) from exc
            self._delivered[0] = seq

    def __aiter__(self) -> AsyncConsumeSession:
        return self

    async def __anext__(self) -> ReadResult:
        if self._error is not None:
            raise self._error
        if self.result is not None or self._cancelled:
            raise StopAsyncIteration
        await self._send(credit=True)
        if self._ready:
            return self._ready.popleft()
        while True:
            try:
                reply = await self._call.read()
            except asyncio.CancelledError:
                if self._cancelled:  # read() of a call cancelled by cancel()
                    raise StopAsyncIteration from None
                raise
            except grpc.RpcError as exc:
                if self._cancelled_here(exc):
                    raise StopAsyncIteration from None
                raise self._fail(exc) from exc
            if reply is grpc.aio.EOF:
                self._ended_ok()
                raise StopAsyncIteration
            batch = self._take(reply)
            if batch is not None:
                return batch

    def entries(self, on_gap: Callable[[Gap], None] | None = None) -> AsyncIterator[Entry]:
        """The entries one by one. A gap calls `on_gap`, or raises GapError when there is none."""
        return _entries(self, on_gap)

    async def flush(self) -> None:
        """Send the queued acknowledgements now, without asking for more batches."""
        await self._send(credit=False)

    async def close(self, timeout: float | None = None) -> AckResult:
        """End the session: send the queued acknowledgements, half-close, read the server's last reply.

        As ConsumeSession.close(): the acknowledgement totals, or an exception when
        some may not be applied.
        """
        done = self._closing()
        if done is not None:
            return done
        await self._send(credit=False)
        if not self._half_closed:
            self._half_closed = True
            with contextlib.suppress(asyncio.InvalidStateError):
                await self._call.done_writing()
        deadline = call_timeout(self._close_timeout, timeout)
        try:
            async with asyncio.timeout(deadline):
                while (reply := await self._call.read()) is not grpc.aio.EOF:
                    self._drained(reply)
        except TimeoutError as exc:
            self._call.cancel()
            raise self._timed_out(deadline) from exc
        except grpc.RpcError as exc:
            raise self._fail(exc) from exc
        self._ended_ok()
        return self._finish([await self._ack_call(request) for request in self._leftover_acks()])

    def cancel(self) -> None:
        """Abandon the session at once: queued acknowledgements are not sent (see pending_acks())."""
        self._cancelled = True
        self._call.cancel()

    async def __aenter__(self) -> AsyncConsumeSession:
        return self

    async def __aexit__(self, exc_type: object, exc: object, traceback: object) -> None:
        if self._cancelled or self.result is not None:
            return
        if self._error is not None:
            self.cancel()
            return
        if exc is None:
            await self.close()
            return
        try:
            await self.close()
        except StreamlogError:
            self.cancel()


class AsyncPublishSession(PublishSessionBase):
    """An open Publish call (grpc.aio): appends sent as messages without waiting; as PublishSession.

        async with client.publisher() as session:
            futures = [await session.publish("orders", b"order %d" % i) for i in range(1000)]
        print(futures[-1].result().first_offset)

    `await publish(...)` returns once the message is handed to gRPC (it waits while
    `max_in_flight` messages are unanswered, or while gRPC's flow control holds the
    call back) with an asyncio.Future of its AppendResult: await that for the answer.
    """

    def __init__(self, start: Callable[[], Any], max_in_flight: int) -> None:
        super().__init__(max_in_flight)
        self._room = asyncio.Condition()
        self._closed = False
        self._call = start()
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def publish(
        self,
        stream: str,
        data: bytes | Record | Entry | Iterable[bytes | Record | Entry],
        *,
        producer_id: str | None = None,
        producer_sequence: int | None = None,
    ) -> asyncio.Future[AppendResult]:
        """Send one append; an asyncio.Future of its AppendResult (or of its error)."""
        request = self._message(stream, data, producer_id, producer_sequence)
        async with self._room:
            await self._room.wait_for(
                lambda: len(self._unanswered) < self.max_in_flight or self._reader.done()
            )
        if self._closed or self._reader.done():
            if self._error is not None:
                raise self._error
            raise ProducerClosedError("the Publish session is closed")
        future: asyncio.Future[AppendResult] = asyncio.get_running_loop().create_future()
        self._unanswered.append(Unanswered(request, future))
        with contextlib.suppress(asyncio.InvalidStateError, grpc.RpcError):
            # A call that has ended refuses the write; its reader fails the message's future.
            await self._call.write(request)
        return future

    async def _read(self) -> None:
        error: StreamlogError | None = None
        try:
            while (reply := await self._call.read()) is not grpc.aio.EOF:
                self._answered(reply)
                async with self._room:
                    self._room.notify_all()
        except grpc.RpcError as exc:
            error = from_rpc_error(exc)
        except StreamlogError as exc:
            error = exc
            self._call.cancel()
        self._ended(error)
        async with self._room:
            self._room.notify_all()

    async def close(self, timeout: float | None = None) -> None:
        """Half-close the call and wait until every message is answered (or the call ends)."""
        if not self._closed:
            self._closed = True
            with contextlib.suppress(asyncio.InvalidStateError):
                await self._call.done_writing()
        async with asyncio.timeout(timeout):
            await asyncio.shield(self._reader)

    def cancel(self) -> None:
        """End the call at once; unanswered messages fail (see unanswered())."""
        self._call.cancel()

    async def __aenter__(self) -> AsyncPublishSession:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
