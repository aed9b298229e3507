"""Where a client's calls go: the cluster layout it learned, and one channel per node it talks to.

Shared by AsyncClient and Client (clients/aio.py, and clients/client.py generated from it),
which do the calls (DescribeCluster to learn, the call itself, its retries); this module
does no I/O. Against a single server (DescribeCluster answers with no cluster name) every
call goes to the one channel, as if this module did not exist. In a cluster, each
stream-scoped call goes to the stream's leader, with `streamlog-route: redirect`: a node
that does not lead the stream answers UNAVAILABLE naming the leader (service/routing.py)
instead of forwarding the call, so a stale layout costs one refused call, not a hop on
every call.

Reads from in-sync replicas (`read_from="replica"`): a plain read or subscription of a stream
goes to one of its live in-sync replicas, with `streamlog-read-from: replica` (the leader is
one of them), which serves it from its copy, committed entries only. The client chooses a
replica for each stream the first time it reads it, in turn among the stream's in-sync
replicas in node id order (a client starts its turns at a random place, so that clients
spread), and keeps it. When a read there fails (the node is down, or no longer serves the
stream in sync: it redirects to the leader), the client looks the layout up again and
chooses again; with no in-sync replica known it reads from the leader. A read may name the
replica it prefers (a node id: `read(..., replica=...)`, as the Spark connector's planner spreads
its partitions): it goes there while that node is a live in-sync replica of the stream, else to
the replica chosen in turn. A replica whose read failed (down, or redirecting: not in sync) is
passed over for that stream's replica reads for PASS_OVER_S, preferred or not, so that a dead
node costs a stream one failed attempt, not one per read, until the layout shows it gone.

What is retried after UNAVAILABLE (the caller's deadline permitting): any call refused
with a redirect (the node refused it before serving it), and any call gRPC could not send
(no connection to the node: "failed to connect to all addresses"); otherwise (a node went
down, the leader changed under the call) only calls that may run twice: reads, idempotent
admin calls, and appends that carry a producer id (the server answers a resend as a
duplicate). A call not retried still makes the client look the layout up again on its next
call, so a leader that went down is not called again.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from clients.errors import StreamlogError
from clients.types import ClusterDescription

_METHODS = [method.name for method in pb.DESCRIPTOR.services_by_name["StreamLogService"].methods]
ROUTE_METADATA = ("streamlog-route", "redirect")
READ_FROM_METADATA = ("streamlog-read-from", "replica")
READ_FROM = ("leader", "replica")  # where a client's plain reads and subscriptions go
LEADER_ADDRESS = "streamlog-leader-address"

# A layout lookup (DescribeCluster of one stream's prefix) is quick: a node that takes longer is
# passed over for the next (a paused node must not hold a call for the client's whole timeout).
LOOKUP_TIMEOUT_S = 5.0
# How long calls retry when they have no deadline of their own (a leader's election takes seconds).
RETRY_WINDOW_S = 30.0
# How long a replica whose read of a stream failed is passed over for that stream's replica reads:
# about a lease and an election, by when the layout shows a dead node gone from the in-sync set.
PASS_OVER_S = 10.0
_FIRST_PAUSE_S = 0.05
_MAX_PAUSE_S = 1.0

# Calls that may run twice with the outcome of once: retried after any UNAVAILABLE.
# A group read may deliver entries twice: they stay pending and are redelivered (at-least-once).
_IDEMPOTENT = frozenset(
    {
        "Read",
        "GetStreamInfo",
        "ListGroups",
        "GetGroupInfo",
        "GetPending",
        "SeekTime",
        "CountRange",
        "SetStreamConfig",
        "ReassignReplicas",
        "SetGroupConfig",
        "SetGroupOffset",
        "Ack",
        "Trim",
    }
)


def seed_addresses(address: str | Sequence[str]) -> list[str]:
    """The addresses given: one, several in a list, or several comma-separated."""
    parts = address.split(",") if isinstance(address, str) else list(address)
    seeds = [part.strip() for part in parts if part.strip()]
    if not seeds:
        raise ValueError("no server address given")
    return seeds


def stream_of(request: Any) -> str | None:
    """The stream a request is about; None for calls that are not stream-scoped."""
    return request.stream if "stream" in request.DESCRIPTOR.fields_by_name else None


def redirect_address(error: BaseException | None) -> str | None:
    """The leader's address a node named when it refused a call (or session) with a redirect."""
    cause = error.__cause__ if isinstance(error, StreamlogError) else error
    trailers = getattr(cause, "trailing_metadata", None)
    if not callable(trailers):
        return None
    for key, value in trailers() or ():
        if key == LEADER_ADDRESS and value:
            return str(value)
    return None


def retryable(method: str, request: Any, error: grpc.RpcError) -> bool:
    """Whether a call that failed with `error` may be sent again (see the module docstring)."""
    if error.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    if redirect_address(error) is not None or _never_sent(error):
        return True
    return method in _IDEMPOTENT or (method == "Append" and bool(request.producer_id))


def _never_sent(error: grpc.RpcError) -> bool:
    """Whether gRPC failed the call before sending it: it found no connection to the node
    (gRPC core's words for that case; the request never left the client)."""
    details = error.details() if hasattr(error, "details") else None
    return (details or "").startswith("failed to connect to all addresses")


class Routes:
    """The layout a client learned, and its channels (one per node address, opened when first used).

    `cluster`: None until a DescribeCluster answered, then whether the server is a cluster's
    node; False from the start for a client given a ready channel (it talks to that only).
    """

    def __init__(
        self, seeds: list[str], open_channel: Callable[[str], Any], channel: Any | None = None
    ) -> None:
        self.seeds = seeds
        self._open = open_channel
        self._channels: dict[str, Any] = {}
        self._stubs: dict[str, pb_grpc.StreamLogServiceStub] = {}
        self._names: dict[Any, str] = {}  # each stub's methods: the method's name
        self.cluster: bool | None = None if channel is None else False
        self.default = seeds[0]  # where calls go while nothing better is known: the seed that answered
        self._channels[self.default] = channel if channel is not None else open_channel(self.default)
        self._leaders: dict[str, str] = {}  # stream -> its leader's address
        self._nodes: list[str] = []  # live nodes' addresses, as last described
        self._suspects: set[str] = set()  # addresses that failed since the last description
        # stream -> its live in-sync replicas, node id -> address, in node id order
        self._in_sync: dict[str, dict[str, str]] = {}
        self._replicas: dict[str, str] = {}  # stream -> the in-sync replica its reads go to
        # (stream, address) -> when a replica whose read of the stream failed may be chosen again
        self._passed_over: dict[tuple[str, str], float] = {}
        self._turn = random.randrange(1 << 16)  # the next choice of a replica (random: clients spread)
        # Counters, for tests and monitoring: redirects followed, layouts learned.
        self.redirects = 0
        self.lookups = 0

    # -- channels

    def channel(self, address: str) -> Any:
        if address not in self._channels:
            self._channels[address] = self._open(address)
        return self._channels[address]

    def stub(self, address: str) -> pb_grpc.StreamLogServiceStub:
        if address not in self._stubs:
            stub = self._stubs[address] = pb_grpc.StreamLogServiceStub(self.channel(address))
            self._names.update((getattr(stub, name), name) for name in _METHODS)
        return self._stubs[address]

    def method_name(self, method: Any) -> str:
        """The name of a stub's method (a client's call sites pass `self._stub.Append`), to make
        the same call on another node's stub."""
        return self._names[method]

    def opened(self) -> list[Any]:
        """Every channel opened, for the client to close."""
        return list(self._channels.values())

    # -- the layout

    def leader(self, stream: str) -> str | None:
        """Where calls on `stream` go now: the client's only server, or the stream's leader when
        known; None when the layout must be looked up first."""
        if self.cluster is False:
            return self.default
        return self._leaders.get(stream)

    def replica(self, stream: str, prefer: str | None = None) -> str | None:
        """Where reads of `stream` from an in-sync replica go: the client's only server; node
        `prefer` (an id) while it is a live in-sync replica of the stream not passed over; else the
        replica chosen for the stream (the next in turn among its in-sync replicas not passed over,
        the first time); None when no in-sync replica is known: look the layout up first."""
        if self.cluster is False:
            return self.default
        in_sync = self._in_sync.get(stream)
        if not in_sync:
            return None
        preferred = in_sync.get(prefer) if prefer is not None else None
        if preferred is not None and not self._passed(stream, preferred):
            return preferred
        chosen = self._replicas.get(stream)
        if chosen is None:
            live = [a for a in in_sync.values() if not self._passed(stream, a)]
            candidates = live or list(in_sync.values())
            chosen = self._replicas[stream] = candidates[self._turn % len(candidates)]
            self._turn += 1
        return chosen

    def in_sync_nodes(self, stream: str) -> list[str]:
        """The node ids of `stream`'s live in-sync replicas as last described, in node id order."""
        return list(self._in_sync.get(stream, ()))

    def _passed(self, stream: str, address: str) -> bool:
        until = self._passed_over.get((stream, address))
        return until is not None and until > time.monotonic()

    def describers(self) -> list[str]:
        """Addresses to ask for the layout, in order: nodes not seen failing, then the others."""
        known = list(dict.fromkeys([self.default, *self._nodes, *self.seeds]))
        return [a for a in known if a not in self._suspects] + [a for a in known if a in self._suspects]

    def learn(self, address: str, description: ClusterDescription) -> None:
        """Take in what the node at `address` described (a whole catalog or a prefix of it)."""
        self.lookups += 1
        self.default = address
        if not description.cluster_name:
            self.cluster = False  # a single server: nothing to route, ever
            return
        self.cluster = True
        addresses = {node.id: node.address for node in description.nodes if node.alive and node.address}
        self._nodes = list(addresses.values())
        self._suspects.clear()
        for placement in description.streams:
            name = placement.name
            address = addresses.get(placement.leader, "")
            if address:
                self._leaders[name] = address
            else:  # no leader now (an election): look again next time
                self._leaders.pop(name, None)
            in_sync = {n: addresses[n] for n in sorted(placement.in_sync_replicas) if n in addresses}
            self._in_sync[name] = in_sync if address else {}
            if self._replicas.get(name) not in self._in_sync[name].values():
                self._replicas.pop(name, None)

    def failed(self, stream: str, error: BaseException) -> bool:
        """A call or session on `stream` failed with `error`: follow its redirect if it named the
        leader (True), else forget the stream's leader, so that the next call looks it up."""
        address = redirect_address(error)
        if address is not None:
            self.redirects += 1
            self._leaders[stream] = address
            self._suspects.discard(address)
            return True
        previous = self._leaders.pop(stream, None)
        if previous is not None:
            self._suspects.add(previous)
        return False

    def failed_replica(self, stream: str, error: BaseException, address: str | None = None) -> bool:
        """A read of `stream` from the replica at `address` (default: the one chosen for the
        stream) failed with `error`: that replica is passed over for the stream's replica reads
        for PASS_OVER_S, and the replicas are looked up again and chosen anew. True if the node
        named the leader (a redirect: it does not serve the stream in sync now), whose address is
        then known."""
        failed = self._replicas.get(stream) if address is None else address
        if failed is not None and self._replicas.get(stream) == failed:
            del self._replicas[stream]
        self._in_sync.pop(stream, None)
        if failed is not None:
            now = time.monotonic()
            self._passed_over = {key: until for key, until in self._passed_over.items() if until > now}
            self._passed_over[(stream, failed)] = now + PASS_OVER_S
        leader = redirect_address(error)
        if leader is not None:
            self.redirects += 1
            self._leaders[stream] = leader
            return True
        if failed is not None:
            self._suspects.add(failed)
        return False


class Attempts:
    """The deadline and the pauses of one call's attempts (`timeout`: its whole time, None for
    RETRY_WINDOW_S of retrying)."""

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        self._deadline = time.monotonic() + (RETRY_WINDOW_S if timeout is None else timeout)
        self._pause = _FIRST_PAUSE_S

    def remaining(self) -> float | None:
        """The next attempt's timeout: what is left of the call's (None: no deadline)."""
        if self.timeout is None:
            return None
        return max(self._deadline - time.monotonic(), 0.0)

    def pause(self, redirected: bool) -> float | None:
        """How long to wait before the next attempt (none after a first redirect: the leader is
        named); None when the deadline leaves no time for one."""
        if redirected and self._pause == _FIRST_PAUSE_S:
            pause = 0.0
        else:
            pause = random.uniform(self._pause / 2, self._pause)  # jitter: clients do not retry in step
        self._pause = min(self._pause * 2, _MAX_PAUSE_S)
        if time.monotonic() + pause >= self._deadline:
            return None
        return pause
