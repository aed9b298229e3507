"""The long calls a node serves as a stream's leader, ended when it stops leading the stream.

Subscribe, Consume and blocking Reads can outlive a leadership: when placement says
another node (or none) now leads the stream, this node's copy is no longer where the
stream moves on, so those calls end with UNAVAILABLE "leader changed; ..." and say
where to resume: a plain subscription from the next offset it would have sent (the
`next_offset` of its last reply), a blocking read from the offset it asked for, a
group call simply again (the group keeps its position). The client then calls again
and is routed to the new leader.

A streaming call is ended through its OpenCall (service/opencalls.py), which
interrupts it wherever its task waits, in the service or in an outer layer sending a
reply. A blocking Read is a unary call that waits inside the service: its OpenCall is
made here and interrupts that wait.
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


class LeaderCalls:
    """The calls served here as leader, by stream. Event loop only."""

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

    def end(self, stream: str) -> int:
        """End every call held on `stream` (this node no longer leads it); return how many."""
        calls = self._calls.get(stream)
        if not calls:
            return 0
        for call, resume in list(calls.items()):
            call.end(grpc.StatusCode.UNAVAILABLE, f"leader changed; {resume()}")
        return len(calls)
