"""Long calls by stream (Subscribe, Consume, blocking Reads), to end them all at once with a reason.

A clustered node holds two such sets. The calls it serves as a stream's leader end
when placement says another node (or none) now leads the stream: its copy is no
longer where the stream moves on, so they end with UNAVAILABLE "leader changed;
...". The calls it relays to other nodes' leaders end when it drains for shutdown
("server is shutting down; ..."), as the calls it serves itself do. Either way the
status says where to resume: a plain subscription from the next offset it would have
sent (the `next_offset` of its last reply), a blocking read from the offset it asked
for, a group call simply again (the group keeps its position). The client then calls
again, and is routed to the leader.

A streaming call is ended through its OpenCall (service/opencalls.py), which
interrupts it wherever its task waits, in the service or in an outer layer sending a
reply. A blocking Read is a unary call that waits inside the handler: its OpenCall is
made by the layer that holds it, and interrupts that wait.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import grpc
from google.protobuf.message import DecodeError
from streamlog.v1 import streamlog_pb2 as pb

from service.opencalls import OpenCall

# The start of a Subscribe reply that holds its next_offset: the servicer writes a reply's
# scalar fields before its entries, first_offset (field 2) then next_offset (field 3), each
# a tag byte and a varint of at most 10 bytes.
SUBSCRIBE_HEAD_BYTES = 22


def next_offset_in(head: bytes) -> int:
    """The next_offset of a serialized SubscribeResponse, from its first SUBSCRIBE_HEAD_BYTES.

    The head may end inside the entries that follow the scalar fields: its longest prefix
    that parses as a message holds them all (a field cut short never parses).
    """
    for end in range(len(head), -1, -1):
        try:
            return pb.SubscribeResponse.FromString(head[:end]).next_offset
        except DecodeError:
            continue
    return 0  # not reached: the empty prefix parses


class SubscribePosition:
    """Where a plain subscription resumes: its start, then the next_offset of each reply sent."""

    __slots__ = ("_head", "_start")

    def __init__(self, start: int | None) -> None:
        self._start = start  # None: a start position (oldest, latest, time) not resolved yet
        self._head: bytes | None = None

    def sent(self, reply: bytes) -> None:
        self._head = reply[:SUBSCRIBE_HEAD_BYTES]

    def resume(self) -> str:
        offset = self._start if self._head is None else next_offset_in(self._head)
        return "subscribe again" if offset is None else f"resubscribe from offset {offset}"


class LongCalls:
    """Open long calls, by stream. Event loop only."""

    def __init__(self) -> None:
        # stream -> {call: its resume hint}
        self._calls: dict[str, dict[OpenCall, Callable[[], str]]] = {}

    def __len__(self) -> int:
        return sum(map(len, self._calls.values()))

    @contextlib.contextmanager
    def held(self, stream: str, call: OpenCall, resume: Callable[[], str]) -> Iterator[None]:
        """Keep `call` here while the block runs; `resume()` says where the client resumes."""
        calls = self._calls.setdefault(stream, {})
        calls[call] = resume
        try:
            yield
        finally:
            calls.pop(call, None)
            if not calls and self._calls.get(stream) is calls:
                del self._calls[stream]

    def end(self, stream: str, reason: str) -> int:
        """End every call held on `stream` with UNAVAILABLE "<reason>; <where to resume>"."""
        calls = self._calls.get(stream)
        if not calls:
            return 0
        for call, resume in list(calls.items()):
            call.end(grpc.StatusCode.UNAVAILABLE, f"{reason}; {resume()}")
        return len(calls)

    def end_all(self, reason: str) -> int:
        return sum(self.end(stream, reason) for stream in list(self._calls))
