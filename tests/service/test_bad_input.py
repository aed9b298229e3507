"""Bad input to every RPC: the exact status code, a message naming the problem, and no harm done.

One server serves the whole module; after every refused call the server must still
be SERVING and a canary stream must read back exactly as written.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from service import validation
from service.errors import ServiceError
from storage import MAX_DURATION_MS, InvalidNameError, validate_name
from tests.service.helpers import ServerThread, small_settings

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
OUT_OF_RANGE = grpc.StatusCode.OUT_OF_RANGE
ALREADY_EXISTS = grpc.StatusCode.ALREADY_EXISTS

CANARY = "canary"
CANARY_PAYLOADS = [b"c%d" % i for i in range(20)]
EXISTING = "existing"  # has 5 entries
GROUP = "grp"  # a consumer group on EXISTING
BAD_NAMES = [
    ("", "must not be empty"),
    ("x" * 256, "the limit is 255"),
    ("é" * 128, "256 bytes"),  # 128 characters, but 256 bytes of UTF-8
    ("a\x00b", "NUL"),
]


@pytest.mark.parametrize(("name", "why"), BAD_NAMES)
def test_the_service_refuses_a_name_for_the_reason_the_engine_gives(name: str, why: str) -> None:
    # One rule for stream, group and consumer names (storage/names.py), worded for each layer.
    with pytest.raises(InvalidNameError) as engine:
        validate_name(name, "consumer")
    with pytest.raises(ServiceError) as service:
        validation.name("consumer", name)
    assert str(engine.value) == f"consumer name {engine.value.problem}"
    assert service.value.message == f"consumer: {engine.value.problem}"
    assert why in service.value.message


def _entries(*sizes: int, **fields: Any) -> list[pb.Entry]:
    return [pb.Entry(payload=b"p" * size, **fields) for size in sizes]


def _token(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode()


# (rpc, request, expected code, fragment(s) of the expected message)
CASES: list[tuple[str, Any, grpc.StatusCode, str | tuple[str, ...]]] = []
for name, why in BAD_NAMES:
    CASES += [
        ("Append", pb.AppendRequest(stream=name, entries=_entries(1)), INVALID, why),
        ("Read", pb.ReadRequest(stream=name), INVALID, why),
        ("Read", pb.ReadRequest(stream=name, block_ms=100), INVALID, why),
        ("Subscribe", pb.SubscribeRequest(stream=name), INVALID, why),
        ("Ack", pb.AckRequest(stream=name, group="g", offsets=[1]), INVALID, why),
        ("Ack", pb.AckRequest(stream=EXISTING, group=name, offsets=[1]), INVALID, ("group:", why)),
        ("GetStreamInfo", pb.GetStreamInfoRequest(stream=name), INVALID, why),
        ("DeleteStream", pb.DeleteStreamRequest(stream=name), INVALID, why),
        ("Trim", pb.TrimRequest(stream=name, keep_last=1), INVALID, why),
        ("SetStreamConfig", pb.SetStreamConfigRequest(stream=name), INVALID, why),
        ("SeekTime", pb.SeekTimeRequest(stream=name), INVALID, why),
        ("CountRange", pb.CountRangeRequest(stream=name), INVALID, why),
        ("Nack", pb.NackRequest(stream=name, group=GROUP, offsets=[0]), INVALID, why),
        ("Nack", pb.NackRequest(stream=EXISTING, group=name, offsets=[0]), INVALID, ("group:", why)),
        ("CreateGroup", pb.CreateGroupRequest(stream=name, group="g"), INVALID, why),
        ("CreateGroup", pb.CreateGroupRequest(stream=EXISTING, group=name), INVALID, ("group:", why)),
        ("DeleteGroup", pb.DeleteGroupRequest(stream=name, group=GROUP), INVALID, why),
        ("DeleteGroup", pb.DeleteGroupRequest(stream=EXISTING, group=name), INVALID, ("group:", why)),
        ("ListGroups", pb.ListGroupsRequest(stream=name), INVALID, why),
        ("GetGroupInfo", pb.GetGroupInfoRequest(stream=name, group=GROUP), INVALID, why),
        ("GetGroupInfo", pb.GetGroupInfoRequest(stream=EXISTING, group=name), INVALID, ("group:", why)),
        ("SetGroupOffset", pb.SetGroupOffsetRequest(stream=name, group=GROUP), INVALID, why),
        ("SetGroupOffset", pb.SetGroupOffsetRequest(stream=EXISTING, group=name), INVALID, ("group:", why)),
        ("SetGroupConfig", pb.SetGroupConfigRequest(stream=name, group=GROUP), INVALID, why),
        ("SetGroupConfig", pb.SetGroupConfigRequest(stream=EXISTING, group=name), INVALID, ("group:", why)),
        ("DeleteConsumer", pb.DeleteConsumerRequest(stream=name, group=GROUP, consumer="c"), INVALID, why),
        (
            "DeleteConsumer",
            pb.DeleteConsumerRequest(stream=EXISTING, group=GROUP, consumer=name),
            INVALID,
            ("consumer:", why),
        ),
        ("Claim", pb.ClaimRequest(stream=name, group=GROUP, consumer="c", offsets=[0]), INVALID, why),
        (
            "Claim",
            pb.ClaimRequest(stream=EXISTING, group=GROUP, consumer=name, offsets=[0]),
            INVALID,
            ("consumer:", why),
        ),
        ("AutoClaim", pb.AutoClaimRequest(stream=name, group=GROUP, consumer="c"), INVALID, why),
        (
            "AutoClaim",
            pb.AutoClaimRequest(stream=EXISTING, group=name, consumer="c"),
            INVALID,
            ("group:", why),
        ),
        ("GetPending", pb.GetPendingRequest(stream=name, group=GROUP), INVALID, why),
        ("GetPending", pb.GetPendingRequest(stream=EXISTING, group=name), INVALID, ("group:", why)),
        ("Read", pb.ReadRequest(stream=EXISTING, group=GROUP, consumer=name), INVALID, ("consumer:", why)),
        (
            "Subscribe",
            pb.SubscribeRequest(stream=EXISTING, group=GROUP, consumer=name),
            INVALID,
            ("consumer:", why),
        ),
    ]
    # Consume: a session's requests, in order; the first opens it.
    CASES += [
        ("Consume", [pb.ConsumeRequest(stream=name, group=GROUP, consumer="c", batches=1)], INVALID, why),
        (
            "Consume",
            [pb.ConsumeRequest(stream=EXISTING, group=name, consumer="c", batches=1)],
            INVALID,
            ("group:", why),
        ),
        (
            "Consume",
            [pb.ConsumeRequest(stream=EXISTING, group=GROUP, consumer=name, batches=1)],
            INVALID,
            ("consumer:", why),
        ),
    ]
    if name:  # an empty group is a plain read, whose consumer field is refused ("need a group")
        CASES.append(
            ("Read", pb.ReadRequest(stream=EXISTING, group=name, consumer="c"), INVALID, ("group:", why))
        )
# Bad GroupConfig values, refused the same way by CreateGroup and SetGroupConfig.
BAD_GROUP_CONFIGS = [
    (pb.GroupConfig(retry_ms=-1), "config.retry_ms: must not be negative"),
    (pb.GroupConfig(expire_ms=-5), "config.expire_ms"),
    (pb.GroupConfig(idle_release_ms=-1), "config.idle_release_ms"),
    (pb.GroupConfig(max_pending=0), "config.max_pending: must be positive"),
    (pb.GroupConfig(max_deliveries=-2), "config.max_deliveries: must be positive"),
    (pb.GroupConfig(delay_ms=-1), "config.delay_ms"),
    (pb.GroupConfig(dead_letter_stream="a\x00b"), "config.dead_letter_stream: must not contain NUL"),
    (pb.GroupConfig(dead_letter_stream=EXISTING), "must not be the group's own stream"),
    # Durations added to the clock stay far inside int64 (issue 12).
    (pb.GroupConfig(retry_ms=2**63 - 1), "config.retry_ms: 9223372036854775807 ms is past the limit"),
    (pb.GroupConfig(expire_ms=MAX_DURATION_MS + 1), "config.expire_ms: 1000000000000001 ms is past"),
    (pb.GroupConfig(idle_release_ms=2**63 - 1), "config.idle_release_ms: 9223372036854775807 ms is past"),
    (pb.GroupConfig(delay_ms=2**63 - 1), "config.delay_ms: 9223372036854775807 ms is past the limit"),
]
for config, why in BAD_GROUP_CONFIGS:
    CASES += [
        ("CreateGroup", pb.CreateGroupRequest(stream=EXISTING, group="g", config=config), INVALID, why),
        (
            "SetGroupConfig",
            pb.SetGroupConfigRequest(stream=EXISTING, group=GROUP, config=config),
            INVALID,
            why,
        ),
    ]
CASES += [
    # Append: empty batch, limits (named in the message), bad fields.
    ("Append", pb.AppendRequest(stream="new"), INVALID, "at least one entry"),
    (
        "Append",
        pb.AppendRequest(stream="new", entries=_entries(*[1] * 101)),
        EXHAUSTED,
        "max_batch_entries=100",
    ),
    ("Append", pb.AppendRequest(stream="new", entries=_entries(4097)), EXHAUSTED, "max_entry_bytes=4096"),
    (
        "Append",
        pb.AppendRequest(stream="new", entries=_entries(*[4000] * 17)),
        EXHAUSTED,
        "max_batch_bytes=65536",
    ),
    (
        "Append",
        pb.AppendRequest(stream="new", entries=_entries(1, tag="t" * 1025)),
        EXHAUSTED,
        "max_tag_bytes=1024",
    ),
    (
        "Append",
        pb.AppendRequest(stream="new", entries=_entries(1, headers={"h": b"v" * 5000})),
        EXHAUSTED,
        "max_entry_bytes=4096",
    ),
    (
        "Append",
        pb.AppendRequest(stream="new", entries=_entries(1, deliver_at_ms=-1)),
        INVALID,
        "deliver_at_ms",
    ),
    # Larger than max_message_bytes: refused by gRPC itself before the handler runs.
    ("Append", pb.AppendRequest(stream="new", entries=_entries(1_100_000)), EXHAUSTED, "larger than max"),
    # Read.
    ("Read", pb.ReadRequest(stream=EXISTING, offset=-1), INVALID, "offset: must not be negative"),
    ("Read", pb.ReadRequest(stream=EXISTING, count=-1), INVALID, "count: must not be negative"),
    ("Read", pb.ReadRequest(stream=EXISTING, max_bytes=-1), INVALID, "max_bytes: must not be negative"),
    ("Read", pb.ReadRequest(stream=EXISTING, block_ms=-1), INVALID, "block_ms: must not be negative"),
    ("Read", pb.ReadRequest(stream=EXISTING, block_ms=10_001), INVALID, "max_block_ms=10000"),
    ("Read", pb.ReadRequest(stream="missing"), NOT_FOUND, "'missing' does not exist"),
    ("Read", pb.ReadRequest(stream="missing", reverse=True), NOT_FOUND, "'missing' does not exist"),
    # Subscribe.
    ("Subscribe", pb.SubscribeRequest(stream=EXISTING, offset=-1), INVALID, "offset: must not be negative"),
    ("Subscribe", pb.SubscribeRequest(stream=EXISTING, count=-5), INVALID, "count: must not be negative"),
    ("Subscribe", pb.SubscribeRequest(stream=EXISTING, max_bytes=-5), INVALID, "max_bytes"),
    ("Subscribe", pb.SubscribeRequest(stream=EXISTING, start=99), INVALID, "unknown start position"),
    (
        "Subscribe",
        pb.SubscribeRequest(stream=EXISTING, start=pb.START_POSITION_TIMESTAMP, timestamp_ms=-1),
        INVALID,
        "timestamp_ms",
    ),
    # Ack.
    ("Ack", pb.AckRequest(stream=EXISTING, group="g"), INVALID, "nothing to acknowledge"),
    (
        "Ack",
        pb.AckRequest(stream=EXISTING, group="g", offsets=[3, -1]),
        INVALID,
        "offsets: must not be negative",
    ),
    (
        "Ack",
        pb.AckRequest(stream=EXISTING, group="g", ranges=[pb.OffsetRange(start_offset=5, end_offset=4)]),
        INVALID,
        "ranges[0]: end_offset 4 is before start_offset 5",
    ),
    (
        "Ack",
        pb.AckRequest(stream=EXISTING, group="g", ranges=[pb.OffsetRange(start_offset=-2, end_offset=4)]),
        INVALID,
        "ranges[0].start_offset",
    ),
    ("Ack", pb.AckRequest(stream=EXISTING, group="g", offsets=range(11)), EXHAUSTED, "max_ack_offsets=10"),
    ("Ack", pb.AckRequest(stream="missing", group="g", offsets=[0]), NOT_FOUND, "stream 'missing'"),
    ("Ack", pb.AckRequest(stream=EXISTING, group="g", offsets=[0]), NOT_FOUND, "group 'g' does not exist"),
    # Read and Subscribe in group mode.
    ("Read", pb.ReadRequest(stream=EXISTING, group=GROUP), INVALID, "consumer: must not be empty"),
    ("Read", pb.ReadRequest(stream=EXISTING, consumer="c"), INVALID, "need a group"),
    ("Read", pb.ReadRequest(stream=EXISTING, noack=True), INVALID, "need a group"),
    ("Read", pb.ReadRequest(stream=EXISTING, retry_ms=5), INVALID, "need a group"),
    ("Read", pb.ReadRequest(stream=EXISTING, ack_offsets=[1]), INVALID, "need a group"),
    ("Read", pb.ReadRequest(stream=EXISTING, group=GROUP, consumer="c", reverse=True), INVALID, "reverse"),
    (
        "Read",
        pb.ReadRequest(stream=EXISTING, group=GROUP, consumer="c", retry_ms=-1),
        INVALID,
        "retry_ms: must not be negative",
    ),
    (
        "Read",
        pb.ReadRequest(stream=EXISTING, group=GROUP, consumer="c", expire_ms=-1),
        INVALID,
        "expire_ms: must not be negative",
    ),
    (
        "Read",
        pb.ReadRequest(stream=EXISTING, group=GROUP, consumer="c", claim_idle_ms=-1, block_ms=100),
        INVALID,
        "claim_idle_ms: must not be negative",
    ),
    *[
        (
            "Read",
            pb.ReadRequest(stream=EXISTING, group=GROUP, consumer="c", **{name: 2**63 - 1}),
            INVALID,
            f"{name}: 9223372036854775807 ms is past the limit of {MAX_DURATION_MS} ms",
        )
        for name in ("retry_ms", "expire_ms", "claim_idle_ms")
    ],
    (
        "Read",
        pb.ReadRequest(stream=EXISTING, group=GROUP, consumer="c", ack_offsets=[2, -1]),
        INVALID,
        "ack_offsets: must not be negative",
    ),
    (
        "Read",
        pb.ReadRequest(
            stream=EXISTING,
            group=GROUP,
            consumer="c",
            ack_ranges=[pb.OffsetRange(start_offset=3, end_offset=1)],
        ),
        INVALID,
        "ack_ranges[0]: end_offset 1 is before start_offset 3",
    ),
    (
        "Read",
        pb.ReadRequest(stream=EXISTING, group=GROUP, consumer="c", ack_offsets=range(11)),
        EXHAUSTED,
        "max_ack_offsets=10",
    ),
    (
        "Read",
        pb.ReadRequest(stream=EXISTING, group="nope", consumer="c"),
        NOT_FOUND,
        "group 'nope' does not exist",
    ),
    (
        "Read",
        pb.ReadRequest(stream=EXISTING, group="nope", consumer="c", block_ms=1000),
        NOT_FOUND,
        "group 'nope' does not exist",
    ),
    (
        "Read",
        pb.ReadRequest(stream="missing", group=GROUP, consumer="c"),
        NOT_FOUND,
        "'missing' does not exist",
    ),
    (
        "Read",
        pb.ReadRequest(stream="missing", group=GROUP, consumer="c", block_ms=1000),
        NOT_FOUND,
        "'missing' does not exist",
    ),
    ("Subscribe", pb.SubscribeRequest(stream=EXISTING, group=GROUP), INVALID, "consumer: must not be empty"),
    ("Subscribe", pb.SubscribeRequest(stream=EXISTING, consumer="c"), INVALID, "need a group"),
    (
        "Subscribe",
        pb.SubscribeRequest(stream=EXISTING, group=GROUP, consumer="c", offset=3),
        INVALID,
        "not used in group mode",
    ),
    (
        "Subscribe",
        pb.SubscribeRequest(stream=EXISTING, group=GROUP, consumer="c", start=pb.START_POSITION_OLDEST),
        INVALID,
        "not used in group mode",
    ),
    (
        "Subscribe",
        pb.SubscribeRequest(stream=EXISTING, group=GROUP, consumer="c", retry_ms=-1),
        INVALID,
        "retry_ms: must not be negative",
    ),
    (
        "Subscribe",
        pb.SubscribeRequest(stream=EXISTING, group=GROUP, consumer="c", expire_ms=MAX_DURATION_MS + 1),
        INVALID,
        "expire_ms: 1000000000000001 ms is past the limit",
    ),
    (
        "Subscribe",
        pb.SubscribeRequest(stream=EXISTING, group="nope", consumer="c"),
        NOT_FOUND,
        "group 'nope' does not exist",
    ),
    (
        "Subscribe",
        pb.SubscribeRequest(stream="missing", group=GROUP, consumer="c"),
        NOT_FOUND,
        "'missing' does not exist",
    ),
    # Consume: the opening request's fields as a group Read's; credit; acknowledgements; later requests.
    *[
        ("Consume", [pb.ConsumeRequest(stream=EXISTING, group=GROUP, consumer="c", **fields)], INVALID, why)
        for fields, why in [
            ({"count": -1}, "count: must not be negative"),
            ({"max_bytes": -1}, "max_bytes: must not be negative"),
            ({"retry_ms": -1}, "retry_ms: must not be negative"),
            ({"expire_ms": -1}, "expire_ms: must not be negative"),
            ({"claim_idle_ms": -1, "batches": 1}, "claim_idle_ms: must not be negative"),
            ({"retry_ms": 2**63 - 1, "batches": 1}, "retry_ms: 9223372036854775807 ms is past the limit"),
            ({"batches": -1}, "batches: must not be negative"),
            ({"ack_offsets": [2, -1]}, "ack_offsets: must not be negative"),
            (
                {"ack_ranges": [pb.OffsetRange(start_offset=3, end_offset=1)]},
                "ack_ranges[0]: end_offset 1 is before start_offset 3",
            ),
        ]
    ],
    ("Consume", [pb.ConsumeRequest(stream=EXISTING, group=GROUP)], INVALID, "consumer: must not be empty"),
    ("Consume", [pb.ConsumeRequest(group=GROUP, consumer="c")], INVALID, "stream: must not be empty"),
    *[
        (
            "Consume",
            [pb.ConsumeRequest(stream=EXISTING, group=GROUP, consumer="c"), later],
            INVALID,
            "set by the first request only",
        )
        for later in [
            pb.ConsumeRequest(stream=EXISTING, batches=1),
            pb.ConsumeRequest(group=GROUP, batches=1),
            pb.ConsumeRequest(consumer="c", batches=1),
            pb.ConsumeRequest(count=1, batches=1),
            pb.ConsumeRequest(noack=True, batches=1),
            pb.ConsumeRequest(retry_ms=0, batches=1),
        ]
    ],
    (
        "Consume",
        [pb.ConsumeRequest(stream=EXISTING, group=GROUP, consumer="c"), pb.ConsumeRequest(batches=-3)],
        INVALID,
        "batches: must not be negative",
    ),
    (
        "Consume",
        [pb.ConsumeRequest(stream=EXISTING, group=GROUP, consumer="c", batches=1001)],
        EXHAUSTED,
        "max_consume_batches=1000",
    ),
    (
        "Consume",
        [pb.ConsumeRequest(stream=EXISTING, group=GROUP, consumer="c", ack_offsets=range(11))],
        EXHAUSTED,
        "max_ack_offsets=10",
    ),
    (
        "Consume",
        [
            pb.ConsumeRequest(stream=EXISTING, group=GROUP, consumer="c"),
            pb.ConsumeRequest(ack_offsets=[1], ack_ranges=[pb.OffsetRange(end_offset=1)] * 10),
        ],
        EXHAUSTED,
        "max_ack_offsets=10",
    ),
    (
        "Consume",
        [pb.ConsumeRequest(stream=EXISTING, group="nope", consumer="c", batches=1)],
        NOT_FOUND,
        "group 'nope' does not exist",
    ),
    (
        "Consume",
        [pb.ConsumeRequest(stream=EXISTING, group="nope", consumer="c", ack_offsets=[0])],
        NOT_FOUND,
        "group 'nope' does not exist",
    ),
    (
        "Consume",
        [pb.ConsumeRequest(stream="missing", group=GROUP, consumer="c", batches=1)],
        NOT_FOUND,
        "'missing' does not exist",
    ),
    # Nack.
    ("Nack", pb.NackRequest(stream=EXISTING, group=GROUP), INVALID, "offsets: at least one offset"),
    ("Nack", pb.NackRequest(stream=EXISTING, group=GROUP, offsets=[1, -1]), INVALID, "offsets: must not be"),
    ("Nack", pb.NackRequest(stream=EXISTING, group=GROUP, offsets=[1], delay_ms=-1), INVALID, "delay_ms"),
    (
        "Nack",
        pb.NackRequest(stream=EXISTING, group=GROUP, offsets=[1], delay_ms=2**63 - 1),
        INVALID,
        "delay_ms: 9223372036854775807 ms is past the limit",
    ),
    (
        "Nack",
        pb.NackRequest(stream=EXISTING, group=GROUP, offsets=range(11)),
        EXHAUSTED,
        "max_ack_offsets=10",
    ),
    ("Nack", pb.NackRequest(stream=EXISTING, group="nope", offsets=[1]), NOT_FOUND, "group 'nope'"),
    ("Nack", pb.NackRequest(stream="missing", group=GROUP, offsets=[1]), NOT_FOUND, "stream 'missing'"),
    # CreateGroup.
    ("CreateGroup", pb.CreateGroupRequest(stream=EXISTING, group=GROUP), ALREADY_EXISTS, "already exists"),
    (
        "CreateGroup",
        pb.CreateGroupRequest(stream=EXISTING, group="g", offset=-1),
        INVALID,
        "offset: must not",
    ),
    (
        "CreateGroup",
        pb.CreateGroupRequest(stream=EXISTING, group="g", offset=6),
        OUT_OF_RANGE,
        "past the end",
    ),
    ("CreateGroup", pb.CreateGroupRequest(stream=EXISTING, group="g", start=99), INVALID, "unknown start"),
    (
        "CreateGroup",
        pb.CreateGroupRequest(stream=EXISTING, group="g", start=pb.START_POSITION_TIMESTAMP, timestamp_ms=-1),
        INVALID,
        "timestamp_ms: must not be negative",
    ),
    (
        "CreateGroup",
        pb.CreateGroupRequest(stream=EXISTING, group="g", entries_read=-1),
        INVALID,
        "entries_read: must not be negative",
    ),
    (
        "CreateGroup",
        pb.CreateGroupRequest(stream=EXISTING, group="g", entries_read=6),
        INVALID,
        "entries_read 6 is more than stream 'existing' has had (entries_added 5)",
    ),
    (
        "CreateGroup",
        pb.CreateGroupRequest(stream="missing", group="g"),
        NOT_FOUND,
        "'missing' does not exist",
    ),
    # DeleteGroup, ListGroups, GetGroupInfo.
    ("DeleteGroup", pb.DeleteGroupRequest(stream=EXISTING, group="nope"), NOT_FOUND, "group 'nope'"),
    ("DeleteGroup", pb.DeleteGroupRequest(stream="missing", group=GROUP), NOT_FOUND, "'missing' does not"),
    ("ListGroups", pb.ListGroupsRequest(stream="missing"), NOT_FOUND, "'missing' does not exist"),
    ("GetGroupInfo", pb.GetGroupInfoRequest(stream=EXISTING, group="nope"), NOT_FOUND, "group 'nope'"),
    ("GetGroupInfo", pb.GetGroupInfoRequest(stream="missing", group=GROUP), NOT_FOUND, "'missing' does not"),
    # SetGroupOffset, SetGroupConfig.
    (
        "SetGroupOffset",
        pb.SetGroupOffsetRequest(stream=EXISTING, group=GROUP, offset=6),
        OUT_OF_RANGE,
        "offset: 6 is past the end",
    ),
    ("SetGroupOffset", pb.SetGroupOffsetRequest(stream=EXISTING, group=GROUP, offset=-1), INVALID, "offset"),
    (
        "SetGroupOffset",
        pb.SetGroupOffsetRequest(stream=EXISTING, group=GROUP, start=7),
        INVALID,
        "unknown start",
    ),
    (
        "SetGroupOffset",
        pb.SetGroupOffsetRequest(stream=EXISTING, group=GROUP, entries_read=-3),
        INVALID,
        "entries_read: must not be negative",
    ),
    (
        "SetGroupOffset",
        pb.SetGroupOffsetRequest(stream=EXISTING, group=GROUP, entries_read=2**63 - 1),
        INVALID,
        "entries_read 9223372036854775807 is more than stream 'existing' has had (entries_added 5)",
    ),
    ("SetGroupOffset", pb.SetGroupOffsetRequest(stream=EXISTING, group="nope"), NOT_FOUND, "group 'nope'"),
    ("SetGroupConfig", pb.SetGroupConfigRequest(stream=EXISTING, group="nope"), NOT_FOUND, "group 'nope'"),
    ("SetGroupConfig", pb.SetGroupConfigRequest(stream="missing", group=GROUP), NOT_FOUND, "'missing'"),
    # DeleteConsumer.
    (
        "DeleteConsumer",
        pb.DeleteConsumerRequest(stream=EXISTING, group="nope", consumer="c"),
        NOT_FOUND,
        "group 'nope'",
    ),
    # Claim, AutoClaim.
    ("Claim", pb.ClaimRequest(stream=EXISTING, group=GROUP, consumer="c"), INVALID, "offsets: at least one"),
    (
        "Claim",
        pb.ClaimRequest(stream=EXISTING, group=GROUP, consumer="c", offsets=[0], min_idle_ms=-1),
        INVALID,
        "min_idle_ms: must not be negative",
    ),
    (
        "Claim",
        pb.ClaimRequest(stream=EXISTING, group=GROUP, consumer="c", offsets=[-4]),
        INVALID,
        "offsets: must not be negative",
    ),
    (
        "Claim",
        pb.ClaimRequest(stream=EXISTING, group=GROUP, consumer="c", offsets=range(11)),
        EXHAUSTED,
        "max_ack_offsets=10",
    ),
    (
        "Claim",
        pb.ClaimRequest(stream=EXISTING, group="nope", consumer="c", offsets=[0]),
        NOT_FOUND,
        "group 'nope'",
    ),
    (
        "AutoClaim",
        pb.AutoClaimRequest(stream=EXISTING, group=GROUP, consumer="c", cursor=-1),
        INVALID,
        "cursor: must not be negative",
    ),
    (
        "AutoClaim",
        pb.AutoClaimRequest(stream=EXISTING, group=GROUP, consumer="c", count=-1),
        INVALID,
        "count: must not be negative",
    ),
    (
        "AutoClaim",
        pb.AutoClaimRequest(stream=EXISTING, group=GROUP, consumer="c", min_idle_ms=-1),
        INVALID,
        "min_idle_ms",
    ),
    ("AutoClaim", pb.AutoClaimRequest(stream=EXISTING, group=GROUP), INVALID, "consumer: must not be empty"),
    (
        "AutoClaim",
        pb.AutoClaimRequest(stream=EXISTING, group="nope", consumer="c"),
        NOT_FOUND,
        "group 'nope'",
    ),
    # GetPending.
    (
        "GetPending",
        pb.GetPendingRequest(stream=EXISTING, group=GROUP, start_offset=4, end_offset=2),
        INVALID,
        "end_offset: 2 is before start_offset 4",
    ),
    (
        "GetPending",
        pb.GetPendingRequest(stream=EXISTING, group=GROUP, start_offset=-1),
        INVALID,
        "start_offset",
    ),
    ("GetPending", pb.GetPendingRequest(stream=EXISTING, group=GROUP, count=-1), INVALID, "count: must not"),
    (
        "GetPending",
        pb.GetPendingRequest(stream=EXISTING, group=GROUP, min_idle_ms=-1),
        INVALID,
        "min_idle_ms",
    ),
    (
        "GetPending",
        pb.GetPendingRequest(stream=EXISTING, group=GROUP, consumer="a\x00"),
        INVALID,
        "consumer:",
    ),
    ("GetPending", pb.GetPendingRequest(stream=EXISTING, group="nope"), NOT_FOUND, "group 'nope'"),
    # ListStreams.
    ("ListStreams", pb.ListStreamsRequest(page_size=-1), INVALID, "page_size"),
    ("ListStreams", pb.ListStreamsRequest(page_token="not base64!"), INVALID, "page_token"),
    ("ListStreams", pb.ListStreamsRequest(page_token=_token(b"someone else's")), INVALID, "page_token"),
    ("ListStreams", pb.ListStreamsRequest(prefix="p" * 256), INVALID, "prefix"),
    # DescribeCluster: pages like ListStreams.
    ("DescribeCluster", pb.DescribeClusterRequest(page_size=-1), INVALID, "page_size"),
    ("DescribeCluster", pb.DescribeClusterRequest(page_token="not base64!"), INVALID, "page_token"),
    ("DescribeCluster", pb.DescribeClusterRequest(prefix="p" * 256), INVALID, "prefix"),
    # ReassignReplicas: a single server has no replicas to move (a cluster: tests/cluster/test_rebalance.py).
    (
        "ReassignReplicas",
        pb.ReassignReplicasRequest(stream=EXISTING, replicas=["n1"]),
        grpc.StatusCode.FAILED_PRECONDITION,
        "not in a cluster",
    ),
    # GetStreamInfo, DeleteStream.
    ("GetStreamInfo", pb.GetStreamInfoRequest(stream="missing"), NOT_FOUND, "'missing' does not exist"),
    ("DeleteStream", pb.DeleteStreamRequest(stream="missing"), NOT_FOUND, "'missing' does not exist"),
    # Trim.
    ("Trim", pb.TrimRequest(stream=EXISTING), INVALID, "mode: set one of"),
    ("Trim", pb.TrimRequest(stream=EXISTING, evict_up_to_offset=-1), INVALID, "evict_up_to_offset"),
    ("Trim", pb.TrimRequest(stream=EXISTING, keep_last=-1), INVALID, "keep_last"),
    ("Trim", pb.TrimRequest(stream=EXISTING, trim_to_offset=-1), INVALID, "trim_to_offset"),
    ("Trim", pb.TrimRequest(stream=EXISTING, trim_to_offset=6), OUT_OF_RANGE, "past the end"),
    ("Trim", pb.TrimRequest(stream="missing", keep_last=1), NOT_FOUND, "'missing' does not exist"),
    # SetStreamConfig.
    ("SetStreamConfig", pb.SetStreamConfigRequest(stream="missing"), NOT_FOUND, "'missing' does not exist"),
    (
        "SetStreamConfig",
        pb.SetStreamConfigRequest(stream=EXISTING, config=pb.StreamConfig(max_entries=0)),
        INVALID,
        "config.max_entries: must be positive",
    ),
    (
        "SetStreamConfig",
        pb.SetStreamConfigRequest(stream=EXISTING, config=pb.StreamConfig(max_age_ms=-5)),
        INVALID,
        "config.max_age_ms",
    ),
    (
        "SetStreamConfig",
        pb.SetStreamConfigRequest(stream=EXISTING, config=pb.StreamConfig(tombstone_retention_ms=-1)),
        INVALID,
        "config.tombstone_retention_ms",
    ),
    (
        "SetStreamConfig",
        pb.SetStreamConfigRequest(stream=EXISTING, config=pb.StreamConfig(fsync=9)),
        INVALID,
        "config.fsync",
    ),
    # SeekTime, CountRange.
    ("SeekTime", pb.SeekTimeRequest(stream=EXISTING, timestamp_ms=-1), INVALID, "timestamp_ms"),
    ("SeekTime", pb.SeekTimeRequest(stream="missing"), NOT_FOUND, "'missing' does not exist"),
    ("CountRange", pb.CountRangeRequest(stream=EXISTING, start_offset=-1), INVALID, "start_offset"),
    (
        "CountRange",
        pb.CountRangeRequest(stream=EXISTING, start_offset=3, end_offset=2),
        INVALID,
        "end_offset: 2 is before start_offset 3",
    ),
    ("CountRange", pb.CountRangeRequest(stream="missing"), NOT_FOUND, "'missing' does not exist"),
]
# Publish: each of Append's cases as the message of a session (AppendRequest's fields 1-5 are
# PublishRequest's), answered with the same status in its `error`; a message over
# max_message_bytes ends the call instead (gRPC refuses it whole).
CASES += [
    ("Publish", pb.PublishRequest.FromString(request.SerializeToString()), code, fragment)
    for rpc, request, code, fragment in list(CASES)
    if rpc == "Append" and not request.HasField("expected_next_offset")
]


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    server = ServerThread(small_settings(tmp_path_factory.mktemp("bad-input")))
    server.start()
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.StreamLogServiceStub(channel)
            stub.Append(
                pb.AppendRequest(stream=CANARY, entries=[pb.Entry(payload=p) for p in CANARY_PAYLOADS])
            )
            stub.Append(pb.AppendRequest(stream=EXISTING, entries=_entries(1, 2, 3, 4, 5)))
            stub.CreateGroup(pb.CreateGroupRequest(stream=EXISTING, group=GROUP))
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def shared_channel(shared_server: ServerThread) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(shared_server.target) as channel:
        yield channel


# AppendMany: each Append case as a batch of its own, answered in its result; the request as a whole.
CASES += [
    ("AppendMany", pb.AppendManyRequest(batches=[request]), code, why)
    for rpc, request, code, why in list(CASES)
    if rpc == "Append"
]
CASES += [
    ("AppendMany", pb.AppendManyRequest(), INVALID, "batches: at least one batch is required"),
    (
        "AppendMany",
        pb.AppendManyRequest(batches=[pb.AppendRequest(stream="new", payloads=[b"x"])] * 21),
        EXHAUSTED,
        "max_append_many_batches=20",
    ),
    (
        "AppendMany",
        pb.AppendManyRequest(batches=[pb.AppendRequest(stream="new", payloads=[b"x" * 4000] * 10)] * 4),
        EXHAUSTED,
        "max_append_many_bytes=131072",
    ),
]


class MessageRefused(grpc.RpcError):
    """A Publish message's or AppendMany batch's `error`, as the status a unary call would have
    ended with."""

    def __init__(self, error: pb.PublishError) -> None:
        super().__init__(error.message)
        self._error = error

    def code(self) -> grpc.StatusCode:
        return next(c for c in grpc.StatusCode if c.value[0] == self._error.code)

    def details(self) -> str:
        return self._error.message


def _call(stub: pb_grpc.StreamLogServiceStub, rpc: str, request: Any) -> None:
    if rpc == "Publish":
        (answer,) = stub.Publish(iter([request]), timeout=5)
        if answer.HasField("error"):
            raise MessageRefused(answer.error)
    elif rpc == "AppendMany":
        (result,) = stub.AppendMany(request, timeout=5).results
        if result.HasField("error"):
            raise MessageRefused(result.error)
    elif rpc == "Consume":
        ended = threading.Event()

        def requests() -> Iterator[pb.ConsumeRequest]:
            yield from request
            # Keep the client's side open: the refusal must come from the requests, not a half-close.
            ended.wait(5)

        call = stub.Consume(requests(), timeout=5)
        try:
            for _reply in call:
                pass
        finally:
            ended.set()
            call.cancel()
    elif rpc == "Subscribe":
        call = stub.Subscribe(request, timeout=5)
        try:
            next(call)
        finally:
            call.cancel()
    else:
        getattr(stub, rpc)(request, timeout=5)


@pytest.mark.parametrize(
    ("rpc", "request_message", "code", "fragment"),
    CASES,
    ids=[f"{rpc}-{i}" for i, (rpc, *_rest) in enumerate(CASES)],
)
def test_bad_input_is_refused_with_the_right_status(
    shared_channel: grpc.Channel,
    rpc: str,
    request_message: Any,
    code: grpc.StatusCode,
    fragment: str | tuple[str, ...],
) -> None:
    stub = pb_grpc.StreamLogServiceStub(shared_channel)
    with pytest.raises(grpc.RpcError) as caught:
        _call(stub, rpc, request_message)
    assert caught.value.code() == code, caught.value.details()
    for part in (fragment,) if isinstance(fragment, str) else fragment:
        assert part in caught.value.details()

    # The server keeps serving, and nothing was written or harmed.
    health = health_pb2_grpc.HealthStub(shared_channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    canary = stub.Read(pb.ReadRequest(stream=CANARY, offset=0, count=100), timeout=5)
    assert [e.payload for e in canary.entries] == CANARY_PAYLOADS
    existing = stub.GetStreamInfo(pb.GetStreamInfoRequest(stream=EXISTING), timeout=5).info
    assert (existing.first_offset, existing.next_offset) == (0, 5)
    listed = stub.ListStreams(pb.ListStreamsRequest(page_size=5), timeout=5).streams
    assert list(listed) == [CANARY, EXISTING]
    # The group is untouched: no consumer created, nothing delivered, same position and config.
    groups = stub.ListGroups(pb.ListGroupsRequest(stream=EXISTING), timeout=5).groups
    assert [(g.name, g.next_offset, g.pending, len(g.consumers), g.counters.delivered) for g in groups] == [
        (GROUP, 0, 0, 0, 0)
    ]
    assert groups[0].config == pb.GroupConfig()


def test_every_rpc_has_bad_input_cases() -> None:
    rpcs = {method.name for method in pb.DESCRIPTOR.services_by_name["StreamLogService"].methods}
    assert {rpc for rpc, *_ in CASES} == rpcs
