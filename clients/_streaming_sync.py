"""The streaming calls of the sync Client: Subscription, ConsumeSession, PublishSession (threads, grpc).

With clients/_streaming_aio.py, this is the part of the two clients written twice,
because it differs: a thread blocks in `next()` on a call where a task awaits
`read()`, and gRPC takes a Consume call's requests from an iterator it reads in a
thread of its own where grpc.aio has the session write them. The books they keep
are shared (clients/_subscription.py, clients/_consume.py); everything else of
Client is generated from AsyncClient (clients/_generate_sync.py).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any

import grpc

from clients._connection import call_timeout
from clients._consume import ConsumeSessionBase
from clients._publish import PublishSessionBase, Unanswered
from clients._subscription import Reopen, SubscriptionBase
from clients.errors import GapError, ProducerClosedError, StreamlogError, from_rpc_error
from clients.types import AckResult, AppendResult, Entry, Gap, ReadResult, Record


def sleep(seconds: float) -> None:
    """Wait before a call's retry (clients/client.py; the async client's is asyncio.sleep)."""
    time.sleep(seconds)


class _Replies:
    """A call's replies, taken from gRPC by a thread of their own.

    A thread that waits for a reply waits on a queue, never inside gRPC: an exception
    raised in that wait (KeyboardInterrupt at Ctrl-C) can leave a gRPC lock held when it
    lands inside gRPC's own wait, and cancelling or closing the call then hangs. `window`
    bounds the replies taken ahead of the reader (None: the server's credit bounds them).
    """

    def __init__(self, call: Any, window: int | None) -> None:
        self._call = call
        self._queue: queue.SimpleQueue[tuple[Any, BaseException | None]] = queue.SimpleQueue()
        self._credit: queue.SimpleQueue[bool] | None = None
        if window is not None:
            self._credit = queue.SimpleQueue()
            for _ in range(window):
                self._credit.put(True)
        # The thread holds the call and the queues, not their owner (a dropped session is collected).
        threading.Thread(
            target=_pump, args=(call, self._queue, self._credit), name="streamlog-replies", daemon=True
        ).start()

    def __iter__(self) -> _Replies:
        return self

    def __next__(self) -> Any:
        item = self._queue.get()
        reply, error = item
        if reply is None:
            self._queue.put(item)  # the end stays the end for a later next()
            if error is None:
                raise StopIteration
            raise error
        if self._credit is not None:
            self._credit.put(True)
        return reply

    def cancel(self) -> None:
        """Cancel the call; the thread then ends (given credit, should it be waiting for some)."""
        self._call.cancel()
        if self._credit is not None:
            self._credit.put(True)


def _pump(
    call: Any,
    replies: queue.SimpleQueue[tuple[Any, BaseException | None]],
    credit: queue.SimpleQueue[bool] | None,
) -> None:
    try:
        while True:
            if credit is not None:
                credit.get()
            replies.put((next(call), None))
    except StopIteration:
        replies.put((None, None))
    except BaseException as exc:  # grpc.RpcError: handed to the reader, who knows what it means
        replies.put((None, exc))


def _entries(batches: Iterable[ReadResult], on_gap: Callable[[Gap], None] | None) -> Iterator[Entry]:
    for batch in batches:
        if batch.gap is not None:
            if on_gap is None:
                raise GapError(batch.gap)
            on_gap(batch.gap)
        yield from batch.entries


class Subscription(SubscriptionBase):
    """An open Subscribe call: iterate it for batches (`ReadResult`), or `entries()` for entries.

    Against a single server it does not reconnect: when it ends with an error, resubscribe
    from `next_offset` (plain subscriptions) to continue with no loss and no duplicates. A
    client of a cluster reopens it on the stream's new leader after a leader change, from
    there. `cancel()` (or leaving a `with` block) ends it; iteration then stops quietly.
    """

    def __init__(self, call: Any, reopen: Reopen | None = None) -> None:
        super().__init__(call, reopen)
        # Two batches taken ahead: a reader slower than the stream holds the server back
        # (its slow-subscriber cut-off) rather than buffering here.
        self._replies = _Replies(call, window=2)

    def __iter__(self) -> Subscription:
        return self

    def __next__(self) -> ReadResult:
        while True:
            try:
                reply = next(self._replies)
            except grpc.RpcError as exc:
                if self._cancelled_here(exc):
                    raise StopIteration from None
                error = from_rpc_error(exc)
                reopen = self._reopener()
                call = None if reopen is None else reopen(error)
                if call is None:
                    raise error from exc
                self._call = call
                self._replies = _Replies(call, window=2)
                continue
            return self._batch(reply)

    def entries(self, on_gap: Callable[[Gap], None] | None = None) -> Iterator[Entry]:
        """The entries one by one. A gap calls `on_gap`, or raises GapError when there is none."""
        return _entries(self, on_gap)

    def cancel(self) -> None:
        self._cancelled = True
        self._replies.cancel()

    close = cancel

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cancel()


def _outgoing(requests: queue.SimpleQueue[tuple[int, Any] | None], delivered: list[int]) -> Iterator[Any]:
    """The client's side of a Consume call (gRPC takes it in a thread of its own); None half-closes."""
    while (item := requests.get()) is not None:
        seq, request = item
        yield request
        # gRPC asks for the next request only once this one is sent.
        delivered[0] = seq


class ConsumeSession(ConsumeSessionBase):
    """An open Consume call: a consumer-group session. Iterate it for batches (`ReadResult`).

        with client.consume("orders", "billing", "worker-1", count=100) as session:
            for batch in session:
                handle(batch.entries)
                session.ack(ranges=[(batch.entries[0].offset, batch.entries[-1].offset + 1)])

    Taking a batch sends one request on the open call: the acknowledgements queued
    by ack() since the last one, and credit to keep `ahead` batches asked for. The
    server assigns entries to the consumer only for batches asked for, and sends
    each as soon as the group has entries for it (iteration waits as long as it
    takes: there is no idle timeout). Each batch's `acknowledged` / `ack_unknown`
    count the acknowledgements applied since the previous batch; the session's
    `acknowledged` / `ack_unknown` are the totals so far.

    close() (or leaving the `with` block) sends what is still queued, half-closes
    the call, reads the server's last reply and returns the totals as an AckResult:
    returning at all means every acknowledgement was applied; otherwise it raises.
    Batches that arrive after close() began are not handed out: their offsets are
    in `unconsumed_offsets`, still pending for this consumer. stop() ends the
    session from another thread (or a signal handler) without waiting; cancel()
    abandons it. A failed session does not reopen: open a new one, passing it
    `pending_acks()`. Errors are those of clients.errors, as for every call
    (NotFoundError for an unknown stream or group, on the first batch).
    """

    def __init__(
        self,
        start: Callable[[Iterator[Any]], Any],
        opening: Any,
        ahead: int,
        ack_call: Callable[[Any], Any],
        close_timeout: float | None,
    ) -> None:
        super().__init__(opening, ahead)
        self._requests: queue.SimpleQueue[tuple[int, Any] | None] = queue.SimpleQueue()
        self._ack_call = ack_call
        self._close_timeout = close_timeout
        # An exception raised by a signal handler (KeyboardInterrupt) reached the caller: the user
        # is leaving, and it may have landed inside gRPC, see close().
        self._interrupted = False
        self._call = start(_outgoing(self._requests, self._delivered))
        self._replies = _Replies(self._call, window=None)

    def __del__(self) -> None:
        # Dropped without close(): end the thread gRPC sends requests from (it holds no
        # reference to the session, so the session can be collected).
        requests = getattr(self, "_requests", None)
        if requests is not None and not self._half_closed:
            requests.put(None)

    def _send(self, credit: bool) -> None:
        if self._half_closed:
            return  # stop(): what is still queued goes in an Ack at close()
        for item in self._next_requests(credit):
            self._requests.put(item)

    def __iter__(self) -> ConsumeSession:
        return self

    def __next__(self) -> ReadResult:
        if self._error is not None:
            raise self._error
        if self.result is not None or self._cancelled:
            raise StopIteration
        self._send(credit=True)
        if self._ready:
            return self._ready.popleft()
        while True:
            try:
                reply = next(self._replies)
            except StopIteration:
                self._ended_ok()  # after stop(): the server ends the call once the client has
                raise
            except grpc.RpcError as exc:
                if self._cancelled_here(exc):
                    raise StopIteration from None
                raise self._fail(exc) from exc
            except BaseException:
                self._interrupted = True
                raise
            batch = self._take(reply)
            if batch is not None:
                return batch

    def entries(self, on_gap: Callable[[Gap], None] | None = None) -> Iterator[Entry]:
        """The entries one by one. A gap calls `on_gap`, or raises GapError when there is none."""
        return _entries(self, on_gap)

    def flush(self) -> None:
        """Send the queued acknowledgements now, without asking for more batches."""
        self._send(credit=False)

    def stop(self) -> None:
        """Half-close the call without waiting; safe from any thread and from a signal handler.

        The server sends no more batches and ends the call; iteration ends after the
        batches already on their way. Acknowledge what you handled, then close().
        """
        if not self._half_closed:
            self._half_closed = True
            self._requests.put(None)

    def close(self, timeout: float | None = None, *, interrupted: bool = False) -> AckResult:
        """End the session: send the queued acknowledgements, half-close, read the server's last reply.

        Returns the session's acknowledgement totals; raises if the call failed (then
        some acknowledgements may not be applied: see pending_acks()). `timeout`: how
        long to wait for the server to end the call (default: the client's timeout).
        Closing again returns the same result.

        After an exception raised by a signal handler (KeyboardInterrupt) interrupted a
        wait for a batch, or left the `with` block, or when `interrupted` says so, close()
        waits for nothing: it cancels the call and sends the acknowledgements it did not
        confirm in Ack calls. Such an exception can land inside gRPC just after it took a
        lock (of the channel's), which then stays held by this thread: this thread's own
        calls still go through, but gRPC's threads for the session (sending requests,
        reading replies, a timer's cancel) wait for that lock for ever.
        """
        done = self._closing()
        if done is not None:
            return done
        if self._interrupted or interrupted:
            self._abandon()
        else:
            self._send(credit=False)
            self.stop()
            self._drain(call_timeout(self._close_timeout, timeout))
        return self._finish([self._ack_call(request) for request in self._leftover_acks()])

    def _drain(self, deadline: float | None) -> None:
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            self._replies.cancel()

        timer = threading.Timer(deadline, expire) if deadline is not None else None
        if timer is not None:
            timer.daemon = True
            timer.start()
        try:
            for reply in self._replies:
                self._drained(reply)
        except grpc.RpcError as exc:
            raise (self._timed_out(deadline) if expired.is_set() else self._fail(exc)) from exc
        finally:
            if timer is not None:
                timer.cancel()
        self._ended_ok()

    def _fail(self, error: grpc.RpcError) -> StreamlogError:
        self.stop()  # release the thread gRPC sends requests from
        return super()._fail(error)

    def cancel(self) -> None:
        """Abandon the session at once: queued acknowledgements are not sent (see pending_acks())."""
        self._cancelled = True
        self._abandon()

    def _abandon(self) -> None:
        # Cancelled before the half-close: woken by the half-close, gRPC's request thread takes the
        # call's lock, then waits for the channel's, which an interrupt may have left held by this
        # thread; this thread's cancel() would then wait for the call's lock for ever.
        self._replies.cancel()
        self.stop()

    def __enter__(self) -> ConsumeSession:
        return self

    def __exit__(self, exc_type: object, exc: object, traceback: object) -> None:
        if self._cancelled or self.result is not None:
            return
        if self._error is not None:
            self.cancel()  # the error was raised where it happened
            return
        if exc is None:
            self.close()
            return
        # The block failed: still send the acknowledgements it made, but let its error through.
        # Ctrl-C's KeyboardInterrupt (not an Exception) may have landed inside gRPC: see close().
        self._interrupted = self._interrupted or not isinstance(exc, Exception)
        try:
            self.close()
        except StreamlogError:
            self.cancel()


class PublishSession(PublishSessionBase):
    """An open Publish call: appends sent as messages without waiting, answered in order.

        with client.publisher() as session:
            futures = [session.publish("orders", b"order %d" % i) for i in range(1000)]
        print(futures[-1].result().first_offset)

    publish() sends one message (an append of its own, to any stream) and returns a
    Future of its AppendResult at once; it waits only while `max_in_flight` messages
    are unanswered. A message the server refuses fails its own future (with the
    clients.errors exception for its status); the session goes on. close() (or
    leaving the `with` block) half-closes the call and waits for every answer. If the
    call ends first (the connection broke, the server shut down), the messages still
    unanswered fail with its error and `unanswered()` lists them: resend them on a
    new session (with a producer id and their sequence, a message that was written is
    answered as a duplicate). The Producer does all of that for you.
    """

    def __init__(self, start: Callable[[Iterator[Any]], Any], max_in_flight: int) -> None:
        super().__init__(max_in_flight)
        self._lock = threading.Condition()
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        self._call = start(iter(self._requests.get, None))
        self._reader = threading.Thread(target=self._read, name="streamlog-publish", daemon=True)
        self._reader.start()

    def publish(
        self,
        stream: str,
        data: bytes | Record | Entry | Iterable[bytes | Record | Entry],
        *,
        producer_id: str | None = None,
        producer_sequence: int | None = None,
    ) -> Future[AppendResult]:
        """Send one append; a Future of its AppendResult (or of its error)."""
        request = self._message(stream, data, producer_id, producer_sequence)
        future: Future[AppendResult] = Future()
        with self._lock:
            while len(self._unanswered) >= self.max_in_flight and self._error is None and not self._ending:
                self._lock.wait()
            if self._error is not None:
                raise self._error
            if self._closed or self._ending:
                raise ProducerClosedError("the Publish session is closed")
            self._unanswered.append(Unanswered(request, future))
            self._requests.put(request)
        return future

    @property
    def _ending(self) -> bool:
        return not self._reader.is_alive()

    def _read(self) -> None:
        error: StreamlogError | None = None
        try:
            for reply in self._call:
                with self._lock:
                    self._answered(reply)
                    self._lock.notify_all()
        except grpc.RpcError as exc:
            error = from_rpc_error(exc)
        except StreamlogError as exc:
            error = exc
            self._call.cancel()
        with self._lock:
            self._ended(error)
            self._lock.notify_all()
        self._requests.put(None)  # ends gRPC's thread that sends the requests, if still waiting

    def close(self, timeout: float | None = None) -> None:
        """Half-close the call and wait until every message is answered (or the call ends)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._requests.put(None)
        self._reader.join(timeout)
        if self._reader.is_alive():
            raise TimeoutError("close: the Publish session's answers did not all come in time")

    def cancel(self) -> None:
        """End the call at once; unanswered messages fail (see unanswered())."""
        self._call.cancel()

    def __enter__(self) -> PublishSession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
