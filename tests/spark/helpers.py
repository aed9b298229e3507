"""Helpers for the Spark connector tests: server settings, filling streams, reading results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from service.config import Settings


def settings(data_dir: Path, **overrides: Any) -> Settings:
    # Small nodes so that trimming and retention act at a fine grain in tests.
    values: dict[str, Any] = dict(
        data_dir=data_dir,
        port=0,
        log_level="warning",
        node_entries=100,
        segment_bytes=16 << 20,
        shutdown_grace_ms=1_000,
    )
    values.update(overrides)
    return Settings(**values)


def fill(
    stub: pb_grpc.StreamLogServiceStub, stream: str, count: int, prefix: str = "e", batch: int = 1000
) -> None:
    """Append `count` payload-only entries "<prefix><i>" (i counting on from the stream's end)."""
    try:
        start = stub.GetStreamInfo(pb.GetStreamInfoRequest(stream=stream), timeout=10).info.next_offset
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.NOT_FOUND:
            raise
        start = 0
    for first in range(start, start + count, batch):
        last = min(first + batch, start + count)
        payloads = [f"{prefix}{i}".encode() for i in range(first, last)]
        stub.Append(pb.AppendRequest(stream=stream, payloads=payloads), timeout=10)


def finish(query: Any, timeout_s: float = 120) -> None:
    """Wait for a streaming query (availableNow) to end; stop it whatever happens."""
    try:
        assert query.awaitTermination(timeout_s), "the query did not finish in time"
    finally:
        query.stop()


def info(stub: pb_grpc.StreamLogServiceStub, stream: str) -> pb.StreamInfo:
    return stub.GetStreamInfo(pb.GetStreamInfoRequest(stream=stream), timeout=10).info
