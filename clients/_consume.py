"""Consume sessions without the I/O: what `ConsumeSession` and `AsyncConsumeSession` share.

A session (see `Client.consume`) is one Consume call. Its requests carry credit
(`batches`: how many more batches the client wants) and acknowledgements; the
server sends a batch only while it owes one. This module decides what to send
and keeps the books; the sync and async sessions (clients/_streaming_sync.py,
clients/_streaming_aio.py) only move the messages.

- Credit: when the caller asks for the next batch, the session tops up to
  `ahead` batches asked for and not yet received, so at most that many batches
  are assigned to the consumer beyond those already handed out.
- Acknowledgements are queued by `ack()` and ride in the next request (at most
  `ACK_ITEMS_PER_REQUEST` offsets and ranges each, below the server's
  max_ack_offsets).
- Which acknowledgements are known to be applied: the server applies a
  request's acknowledgements before the batches its credit pays for, and
  requests in order, so those of a request are applied once a batch arrives
  that only that request's credit, or a later one's, could have paid for; and
  all of those sent are applied once the call ends OK. The others are
  `pending_acks()`: after an error, give them to a new session or `Client.ack`
  (acknowledging twice is harmless).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain

import grpc
from streamlog.v1 import streamlog_pb2 as pb

from clients import _convert as convert
from clients.errors import DeadlineExceededError, StreamlogError, from_rpc_error
from clients.types import AckResult, Ranges, ReadResult

# Offsets and ranges per request. The server refuses more than its max_ack_offsets (10,000
# by default) in one request, and a refusal would end the whole session.
ACK_ITEMS_PER_REQUEST = 1000


def compress_offsets(offsets: Iterable[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """Offsets as single offsets and half-open ranges of consecutive ones (fewer items on the wire)."""
    singles: list[int] = []
    ranges: list[tuple[int, int]] = []
    ordered = sorted(set(offsets))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        if j > i:
            ranges.append((ordered[i], ordered[j] + 1))
        else:
            singles.append(ordered[i])
        i = j + 1
    return singles, ranges


def _checked_acks(offsets: Iterable[int], ranges: Ranges) -> tuple[list[int], list[tuple[int, int]]]:
    """Acknowledgements checked here: one the server refused would end the session, not one call."""
    singles = [int(offset) for offset in offsets]
    if any(offset < 0 for offset in singles):
        raise ValueError(f"offsets to acknowledge must not be negative: {min(singles)}")
    spans: list[tuple[int, int]] = []
    for start, end in map(convert.span_bounds, ranges):
        if start < 0 or end < start:
            raise ValueError(f"a range to acknowledge needs 0 <= start <= end, got ({start}, {end})")
        if end > start:
            spans.append((int(start), int(end)))
    return singles, spans


def _chunks(items: list[int | tuple[int, int]]) -> list[list[int | tuple[int, int]]]:
    return [items[i : i + ACK_ITEMS_PER_REQUEST] for i in range(0, len(items), ACK_ITEMS_PER_REQUEST)]


@dataclass(slots=True)
class _SentAcks:
    """Acknowledgements that went out in request number `seq`, not yet known to be applied."""

    seq: int
    # The number of the first batch that only this request's credit, or a later one's, pays for.
    proof: int
    offsets: list[int]
    ranges: list[tuple[int, int]]


class ConsumeSessionBase:
    """The state of one Consume session: credit, acknowledgements queued and unconfirmed, totals.

    Public attributes: `stream`, `group`, `consumer`, `ahead`; `acknowledged` and
    `ack_unknown`, the totals the server has reported so far; `unconsumed_offsets`,
    the entries of batches that arrived after close() began and were never handed
    out (pending for this consumer until acknowledged, nacked, claimed or
    redelivered after retry_ms); `result`, close()'s AckResult once it succeeded.
    """

    def __init__(self, opening: pb.ConsumeRequest, ahead: int) -> None:
        if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 1:
            raise ValueError(f"ahead must be a whole number of batches >= 1, got {ahead!r}")
        self.stream = opening.stream
        self.group = opening.group
        self.consumer = opening.consumer
        self.ahead = ahead
        self.acknowledged = 0
        self.ack_unknown = 0
        self.unconsumed_offsets: list[int] = []
        self.result: AckResult | None = None
        self._opening: pb.ConsumeRequest | None = opening  # sent with the first request
        self._lock = threading.Lock()  # ack() may be called from other threads
        self._offsets: list[int] = []
        self._ranges: list[tuple[int, int]] = []
        self._sent: deque[_SentAcks] = deque()
        self._seq = 0  # requests made
        # The number of the last request known to have gone out on the call (in a list, so
        # that a sender holding no reference to the session can update it).
        self._delivered = [0]
        self._asked = 0  # batches asked for
        self._received = 0  # batches received
        # Batches received and not yet handed out: a reply that fills several (they were due
        # at once) is handed out a batch at a time.
        self._ready: deque[ReadResult] = deque()
        self._half_closed = False
        self._cancelled = False
        self._error: StreamlogError | None = None

    # ------------------------------------------------------------------ public

    def ack(self, offsets: Iterable[int] = (), *, ranges: Ranges = ()) -> None:
        """Acknowledge entries by offset and by half-open (start, end) ranges (or Python ranges).

        Queued, and sent with the session's next request: when you take the next
        batch, at flush(), or at close(). Raises ValueError for a negative offset or
        a backward range (the server would end the session for it).
        """
        singles, spans = _checked_acks(offsets, ranges)
        if self.result is not None:
            raise StreamlogError("the session is closed: acknowledge with Client.ack")
        with self._lock:
            self._offsets.extend(singles)
            self._ranges.extend(spans)

    def pending_acks(self) -> tuple[list[int], list[tuple[int, int]]]:
        """Acknowledgements not known to be applied: queued, or sent and not yet confirmed.

        After the session failed, pass them on (`Client.ack(stream, group, offsets,
        ranges=ranges)` or a new session's ack()): acknowledging twice is harmless.
        """
        with self._lock:
            offsets = [*chain.from_iterable(s.offsets for s in self._sent), *self._offsets]
            ranges = [*chain.from_iterable(s.ranges for s in self._sent), *self._ranges]
        singles, spans = compress_offsets(offsets)
        return singles, spans + ranges

    # ------------------------------------------------------------------ for the sessions

    def _next_requests(self, credit: bool) -> list[tuple[int, pb.ConsumeRequest]]:
        """The requests to send now, numbered: the queued acknowledgements and, with `credit`,
        batches enough to have `ahead` asked for and not received. The first opens the session."""
        with self._lock:  # taken from the queue and recorded as sent at once, for pending_acks()
            return self._make_requests(credit)

    def _make_requests(self, credit: bool) -> list[tuple[int, pb.ConsumeRequest]]:
        offsets, self._offsets = self._offsets, []
        extra, self._ranges = self._ranges, []
        singles, spans = compress_offsets(offsets)
        items: list[int | tuple[int, int]] = [*singles, *spans, *extra]
        handed_out = self._received - len(self._ready)
        wanted = max(self.ahead - (self._asked - handed_out), 0) if credit else 0
        chunks = _chunks(items) or [[]]
        requests: list[tuple[int, pb.ConsumeRequest]] = []
        for index, chunk in enumerate(chunks):
            batches = wanted if index == len(chunks) - 1 else 0  # credit goes last: after every ack
            if not chunk and not batches:
                continue  # nothing to say (a session is opened only to ask or acknowledge)
            chunk_offsets = [item for item in chunk if isinstance(item, int)]
            chunk_ranges = [item for item in chunk if isinstance(item, tuple)]
            request = pb.ConsumeRequest(
                batches=batches,
                ack_offsets=chunk_offsets,
                ack_ranges=convert.offset_ranges(chunk_ranges),
            )
            if self._opening is not None:
                request.MergeFrom(self._opening)
                self._opening = None
            self._seq += 1
            if chunk:
                self._sent.append(_SentAcks(self._seq, self._asked + 1, chunk_offsets, chunk_ranges))
            self._asked += batches
            requests.append((self._seq, request))
        return requests

    def _take(self, reply: pb.ConsumeResponse) -> ReadResult | None:
        """Account for one reply; the first batch it carries (the others wait in `_ready`), or
        None for the last reply (counts only)."""
        self.acknowledged += reply.acknowledged
        self.ack_unknown += reply.ack_unknown
        if not reply.entries and not reply.HasField("gap"):
            return None
        filled = reply.batches or 1  # several batches due at once come in one reply
        self._received += filled
        with self._lock:
            while self._sent and self._sent[0].proof <= self._received:
                self._sent.popleft()
        first, *rest = _split(convert.read_result(reply), filled)
        self._ready.extend(rest)
        return first

    def _drained(self, reply: pb.ConsumeResponse) -> None:
        """A reply read by close(): its entries are never handed out."""
        self._put_back()
        batch = self._take(reply)
        if batch is not None:
            self.unconsumed_offsets.extend(entry.offset for entry in batch.entries)
            self._put_back()

    def _put_back(self) -> None:
        """Batches received and never handed out: unconsumed, since close() began."""
        while self._ready:
            self.unconsumed_offsets.extend(entry.offset for entry in self._ready.popleft().entries)

    def _ended_ok(self) -> None:
        """The call ended OK: every acknowledgement that went out on it was applied."""
        with self._lock:
            self._sent = deque(s for s in self._sent if s.seq > self._delivered[0])

    def _cancelled_here(self, error: grpc.RpcError) -> bool:
        """Whether the call ended because cancel() cancelled it (iteration then stops quietly)."""
        return self._cancelled and error.code() == grpc.StatusCode.CANCELLED

    def _fail(self, error: grpc.RpcError) -> StreamlogError:
        self._error = from_rpc_error(error)
        return self._error

    def _timed_out(self, deadline: float | None) -> StreamlogError:
        self._error = DeadlineExceededError(
            f"the server did not end the session within {deadline} s of close()",
            grpc.StatusCode.DEADLINE_EXCEEDED,
        )
        return self._error

    def _closing(self) -> AckResult | None:
        """close()'s first step: the result of an earlier close(), or None to go on closing.

        Raises when the acknowledgements cannot be confirmed any more (the session
        failed, or was cancelled); batches received and never handed out become
        `unconsumed_offsets`.
        """
        if self.result is not None:
            return self.result
        if self._error is not None:
            raise self._error
        if self._cancelled:
            raise StreamlogError("the session was cancelled: its acknowledgements may not be applied")
        self._put_back()
        return None

    def _leftover_acks(self) -> list[pb.AckRequest]:
        """Ack calls for what the call did not confirm (queued after stop(), say)."""
        singles, spans = self.pending_acks()
        items: list[int | tuple[int, int]] = [*singles, *spans]
        return [
            convert.ack_request(
                self.stream,
                self.group,
                [item for item in chunk if isinstance(item, int)],
                [item for item in chunk if isinstance(item, tuple)],
            )
            for chunk in _chunks(items)
        ]

    def _finish(self, replies: Iterable[pb.AckResponse]) -> AckResult:
        """close()'s result, counting the leftover Ack calls' replies."""
        for reply in replies:
            self.acknowledged += reply.acknowledged
            self.ack_unknown += reply.unknown
        with self._lock:
            self._sent.clear()
            self._offsets.clear()
            self._ranges.clear()
        self.result = AckResult(self.acknowledged, self.ack_unknown)
        return self.result


def _split(result: ReadResult, batches: int) -> list[ReadResult]:
    """A reply that fills `batches` batches, as that many batches of equal size (the last one
    smaller); the first carries the reply's acknowledgement counts and gap."""
    if batches <= 1 or len(result.entries) <= 1:
        return [result]
    size = -(-len(result.entries) // batches)
    chunks = [result.entries[i : i + size] for i in range(0, len(result.entries), size)]
    return [dataclasses.replace(result, entries=chunks[0])] + [
        dataclasses.replace(result, entries=chunk, acknowledged=0, ack_unknown=0, gap=None)
        for chunk in chunks[1:]
    ]
