"""Many members on one machine: 1 member vs 2 (python -m bench.cluster --only members).

A node is one process, so a machine with N cores runs N members, one data directory each.
bench.cluster starts two clusters on one etcd (fsync everysec, one replica per stream): one
member, and two; this measures them. Each gets the same streams (STREAMS of them, placed
by the cluster: half led by each member of the two), then several client processes (spawned,
each an AsyncClient given every member's address, so it routes each call to its stream's
leader) append one 100-byte entry per call, unbatched, each keeping `concurrency` calls in
flight, over every stream in turn: so each client loads both members. The configurations
take turns, round by round, so that load from elsewhere on the machine falls on both alike;
each one's figure is its acknowledged appends over its rounds' time.

Emits `members_appends` (appends/s) for 1 and 2 members, and `members_ratio` (2 over 1).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from collections import Counter
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier

from bench.common import emit
from clients import Client
from clients.aio import AsyncClient
from tests.cluster.nodes import eventually

PAYLOAD = 100
STREAMS = 8
BARRIER_TIMEOUT_S = 120  # client processes start, connect and learn the layout within this


def stream_names() -> list[str]:
    return [f"members-{i}" for i in range(STREAMS)]


def create_streams(addresses: list[str]) -> Counter[str]:
    """Create the streams once every member sees the others live (a member places a new stream on
    those it sees); how many each node leads."""
    with Client(addresses) as client:
        eventually(lambda: sum(node.alive for node in client.describe_cluster().nodes) == len(addresses), 60)
        for stream in stream_names():
            client.append(stream, b"create")
        leaders = Counter(placement.leader for placement in client.describe_cluster("members-").streams)
    if len(leaders) != len(addresses):
        raise AssertionError(f"the streams are not led by every member: {dict(leaders)}")
    return leaders


async def _append_for(
    addresses: list[str], concurrency: int, seconds: float, barrier: Barrier
) -> tuple[int, float, float]:
    payload = os.urandom(PAYLOAD)
    streams = stream_names()
    async with AsyncClient(addresses) as client:
        for stream in streams:  # the layout learned and a channel open to each member before timing
            await client.append(stream, payload)
        await asyncio.to_thread(barrier.wait, BARRIER_TIMEOUT_S)
        started, cpu = time.monotonic(), time.process_time()
        deadline = started + seconds
        acknowledged = 0

        async def appender(first: int) -> None:
            nonlocal acknowledged
            turn = first
            while time.monotonic() < deadline:
                await client.append(streams[turn % len(streams)], payload)
                acknowledged += 1
                turn += 1

        await asyncio.gather(*(appender(i) for i in range(concurrency)))
        return acknowledged, time.monotonic() - started, time.process_time() - cpu


def client_process(
    addresses: list[str], concurrency: int, seconds: float, barrier: Barrier, results: Queue
) -> None:
    """One client process: (appends acknowledged, seconds taken, CPU seconds used) onto `results`."""
    results.put(asyncio.run(_append_for(addresses, concurrency, seconds, barrier)))


def round_of(
    addresses: list[str], processes: int, concurrency: int, seconds: float
) -> tuple[int, float, float]:
    """`processes` clients appending for `seconds` at once: appends acknowledged, the mean time the
    clients took (the round's duration), and the CPU time they used."""
    context = multiprocessing.get_context("spawn")  # no fork of a process holding gRPC threads
    barrier = context.Barrier(processes)
    results = context.Queue()
    clients = [
        context.Process(target=client_process, args=(addresses, concurrency, seconds, barrier, results))
        for _ in range(processes)
    ]
    for process in clients:
        process.start()
    try:
        outcomes = [results.get(timeout=BARRIER_TIMEOUT_S + seconds * 10) for _ in clients]
    finally:
        for process in clients:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    if any(process.exitcode != 0 for process in clients):
        raise RuntimeError(f"a client process failed: exit codes {[p.exitcode for p in clients]}")
    counts, durations, cpu = zip(*outcomes, strict=True)
    return sum(counts), sum(durations) / len(durations), sum(cpu)


def measure(
    configurations: dict[int, list[str]], rounds: int, seconds: float, processes: int, concurrency: int
) -> dict[int, float]:
    """Appends/s of each configuration (its members' addresses, by member count: 1 and 2), emitted
    with their ratio."""
    leaders = {count: create_streams(addresses) for count, addresses in configurations.items()}
    appended = dict.fromkeys(configurations, 0)
    took = dict.fromkeys(configurations, 0.0)
    client_cpu = dict.fromkeys(configurations, 0.0)
    for _ in range(rounds):
        for count, addresses in configurations.items():
            acknowledged, duration, cpu = round_of(addresses, processes, concurrency, seconds)
            appended[count] += acknowledged
            took[count] += duration
            client_cpu[count] += cpu
    rates = {count: appended[count] / took[count] for count in configurations}
    labels = {
        "payload_bytes": PAYLOAD,
        "streams": STREAMS,
        "client_processes": processes,
        "concurrency": concurrency,
        "rounds": rounds,
        "round_s": seconds,
        "load_average": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
    }
    for count, rate in rates.items():
        emit(
            "members_appends",
            rate,
            "appends/s",
            members=count,
            appends=appended[count],
            streams_led=dict(leaders[count]),
            # The clients share the machine's cores with the members: what each append cost them.
            client_cpu_us_per_append=round(client_cpu[count] / appended[count] * 1e6, 1),
            **labels,
        )
    emit("members_ratio", rates[2] / rates[1], "x", **labels)
    return rates
