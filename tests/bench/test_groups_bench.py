"""bench.groups' streamlog workloads against a real server: they consume what they claim, nothing more.

These check the harness, not its speed: a figure from a workload that skipped
or duplicated entries, or left some pending, would be a fast wrong answer.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from bench import groups
from tests.service.helpers import ServerThread, small_settings


@pytest.fixture
def rounds(tmp_path: Path) -> Iterator[groups.Rounds]:
    settings = small_settings(
        tmp_path / "data", max_batch_entries=groups.STREAM_LEN, max_batch_bytes=512 << 10
    )
    server = ServerThread(settings).start()
    sessions = groups.SessionClient(server.target)
    try:
        with grpc.insecure_channel(server.target) as channel:
            payloads = [os.urandom(groups.PAYLOAD) for _ in range(groups.STREAM_LEN)]
            yield groups.Rounds(pb_grpc.StreamLogServiceStub(channel), payloads, sessions)
    finally:
        sessions.close()
        server.stop()


def test_acks_are_one_range_for_contiguous_batches_and_offsets_otherwise() -> None:
    run = [pb.Entry(offset=o) for o in (5, 6, 7)]
    assert groups._acks(run) == {"ranges": [pb.OffsetRange(start_offset=5, end_offset=8)]}
    holes = [pb.Entry(offset=o) for o in (5, 7)]
    assert groups._acks(holes) == {"offsets": [5, 7]}
    assert groups._read_acks(holes) == {"ack_offsets": [5, 7]}
    assert groups._acks([]) == {}


@pytest.mark.parametrize(
    "mode", ["read_batch", "subscribe", "subscribe_ack_each", "consume_batch", "consume_stream"]
)
def test_a_round_consumes_every_entry_once_and_leaves_nothing_pending(
    rounds: groups.Rounds, mode: str
) -> None:
    figures = groups.measure(rounds, mode, 1)
    assert figures["entries"] == groups.STREAM_LEN
    assert figures["ms_per_batch"] > 0 and figures["entries_per_s"] > 0
    # check_and_drop verified the group and deleted the stream: nothing is left behind.
    assert list(rounds.stub.ListStreams(pb.ListStreamsRequest()).streams) == []


def test_a_round_that_misses_entries_is_refused(rounds: groups.Rounds) -> None:
    stream = rounds.prepare()
    consumed = groups.read_batches(rounds.stub, stream, groups.COUNT)
    with pytest.raises(AssertionError, match="consumed 999/1000"):
        rounds.check_and_drop(stream, "read_batch", consumed - 1)
