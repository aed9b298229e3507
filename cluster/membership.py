"""This node's membership: its `nodes/<id>` key under a lease it keeps alive every TTL/3.

Why it matters beyond "being listed": a node may act as a stream's leader (acknowledge
appends, serve reads) only while its lease is valid, and it has to know that without
asking etcd. The lease is valid until `lease_valid_until`: the monotonic time the last
successful keep-alive was *sent*, plus the TTL etcd granted. etcd renews the lease when
the request arrives, later than it was sent, so etcd never expires the lease before
that moment: once `lease_valid()` is false, a new leader may be elected elsewhere, and
not before.

A lost lease (etcd expired it while this node was paused or cut off, or its key went
away) is replaced at once by a new registration, and the listeners are told so that
the layer above re-reads what placement says this node is.

A node id that a live node already holds is refused (`DuplicateNodeError`). The holder
may be this node's own previous run, killed before its lease ran out: so a start waits
up to one lease TTL for the key to go before it gives up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from cluster.errors import DuplicateNodeError, EtcdError
from cluster.etcd import Condition, EtcdClient, KeyValue
from cluster.keys import KeyLayout
from cluster.mirror import Mirror
from cluster.nodes import NodeInfo
from cluster.tasks import cancel_and_wait, within

log = logging.getLogger("streamlog.cluster.membership")

# etcd checks for expired leases twice a second and then commits the deletion.
_EXPIRY_SLACK_S = 1.0
# A failed keep-alive is retried this soon (or at the usual interval, if shorter).
_RETRY_S = 0.25


class Membership:
    """Registers this node, keeps its lease alive, and re-registers when the lease is lost."""

    def __init__(
        self, etcd: EtcdClient, keys: KeyLayout, mirror: Mirror, info: NodeInfo, *, lease_ttl_s: int
    ) -> None:
        self._etcd = etcd
        self._key = keys.node(info.node_id)
        self._info = info
        self._ttl_s = lease_ttl_s
        self.lease_id = 0
        self.lease_valid_until = 0.0
        # Set when the node id was taken by another node while this one was cut off; `failed`
        # wakes whoever must then stop the node (it no longer acts as a member).
        self.error: DuplicateNodeError | None = None
        self.failed = asyncio.Event()
        self._listeners: list[Callable[[int], None]] = []
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        mirror.add_listener(self._on_change)

    @property
    def node_id(self) -> str:
        return self._info.node_id

    def lease_valid(self) -> bool:
        """Whether etcd still holds this node's lease for certain (no call to etcd)."""
        return time.monotonic() < self.lease_valid_until

    def add_listener(self, listener: Callable[[int], None]) -> None:
        """`listener(lease_id)` runs after each re-registration under a new lease."""
        self._listeners.append(listener)

    async def start(self) -> None:
        """Register (waiting up to a TTL for a previous holder of the id to expire), then keep alive."""
        await self._register()
        self._spawn(self._keep_alive())

    async def stop(self) -> None:
        """Stop keeping alive and revoke the lease, so that the node's keys go at once."""
        await cancel_and_wait(self._tasks)
        lease_id, self.lease_id, self.lease_valid_until = self.lease_id, 0, 0.0
        if lease_id:
            try:
                await self._etcd.revoke_lease(lease_id)
            except EtcdError as exc:
                log.warning("could not revoke lease %x (it expires by itself): %s", lease_id, exc)

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _register(self) -> None:
        deadline: float | None = None
        while True:
            sent = time.monotonic()
            lease = await self._etcd.grant_lease(self._ttl_s)
            result = await self._etcd.put_if(
                self._key, self._info.to_json(), [Condition(self._key, 0, "create")], lease=lease.lease_id
            )
            if result.succeeded:
                self.lease_id, self.lease_valid_until = lease.lease_id, sent + lease.ttl_s
                self._ttl_s = lease.ttl_s
                log.info(
                    "registered node %s under lease %x (TTL %d s)", self.node_id, lease.lease_id, lease.ttl_s
                )
                return
            await self._etcd.revoke_lease(lease.lease_id)
            if result.kv is None:
                continue  # the holder went in between
            if deadline is None:
                deadline = time.monotonic() + lease.ttl_s + _EXPIRY_SLACK_S
            if not await self._wait_deleted(result.kv, deadline):
                raise DuplicateNodeError(
                    f"node id {self.node_id!r} is registered by a live node (record "
                    f"{result.kv.value.decode(errors='replace')}, lease {result.kv.lease:x}) that kept it "
                    f"for more than a lease TTL: stop that node or give this one another --node-id"
                )

    async def _wait_deleted(self, holder: KeyValue, deadline: float) -> bool:
        """Wait until the holder's key is deleted; False if it is still there at the deadline."""

        async def deleted() -> None:
            watch = self._etcd.watch_prefix(self._key, holder.mod_revision + 1)
            async with contextlib.aclosing(watch):
                async for event in watch:
                    if event.key == self._key and event.kv is None:
                        return

        finished, _ = await within(deadline - time.monotonic(), deleted())
        return finished

    async def _keep_alive(self) -> None:
        while self.error is None:
            lease_id, interval = self.lease_id, self._ttl_s / 3
            sent = time.monotonic()
            try:
                ttl = await self._etcd.keep_alive(lease_id)
            except EtcdError as exc:  # whatever went wrong, the lease needs the next try
                log.warning(
                    "lease keep-alive failed (%s); lease valid %.2f s more",
                    exc,
                    max(0.0, self.lease_valid_until - time.monotonic()),
                )
                await asyncio.sleep(min(interval, _RETRY_S))
                continue
            if ttl > 0:
                if lease_id == self.lease_id:
                    self.lease_valid_until = max(self.lease_valid_until, sent + ttl)
                await asyncio.sleep(max(0.0, sent + interval - time.monotonic()))
            else:
                await self._recover(lease_id)

    def _on_change(self, key: bytes, old: KeyValue | None, new: KeyValue | None) -> None:
        # Our key deleted while we hold its lease: expired, revoked or deleted by hand.
        # Re-register now rather than at the next keep-alive.
        if key == self._key and new is None and old is not None and old.lease == self.lease_id:
            self._spawn(self._recover(old.lease))

    async def _recover(self, lost_lease_id: int) -> None:
        """Replace a lost registration once, however many signals reported it."""
        async with self._lock:
            if lost_lease_id != self.lease_id or self.error is not None:
                return
            self.lease_valid_until = 0.0
            log.warning("node %s lost its lease %x; registering again", self.node_id, lost_lease_id)
            # The lease may still live if only the key was deleted: revoke it with its other keys.
            with contextlib.suppress(EtcdError):
                await self._etcd.revoke_lease(lost_lease_id)
            while True:
                try:
                    await self._register()
                    break
                except EtcdError as exc:
                    log.warning("cannot register again yet: %s", exc)
                    await asyncio.sleep(_RETRY_S)
                except DuplicateNodeError as exc:
                    log.error("node %s stops acting as a member: %s", self.node_id, exc)
                    self.error = exc
                    self.failed.set()
                    return
        for listener in self._listeners:
            listener(self.lease_id)
