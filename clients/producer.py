"""Producer: batched, idempotent appends to one stream or many, from any number of threads.

    with Producer(client, "orders") as producer:
        futures = [producer.send(b"order %d" % i) for i in range(10_000)]
    print(futures[-1].result())          # the last entry's offset

    with Producer(client) as producer:   # a stream per send: per device, per order, ...
        producer.send(b"reading", stream="device-17")

`send()` only queues the entry and returns a future. A background thread turns the
queue into batches: a batch goes out when it holds `max_batch_entries` entries or
`max_batch_bytes` bytes, or `linger_ms` after its first entry was queued, or at once
on `flush()` / `close()`. Batches go out as messages of one Publish session, up to
`max_in_flight` of them unanswered (pipelined: the next batch does not wait for the
previous one's answer); the server writes and answers them in order, so entries
keep the order in which they were sent. The session carries the producer's own
stream only; a batch due when entries for several streams (or for another stream) are
queued holds each stream's entries as a batch of its own, and goes out as one
AppendMany call, once the session has answered what it carries (so no stream's entries
overtake earlier ones); a batch refused with UNAVAILABLE or DEADLINE_EXCEEDED is sent
again in the next such call, with the same sequence.

Every batch carries this producer's `producer_id` and the next sequence number. When
the session fails with UNAVAILABLE or DEADLINE_EXCEEDED (or an answer takes longer
than `request_timeout_s`), the producer opens a new session (exponential backoff with
jitter) and resends every batch not yet answered, in order, with the same sequences,
for up to `delivery_timeout_s` per batch: a batch the failed session did write is
answered as a duplicate with its first offsets, so nothing is written twice. Other
errors fail that batch's futures with the client's exception; the others go on.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, wait
from dataclasses import dataclass

from clients.client import Client, PublishSession
from clients.errors import DeadlineExceededError, ProducerClosedError, StreamlogError, TransientError
from clients.types import AppendResult, Batch, Record

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Queued:
    stream: str
    item: bytes | Record
    size: int
    future: Future[int]
    queued_at: float


@dataclass(slots=True)
class _Sent:
    """A batch of one stream, sent and not yet answered."""

    stream: str
    batch: list[_Queued]
    sequence: int
    answer: Future[AppendResult]
    sent_at: float  # of its latest attempt
    deadline: float  # of all its attempts


def _size(item: bytes | Record) -> int:
    if isinstance(item, bytes):
        return len(item)
    headers = sum(len(k) + len(v) for k, v in item.headers.items()) if item.headers else 0
    return len(item.payload) + len(item.tag) + headers


class Producer:
    """Batches and retries appends through `client`; thread-safe.

    stream: where send() appends unless it names a stream (None: every send names one).
    producer_id: defaults to a random one per Producer. Give a stable id only if you
    also want deduplication across restarts of your process; sequences start from the
    current time in microseconds either way, so a restarted producer never reuses a
    sequence the server still remembers (which would make it report an old batch as
    a duplicate instead of writing the new one).
    max_buffered: `send()` blocks while this many entries wait to be sent (backpressure).
    max_in_flight: batches sent and not yet answered (at most 32, the server's dedup
    window per producer, so that every resend is recognised).
    request_timeout_s: how long an answer may take before the session is given up and
    its unanswered batches resent; delivery_timeout_s: the deadline of all attempts.
    """

    def __init__(
        self,
        client: Client,
        stream: str | None = None,
        *,
        producer_id: str | None = None,
        max_batch_entries: int = 1000,
        max_batch_bytes: int = 1 << 20,
        linger_ms: float = 5.0,
        max_buffered: int = 100_000,
        max_in_flight: int = 16,
        request_timeout_s: float = 10.0,
        delivery_timeout_s: float = 120.0,
        initial_backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
    ) -> None:
        if max_batch_entries < 1 or max_batch_bytes < 1 or max_buffered < 1:
            raise ValueError("max_batch_entries, max_batch_bytes and max_buffered must be positive")
        if not 1 <= max_in_flight <= 32:
            raise ValueError("max_in_flight must be between 1 and 32 (the server's dedup window)")
        self.client = client
        self.stream = stream
        self.producer_id = producer_id or f"producer-{uuid.uuid4().hex}"
        self.max_batch_entries = max_batch_entries
        self.max_batch_bytes = max_batch_bytes
        self.linger_s = linger_ms / 1000
        self.max_buffered = max_buffered
        self.max_in_flight = max_in_flight
        self.request_timeout_s = request_timeout_s
        self.delivery_timeout_s = delivery_timeout_s
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s
        self._sequence = time.time_ns() // 1000
        # Counters, for tests and monitoring: batches answered, sessions reopened to resend
        # (retries), batches answered as duplicates of an earlier attempt.
        self.batches_sent = 0
        self.retries = 0
        self.duplicates = 0
        self._backoff_s = initial_backoff_s

        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._queue: deque[_Queued] = deque()
        self._queued_bytes = 0
        self._sent_count = 0  # entries handed to send(), ever
        self._taken_count = 0  # entries taken from the queue into batches, ever
        self._done_count = 0  # entries whose futures are resolved, ever
        self._urgent_until = 0  # entries below this count go out without lingering (flush)
        self._closing = False
        self._abort = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"streamlog-producer-{stream or 'streams'}", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------ API

    def send(
        self,
        payload: bytes | Record,
        *,
        stream: str | None = None,
        tag: str = "",
        headers: Mapping[str, bytes] | None = None,
        deliver_at_ms: int = 0,
    ) -> Future[int]:
        """Queue one entry for `stream` (default: the producer's); the future resolves to its
        offset, or to its batch's error."""
        stream = stream or self.stream
        if not stream:
            raise ValueError("send: name a stream (this producer has no default stream)")
        if isinstance(payload, Record):
            item: bytes | Record = payload
        elif not isinstance(payload, bytes | bytearray | memoryview):
            raise TypeError(f"payload must be bytes or a Record, not {type(payload).__name__}")
        elif tag or headers or deliver_at_ms:
            item = Record(bytes(payload), tag=tag, headers=headers, deliver_at_ms=deliver_at_ms)
        else:
            item = bytes(payload)
        future: Future[int] = Future()
        queued = _Queued(stream, item, _size(item), future, time.monotonic())
        with self._changed:
            while len(self._queue) >= self.max_buffered and not self._closing:
                self._changed.wait()
            if self._closing:
                raise ProducerClosedError("the producer is closed")
            self._queue.append(queued)
            self._queued_bytes += queued.size
            self._sent_count += 1
            if len(self._queue) == 1 or self._batch_full():
                self._changed.notify_all()
        return future

    def flush(self, timeout: float | None = None) -> None:
        """Send everything queued so far at once and wait until each entry has its outcome.

        Raises TimeoutError if that takes longer than `timeout` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            target = self._sent_count
            self._urgent_until = max(self._urgent_until, target)
            self._changed.notify_all()
            while self._done_count < target:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"flush: {target - self._done_count} entries still in flight")
                if not self._thread.is_alive():
                    raise RuntimeError("the producer's sender thread died; see the log")
                self._changed.wait(remaining)

    def close(self, timeout: float | None = None) -> None:
        """Send what is queued, wait for it, then stop. Later sends raise ProducerClosedError.

        With a `timeout` that passes first: entries still queued fail with
        ProducerClosedError, and TimeoutError is raised.
        """
        with self._changed:
            self._closing = True
            self._urgent_until = self._sent_count
            self._changed.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            # Stop retrying; the batch in flight finishes its current attempt.
            self._abort.set()
            self._thread.join(self.request_timeout_s)
            raise TimeoutError("close: the producer did not finish sending in time")

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ sender thread

    def _batch_full(self) -> bool:
        return len(self._queue) >= self.max_batch_entries or self._queued_bytes >= self.max_batch_bytes

    def _batch_due(self, in_flight: int) -> bool:
        if not self._queue or in_flight >= self.max_in_flight:
            return False
        if self._batch_full() or self._taken_count < self._urgent_until or self._closing:
            return True
        return self._queue[0].queued_at + self.linger_s <= time.monotonic()

    def _wait(self, sent: deque[_Sent]) -> list[_Queued] | None:
        """Wait until a batch is due (and take it off the queue) or the oldest answer is in
        (None); None at once when closed with nothing left."""
        with self._changed:
            while not self._batch_due(len(sent)):
                if sent and sent[0].answer.done():
                    return None
                if self._closing and not self._queue and not sent:
                    return None
                timeouts = []
                if sent:
                    timeouts.append(sent[0].sent_at + self.request_timeout_s - time.monotonic())
                if self._queue and len(sent) < self.max_in_flight:
                    timeouts.append(self._queue[0].queued_at + self.linger_s - time.monotonic())
                if timeouts and min(timeouts) <= 0:
                    return None  # an answer is overdue (the caller looks), or a batch is due
                self._changed.wait(min(timeouts) if timeouts else None)
            batch: list[_Queued] = []
            size = 0
            while self._queue and len(batch) < self.max_batch_entries:
                queued = self._queue[0]
                # An entry bigger than max_batch_bytes still goes, alone: the server judges it.
                if batch and size + queued.size > self.max_batch_bytes:
                    break
                batch.append(self._queue.popleft())
                size += queued.size
            self._queued_bytes -= size
            self._taken_count += len(batch)
            self._changed.notify_all()  # room for senders blocked by max_buffered
            return batch

    def _answered(self, _answer: Future[AppendResult]) -> None:
        with self._changed:  # (on the session's reader thread)
            self._changed.notify_all()

    def _run(self) -> None:
        sent: deque[_Sent] = deque()
        session: PublishSession | None = None
        try:
            while True:
                failure = self._settle(sent)
                if failure is not None:
                    session = self._resend(session, sent, failure)
                    continue
                batch = self._wait(sent)
                if batch is None:
                    with self._changed:
                        if self._closing and not self._queue and not sent:
                            break
                    continue
                items = self._per_stream(batch)
                if self._abort.is_set():
                    self._finish(
                        items, ProducerClosedError("the producer was closed before this entry was sent")
                    )
                    continue
                # The session carries the producer's own stream (in a cluster, a session is served
                # by that stream's leader); batches for other streams, or several, go by AppendMany.
                if len(items) > 1 or items[0].stream != self.stream:
                    if sent:
                        session = self._drain(session, sent)
                    self._append_many(items)
                    continue
                sent.extend(items)
                session = session or self._open_session()
                self._publish(session, items[0])
        except BaseException as exc:
            # Whatever happens, every future gets an outcome.
            log.exception("producer %s: unexpected error", self.producer_id)
            self._finish(list(sent), exc)
            with self._changed:
                while self._queue:
                    queued = self._queue.popleft()
                    queued.future.set_exception(exc)
                    self._done_count += 1
                self._changed.notify_all()
        finally:
            if session is not None:
                session.cancel()

    def _open_session(self, failure: StreamlogError | None = None) -> PublishSession:
        # On the stream's leader; after a failure, where the cluster now says it is (a failover).
        stream = self.stream
        assert stream is not None  # only batches of the producer's own stream go on the session
        self.client.route(stream, failure)
        return self.client.publisher(stream=stream, max_in_flight=self.max_in_flight)

    def _per_stream(self, batch: list[_Queued]) -> list[_Sent]:
        """The entries taken off the queue as one batch per stream (in the order sent), each with
        the next sequence."""
        streams: dict[str, list[_Queued]] = {}
        for queued in batch:
            streams.setdefault(queued.stream, []).append(queued)
        now = time.monotonic()
        items = []
        for stream, entries in streams.items():
            items.append(_Sent(stream, entries, self._sequence, Future(), now, now + self.delivery_timeout_s))
            self._sequence += 1
        return items

    def _drain(self, session: PublishSession | None, sent: deque[_Sent]) -> PublishSession | None:
        """Wait until every batch sent on the session is answered (resending as needed): a batch
        sent by another call must not overtake them."""
        while sent:
            failure = self._settle(sent)
            if failure is not None:
                session = self._resend(session, sent, failure)
            elif sent:
                head = sent[0]
                wait(
                    [head.answer], timeout=max(0.0, head.sent_at + self.request_timeout_s - time.monotonic())
                )
        return session

    def _append_many(self, items: list[_Sent]) -> None:
        """Send batches for several streams in one AppendMany call, and again, after a pause, those
        refused with a transient error (same sequences: one written is answered as a duplicate),
        until their delivery timeout."""
        pending = items
        while True:
            batches = [
                Batch(i.stream, [q.item for q in i.batch], self.producer_id, i.sequence) for i in pending
            ]
            results: list[AppendResult | StreamlogError]
            try:
                results = self.client.append_many(batches, timeout=self.request_timeout_s)
            except TransientError as exc:
                results = [exc] * len(pending)
            except (StreamlogError, ValueError, TypeError) as exc:
                self._finish(pending, exc)
                return
            pause = self._next_pause()
            retry = []
            for item, result in zip(pending, results, strict=True):
                if isinstance(result, AppendResult):
                    self._deliver(item, result)
                elif isinstance(result, TransientError) and not self._expired(item, pause):
                    retry.append(item)
                else:
                    self._finish([item], result)
            if not retry:
                self._backoff_s = self.initial_backoff_s
                return
            log.debug("producer %s: resending %d batches in %.3f s", self.producer_id, len(retry), pause)
            self._abort.wait(pause)
            self.retries += 1
            pending = retry

    def _next_pause(self) -> float:
        """The pause before a resend: exponential backoff, with full jitter (no lockstep)."""
        pause = random.uniform(self._backoff_s / 2, self._backoff_s)
        self._backoff_s = min(self._backoff_s * 2, self.max_backoff_s)
        return pause

    def _expired(self, item: _Sent, pause: float) -> bool:
        return self._abort.is_set() or time.monotonic() + pause > item.deadline

    def _publish(self, session: PublishSession, item: _Sent) -> None:
        items = [queued.item for queued in item.batch]
        try:
            item.answer = session.publish(
                item.stream, items, producer_id=self.producer_id, producer_sequence=item.sequence
            )
        except (StreamlogError, ValueError, TypeError) as exc:
            item.answer = Future()
            item.answer.set_exception(exc)
        item.answer.add_done_callback(self._answered)

    def _settle(self, sent: deque[_Sent]) -> StreamlogError | None:
        """Give the answered batches at the head their outcomes; the transient failure (or overdue
        answer) of the oldest batch, which ends the session, if there is one."""
        while sent:
            head = sent[0]
            if not head.answer.done():
                if time.monotonic() - head.sent_at >= self.request_timeout_s:
                    return DeadlineExceededError(
                        f"no answer within request_timeout_s={self.request_timeout_s}"
                    )
                return None
            error = head.answer.exception()
            if isinstance(error, TransientError):
                return error
            sent.popleft()
            if error is not None:
                self._finish([head], error)
                continue
            self._backoff_s = self.initial_backoff_s
            self._deliver(head, head.answer.result())
        return None

    def _resend(
        self, session: PublishSession | None, sent: deque[_Sent], failure: StreamlogError
    ) -> PublishSession:
        """A new session, with every batch still unanswered sent again (same sequences), after a
        pause; batches past their delivery timeout fail with `failure` instead."""
        if session is not None:
            session.cancel()
        pause = self._next_pause()
        expired = [item for item in sent if self._expired(item, pause)]
        if expired:
            self._finish(expired, failure)
            for item in expired:
                sent.remove(item)
        log.debug(
            "producer %s: %s; resending %d batches in %.3f s", self.producer_id, failure, len(sent), pause
        )
        self._abort.wait(pause)
        self.retries += 1
        session = self._open_session(failure)
        for item in sent:
            item.sent_at = time.monotonic()
            self._publish(session, item)
        return session

    def _deliver(self, item: _Sent, result: AppendResult) -> None:
        self.batches_sent += 1
        if result.duplicate:
            self.duplicates += 1
        if result.count != len(item.batch):
            # Only a reused (producer id, sequence) can answer for another batch.
            self._finish(
                [item],
                StreamlogError(
                    f"the server reports {result.count} entries for sequence {item.sequence}, "
                    f"which held {len(item.batch)}: producer id {self.producer_id!r} is used elsewhere"
                ),
            )
            return
        for index, queued in enumerate(item.batch):
            queued.future.set_result(result.first_offset + index)
        self._done(len(item.batch))

    def _finish(self, items: list[_Sent], exc: BaseException) -> None:
        for item in items:
            for queued in item.batch:
                if not queued.future.done():
                    queued.future.set_exception(exc)
            self._done(len(item.batch))

    def _done(self, entries: int) -> None:
        with self._changed:
            self._done_count += entries
            self._changed.notify_all()
