"""Producer: batched, idempotent appends to one stream from any number of threads.

    with Producer(client, "orders") as producer:
        futures = [producer.send(b"order %d" % i) for i in range(10_000)]
    print(futures[-1].result())          # the last entry's offset

`send()` only queues the entry and returns a future. A background thread turns the
queue into batches: a batch goes out when it holds `max_batch_entries` entries or
`max_batch_bytes` bytes, or `linger_ms` after its first entry was queued, or at once
on `flush()` / `close()`. One batch is in flight at a time, so entries keep the
order in which they were sent.

Every batch carries this producer's `producer_id` and the next sequence number, so
a batch retried after UNAVAILABLE or DEADLINE_EXCEEDED (exponential backoff with
jitter, for up to `delivery_timeout_s`) is written once even when the failed attempt
did reach the server: the server answers the retry with the first attempt's offsets
(`duplicate`). Other errors fail the batch's futures with the client's exception.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass

from clients.client import Client
from clients.errors import ProducerClosedError, StreamlogError, TransientError
from clients.types import Record

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Queued:
    item: bytes | Record
    size: int
    future: Future[int]
    queued_at: float


def _size(item: bytes | Record) -> int:
    if isinstance(item, bytes):
        return len(item)
    headers = sum(len(k) + len(v) for k, v in item.headers.items()) if item.headers else 0
    return len(item.payload) + len(item.tag) + headers


class Producer:
    """Batches and retries appends to `stream` through `client`; thread-safe.

    producer_id: defaults to a random one per Producer. Give a stable id only if you
    also want deduplication across restarts of your process; sequences start from the
    current time in microseconds either way, so a restarted producer never reuses a
    sequence the server still remembers (which would make it report an old batch as
    a duplicate instead of writing the new one).
    max_buffered: `send()` blocks while this many entries wait to be sent (backpressure).
    request_timeout_s: the deadline of one attempt; delivery_timeout_s: of all attempts.
    """

    def __init__(
        self,
        client: Client,
        stream: str,
        *,
        producer_id: str | None = None,
        max_batch_entries: int = 1000,
        max_batch_bytes: int = 1 << 20,
        linger_ms: float = 5.0,
        max_buffered: int = 100_000,
        request_timeout_s: float = 10.0,
        delivery_timeout_s: float = 120.0,
        initial_backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
    ) -> None:
        if max_batch_entries < 1 or max_batch_bytes < 1 or max_buffered < 1:
            raise ValueError("max_batch_entries, max_batch_bytes and max_buffered must be positive")
        self.client = client
        self.stream = stream
        self.producer_id = producer_id or f"producer-{uuid.uuid4().hex}"
        self.max_batch_entries = max_batch_entries
        self.max_batch_bytes = max_batch_bytes
        self.linger_s = linger_ms / 1000
        self.max_buffered = max_buffered
        self.request_timeout_s = request_timeout_s
        self.delivery_timeout_s = delivery_timeout_s
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s
        self._sequence = time.time_ns() // 1000
        # Counters, for tests and monitoring.
        self.batches_sent = 0
        self.retries = 0
        self.duplicates = 0

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
        self._thread = threading.Thread(target=self._run, name=f"streamlog-producer-{stream}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ API

    def send(
        self,
        payload: bytes | Record,
        *,
        tag: str = "",
        headers: Mapping[str, bytes] | None = None,
        deliver_at_ms: int = 0,
    ) -> Future[int]:
        """Queue one entry; the future resolves to its offset, or to the batch's error."""
        if isinstance(payload, Record):
            item: bytes | Record = payload
        elif not isinstance(payload, bytes | bytearray | memoryview):
            raise TypeError(f"payload must be bytes or a Record, not {type(payload).__name__}")
        elif tag or headers or deliver_at_ms:
            item = Record(bytes(payload), tag=tag, headers=headers, deliver_at_ms=deliver_at_ms)
        else:
            item = bytes(payload)
        future: Future[int] = Future()
        queued = _Queued(item, _size(item), future, time.monotonic())
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

    def _take_batch(self) -> list[_Queued] | None:
        """Wait for a batch worth sending and take it off the queue; None when closed and drained."""
        with self._changed:
            while not self._queue:
                if self._closing:
                    return None
                self._changed.wait()
            while not (self._batch_full() or self._taken_count < self._urgent_until or self._closing):
                remaining = self._queue[0].queued_at + self.linger_s - time.monotonic()
                if remaining <= 0:
                    break
                self._changed.wait(remaining)
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

    def _run(self) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            sequence = self._sequence
            self._sequence += 1
            try:
                if self._abort.is_set():
                    _fail(batch, ProducerClosedError("the producer was closed before this entry was sent"))
                else:
                    self._deliver(batch, sequence)
            except BaseException as exc:
                # Whatever happens, every future gets an outcome and the thread goes on.
                log.exception("producer %s: unexpected error", self.producer_id)
                for queued in batch:
                    if not queued.future.done():
                        queued.future.set_exception(exc)
            with self._changed:
                self._done_count += len(batch)
                self._changed.notify_all()

    def _deliver(self, batch: list[_Queued], sequence: int) -> None:
        deadline = time.monotonic() + self.delivery_timeout_s
        backoff = self.initial_backoff_s
        items = [queued.item for queued in batch]
        while True:
            try:
                result = self.client.append(
                    self.stream,
                    items,
                    producer_id=self.producer_id,
                    producer_sequence=sequence,
                    timeout=self.request_timeout_s,
                )
            except TransientError as exc:
                # Full jitter keeps many producers from retrying in lockstep.
                pause = random.uniform(backoff / 2, backoff)
                if self._abort.is_set() or time.monotonic() + pause > deadline:
                    _fail(batch, exc)
                    return
                self.retries += 1
                log.debug("producer %s: %s; retrying in %.3f s", self.producer_id, exc, pause)
                self._abort.wait(pause)
                backoff = min(backoff * 2, self.max_backoff_s)
                continue
            except (StreamlogError, ValueError, TypeError) as exc:
                _fail(batch, exc)
                return
            break
        self.batches_sent += 1
        if result.duplicate:
            self.duplicates += 1
        if result.count != len(batch):
            # Only a reused (producer id, sequence) can answer for another batch.
            _fail(
                batch,
                StreamlogError(
                    f"the server reports {result.count} entries for sequence {sequence}, "
                    f"which held {len(batch)}: producer id {self.producer_id!r} is used elsewhere"
                ),
            )
            return
        for index, queued in enumerate(batch):
            queued.future.set_result(result.first_offset + index)


def _fail(batch: list[_Queued], exc: BaseException) -> None:
    for queued in batch:
        queued.future.set_exception(exc)
