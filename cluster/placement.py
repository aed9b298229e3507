"""The placement table: where each stream lives (`streams/<name>` in etcd), and its changes.

A record names the stream's replicas, its leader (empty: offline), the leader epoch
(only grows), the in-sync replicas and the stream's cluster config. Its incarnation is
the key's `create_revision`, not a stored field: the transaction that creates a record
cannot know its own revision, and a stream deleted and created again gets a new one for
free. Its `revision` (the key's `mod_revision`) is the compare-and-swap token: every
change is a transaction requiring the revision the writer read, so of two writers that
read the same record one wins and the other gets the fresh record back to decide again.

The table here is a cache kept current by the cluster mirror, so `locate` costs no
call to etcd; listeners hear (name, old, new) for every change, in revision order. The
replication layer and the service's router use `locate`, `create_if_absent`, `cas`,
`delete` and the listeners; nothing else in the server writes placement.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cluster.errors import ClusterError, PlacementError
from cluster.etcd import Condition, EtcdClient, KeyValue, TxnResult
from cluster.keys import KeyLayout
from cluster.mirror import Mirror, MirrorView
from cluster.nodes import NodeDirectory


@dataclasses.dataclass(frozen=True)
class StreamPlacement:
    """One stream's placement, as etcd held it at `revision`."""

    name: str
    incarnation: int  # the key's create_revision: new each time the stream is created
    revision: int  # the key's mod_revision: what a compare-and-swap compares
    replicas: tuple[str, ...]
    leader: str  # "" while no in-sync replica is alive (offline)
    epoch: int
    isr: tuple[str, ...]
    config: Mapping[str, Any]
    # The replicas a move (cluster/reassign.py) is taking the stream to, the preferred leader
    # first; empty when no move is under way.
    target: tuple[str, ...] = ()
    # The replicas that move added so far (outside the original ones): what cancelling it drops.
    added: tuple[str, ...] = ()

    @property
    def replica_count(self) -> int:
        """How many replicas the stream has once any move is done: what acks=quorum counts a
        majority of (a move's extra replicas, still copying, must not raise the bar)."""
        return len(self.target or self.replicas)

    def to_json(self) -> bytes:
        fields: dict[str, Any] = {
            "replicas": list(self.replicas),
            "leader": self.leader,
            "epoch": self.epoch,
            "isr": list(self.isr),
            "config": dict(self.config),
        }
        if self.target:
            fields["target"] = list(self.target)
        if self.added:
            fields["added"] = list(self.added)
        return json.dumps(fields, sort_keys=True).encode()

    @classmethod
    def from_kv(cls, name: str, kv: KeyValue) -> StreamPlacement:
        try:
            fields = json.loads(kv.value)
            record = cls(
                name=name,
                incarnation=kv.create_revision,
                revision=kv.mod_revision,
                replicas=tuple(fields["replicas"]),
                leader=fields["leader"],
                epoch=fields["epoch"],
                isr=tuple(fields["isr"]),
                config=fields["config"],
                target=tuple(fields.get("target", ())),
                added=tuple(fields.get("added", ())),
            )
        except (ValueError, TypeError, KeyError) as exc:
            raise PlacementError(f"stream {name!r}: not a placement record ({exc!r}): {kv.value!r}") from None
        record.check()
        return record

    def check(self) -> None:
        """Raise PlacementError unless the record keeps the table's rules."""
        problems = []
        if not self.replicas or not all(isinstance(node, str) and node for node in self.replicas):
            problems.append("replicas must be a non-empty list of node ids")
        if len(set(self.replicas)) != len(self.replicas):
            problems.append("a replica is listed twice")
        if not all(isinstance(node, str) and node for node in self.target):
            problems.append("target must be a list of node ids")
        if len(set(self.target)) != len(self.target):
            problems.append("a target replica is listed twice")
        if not set(self.added) <= set(self.replicas) or (self.added and not self.target):
            problems.append("the replicas a move added must be replicas, while it is under way")
        if not isinstance(self.epoch, int) or isinstance(self.epoch, bool) or self.epoch < 1:
            problems.append("epoch must be a positive integer")
        if not set(self.isr) <= set(self.replicas):
            problems.append("every in-sync replica must be a replica")
        if not isinstance(self.leader, str) or (self.leader and self.leader not in self.isr):
            problems.append("the leader must be an in-sync replica, or empty")
        if not isinstance(self.config, Mapping):
            problems.append("config must be an object")
        if problems:
            raise PlacementError(f"stream {self.name!r}: " + "; ".join(problems))


@dataclasses.dataclass(frozen=True)
class CasOutcome:
    """Whether a compare-and-swap applied, and the record etcd holds now (None: deleted)."""

    applied: bool
    record: StreamPlacement | None


# A listener gets (stream name, record before, record after); None means absent.
PlacementListener = Callable[[str, StreamPlacement | None, StreamPlacement | None], None]


class PlacementTable:
    """Placement records: a cache read from the mirror, and conditional writes to etcd."""

    def __init__(
        self,
        etcd: EtcdClient,
        keys: KeyLayout,
        mirror: Mirror,
        nodes: NodeDirectory,
        *,
        defaults: Mapping[str, Any],
        wait_s: float,
    ) -> None:
        """`defaults` is the config of a stream created without one (it must hold
        `replication_factor`); `wait_s` bounds how long a write waits for the cache to
        show it (the write's result is returned either way)."""
        self._etcd = etcd
        self._keys = keys
        self._mirror = mirror
        self._nodes = nodes
        self._defaults = dict(defaults)
        self._wait_s = wait_s
        self._view = MirrorView(mirror, keys.stream_name, StreamPlacement.from_kv)
        self._streams = self._view.records

    def locate(self, name: str) -> StreamPlacement | None:
        """The stream's record as of the mirror's revision (no call to etcd)."""
        return self._streams.get(name)

    def streams(self) -> Mapping[str, StreamPlacement]:
        return self._streams

    def add_listener(self, listener: PlacementListener) -> None:
        self._view.add_listener(listener)

    async def create_if_absent(
        self,
        name: str,
        *,
        replication_factor: int | None = None,
        config: Mapping[str, Any] | None = None,
        replicas: Sequence[str] | None = None,
        followers_in_sync: bool = True,
    ) -> StreamPlacement:
        """The stream's record, created first if there is none.

        A new record gets `replication_factor` replicas (default: the defaults'), capped
        by the live nodes: those holding the fewest streams, ties broken by id; or the
        `replicas` given (to place a stream beside another). The first leads, at epoch
        1, and all are in sync (empty logs agree), unless `followers_in_sync` is False:
        then only the leader is, until the followers are known to copy it (a node with
        no replication layer creates streams so, so that no follower that never copied
        a byte can be elected). Of several nodes creating one stream at once, one
        transaction wins and all return its record.
        """
        existing = self._streams.get(name)
        if existing is not None:
            return existing
        settings = {**self._defaults, **(config or {})}
        if replication_factor is not None:
            settings["replication_factor"] = replication_factor
        factor = settings.get("replication_factor")
        if not isinstance(factor, int) or isinstance(factor, bool) or factor < 1:
            raise PlacementError(f"replication_factor must be a positive integer, got {factor!r}")
        chosen = tuple(self.choose_replicas(factor) if replicas is None else replicas)
        if not chosen:
            raise ClusterError("no live node to place a stream on")
        isr = chosen if followers_in_sync else chosen[:1]
        record = StreamPlacement(name, 0, 0, chosen, chosen[0], 1, isr, settings)
        record.check()
        key = self._keys.stream(name)
        result = await self._etcd.put_if(key, record.to_json(), [Condition(key, 0, "create")])
        if result.kv is None:  # deleted right after a competitor created it
            raise ClusterError(f"stream {name!r} was created and deleted concurrently; try again")
        return (await self._settled(name, result)).record or record

    def choose_replicas(self, count: int) -> list[str]:
        """Up to `count` live nodes holding the fewest streams (then the lowest ids)."""
        load = collections.Counter(node for record in self._streams.values() for node in record.replicas)
        return sorted(self._nodes.live(), key=lambda node: (load[node], node))[:count]

    async def cas(
        self, expected: StreamPlacement, updated: StreamPlacement, *, fence: Condition | None = None
    ) -> CasOutcome:
        """Write `updated` if the record is still `expected` (and `fence` holds, if given).

        Not applied: the outcome carries the record etcd holds now, to decide again from.
        A fence that no longer holds leaves the record as expected: the caller lost the
        right to write (e.g. it is no longer the controller).
        """
        if (updated.name, updated.incarnation) != (expected.name, expected.incarnation):
            raise PlacementError("a compare-and-swap cannot change a stream's name or incarnation")
        if updated.epoch < expected.epoch:
            raise PlacementError(f"stream {expected.name!r}: epoch {updated.epoch} < {expected.epoch}")
        updated.check()
        key = self._keys.stream(expected.name)
        conditions = [Condition(key, expected.revision, "mod"), *([fence] if fence else [])]
        return await self._settled(expected.name, await self._etcd.put_if(key, updated.to_json(), conditions))

    async def delete(self, record: StreamPlacement) -> bool:
        """Delete this incarnation of the stream (not a newer one); False if it is already gone."""
        key = self._keys.stream(record.name)
        result = await self._etcd.delete_if(key, [Condition(key, record.incarnation, "create")])
        if result.succeeded:
            await self._mirror.wait_for(result.revision, self._wait_s)
        return result.succeeded

    async def _settled(self, name: str, result: TxnResult) -> CasOutcome:
        # Read-your-writes: once a write returns, `locate` shows it (or something newer).
        record = None if result.kv is None else StreamPlacement.from_kv(name, result.kv)
        if record is not None:
            await self._mirror.wait_for(record.revision, self._wait_s)
        return CasOutcome(result.succeeded, record)
