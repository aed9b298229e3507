"""Bad input to every RPC: the exact status code, a message naming the problem, and no harm done.

One server serves the whole module; after every refused call the server must still
be SERVING and a canary stream must read back exactly as written.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from tests.service.helpers import ServerThread, small_settings

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
OUT_OF_RANGE = grpc.StatusCode.OUT_OF_RANGE

CANARY = "canary"
CANARY_PAYLOADS = [b"c%d" % i for i in range(20)]
EXISTING = "existing"  # has 5 entries
BAD_NAMES = [
    ("", "must not be empty"),
    ("x" * 256, "the limit is 255"),
    ("é" * 128, "256 bytes"),  # 128 characters, but 256 bytes of UTF-8
    ("a\x00b", "NUL"),
]


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
    # ListStreams.
    ("ListStreams", pb.ListStreamsRequest(page_size=-1), INVALID, "page_size"),
    ("ListStreams", pb.ListStreamsRequest(page_token="not base64!"), INVALID, "page_token"),
    ("ListStreams", pb.ListStreamsRequest(page_token=_token(b"someone else's")), INVALID, "page_token"),
    ("ListStreams", pb.ListStreamsRequest(prefix="p" * 256), INVALID, "prefix"),
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
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def shared_channel(shared_server: ServerThread) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(shared_server.target) as channel:
        yield channel


def _call(stub: pb_grpc.StreamLogServiceStub, rpc: str, request: Any) -> None:
    if rpc == "Subscribe":
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


def test_every_rpc_has_bad_input_cases() -> None:
    rpcs = {method.name for method in pb.DESCRIPTOR.services_by_name["StreamLogService"].methods}
    assert {rpc for rpc, *_ in CASES} == rpcs
