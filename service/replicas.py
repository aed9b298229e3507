"""This node's role in each stream (leader, follower, none), from the placement table, and deletions.

Every placement change (cluster/placement.py, heard in etcd's revision order) gives
this node a role in the stream. The copies themselves (created with the stream's
incarnation, an older incarnation's wiped, followers fetching from their leader, a
leader's epoch begun before it accepts writes) are the replication layer's
(cluster/replication/manager.py). Here:

- **Deleted**: the copy goes, with its waiting readers told (NOT_FOUND), unless a
  DeleteStream served here is deleting it itself (`deleting`). The work runs in the
  listener, on the event loop, so that a call routed here after the change finds no
  copy.
- **Roles**: `add_listener` tells of every change with this node's role before and
  after, so the routing layer learns where it stopped leading.

At start, a local stream placement does not know (deleted while this node was down,
or from before it joined a cluster) is left on disk, not served, and reported.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections.abc import Callable, Iterator

from cluster.placement import StreamPlacement
from storage import Engine

log = logging.getLogger(__name__)


class Role(enum.Enum):
    LEADER = "leader"
    FOLLOWER = "follower"
    NONE = "none"  # not a replica, or the stream does not exist


# (stream, role before, role after, the record after: None when deleted)
RoleListener = Callable[[str, Role, Role, StreamPlacement | None], None]


class LocalReplicas:
    """Applies placement to this node's engine. Event loop only."""

    def __init__(self, node_id: str) -> None:
        self._node_id = node_id
        self._engine: Engine | None = None
        self._forget: Callable[[str], None] = lambda _name: None
        self._deleting: set[str] = set()
        self._listeners: list[RoleListener] = []

    def role(self, record: StreamPlacement | None) -> Role:
        if record is None or self._node_id not in record.replicas:
            return Role.NONE
        return Role.LEADER if record.leader == self._node_id else Role.FOLLOWER

    def add_listener(self, listener: RoleListener) -> None:
        self._listeners.append(listener)

    def attach(self, engine: Engine, forget: Callable[[str], None]) -> None:
        """Serve `engine` (before the records load); `forget(name)` ends the waits on a
        deleted stream, as DeleteStream does."""
        self._engine, self._forget = engine, forget

    def go_live(self, placed: Callable[[str], bool]) -> None:
        """The records have loaded: report the local streams placement does not know."""
        assert self._engine is not None
        unknown = [name for name in self._engine.list_streams() if not placed(name)]
        if unknown:
            log.warning(
                "%d local streams are not in the cluster's placement and are not served (deleted while "
                "this node was down, or from before it joined the cluster); they stay on disk: %s",
                len(unknown),
                ", ".join(repr(name) for name in unknown[:20]) + (" ..." if len(unknown) > 20 else ""),
            )

    @contextlib.contextmanager
    def deleting(self, name: str) -> Iterator[None]:
        """A DeleteStream served here deletes the local copy itself while the block runs."""
        self._deleting.add(name)
        try:
            yield
        finally:
            self._deleting.discard(name)

    def is_deleting(self, name: str) -> bool:
        return name in self._deleting

    def on_placement(self, name: str, old: StreamPlacement | None, new: StreamPlacement | None) -> None:
        """The placement listener (cluster/placement.py)."""
        if old is not None and new is not None and old.incarnation != new.incarnation:
            # The stream was deleted and created again between two looks (etcd compacted the
            # revisions in between): both changes, in order.
            self.on_placement(name, old, None)
            old = None
        before, after = self.role(old), self.role(new)
        if new is None and old is not None:
            self._delete_copy(name)
        for listener in self._listeners:
            listener(name, before, after, new)

    def _delete_copy(self, name: str) -> None:
        engine = self._engine
        if engine is None or name in self._deleting or not engine.exists(name):
            return
        engine.delete_stream(name)
        self._forget(name)
