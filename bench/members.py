"""Many members on one machine: 1 member vs 2 (python -m bench.cluster --only members).

A node is one process, so a machine with N cores runs N members, one data directory each.
bench.cluster starts two clusters on one etcd (fsync everysec, one replica per stream): one
member, and two; this measures them. Each gets the same streams (STREAMS of them, placed
by the cluster: half led by each member of the two). The load comes from Node.js
(bench/publish_load.js `spread`, clients/node; `npm install` there first), whose calls cost
the two cores the members share far less than a Python client's: one process, one 100-byte
entry per call, `in_flight` calls unanswered, over every stream in turn, so it loads both
members.

- unary Append, unbatched, from one Client given every member's address (it sends each call
  straight to its stream's leader);
- Publish, one session per stream (in a cluster a session carries one stream), on its leader;
- unary Append from h2load (bench/h2load.py: a C HTTP/2 client, one process per stream sending
  to its leader as the layout says), whose calls cost a few tens of microseconds of CPU where
  grpc-js's cost about what the server's do: on two cores shared by clients and members, the
  figure in which the members, not the clients, take the cores.

The configurations take turns, round by round, so that load from elsewhere on the machine
falls on both alike; each one's figure is its acknowledged calls over its rounds' time.

Emits `members_appends` (calls/s) for 1 and 2 members and each RPC, with the CPU the members'
processes and the client used per call, and `members_ratio` (2 over 1).
"""

from __future__ import annotations

import os
import statistics
from collections import Counter

from bench.common import emit, node_load, server_cores, server_cpu_seconds
from bench.h2load import append_load
from clients import Client
from tests.cluster.nodes import eventually

PAYLOAD = 100  # publish_load.js's
STREAMS = 8
RPCS = ("Append", "Publish", "Append/h2load")


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


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def servers_cpu(addresses: list[str]) -> float:
    """The CPU seconds the members at `addresses` (loopback) used so far, together."""
    return sum(server_cpu_seconds(port_of(address)) for address in addresses)


def leaders_of(addresses: list[str]) -> dict[str, str]:
    """Each stream's leader's address, from the layout."""
    with Client(addresses) as client:
        cluster = client.describe_cluster("members-")
    nodes = {node.id: node.address for node in cluster.nodes}
    return {placement.name: nodes[placement.leader] for placement in cluster.streams}


def round_of(addresses: list[str], rpc: str, in_flight: int, seconds: float) -> tuple[float, float, float]:
    """One round of load: calls/s while counted, and the members' and the client's CPU
    microseconds per call (the members' over the whole round, warm-up calls included)."""
    cpu = servers_cpu(addresses)
    calls: float
    if rpc == "Append/h2load":
        rate, client_us, calls = append_load(leaders_of(addresses), os.urandom(PAYLOAD), in_flight, seconds)
    else:
        streams = ",".join(stream_names())
        got = node_load("spread", ",".join(addresses), rpc.lower(), streams, in_flight, seconds)
        rate, client_us, calls = got["calls_per_s"], got["cpu_us_per_call"], got["calls"]
    server_us = (servers_cpu(addresses) - cpu) / calls * 1e6
    return rate, server_us, client_us


def measure(
    configurations: dict[int, list[str]], rounds: int, seconds: float, in_flight: int, pinned: bool = False
) -> dict[str, float]:
    """Calls/s of each configuration (its members' addresses, by member count: 1 and 2) and RPC,
    emitted with the ratios; returns the ratio of each RPC. Rounds are of equal length, so a
    figure is the mean of its rounds'."""
    leaders = {count: create_streams(addresses) for count, addresses in configurations.items()}
    samples = {(count, rpc): [] for count in configurations for rpc in RPCS}
    for _ in range(rounds):
        for rpc in RPCS:
            for count, addresses in configurations.items():
                samples[count, rpc].append(round_of(addresses, rpc, in_flight, seconds))
    labels = {
        "payload_bytes": PAYLOAD,
        "streams": STREAMS,
        "in_flight": in_flight,
        "rounds": rounds,
        "round_s": seconds,
        "pinned": pinned,  # each member on a core of its own
        "load_average": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
    }
    ratios = {}
    for rpc in RPCS:
        rates = {}
        for count in configurations:
            rate, server_us, client_us = (
                statistics.fmean(column) for column in zip(*samples[count, rpc], strict=True)
            )
            rates[count] = rate
            emit(
                "members_appends",
                rate,
                "calls/s",
                members=count,
                rpc=rpc,
                streams_led=dict(leaders[count]),
                cores={address: server_cores(port_of(address)) for address in configurations[count]},
                # The client shares the machine's cores with the members: what each call cost both.
                server_cpu_us_per_call=round(server_us, 1),
                client_cpu_us_per_call=round(client_us, 1),
                **labels,
            )
        ratios[rpc] = rates[2] / rates[1]
        emit("members_ratio", ratios[rpc], "x", rpc=rpc, **labels)
    return ratios
