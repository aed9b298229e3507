"""Where a long call (Subscribe, Consume, a blocking Read) resumes when it is ended for its client
to make it again elsewhere, and ending it so.

In a cluster, a node ends two kinds of open calls (service/opencalls.py holds them
all, by stream). The calls it serves as a stream's leader end when placement says
another node (or none) now leads the stream: its copy is no longer where the stream
moves on, so they end with UNAVAILABLE "leader changed; ...". The calls it relays to
other nodes' leaders end when it drains for shutdown ("server is shutting down;
..."), as the calls it serves itself do. Either way the status says where to resume:
a plain subscription from the next offset it would have sent (the `next_offset` of
its last reply), a blocking read from the offset it asked for, a group call simply
again (the group keeps its position). The client then calls again, and is routed to
the leader. The routing layer (service/routing.py) says where on each call it routes
(`OpenCall.resume`).
"""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError
from streamlog.v1 import streamlog_pb2 as pb

from service.opencalls import OpenCall

# The start of a Subscribe reply that holds its next_offset: service/streamwire.py writes a
# reply's scalar fields before its entries, first_offset (field 2) then next_offset (field 3), each
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


GROUP_RESUME = "call again (the group keeps its position)"
PUBLISH_RESUME = "publish again, resending what was not answered (with a producer id: no duplicates)"


def end_to_resume(call: OpenCall, reason: str) -> None:
    """End `call` with UNAVAILABLE "<reason>; <where to resume>"."""
    where = call.resume() if call.resume is not None else "call again"
    call.end(grpc.StatusCode.UNAVAILABLE, f"{reason}; {where}")
