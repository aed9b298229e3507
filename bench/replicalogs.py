"""Read what a stopped node's data directory holds, offline, through the storage engine.

Opening a data directory runs the engine's recovery, as a restart would: the
logs read are what the node would serve. The node must not be running (the
engine takes the directory's lock).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.checker import FinalStream, ReplicaLog
from bench.history import LogEntry
from storage import Engine, EngineConfig
from storage.inspect import verify

_PAGE = 5000


def read_replica(data_dir: Path, node: str) -> tuple[dict[str, ReplicaLog], list[str]]:
    """Every stream's log in `data_dir` (stream -> log), and the problems found: stream directories
    the engine could not read, then what `storage.inspect verify` says after recovery."""
    if not (data_dir / "streams").is_dir():
        return {}, []  # never started, or wiped: it holds nothing
    logs: dict[str, ReplicaLog] = {}
    with Engine(data_dir, EngineConfig(background=False)) as engine:
        problems = [f"stream directory {name} is unreadable" for name in engine.unreadable]
        for name in engine.list_streams():
            bounds = engine.bounds(name)
            entries: list[LogEntry] = []
            offset = bounds.first_offset
            while offset < bounds.end_offset:
                page = engine.read(name, offset, _PAGE)
                entries.extend(LogEntry(e.offset, e.timestamp_ms, e.tag, e.payload) for e in page.entries())
                if page.next_offset <= offset:
                    problems.append(f"stream {name!r}: a read at {offset} below its end did not move on")
                    break
                offset = page.next_offset  # past a gap too: the checker sees the hole in the offsets
            logs[name] = ReplicaLog(node, bounds.first_offset, entries)
    problems += verify(data_dir)
    return logs, problems


def single_server_streams(logs: dict[str, ReplicaLog]) -> dict[str, FinalStream]:
    """The final state of a single server's streams: it leads them all, and all it holds is committed."""
    return {
        name: FinalStream(name, log.node, (log.node,), _end(log), {log.node: log})
        for name, log in logs.items()
    }


def cluster_streams(
    logs_by_node: dict[str, dict[str, ReplicaLog]], placements: dict[str, Any]
) -> tuple[dict[str, FinalStream], list[tuple[str, str]]]:
    """The final state of a cluster's streams: each stream's placement at the end (DescribeCluster's
    `StreamPlacement`: leader, replicas, in-sync replicas, high watermark) with its replicas' logs.

    Without a high watermark (replication does not report one), what the leader holds is committed.
    Also returns the copies found on nodes that are not among their stream's replicas (stream, node).
    """
    streams = {}
    for name, placement in placements.items():
        logs = {
            node: logs_by_node[node][name]
            for node in placement.replicas
            if name in logs_by_node.get(node, {})
        }
        committed = placement.high_watermark
        if committed is None:
            leader = logs.get(placement.leader)
            committed = _end(leader) if leader is not None else 0
        streams[name] = FinalStream(
            name, placement.leader, tuple(placement.in_sync_replicas), committed, logs
        )
    stray = [
        (name, node)
        for node, logs in sorted(logs_by_node.items())
        for name in sorted(logs)
        if name not in placements or node not in placements[name].replicas
    ]
    return streams, stray


def _end(log: ReplicaLog) -> int:
    return log.entries[-1].offset + 1 if log.entries else log.first_offset
