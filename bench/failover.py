"""Failover time: `kill -9` of a stream's leader under load, N times (python -m bench.cluster --failovers N).

Three `streamlog serve --cluster` nodes (fsync everysec, the default) on the given etcd,
one stream with three replicas and acks=quorum, and a producer thread appending one
100-byte entry at a time at a steady rate, through whichever node answered it last:
on UNAVAILABLE or a deadline it sends the same entry (same producer id and sequence,
so never written twice) to the next node. N times:

1. ask the cluster which node leads the stream, and kill -9 it;
2. the failover time: from the kill to the first acknowledged append whose call
   started after the kill (a call already in flight does not count, so the figure
   may be long by one call, never short);
3. restart the killed node on its data directory and port, and wait until it is
   back in the stream's in-sync set (the rejoin time, from the restart).

At the end the stream is read back: every acknowledged entry must be at the offset
its acknowledgement gave, and no payload may be there twice. With `plot`, the
producer's acknowledged appends per 100 ms over the whole run, the kills marked, go
to a PNG (`--plot docs/failover-throughput.png`). Runs from a checkout (the nodes are
the cluster tests' own, tests/cluster/nodes.py).
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from bench.common import emit, percentiles
from tests.cluster.nodes import ClusterNodes, eventually, leader_of

NODES = ("n1", "n2", "n3")
STREAM = "failover"
PAYLOAD = 100
PRODUCER = "bench-failover"
CALL_TIMEOUT_S = 2.0
RETRY_PAUSE_S = 0.01  # after a failed attempt: the next node, without spinning on dead ones
FAILOVER_LIMIT_S = 60.0  # a failover slower than this fails the run (the target is 10 s)
REJOIN_LIMIT_S = 120.0
PLOT_BIN_S = 0.1
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# gRPC waits up to 2 min (growing backoff) before it dials a node that refused it again: a
# restarted node would stay out of reach long after it serves. Dial again within half a second.
RECONNECT = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 500)]


def payload(sequence: int) -> bytes:
    return (b"entry %010d " % sequence).ljust(PAYLOAD, b".")


@dataclass(frozen=True)
class Ack:
    sequence: int
    offset: int
    started: float  # time.monotonic() when the acknowledged attempt was sent
    acknowledged: float


class Producer(threading.Thread):
    """Appends `payload(0)`, `payload(1)`, ... one at a time, `rate` per second, idempotently,
    retrying each through the nodes until one acknowledges it. A status other than UNAVAILABLE
    or DEADLINE_EXCEEDED stops it; `error` holds it and waiters are woken."""

    def __init__(self, addresses: list[str], rate: float) -> None:
        super().__init__(name="failover-producer", daemon=True)
        self._channels = [grpc.insecure_channel(address, options=RECONNECT) for address in addresses]
        self._stubs = [pb_grpc.StreamLogServiceStub(channel) for channel in self._channels]
        self._interval = 1 / rate
        self._stopping = threading.Event()
        self._changed = threading.Condition()
        self.acks: list[Ack] = []
        self.failed_attempts = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._produce()
        except BaseException as exc:  # handed to the waiting thread, which raises it
            with self._changed:
                self.error = exc
                self._changed.notify_all()
        finally:
            for channel in self._channels:
                channel.close()

    def _produce(self) -> None:
        node, sequence, due = 0, 0, time.monotonic()
        while not self._stopping.is_set():
            request = pb.AppendRequest(
                stream=STREAM, payloads=[payload(sequence)], producer_id=PRODUCER, producer_sequence=sequence
            )
            while not self._stopping.is_set():
                started = time.monotonic()
                try:
                    reply = self._stubs[node].Append(request, timeout=CALL_TIMEOUT_S)
                except grpc.RpcError as exc:
                    if exc.code() not in RETRYABLE:
                        raise
                    self.failed_attempts += 1
                    node = (node + 1) % len(self._stubs)
                    self._stopping.wait(RETRY_PAUSE_S)
                    continue
                with self._changed:
                    self.acks.append(Ack(sequence, reply.last_offset, started, time.monotonic()))
                    self._changed.notify_all()
                break
            sequence += 1
            due = max(due + self._interval, time.monotonic() - self._interval)  # no burst after a stall
            self._stopping.wait(max(0.0, due - time.monotonic()))

    def first_ack_after(self, moment: float, timeout_s: float) -> Ack:
        """The first acknowledgement of an attempt sent at or after `moment` (waits for it, bounded)."""

        def found() -> bool:
            return self.error is not None or bool(self.acks and self.acks[-1].started >= moment)

        with self._changed:
            if not self._changed.wait_for(found, timeout_s):
                raise AssertionError(f"no append was acknowledged within {timeout_s} s")
            if self.error is not None:
                raise RuntimeError("the producer failed") from self.error
            return next(ack for ack in self.acks if ack.started >= moment)

    def stop(self) -> None:
        """Stop after the call under way (its outcome still recorded); idempotent."""
        self._stopping.set()
        if self.is_alive():
            self.join(timeout=CALL_TIMEOUT_S * 10)


def read_stream(stub: pb_grpc.StreamLogServiceStub) -> dict[int, bytes]:
    """Every entry of the stream, offset -> payload (what a reader is served: committed entries)."""
    entries: dict[int, bytes] = {}
    offset = 0
    while True:
        reply = stub.Read(pb.ReadRequest(stream=STREAM, offset=offset, count=10_000), timeout=30)
        if not reply.entries:
            return entries
        entries.update((entry.offset, entry.payload) for entry in reply.entries)
        offset = reply.next_offset


@dataclass(frozen=True)
class LossCheck:
    acknowledged: int
    stream_entries: int
    lost: list[Ack]  # acknowledged, but not at the acknowledged offset
    duplicated: list[bytes]  # payloads stored more than once

    def raise_if_broken(self) -> None:
        if self.lost or self.duplicated:
            raise AssertionError(
                f"{len(self.lost)} acknowledged entries lost or moved (first: {self.lost[:3]}), "
                f"{len(self.duplicated)} payloads stored twice (first: {self.duplicated[:3]})"
            )


def check_nothing_lost(acks: list[Ack], entries: dict[int, bytes]) -> LossCheck:
    """Is every acknowledged payload at its acknowledged offset, and no payload there twice?"""
    return LossCheck(
        acknowledged=len(acks),
        stream_entries=len(entries),
        lost=[ack for ack in acks if entries.get(ack.offset) != payload(ack.sequence)],
        duplicated=[value for value, count in Counter(entries.values()).items() if count > 1],
    )


def successor(stub: pb_grpc.StreamLogServiceStub, killed: str) -> pb.StreamPlacement:
    """The stream's placement once the node `stub` calls sees a leader other than `killed` (it learns
    of the election from its etcd watch, maybe a moment after the new leader acknowledged)."""
    eventually(lambda: leader_of(stub, STREAM).leader != killed, REJOIN_LIMIT_S)
    return leader_of(stub, STREAM)


def wait_all_in_sync(stub: pb_grpc.StreamLogServiceStub) -> None:
    """Until the stream's in-sync set, as the node `stub` calls sees it, is every node (bounded)."""
    eventually(lambda: set(leader_of(stub, STREAM).in_sync_replicas) == set(NODES), REJOIN_LIMIT_S)


@dataclass(frozen=True)
class Kill:
    node: str
    at: float  # time.monotonic() of the kill
    failover_s: float  # to the first acknowledged append sent after it


def acknowledged_per_bin(acks: list[Ack], start: float, end: float, bin_s: float = PLOT_BIN_S) -> list[int]:
    """How many appends were acknowledged in each `bin_s` from `start` to `end` (the last bin may
    be partial); acknowledgements outside are not counted."""
    bins = [0] * math.ceil((end - start) / bin_s)
    for ack in acks:
        if start <= ack.acknowledged < end:
            bins[int((ack.acknowledged - start) / bin_s)] += 1
    return bins


def plot_throughput(acks: list[Ack], kills: list[Kill], path: Path, rate: float, lease_ttl_ms: int) -> int:
    """Acknowledged appends per PLOT_BIN_S over the run, each kill a dashed line, to a PNG at `path`;
    returns the number of bins."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start, end = acks[0].acknowledged, acks[-1].acknowledged + PLOT_BIN_S
    bins = acknowledged_per_bin(acks, start, end)
    fig, ax = plt.subplots(figsize=(10, 3.2))
    ax.step([i * PLOT_BIN_S for i in range(len(bins))], bins, where="post", linewidth=0.8)
    for kill in kills:
        ax.axvline(kill.at - start, color="tab:red", linestyle="--", linewidth=0.8)
        ax.annotate(
            f"kill -9 {kill.node}\n{kill.failover_s:.1f} s",
            (kill.at - start, max(bins)),
            xytext=(3, -2),
            textcoords="offset points",
            fontsize=7,
            va="top",
            color="tab:red",
        )
    ax.set_xlabel("seconds")
    ax.set_ylabel(f"appends acknowledged per {PLOT_BIN_S * 1000:.0f} ms")
    ax.set_title(
        f"One producer, {rate:.0f} idempotent appends/s, 3 replicas (acks=quorum), "
        f"lease {lease_ttl_ms / 1000:g} s: the stream's leader killed {len(kills)} times",
        fontsize=9,
    )
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return len(bins)


def run(
    endpoints: list[tuple[str, int]],
    directory: Path,
    failovers: int,
    lease_ttl_ms: int = 5000,
    rate: float = 100.0,
    plot: Path | None = None,
) -> dict[str, float]:
    """Kill the stream's leader `failovers` times; emits one figure per kill, then p50/p99/max and
    the loss check, and with `plot` draws the throughput to that PNG; returns the summary figures
    (seconds)."""
    nodes = ClusterNodes(
        endpoints,
        directory,
        cluster_name="failover",
        lease_ttl_ms=str(lease_ttl_ms),
        default_replication_factor="3",
        default_acks="quorum",
    )
    channels: list[grpc.Channel] = []
    producer: Producer | None = None
    labels = {"lease_ttl_ms": lease_ttl_ms, "rate": rate, "replicas": 3, "acks": "quorum"}
    try:
        nodes.start(*NODES)
        channels.extend(grpc.insecure_channel(nodes.target(name), options=RECONNECT) for name in NODES)
        stubs = {name: pb_grpc.StreamLogServiceStub(ch) for name, ch in zip(NODES, channels, strict=True)}
        producer = Producer([nodes.target(name) for name in NODES], rate)
        producer.start()
        producer.first_ack_after(0.0, FAILOVER_LIMIT_S)  # the first append creates the stream
        witness = stubs["n1"]  # a node that was not restarted last: asked who leads, and the ISR
        wait_all_in_sync(witness)
        if plot is not None:  # a second of steady appends before the first kill, for the plot
            producer.first_ack_after(time.monotonic() + 1.0, FAILOVER_LIMIT_S)
        times: list[float] = []
        kills: list[Kill] = []
        for kill in range(1, failovers + 1):
            killed = leader_of(witness, STREAM).leader
            witness = stubs[next(name for name in NODES if name != killed)]
            killed_at = time.monotonic()
            nodes.kill(killed)
            ack = producer.first_ack_after(killed_at, FAILOVER_LIMIT_S)
            times.append(ack.acknowledged - killed_at)
            kills.append(Kill(killed, killed_at, times[-1]))
            new = successor(witness, killed)
            nodes.start(killed)
            restarted_at = time.monotonic()
            wait_all_in_sync(witness)
            emit(
                "failover",
                times[-1],
                "s",
                kill=kill,
                killed=killed,
                new_leader=new.leader,
                leader_epoch=new.leader_epoch,
                rejoin_s=round(time.monotonic() - restarted_at, 3),
                **labels,
            )
        producer.stop()
        if producer.error is not None:
            raise RuntimeError("the producer failed") from producer.error
        checked = check_nothing_lost(producer.acks, read_stream(witness))
        emit(
            "failover_acknowledged_entries",
            checked.acknowledged,
            "entries",
            stream_entries=checked.stream_entries,
            lost=len(checked.lost),
            duplicated=len(checked.duplicated),
            failed_attempts=producer.failed_attempts,
            **labels,
        )
        checked.raise_if_broken()
        if plot is not None:
            bins = plot_throughput(producer.acks, kills, plot, rate, lease_ttl_ms)
            emit("failover_plot", bins, "bins", bin_ms=PLOT_BIN_S * 1000, path=str(plot), **labels)
        if not times:
            return {}
        p50, p99 = percentiles(times, (50, 99))
        summary = {"50": p50, "99": p99, "max": max(times)}
        for percentile, seconds in summary.items():
            emit("failover", seconds, "s", percentile=percentile, kills=len(times), **labels)
        return summary
    finally:
        if producer is not None:
            producer.stop()
        for channel in channels:
            channel.close()
        nodes.stop_all()
