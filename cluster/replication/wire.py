"""Replica chunks (storage/replica.py) to and from the internal protocol's ReplicaData.

A chunk's record boundaries travel as one bytes field of little-endian uint32s (no
per-record protobuf work). What arrives from a peer is checked for shape here (sizes,
counts, types); storage's `append_chunk` then checks offsets, runs and timestamps
against the records themselves before writing anything.
"""

from __future__ import annotations

import sys
from array import array

from streamlog.internal.v1 import replication_pb2 as rpb

from storage import ProducerMark, ReplicaChunk, ReplicaRun

_BIG_ENDIAN = sys.byteorder == "big"
_MAX_OFFSET = (1 << 63) - 1


class BadChunkError(ValueError):
    """A ReplicaData that cannot be a chunk (the leader sent something malformed)."""


def _le(positions: array) -> bytes:
    if _BIG_ENDIAN:
        positions = array("I", positions)
        positions.byteswap()
    return positions.tobytes()


def to_data(chunk: ReplicaChunk, *, high_watermark: int, log_start: int) -> rpb.ReplicaData:
    """The chunk as ReplicaData, with the leader's high watermark and first offset."""
    data = rpb.ReplicaData(
        first_offset=chunk.first_offset,
        records=chunk.records,
        positions=_le(chunk.positions),
        runs=[
            rpb.Run(
                first_offset=r.first_offset,
                count=r.count,
                first_ts=r.first_ts,
                last_ts=r.last_ts,
                flags=r.flags,
            )
            for r in chunk.runs
        ],
        producers=[
            rpb.ProducerMark(
                producer_id=p.producer_id,
                sequence=p.sequence,
                last_offset=p.last_offset,
                timestamp_ms=p.timestamp_ms,
            )
            for p in chunk.producers
        ],
        log_end=chunk.log_end,
        end_offset=chunk.end_offset,
        high_watermark=high_watermark,
        log_start=log_start,
    )
    return data


def from_data(data: rpb.ReplicaData) -> ReplicaChunk:
    """The chunk ReplicaData carries (BadChunkError if its shape is wrong)."""
    raw = data.positions
    if len(raw) % 4 or not raw:
        raise BadChunkError("positions must be count+1 little-endian uint32 values")
    positions = array("I")
    positions.frombytes(raw)
    if _BIG_ENDIAN:
        positions.byteswap()
    if not 0 <= data.first_offset <= _MAX_OFFSET - len(positions):
        raise BadChunkError(f"first_offset {data.first_offset} is out of range")
    runs = tuple(ReplicaRun(r.first_offset, r.count, r.first_ts, r.last_ts, r.flags) for r in data.runs)
    if any(r.count < 1 or r.first_ts < 0 or r.last_ts < 0 for r in runs):
        raise BadChunkError("a run must hold a record and carry non-negative timestamps")
    if not data.first_offset <= data.end_offset <= _MAX_OFFSET:
        raise BadChunkError(f"end_offset {data.end_offset} is out of range")
    producers = tuple(
        ProducerMark(p.producer_id, p.sequence, p.last_offset, p.timestamp_ms) for p in data.producers
    )
    return ReplicaChunk(
        data.first_offset, data.records, positions, runs, producers, data.log_end, data.end_offset
    )
