"""One node's part in the cluster's coordination, assembled and started in the right order.

Why an assembly of its own: the parts depend on each other's start (registration before
the mirror is read, the mirror before the election and the controller look at it) and
must stop in the reverse order, with the lease revoked last so that the node's keys
vanish at once and the other nodes take over without waiting for a TTL. The layers
above hold a `Coordinator` and use its parts: `placement` (locate, create_if_absent,
cas, delete, listeners), `nodes` (who is live, at which address), `membership`
(`lease_valid()`: whether this node may act as a leader now).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
import time
from collections.abc import Sequence

from cluster.addresses import check_name
from cluster.controller import Controller
from cluster.election import ControllerElection
from cluster.etcd import EtcdClient
from cluster.keys import KeyLayout
from cluster.membership import Membership
from cluster.mirror import Mirror
from cluster.nodes import NodeDirectory, NodeInfo
from cluster.placement import PlacementTable


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """What a node needs to join a cluster (from the server settings of the same names)."""

    endpoints: Sequence[tuple[str, int]]
    node_id: str
    advertise: str
    cluster_name: str = "streamlog"
    # Rounded up to whole seconds (etcd's unit); etcd raises it to its minimum (2 s by default).
    lease_ttl_ms: int = 5000
    default_replication_factor: int = 3
    default_acks: str = "quorum"
    replica_replace_after_ms: int = 600_000
    max_concurrent_moves: int = 4
    version: str = dataclasses.field(default_factory=lambda: importlib.metadata.version("streamlog"))

    @property
    def lease_ttl_s(self) -> int:
        return max(1, math.ceil(self.lease_ttl_ms / 1000))


class Coordinator:
    """This node's registration, its view of the cluster, and its share of the controller's work."""

    def __init__(self, config: ClusterConfig) -> None:
        check_name("a node id", config.node_id)
        self.config = config
        keys = KeyLayout(config.cluster_name)
        # A request that takes a third of a lease is late enough to try another endpoint.
        timeout_s = max(1.0, config.lease_ttl_s / 3)
        self.etcd = EtcdClient(config.endpoints, timeout_s=timeout_s)
        self.mirror = Mirror(self.etcd, keys.root)
        self.nodes = NodeDirectory(self.mirror, keys)
        self.placement = PlacementTable(
            self.etcd,
            keys,
            self.mirror,
            self.nodes,
            defaults={"replication_factor": config.default_replication_factor, "acks": config.default_acks},
            wait_s=timeout_s,
        )
        info = NodeInfo(config.node_id, config.advertise, int(time.time() * 1000), config.version)
        self.membership = Membership(self.etcd, keys, self.mirror, info, lease_ttl_s=config.lease_ttl_s)
        self.controller = Controller(
            self.placement,
            self.nodes,
            max_moves=config.max_concurrent_moves,
            replace_after_s=config.replica_replace_after_ms / 1000,
        )
        self.election = ControllerElection(
            self.etcd, keys, self.mirror, self.membership, self.controller.set_fence
        )

    @property
    def node_id(self) -> str:
        return self.config.node_id

    async def start(self) -> None:
        """Join: register (DuplicateNodeError if the id is live elsewhere), read the cluster, campaign."""
        try:
            await self.membership.start()
            await self.mirror.start()
            self.controller.start()
            self.election.start()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        """Leave: stop acting, then revoke the lease (the node's keys go at once)."""
        await self.election.stop()
        await self.controller.stop()
        await self.mirror.stop()
        await self.membership.stop()
        await self.etcd.close()
