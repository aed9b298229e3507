"""What a server runs in a cluster, assembled: coordination, routing, peers, replication.

Loaded only when the server runs with `--cluster` (service/server.py imports it then):
a single server never loads the cluster layer or the etcd client.

Order. Built before the gRPC server (its routing interceptor goes into the chain, its
ReplicaService onto the server); started after the engine has recovered: the node then
starts its replica manager (cluster/replication/manager.py: copies and roles), registers
in etcd, loads the cluster's records (the manager creates the copies it lacks and takes
its role in each stream), takes part in the controller election, and only then routes
calls (until then they get UNAVAILABLE, and health says NOT_SERVING). Health says
StreamLogService is SERVING only once the node has caught up (`wait_caught_up`): each copy
it follows is in its stream's in-sync set, or the stream has no leader to copy from, or a
move is adding it (cluster/reassign.py: the old replicas serve meanwhile); a restarted node
thus stays out of a Kubernetes Service, and a rolling update waits, until its streams are
fully replicated again. When the server
drains, it forwards no more calls and ends those it relays; it is stopped after the gRPC
server has drained, so that calls in flight finish as leader: then replication stops,
then the coordinator, revoking the lease last, so that the node's keys go at once and
other nodes take over without waiting for a TTL; then the peer channels close.

A node whose id another process took while it was cut off from etcd no longer acts as
a member: `failed` is set, and the server shuts down (service/server.py).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from streamlog.internal.v1 import replication_pb2 as rpb

from cluster.addresses import parse_endpoints
from cluster.coordinator import ClusterConfig, Coordinator
from cluster.errors import ClusterError
from cluster.placement import StreamPlacement
from cluster.replication.leader import StreamLeader
from cluster.replication.manager import ReplicaManager, ReplicationConfig
from cluster.replication.service import PEER_SECRET, REPLICA_STATE, REPLICATE, ReplicaServicer
from cluster.replication.service import add_to_server as add_replica_service
from service.config import Settings
from service.forwarding import Forwarder
from service.loophops import LoopHops
from service.metrics import ClusterState
from service.opencalls import OpenCalls
from service.peers import PeerChannels
from service.replicas import LocalReplicas, Role
from service.resume import end_to_resume
from service.routing import RoutingInterceptor
from storage import Engine

if TYPE_CHECKING:  # server.py imports this module
    from service.server import GenericHandlersOnly

# How long a node that lost a copy waits for a peer to say how much of the stream it holds.
_STATE_TIMEOUT_S = 2.0


class ClusterStartError(RuntimeError):
    """The node could not join its cluster (etcd unreachable, its id held by a live node, ...)."""


class ClusterNode:
    """One server's membership in a cluster and the routing of its calls."""

    def __init__(self, settings: Settings, service: Any, raw_reply_methods: Iterable[str]) -> None:
        self.settings = settings
        self.node_id = settings.node_id
        self.coordinator = Coordinator(
            ClusterConfig(
                endpoints=parse_endpoints(settings.cluster),
                node_id=settings.node_id,
                advertise=settings.advertise,
                cluster_name=settings.cluster_name,
                lease_ttl_ms=settings.lease_ttl_ms,
                default_replication_factor=settings.default_replication_factor,
                default_acks=settings.default_acks,
                replica_replace_after_ms=settings.replica_replace_after_ms,
                max_concurrent_moves=settings.max_concurrent_moves,
            )
        )
        # Followers copy their leaders (cluster/replication/), so new streams start with all
        # their replicas in sync (empty logs agree).
        self.followers_copy_leaders = True
        self.peers = PeerChannels(settings)
        secret = (
            Path(settings.cluster_secret_file).read_bytes().strip() if settings.cluster_secret_file else None
        )
        self._peer_metadata = ((PEER_SECRET, secret.decode()),) if secret else ()
        # Set by `start` (it needs the engine); until then the replica service serves nothing.
        self._replication: ReplicaManager | None = None
        self.replica_service = ReplicaServicer(self.node_id, self._leader_role, self._copy_state, secret)
        self.forwarder = Forwarder(self.node_id, self.peers, service, raw_reply_methods)
        # The server's open calls: those served here as their stream's leader, and those relayed
        # to other leaders (service/routing.py marks which). Set by `start`.
        self._calls = OpenCalls()
        self.replicas = LocalReplicas(self.node_id)
        self.replicas.add_listener(self._on_role)
        placement = self.coordinator.placement
        # Listeners added now hear the records that exist when the coordinator starts.
        placement.add_listener(self.replicas.on_placement)
        placement.add_listener(self._on_catalog_change)
        placement.add_listener(self._track_catch_up)
        # Streams whose copy here is out of their in-sync set while they have a leader to copy.
        self._behind: set[str] = set()
        self._caught_up = asyncio.Event()
        # Times this node became the leader of a stream it followed, and stopped leading one.
        self._leader_changes: collections.Counter[str] = collections.Counter()
        self.routing = RoutingInterceptor(service.full_name, self)
        self.engine: Engine | None = None
        self.started = False
        self.draining = False
        self._names: list[str] | None = None  # the catalog's names, sorted; None: to sort again

    @property
    def failed(self) -> asyncio.Event:
        """Set when the node can no longer act as a member (`error` says why)."""
        return self.coordinator.membership.failed

    @property
    def error(self) -> Exception | None:
        return self.coordinator.membership.error

    def add_services(self, server: GenericHandlersOnly) -> None:
        """The internal services peers call (replication), on the server's port."""
        add_replica_service(self.replica_service, server)

    async def start(
        self, engine: Engine, forget: Callable[[str], None], calls: OpenCalls, hops: LoopHops
    ) -> None:
        """Join the cluster, serving `engine`; `forget(name)` ends the waits on a deleted stream;
        `calls`: the server's open calls (service/opencalls.py); `hops`: the server's hops of the
        engine's listeners to the loop (a thread's AppendMany tells the leaders in one)."""
        self.engine = engine
        self._calls = calls
        self.replicas.attach(engine, forget)
        settings, membership = self.settings, self.coordinator.membership
        self._replication = replication = ReplicaManager(
            self.node_id,
            engine,
            self.coordinator.placement,
            lease_valid_until=lambda: membership.lease_valid_until,
            connect=self._replicate_on,
            metadata=self._peer_metadata,
            forget=forget,
            live=lambda: self.coordinator.nodes.live().keys(),
            ask_state=self._ask_state,
            to_loop=hops.tell,
            config=ReplicationConfig(
                replica_lag_ms=settings.replica_lag_ms,
                max_fetch_bytes=settings.replica_fetch_bytes,
                move_bytes_per_s=settings.move_bytes_per_s,
            ),
        )
        replication.start()
        # Added before the coordinator starts: it hears every record that exists then.
        self.coordinator.placement.add_listener(replication.on_placement)
        try:
            await self.coordinator.start()
        except ClusterError as exc:
            raise ClusterStartError(f"cannot join the cluster: {exc}") from exc
        self.replicas.go_live(lambda name: self.coordinator.placement.locate(name) is not None)
        replication.go_live()
        self.started = True

    def drain(self) -> None:
        """The server is shutting down: forward no more calls, and end those relayed (the calls
        served here end as on a single server)."""
        self.draining = True
        for call in self._calls:
            if call.relayed:
                end_to_resume(call, "server is shutting down")

    async def stop(self) -> None:
        self.started = False
        if self._replication is not None:
            await self._replication.stop()
        await self.coordinator.stop()
        await self.peers.close()

    @property
    def replication(self) -> ReplicaManager:
        """This node's replicas and roles (cluster/replication/manager.py); set once it started."""
        assert self._replication is not None, "the cluster node has not started"
        return self._replication

    def replication_progress(self, name: str) -> tuple[int, list[tuple[str, int, int]]] | None:
        """A stream this node leads: its HW and each replica's (node, log end, lag ms)."""
        leader = self._leader_role(name)
        return None if leader is None else leader.progress()

    def _leader_role(self, name: str) -> StreamLeader | None:
        return self._replication.leader(name) if self._replication is not None else None

    def _copy_state(self, name: str, incarnation: int) -> tuple[int, int] | None:
        return self._replication.state(name, incarnation) if self._replication is not None else None

    async def _ask_state(self, node_id: str, name: str, incarnation: int) -> tuple[int, int] | None:
        """A peer's ReplicaState for the stream: (last epoch, log end); None if it gives none."""
        info = self.coordinator.nodes.live().get(node_id)
        if info is None:
            return None
        call = self.peers.method(
            node_id,
            info.address,
            REPLICA_STATE,
            "unary_unary",
            request_serializer=rpb.ReplicaStateRequest.SerializeToString,
            response_deserializer=rpb.ReplicaStateResponse.FromString,
        )
        request = rpb.ReplicaStateRequest(stream=name, incarnation=incarnation)
        try:
            reply = await call(request, metadata=self._peer_metadata, timeout=_STATE_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return None
        return reply.last_epoch, reply.log_end

    def _replicate_on(self, node_id: str) -> Any:
        """The Replicate multicallable on the channel to `node_id` (placement's leader)."""
        info = self.coordinator.nodes.live().get(node_id)
        return self.peers.method(
            node_id,
            info.address if info is not None else "",
            REPLICATE,
            "stream_stream",
            request_serializer=rpb.FetchRequest.SerializeToString,
            response_deserializer=rpb.FetchResponse.FromString,
        )

    def stream_names(self) -> list[str]:
        """Every stream of the cluster, sorted (code point order, as ListStreams lists)."""
        if self._names is None:
            self._names = sorted(self.coordinator.placement.streams())
        return self._names

    def _on_catalog_change(
        self, _name: str, old: StreamPlacement | None, new: StreamPlacement | None
    ) -> None:
        if old is None or new is None:
            self._names = None

    async def wait_caught_up(self) -> None:
        """Return once no copy here is behind (see the module docstring): health's readiness."""
        while self._behind:
            self._caught_up.clear()
            await self._caught_up.wait()

    def _track_catch_up(self, name: str, _old: StreamPlacement | None, new: StreamPlacement | None) -> None:
        me = self.node_id
        # A replica a move is adding here copies while the old ones serve: this node is not behind.
        adding = new is not None and me in new.target
        if new is not None and new.leader and me in new.replicas and me not in new.isr and not adding:
            self._behind.add(name)
        else:
            self._behind.discard(name)
        if not self._behind:
            self._caught_up.set()

    def metrics_state(self) -> ClusterState:
        """What /metrics reports of this node's part in the cluster (on the event loop)."""
        led: collections.Counter[tuple[int, int]] = collections.Counter()
        under_replicated: dict[str, int] = {}
        lag_entries: dict[str, int] = {}
        lag_seconds: dict[str, float] = {}
        leaders = self._replication.leaders if self._replication is not None else {}
        for name, leader in leaders.items():
            if not leader.leading:
                continue
            # A move's replicas still copying do not count: the stream is not short of any.
            replicas, in_sync = leader.record.replica_count, len(leader.record.isr)
            led[(replicas, in_sync)] += 1
            if in_sync < replicas:
                under_replicated[name] = in_sync
            _hw, progress = leader.progress()
            (_me, end, _), *followers = progress
            for node, log_end, lag_ms in followers:
                lag_entries[node] = lag_entries.get(node, 0) + end - log_end
                lag_seconds[node] = max(lag_seconds.get(node, 0.0), lag_ms / 1000)
        return ClusterState(
            live_nodes=len(self.coordinator.nodes.live()) if self.started else 0,
            copies_behind=len(self._behind),
            led_streams=dict(led),
            under_replicated=under_replicated,
            lag_entries=lag_entries,
            lag_seconds=lag_seconds,
            leader_changes=dict(self._leader_changes),
            forwarded=dict(self.forwarder.forwarded),
        )

    def _on_role(self, name: str, before: Role, after: Role, record: StreamPlacement | None) -> None:
        if record is not None and before is Role.FOLLOWER and after is Role.LEADER:
            self._leader_changes["gained"] += 1
        elif record is not None and before is Role.LEADER and after is not Role.LEADER:
            self._leader_changes["lost"] += 1
        # Calls served here on a stream this node does not lead (any more, or at all: a wait
        # on a stream that did not exist yet) end, to be routed to the leader again; reads
        # served here as an in-sync follower end when the epoch they follow changes or this
        # node leaves the in-sync set. A deleted stream's calls end as on a single server
        # (NOT_FOUND), by the deletion.
        if record is None:
            return
        for call in self._calls.on_stream(name):
            if call.relayed:
                continue
            if call.in_sync_epoch is None:
                if after is not Role.LEADER:
                    end_to_resume(call, "leader changed")
            elif after is not Role.FOLLOWER or record.epoch != call.in_sync_epoch:
                end_to_resume(call, "leader changed")
            elif self.node_id not in record.isr:
                end_to_resume(call, "this replica left the in-sync set")
