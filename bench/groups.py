"""Consumer groups vs Redis Streams, seed 004's queue workload side by side: python -m bench.groups [--quick]

A group on a stream of 1000 entries (100-byte payloads) is consumed 50 at a
time, with acknowledgement, until empty; 10 rounds (10,000 entries), each on a
fresh stream and group filled before the clock starts. Modes:

streamlog (its own `streamlog serve`, fsync everysec, on a loopback port):

- `read_batch`: one Read per batch, carrying the acknowledgement of the
  previous batch (ack_ranges) and the group read of the next: seed 004's
  "single round trip". The last call acknowledges the last batch and finds
  the group empty.
- `read_one`: one entry per Read (count 1), acknowledging the previous entry
  in the same call.
- `subscribe`: one Subscribe in group mode (count 50), with batched acks: an
  Ack of one range per 200 entries received (4 batches), sent without waiting
  for its reply; the round ends when all 1000 entries arrived and every Ack
  was answered.
- `subscribe_ack_each`: the same with one Ack per 50-entry batch.
- `consume_batch`: a Consume session, one request and one batch per round trip,
  each request acknowledging the previous batch and asking for the next: (a)'s
  "single round trip" without a call per batch. The round ends when the client
  closes its side and the server confirms the last acknowledgement (OK).
- `consume_stream`: a Consume session that keeps 8 batches asked for (topped up
  by 4 once 4 arrived) and acknowledges every 200 entries with the next
  request: a group-mode subscription whose acknowledgements travel on the same
  call. Sessions run on a grpc.aio channel (one thread: see SessionClient).

Redis (its own redis-server, appendfsync everysec), through
bench.redis_baseline.xreadgroup_consume: XREADGROUP COUNT 50 then XACK
(`batch`, two round trips per batch), the same pipelined (`pipelined`: XACK of
the previous batch and XREADGROUP of the next in one round trip), and
XREADGROUP COUNT 1 + XACK (`one_at_a_time`).

Both servers run side by side and every repetition runs every mode of both,
so load on a shared machine falls on both columns alike. Every figure is the
median of --repeat runs (all runs are listed); every run checks that it
consumed every entry once and left nothing pending. Figures are
`ms_per_batch` (per 50 entries, in every mode) and `entries_per_s`, one JSON
object per line (bench.common.emit). Targets (issue 4): (a) <= 0.86 ms per
batch (seed 004's best, its Lua multi-consume), reported for read_batch and
consume_batch; (c) >= Redis pipelined entries/s, reported for subscribe and
consume_stream. For scale, the run also reports the round trip of an
empty call to each server (a gRPC health check, a Redis PING).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from bench import redis_baseline
from bench.common import Timer, cpu_steal_ticks, emit, percentiles
from bench.service import _channel, streamlog_server

STREAM_LEN = 1000
COUNT = 50
PAYLOAD = 100
TARGET_MS_PER_BATCH = 0.86  # seed 004: its single-command Lua consume of 50 messages
ACK_EVERY = 200  # entries per Ack in `subscribe` and `consume_stream` modes
CONSUME_AHEAD = 8  # batches a `consume_stream` session asks for in advance

Stub = pb_grpc.StreamLogServiceStub


def _acks(entries: Sequence[pb.Entry]) -> dict[str, list]:
    """ReadRequest/AckRequest fields acknowledging `entries`: one range when their offsets are contiguous."""
    if not entries:
        return {}
    first, last = entries[0].offset, entries[-1].offset
    if last - first + 1 == len(entries):
        return {"ranges": [pb.OffsetRange(start_offset=first, end_offset=last + 1)]}
    return {"offsets": [e.offset for e in entries]}


def _read_acks(entries: Sequence[pb.Entry]) -> dict[str, list]:
    return {f"ack_{name}": value for name, value in _acks(entries).items()}


class _Unacked:
    """Acknowledgements owed for the batches received, as ranges (one per contiguous batch):
    no per-entry objects, whatever the batch size."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.count = 0
        self._fields: dict[str, list] = {"ranges": [], "offsets": []}

    def add(self, entries: Sequence[pb.Entry]) -> None:
        self.count += len(entries)
        for name, values in _acks(entries).items():
            self._fields[name].extend(values)

    def take(self, prefix: str = "") -> dict[str, list]:
        """AckRequest fields (prefix "ack_": ReadRequest/ConsumeRequest ones) for all of them."""
        fields = {prefix + name: values for name, values in self._fields.items() if values}
        self._reset()
        return fields


class Rounds:
    """Fresh streams and groups for each round, filled and created before the clock starts."""

    def __init__(self, stub: Stub, payloads: list[bytes], sessions: SessionClient) -> None:
        self.stub = stub
        self.payloads = payloads
        self.sessions = sessions

    def prepare(self) -> str:
        stream = f"bench-group-{uuid.uuid4().hex}"
        self.stub.Append(pb.AppendRequest(stream=stream, payloads=self.payloads))
        self.stub.CreateGroup(pb.CreateGroupRequest(stream=stream, group="g", start=pb.START_POSITION_OLDEST))
        return stream

    def check_and_drop(self, stream: str, mode: str, consumed: int) -> None:
        group = self.stub.GetGroupInfo(pb.GetGroupInfoRequest(stream=stream, group="g")).group
        if consumed != STREAM_LEN or group.pending or group.counters.acked != STREAM_LEN:
            raise AssertionError(
                f"{mode}: consumed {consumed}/{STREAM_LEN}, {group.pending} pending, "
                f"{group.counters.acked} acknowledged"
            )
        self.stub.DeleteStream(pb.DeleteStreamRequest(stream=stream))


def read_batches(stub: Stub, stream: str, count: int) -> int:
    """Read + acknowledge-the-previous in one call until the group is empty; returns entries consumed."""
    consumed = 0
    acks: dict[str, list] = {}
    for _ in range(STREAM_LEN + 2):  # bound: STREAM_LEN / count reads and a last, empty one
        reply = stub.Read(pb.ReadRequest(stream=stream, group="g", consumer="c1", count=count, **acks))
        entries = reply.entries
        if not entries:
            break  # this call also acknowledged the final batch
        consumed += len(entries)
        acks = _read_acks(entries)
    return consumed


def subscribe_batches(stub: Stub, stream: str, ack_every: int) -> int:
    """A group-mode Subscribe; an Ack per `ack_every` entries received, not waited for until the end."""
    consumed = 0
    acks: list[grpc.Future] = []
    unacked = _Unacked()
    request = pb.SubscribeRequest(stream=stream, group="g", consumer="c1", count=COUNT)
    call = stub.Subscribe(request, timeout=60)
    try:
        for reply in call:
            entries = reply.entries
            consumed += len(entries)
            unacked.add(entries)
            if unacked.count and (unacked.count >= ack_every or consumed >= STREAM_LEN):
                acks.append(stub.Ack.future(pb.AckRequest(stream=stream, group="g", **unacked.take())))
            if consumed >= STREAM_LEN:
                break
    finally:
        call.cancel()
    for ack in acks:
        ack.result(timeout=60)
    return consumed


class SessionClient:
    """Consume sessions from a grpc.aio channel on a private event loop: one thread, so the
    client's requests and the server's batches never wait for each other's GIL turn, as they
    do between the threads of a blocking client."""

    def __init__(self, address: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._channel = self._loop.run_until_complete(self._open(address))
        self._stub = Stub(self._channel)

    @staticmethod
    async def _open(address: str) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(address)

    def consume(self, stream: str, ahead: int, ack_every: int) -> int:
        return self._loop.run_until_complete(self._consume(stream, ahead, ack_every))

    async def _consume(self, stream: str, ahead: int, ack_every: int) -> int:
        """One session: `ahead` batches asked for at the start and topped up to `ahead` once half
        as many have arrived (after every batch when ahead is 1), entries acknowledged every
        `ack_every` with the next request. ahead=1, ack_every=COUNT: one request and one batch
        per round trip, each request acknowledging the previous batch. The round ends when
        the client has closed its side and the server has confirmed every ack (OK)."""
        refill = max(1, ahead // 2)
        call = self._stub.Consume(timeout=60)
        opening = pb.ConsumeRequest(stream=stream, group="g", consumer="c1", count=COUNT, batches=ahead)
        await call.write(opening)
        asked = ahead
        consumed = received = 0
        unacked = _Unacked()
        while consumed < STREAM_LEN:
            reply = await call.read()
            if reply is grpc.aio.EOF:
                raise AssertionError(f"session ended after {consumed} entries: {await call.code()}")
            consumed += len(reply.entries)
            received += reply.batches  # batches due at once come in one reply
            unacked.add(reply.entries)
            acks: dict[str, list] = {}
            if unacked.count >= ack_every or consumed >= STREAM_LEN:
                acks = unacked.take("ack_")
            more = ahead - (asked - received)
            if consumed >= STREAM_LEN:
                await call.write(pb.ConsumeRequest(**acks))
            elif more >= refill:
                asked += more
                await call.write(pb.ConsumeRequest(batches=more, **acks))
            elif acks:
                await call.write(pb.ConsumeRequest(**acks))
        await call.done_writing()
        while await call.read() is not grpc.aio.EOF:
            pass  # the reply reporting the last acknowledgements
        if await call.code() != grpc.StatusCode.OK:
            raise AssertionError(f"session ended with {await call.code()}")
        return consumed

    def close(self) -> None:
        self._loop.run_until_complete(self._channel.close())
        self._loop.close()


def measure(rounds: Rounds, mode: str, n_rounds: int) -> dict[str, Any]:
    consume: Callable[[Stub, str], int] = {
        "read_batch": lambda stub, stream: read_batches(stub, stream, COUNT),
        "read_one": lambda stub, stream: read_batches(stub, stream, 1),
        "subscribe": lambda stub, stream: subscribe_batches(stub, stream, ACK_EVERY),
        "subscribe_ack_each": lambda stub, stream: subscribe_batches(stub, stream, COUNT),
        "consume_batch": lambda stub, stream: rounds.sessions.consume(stream, 1, COUNT),
        "consume_stream": lambda stub, stream: rounds.sessions.consume(stream, CONSUME_AHEAD, ACK_EVERY),
    }[mode]
    elapsed = 0.0
    total = 0
    for _ in range(n_rounds):
        stream = rounds.prepare()
        with Timer() as t:
            consumed = consume(rounds.stub, stream)
        elapsed += t.elapsed
        rounds.check_and_drop(stream, mode, consumed)
        total += consumed
    return {
        "mode": mode,
        "entries": total,
        "ms_per_batch": elapsed * 1e3 / (total / COUNT),
        "entries_per_s": total / elapsed,
    }


OURS = ("read_batch", "read_one", "subscribe", "subscribe_ack_each", "consume_batch", "consume_stream")
THEIRS = {"batch": (False, False), "pipelined": (True, False), "one_at_a_time": (False, True)}


def round_trip_floor(call: Callable[[], object], samples: int = 2000) -> float:
    """p50 of an empty request's round trip, in us: what any call pays before doing anything."""
    for _ in range(100):
        call()
    times = []
    for _ in range(samples):
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1e6)
    return percentiles(times, (50,))[0]


def _median(runs: list[dict[str, Any]]) -> tuple[dict[str, Any], list[float]]:
    """The run with the median entries/s, and every run's entries/s (loopback figures are noisy)."""
    ordered = sorted(runs, key=lambda f: f["entries_per_s"])
    return ordered[len(ordered) // 2], [round(r["entries_per_s"]) for r in ordered]


def run(rounds: int, repeat: int) -> None:
    common = {"stream_len": STREAM_LEN, "count": COUNT, "payload_bytes": PAYLOAD, "rounds": rounds}
    steal_before = cpu_steal_ticks()
    payloads = [os.urandom(PAYLOAD) for _ in range(STREAM_LEN)]
    samples: dict[str, list[dict[str, Any]]] = {mode: [] for mode in (*OURS, *THEIRS)}
    with (
        streamlog_server("everysec") as address,
        _channel(address) as channel,
        redis_baseline.RedisServer("everysec") as server,
        contextlib.ExitStack() as stack,
    ):
        sessions = stack.enter_context(contextlib.closing(SessionClient(address)))
        setup = Rounds(Stub(channel), payloads, sessions)
        r = server.client()
        measure(setup, "read_batch", 1)  # warm-up: connection, code paths, caches
        # Both systems run side by side, mode after mode, in every repetition: a burst of load
        # on this shared machine then hits both, not one half of the table.
        for _ in range(max(1, repeat)):
            for mode in OURS:
                samples[mode].append(measure(setup, mode, rounds))
            for mode, (pipelined, one_at_a_time) in THEIRS.items():
                samples[mode].append(
                    redis_baseline.xreadgroup_consume(
                        r,
                        total=rounds * STREAM_LEN,
                        count=COUNT,
                        pipelined=pipelined,
                        one_at_a_time=one_at_a_time,
                        stream_len=STREAM_LEN,
                        payload_size=PAYLOAD,
                    )
                )
        redis_labels = {"redis_version": server.version, "hiredis": redis_baseline.hiredis_in_use()}
        # How much of a call is the transport: a gRPC health check, a Redis PING.
        health = health_pb2_grpc.HealthStub(channel)
        floors = {
            "streamlog": round_trip_floor(lambda: health.Check(health_pb2.HealthCheckRequest())),
            "redis": round_trip_floor(r.ping),
        }

    ours: dict[str, dict[str, Any]] = {}
    theirs: dict[str, dict[str, Any]] = {}
    for mode, runs in samples.items():
        fig, values = _median(runs)
        if mode in OURS:
            ours[mode] = fig
            labels: dict[str, Any] = {"system": "streamlog", "mode": mode, "fsync": "everysec"}
        else:
            theirs[mode] = fig
            labels = {"system": "redis", "mode": mode, "appendfsync": "everysec", **redis_labels}
        labels["entries"] = fig["entries"]
        emit("group_consume.ms_per_batch", fig["ms_per_batch"], "ms", **labels, **common)
        emit(
            "group_consume.entries_per_s", fig["entries_per_s"], "entries/s", **labels, **common, runs=values
        )

    for system, floor in floors.items():
        call = "grpc.health.v1.Health/Check" if system == "streamlog" else "PING"
        emit("group_consume.round_trip_floor_p50", floor, "us", system=system, call=call)
    # (a), one round trip per batch: as a Read call, and as a request on a Consume session.
    for mode in ("read_batch", "consume_batch"):
        batch_ms = ours[mode]["ms_per_batch"]
        emit(
            f"group_consume.target.{mode}_ms",
            batch_ms,
            "ms",
            target=f"<= {TARGET_MS_PER_BATCH}",
            met=batch_ms <= TARGET_MS_PER_BATCH,
        )
    # (c), a group-mode subscription with batched acks: Subscribe + Ack calls, and a Consume
    # session whose acks travel on the same call.
    for mode in ("subscribe", "consume_stream"):
        ratio = ours[mode]["entries_per_s"] / theirs["pipelined"]["entries_per_s"]
        emit(
            f"group_consume.target.{mode}_vs_redis_pipelined",
            ratio,
            "x",
            target=">= 1",
            met=ratio >= 1,
        )
    emit(
        "group_consume.subscribe_ack_each_vs_redis_pipelined",
        ours["subscribe_ack_each"]["entries_per_s"] / theirs["pipelined"]["entries_per_s"],
        "x",
    )
    emit(
        "group_consume.read_batch_vs_redis_pipelined",
        ours["read_batch"]["entries_per_s"] / theirs["pipelined"]["entries_per_s"],
        "x",
    )
    emit(
        "group_consume.read_one_vs_redis_one_at_a_time",
        ours["read_one"]["entries_per_s"] / theirs["one_at_a_time"]["entries_per_s"],
        "x",
    )
    steal_after = cpu_steal_ticks()
    if steal_before and steal_after and steal_after[1] > steal_before[1]:
        # The hypervisor's share of the CPU during the run: when high, it explains a noisy figure.
        steal = 100 * (steal_after[0] - steal_before[0]) / (steal_after[1] - steal_before[1])
        emit("group_consume.cpu_steal_pct", steal, "%")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="rounds of 1000 entries per run (default 10)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure; the median is reported")
    parser.add_argument("--quick", action="store_true", help="2 rounds, 1 run: a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.repeat = 2, 1
    run(args.rounds, args.repeat)


if __name__ == "__main__":
    main()
