"""Where a plain subscription ended by a leader change resumes: next_offset from a reply's first bytes."""

from __future__ import annotations

import grpc
import pytest
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from service.resume import SUBSCRIBE_HEAD_BYTES, SubscribePosition, next_offset_in
from tests.service.helpers import ServerThread, append


def _reply(entries: int = 0, payload: bytes = b"x" * 300, **fields: int) -> bytes:
    """A reply laid out as the servicer writes plain Subscribe replies: scalar fields, then entries."""
    head = pb.SubscribeResponse(**fields).SerializeToString()
    tail = pb.SubscribeResponse(entries=[pb.Entry(offset=i, payload=payload) for i in range(entries)])
    return head + tail.SerializeToString()


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"next_offset": 7},
        {"first_offset": 2**63 - 2, "next_offset": 2**63 - 1, "end_offset": 2**63 - 1},
        {"first_offset": 3, "end_offset": 9},  # next_offset 0, left out
        {"next_offset": 0, "end_offset": 2**40},
    ],
)
def test_next_offset_is_read_from_the_head_of_a_reply(fields: dict[str, int]) -> None:
    # No entries; entries cut by the head; small entries whole within it.
    for entries, payload in ((0, b""), (3, b"x" * 300), (3, b"")):
        reply = _reply(entries, payload, **fields)
        assert next_offset_in(reply[:SUBSCRIBE_HEAD_BYTES]) == fields.get("next_offset", 0)
        assert pb.SubscribeResponse.FromString(reply).next_offset == fields.get("next_offset", 0)


def test_the_servicer_writes_plain_subscribe_replies_with_their_next_offset_first(
    server: ServerThread,
) -> None:
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        for _ in range(3):
            append(stub, "s", *[b"p" * 100] * 50)
        stub.Trim(pb.TrimRequest(stream="s", trim_to_offset=20), timeout=5)  # replies with a gap
        raw = channel.unary_stream("/streamlog.v1.StreamLogService/Subscribe")
        subscription = raw(pb.SubscribeRequest(stream="s", count=40).SerializeToString(), timeout=10)
        position = SubscribePosition(0)
        assert position.resume() == "resubscribe from offset 0"
        seen = []
        for reply in subscription:
            parsed = pb.SubscribeResponse.FromString(reply)
            position.sent(reply)
            seen.append(parsed.next_offset)
            assert position.resume() == f"resubscribe from offset {parsed.next_offset}"
            if parsed.next_offset == 150:
                break
        subscription.cancel()
    assert seen[0] == 60 and seen[-1] == 150  # a gap (0..19), then entries 20..149 in batches
    assert SubscribePosition(None).resume() == "subscribe again"
