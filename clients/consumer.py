"""Consumer: a consumer-group loop with at-least-once delivery.

    with Consumer(client, "orders", "billing", create=True) as consumer:
        consumer.run(handle)                  # handle(message) for every entry, until stop()

    with Consumer(client, "orders", "billing") as consumer:
        for message in consumer:              # the same, as a loop
            process(message.payload)          # acknowledged when the loop asks for the next one

A message is acknowledged after its handler returns (or when the loop moves on),
never before, so a crash while processing means redelivery, not loss. The
consumer reads through a Consume session (`Client.consume`, one open call): the
acknowledgements of a batch travel in the request for the next batch (one
message each way per batch, no call set-up), or with the session's end at
`close()`. The group assigns a batch to the consumer only when the consumer has
no message left in hand. A handler that raises has its message nacked with
`nack_delay_ms`: the group redelivers it (to this or another consumer) after
that delay, with its delivery count raised. When the session fails (the server
restarts, say), the consumer opens a new one, resending the acknowledgements
the old one did not confirm (a repeated acknowledgement is harmless), and first
gives back to the group what it holds as delivered to this consumer but the broken
session never brought (redelivered at once, not after the group's retry_ms).

Long work: when the group redelivers unacknowledged entries after `retry_ms` (set
on the group, or passed here), the consumer re-claims the message in hand every
`extend_every_s` (by default half of retry_ms) so it is not redelivered elsewhere
meanwhile. A re-claim counts as a delivery; the consumer stops extending one
delivery short of the group's max_deliveries, where the group would drop it.

`close()` (or leaving the `with` block) sends the outstanding acknowledgements and
leaves the group: DeleteConsumer hands the entries it still holds (fetched but not
processed) back to the group, for immediate redelivery to the other consumers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from clients._consume import compress_offsets
from clients.client import Client, ConsumeSession
from clients.errors import AlreadyExistsError, NotFoundError, StreamlogError, TransientError
from clients.types import Entry, Start

__all__ = ["Consumer", "Message", "compress_offsets"]

log = logging.getLogger(__name__)

STRANDED_PAGE = 1000  # pending rows per GetPending page and offsets per Nack when giving entries back


class Message:
    """One delivered entry, with ack() and nack(). Settling it twice does nothing the second time."""

    __slots__ = ("_consumer", "entry", "settled")

    def __init__(self, consumer: Consumer, entry: Entry) -> None:
        self._consumer = consumer
        self.entry = entry
        self.settled = False

    @property
    def offset(self) -> int:
        return self.entry.offset

    @property
    def payload(self) -> bytes:
        return self.entry.payload

    @property
    def tag(self) -> str:
        return self.entry.tag

    @property
    def headers(self) -> Mapping[str, bytes]:
        return self.entry.headers

    @property
    def timestamp_ms(self) -> int:
        return self.entry.timestamp_ms

    @property
    def delivery_count(self) -> int:
        """Deliveries by the group when this message was fetched (1 the first time)."""
        return self.entry.delivery_count

    def ack(self) -> None:
        """Acknowledge (sent with the consumer's request for its next batch, or at close)."""
        if not self.settled:
            self.settled = True
            self._consumer._acks.append(self.offset)

    def nack(self, delay_ms: int | None = None) -> None:
        """Give it back to the group now, for redelivery after `delay_ms` (default: the consumer's)."""
        if not self.settled:
            self.settled = True
            consumer = self._consumer
            delay = consumer.nack_delay_ms if delay_ms is None else delay_ms
            consumer.client.nack(consumer.stream, consumer.group, [self.offset], delay_ms=delay)
            consumer.nacked += 1

    def __repr__(self) -> str:
        return f"Message(offset={self.offset}, delivery_count={self.delivery_count}, settled={self.settled})"


class Consumer:
    """A member `name` of consumer group `group` on `stream`.

    batch_size: entries per batch; the consumer reads through a Consume session, which
    waits for entries as long as it takes (stop() ends the wait at once).
    retry_ms / claim_idle_ms: the session's read options (see ReadRequest). create:
    create the group (at `start`) if it does not exist, and again if a leader's failover
    loses it (group state is replicated, so only on an acks=leader stream whose leader died
    before its followers applied the group's creation).
    extend_every_s: re-claim the message in hand this often; None derives it from
    retry_ms, 0 turns it off. give_up_after_s: how long transient errors (server down)
    may last before iteration raises.
    """

    def __init__(
        self,
        client: Client,
        stream: str,
        group: str,
        name: str | None = None,
        *,
        batch_size: int = 100,
        nack_delay_ms: int = 1000,
        retry_ms: int | None = None,
        claim_idle_ms: int | None = None,
        extend_every_s: float | None = None,
        create: bool = False,
        start: Start = "oldest",
        give_up_after_s: float = 60.0,
    ) -> None:
        self.client = client
        self.stream = stream
        self.group = group
        self.name = name or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.batch_size = batch_size
        self.nack_delay_ms = nack_delay_ms
        self.retry_ms = retry_ms
        self.claim_idle_ms = claim_idle_ms
        self.give_up_after_s = give_up_after_s
        # Counters, for tests and monitoring.
        self.delivered = 0
        self.nacked = 0
        self.extended = 0

        self._acks: list[int] = []
        self._extensions: dict[int, int] = {}  # offset -> re-claims made while it was in hand
        self._held: deque[Message] = deque()  # fetched, not yet handed out
        self._current: Message | None = None
        self._stopping = threading.Event()
        self._closed = False
        self._session: ConsumeSession | None = None
        self._stranded_unchecked = False  # a session failed: see _release_stranded
        self._create = create
        self._start = start
        if create:
            self._create_group()
        self._max_deliveries: int | None = None
        self.extend_every_s = self._extend_interval(extend_every_s)
        self._heartbeat: threading.Thread | None = None
        if self.extend_every_s:
            self._heartbeat = threading.Thread(
                target=self._extend_loop, name=f"streamlog-consumer-{self.name}"
            )
            self._heartbeat.daemon = True
            self._heartbeat.start()

    def _create_group(self) -> None:
        # Another consumer may have created it first: that is the same outcome.
        with contextlib.suppress(AlreadyExistsError):
            self.client.create_group(self.stream, self.group, self._start, create_stream=True)

    def _extend_interval(self, requested: float | None) -> float:
        if requested == 0:
            return 0.0
        config = self.client.group_info(self.stream, self.group).config
        self._max_deliveries = config.max_deliveries
        if requested is not None:
            return requested
        retry_ms = self.retry_ms if self.retry_ms is not None else config.retry_ms
        return retry_ms / 2000 if retry_ms else 0.0

    # ------------------------------------------------------------------ the loop

    def __iter__(self) -> Iterator[Message]:
        while not self._stopping.is_set():
            if not self._held:
                self._fetch()
                continue
            message = self._held.popleft()
            self._current = message
            yield message
            # The loop asked for the next message: this one is done.
            message.ack()
            self._current = None

    def run(self, handler: Callable[[Message], Any], *, max_messages: int | None = None) -> int:
        """Call `handler` for each message until stop() (or `max_messages`); return how many ran.

        A handler that returns acknowledges its message; one that raises nacks it.
        """
        handled = 0
        for message in self:
            try:
                handler(message)
            except Exception:
                log.exception("consumer %s: handler failed on offset %d; nacked", self.name, message.offset)
                message.nack()
            handled += 1
            if max_messages is not None and handled >= max_messages:
                message.ack()
                self._current = None
                break
        return handled

    def stop(self) -> None:
        """Make the loop end after the message in hand (safe from any thread or a signal handler)."""
        self._stopping.set()
        # Set before looking: either this sees the session, or _open_session sees the flag.
        session = self._session
        if session is not None:
            session.stop()  # ends a wait for entries at once

    def _open_session(
        self, carried: tuple[list[int], list[tuple[int, int]]], failure: StreamlogError | None
    ) -> ConsumeSession:
        # On the stream's leader; after a failure, where the cluster now says it is (a failover).
        self.client.route(self.stream, failure)
        if failure is not None:
            self._stranded_unchecked = True
        if self._stranded_unchecked:
            self._release_stranded(carried)
        session = self.client.consume(
            self.stream,
            self.group,
            self.name,
            count=self.batch_size,
            retry_ms=self.retry_ms,
            claim_idle_ms=self.claim_idle_ms,
        )
        offsets, ranges = carried
        session.ack(offsets, ranges=ranges)
        self._session = session
        if self._stopping.is_set():
            session.stop()
        return session

    def _release_stranded(self, carried: tuple[list[int], list[tuple[int, int]]]) -> None:
        """Give back, for redelivery at once, what the group holds as delivered to this consumer
        that never reached it: a batch the failed session's reply did not bring (the server sent
        it, or assigned it, as the session broke). Without this it stays pending for this
        consumer until the group's retry_ms, or for ever without one. Entries whose
        acknowledgements are `carried` to the next session are kept. Done before the next session
        opens, so nothing it delivers is taken back. If the calls fail, the next reopen tries again."""
        acked = set(carried[0])
        ranges = carried[1]
        stranded: list[int] = []
        start = 0
        try:
            while True:
                rows = self.client.pending(
                    self.stream, self.group, consumer=self.name, start_offset=start, count=STRANDED_PAGE
                ).entries
                if not rows:
                    break
                stranded.extend(
                    row.offset
                    for row in rows
                    if row.offset not in acked and not any(lo <= row.offset < hi for lo, hi in ranges)
                )
                start = rows[-1].offset + 1
            for at in range(0, len(stranded), STRANDED_PAGE):
                self.client.nack(self.stream, self.group, stranded[at : at + STRANDED_PAGE])
        except StreamlogError as exc:
            log.warning("consumer %s: could not give back its stranded entries yet: %s", self.name, exc)
            return
        self._stranded_unchecked = False
        if stranded:
            log.info(
                "consumer %s: %d entries a broken session never brought are redelivered",
                self.name,
                len(stranded),
            )

    def _fetch(self) -> None:
        """The next batch from the session (its request carries the acknowledgements so far).

        A failed session is replaced after a pause, its unconfirmed acknowledgements
        carried over, while the failures are transient and last at most give_up_after_s.
        Returns without a batch when stop() ended the session.
        """
        started = time.monotonic()
        backoff = 0.05
        carried: tuple[list[int], list[tuple[int, int]]] = ([], [])
        failure: StreamlogError | None = None
        while not self._stopping.is_set():
            session = self._session or self._open_session(carried, failure)
            singles, ranges = compress_offsets(self._acks)
            session.ack(singles, ranges=ranges)
            self._acks.clear()
            try:
                batch = next(session, None)
            except TransientError as exc:
                failure = exc
                self._session = None
                carried = session.pending_acks()
                session.cancel()
                if self._stopping.is_set() or time.monotonic() - started > self.give_up_after_s:
                    self._acks.extend(carried[0])  # for close() to send
                    self._acks.extend(o for start, end in carried[1] for o in range(start, end))
                    raise
                pause = random.uniform(backoff / 2, backoff)
                log.warning("consumer %s: server unavailable; retrying in %.2f s", self.name, pause)
                self._stopping.wait(pause)
                backoff = min(backoff * 2, 2.0)
                continue
            except NotFoundError:
                if not (self._create and failure is not None):
                    raise
                # The failover's new leader has no copy of the group (acks=leader: its creation
                # died with the old leader, docs/CLUSTER.md): created again at `start`.
                log.warning(
                    "consumer %s: group %s is not on the stream's new leader; created again at %r",
                    self.name,
                    self.group,
                    self._start,
                )
                self._session = None
                carried = session.pending_acks()
                session.cancel()
                self._create_group()
                failure = None
                continue
            if batch is None:
                if self._stopping.is_set():
                    return  # stop() ended the session; close() finishes it
                # Ended without being asked to (a server shutting down may): open another.
                self._session = None
                self._stranded_unchecked = True
                carried = session.pending_acks()
                continue
            self._extensions.clear()
            self.delivered += len(batch.entries)
            self._held.extend(Message(self, entry) for entry in batch.entries)
            return

    def _extend_loop(self) -> None:
        while not self._stopping.wait(self.extend_every_s):
            message = self._current
            if message is None or message.settled:
                continue
            limit = self._max_deliveries
            if (
                limit is not None
                and message.delivery_count + self._extensions.get(message.offset, 0) + 1 >= limit
            ):
                continue  # one more delivery would make the group drop it
            try:
                claimed = self.client.claim(self.stream, self.group, self.name, [message.offset])
            except Exception as exc:
                log.warning("consumer %s: could not extend offset %d: %s", self.name, message.offset, exc)
                continue
            if claimed.entries:
                self.extended += 1
                self._extensions[message.offset] = self._extensions.get(message.offset, 0) + 1

    # ------------------------------------------------------------------ leaving

    def close(self) -> None:
        """Send outstanding acknowledgements and leave the group (held entries go back to it)."""
        self._leave(interrupted=False)

    def _leave(self, interrupted: bool) -> None:
        """close(); `interrupted`: Ctrl-C's KeyboardInterrupt ended the loop, perhaps inside a gRPC
        call (ConsumeSession.close says what that means), so nothing waits for gRPC's threads."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        if self._heartbeat is not None:
            self._heartbeat.join(5)
        singles, ranges = compress_offsets(self._acks)
        self._acks.clear()
        session, self._session = self._session, None
        if session is not None:
            # The session's end carries them; if it fails, an Ack call resends what it did not confirm.
            session.ack(singles, ranges=ranges)
            try:
                session.close(interrupted=interrupted)
                singles, ranges = [], []
            except StreamlogError as exc:
                log.warning("consumer %s: session ended badly: %s", self.name, exc)
                singles, ranges = session.pending_acks()
        if singles or ranges:
            self.client.ack(self.stream, self.group, singles, ranges=ranges)
        released = self.client.delete_consumer(self.stream, self.group, self.name)
        log.debug("consumer %s left %s/%s; %d entries released", self.name, self.stream, self.group, released)

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, exc_type: object, exc: object, traceback: object) -> None:
        current = self._current
        if exc is not None and current is not None and not current.settled:
            # The loop body failed on this message: give it back after the delay, so
            # leaving the group (which redelivers held entries at once) does not.
            try:
                current.nack()
            except Exception as nack_error:
                log.warning(
                    "consumer %s: could not nack offset %d: %s", self.name, current.offset, nack_error
                )
        self._leave(interrupted=exc is not None and not isinstance(exc, Exception))
