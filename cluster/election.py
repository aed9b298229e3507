"""Controller election: one node at a time holds the `controller` key, under its lease.

A node campaigns by creating the key in a transaction that requires it to be absent
(`create_revision == 0`); the others see the holder in the mirror and campaign again
when the key goes (its holder's lease expired or was revoked). Holding the key is not
enough to act on, as Jepsen found of etcd locks: a paused controller may still believe
it holds a key etcd has already given to another. So the election hands the controller
a fence, the key's `create_revision`, and every write the controller makes requires
the key still to have it: a deposed controller's writes fail, whatever it believes.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from cluster.errors import EtcdError, EtcdUnavailableError
from cluster.etcd import Condition, EtcdClient, KeyValue
from cluster.keys import KeyLayout
from cluster.membership import Membership
from cluster.mirror import Mirror
from cluster.tasks import cancel_and_wait

log = logging.getLogger("streamlog.cluster.election")

_RETRY_S = 0.25


class ControllerElection:
    """Campaigns for this node and reports the fence whenever it becomes or stops being controller.

    `on_change(fence)` gets a Condition while this node holds the key, None after.
    """

    def __init__(
        self,
        etcd: EtcdClient,
        keys: KeyLayout,
        mirror: Mirror,
        membership: Membership,
        on_change: Callable[[Condition | None], None],
    ) -> None:
        self._etcd = etcd
        self._key = keys.controller
        self._mirror = mirror
        self._membership = membership
        self._on_change = on_change
        self.fence: Condition | None = None
        self._campaign_task: asyncio.Task[None] | None = None
        self._stopped = False
        mirror.add_listener(self._on_key)
        membership.add_listener(lambda _lease_id: self._campaign_soon())

    @property
    def controller_id(self) -> str | None:
        """The node etcd names as controller now (as of the mirror), if any."""
        kv = self._mirror.get(self._key)
        return None if kv is None else _holder(kv)

    def start(self) -> None:
        """Read who holds the key from the mirror (started before this) and campaign if nobody does."""
        self._on_key(self._key, None, self._mirror.get(self._key))

    async def stop(self) -> None:
        self._stopped = True
        if self._campaign_task is not None:
            await cancel_and_wait([self._campaign_task])
        self._set_fence(None)

    def _on_key(self, key: bytes, old: KeyValue | None, new: KeyValue | None) -> None:
        if key != self._key:
            return
        mine = new is not None and new.lease == self._membership.lease_id and self._membership.lease_id != 0
        self._set_fence(Condition(self._key, new.create_revision, "create") if mine and new else None)
        if new is None:
            self._campaign_soon()

    def _set_fence(self, fence: Condition | None) -> None:
        if fence != self.fence:
            self.fence = fence
            log.info("node %s %s controller", self._membership.node_id, "is now" if fence else "is no longer")
            self._on_change(fence)

    def _campaign_soon(self) -> None:
        if self._stopped or (self._campaign_task is not None and not self._campaign_task.done()):
            return
        self._campaign_task = asyncio.get_running_loop().create_task(self._campaign())

    async def _campaign(self) -> None:
        # Until somebody holds the key, or this node has no lease to hold it with (a new
        # registration campaigns again).
        while self._mirror.get(self._key) is None and self._membership.lease_valid():
            value = json.dumps({"node": self._membership.node_id}).encode()
            try:
                result = await self._etcd.put_if(
                    self._key, value, [Condition(self._key, 0, "create")], lease=self._membership.lease_id
                )
            except EtcdUnavailableError as exc:
                log.warning("controller campaign failed (%s); trying again", exc)
                await asyncio.sleep(_RETRY_S)
                continue
            except EtcdError as exc:  # e.g. the lease expired just now: the next registration campaigns
                log.warning("controller campaign failed: %s", exc)
                return
            if result.kv is not None:
                # Won or lost, the mirror reports the key at this revision; wait for it so that
                # the fence is set (and the controller starts) from the mirror, in order.
                await self._mirror.wait_for(result.kv.mod_revision, timeout_s=_RETRY_S * 4)
            if result.succeeded:
                return


def _holder(kv: KeyValue) -> str | None:
    try:
        node = json.loads(kv.value)["node"]
    except (ValueError, TypeError, KeyError):
        return None
    return node if isinstance(node, str) else None
