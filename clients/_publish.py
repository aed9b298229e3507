"""The books a Publish session keeps, shared by its two flavours (clients/_streaming_sync.py and
clients/_streaming_aio.py): the messages sent and not yet answered, in order, each with the
future its answer resolves.

The server answers every message once, in the order sent (its `request_id` echoed), with
its offsets or its own error; an error of one message fails that message's future only.
When the call ends, the messages still unanswered fail with the call's error (or, after
an OK end, with an error saying they were not answered): a Producer resends them on a
new session with the same producer id and sequence, and the server answers a resend of
a message it had written as a duplicate.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from streamlog.v1 import streamlog_pb2 as pb

from clients import _convert as convert
from clients.errors import StreamlogError, UnavailableError, from_status
from clients.types import Entry, Record


@dataclass(slots=True)
class Unanswered:
    """A message sent on the session, and the future its answer resolves."""

    request: pb.PublishRequest
    future: Any  # concurrent.futures.Future or asyncio.Future of an AppendResult


class PublishSessionBase:
    def __init__(self, max_in_flight: int) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be positive")
        self.max_in_flight = max_in_flight
        self._unanswered: deque[Unanswered] = deque()
        self._next_id = 0
        self._error: StreamlogError | None = None  # the call's end, once it ended badly

    def _message(
        self,
        stream: str,
        data: bytes | Record | Entry | Iterable[bytes | Record | Entry],
        producer_id: str | None,
        producer_sequence: int | None,
    ) -> pb.PublishRequest:
        self._next_id += 1
        return convert.publish_request(stream, data, producer_id, producer_sequence, self._next_id)

    def _answered(self, reply: pb.PublishResponse) -> None:
        """Resolve the oldest unanswered message's future with `reply`."""
        if not self._unanswered or self._unanswered[0].request.request_id != reply.request_id:
            raise StreamlogError(f"the server answered request {reply.request_id}, not the next one sent")
        future = self._unanswered.popleft().future
        if future.done():
            return  # its sender gave up waiting
        if reply.HasField("error"):
            future.set_exception(from_status(reply.error.code, reply.error.message))
        else:
            future.set_result(convert.append_result(reply))

    def _ended(self, error: StreamlogError | None) -> None:
        """The call ended (`error`: how, None for OK): fail what it left unanswered."""
        self._error = error
        failure = error or UnavailableError("the Publish session ended before this message was answered")
        for item in self._unanswered:  # kept: unanswered() lists them for a resend
            if not item.future.done():
                item.future.set_exception(failure)

    def unanswered(self) -> list[pb.PublishRequest]:
        """The messages sent and not answered yet, in order."""
        return [item.request for item in self._unanswered]
