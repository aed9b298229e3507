"""This node's copies of streams, kept in line with the placement table, and its role in each.

Every placement change (cluster/placement.py, heard in etcd's revision order) gives
this node a role in the stream: leader, follower, or none. Here:

- **Leader**: the node holds the stream's copy, created empty when the stream is new.
  A stream created anew (a new incarnation) while a copy of that name is here finds
  an old copy (the stream was deleted and its name taken again while this node kept
  one): it is wiped first, so no entry of the old stream is ever served as the new.
- **Deleted**: the copy goes, with its waiting readers told (NOT_FOUND), unless a
  DeleteStream served here is deleting it itself (`deleting`).
- **Follower**: nothing yet. Until replication lands, a node holds data only for the
  streams it leads, and streams are created with their followers out of the in-sync
  set (service/routing.py), so none is elected without the data. The replication
  layer attaches as a role listener: `add_listener` tells it of every change with
  this node's role before and after, so it learns where it starts or stops following
  (and leading), as the routing layer learns where it stopped leading.

The work runs in the listener, on the event loop, so that a call routed here after
the change finds the copy as placement says. It is small (creating a stream's empty
directory) except in the rare cases above (wiping an old copy, a deletion made
elsewhere), which delete files on the loop.

At start, a stream this node leads but holds no copy of is created empty (with a
warning: its data was lost, or it was never written); a local stream placement does
not know (deleted while this node was down, or from before it joined a cluster) is
left on disk, not served, and reported.
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
        self._live = False  # False while the cluster's records load at start
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
        self._live = True
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
        if new is None:
            if old is not None:
                self._delete_copy(name)
        elif after is Role.LEADER and before is not Role.LEADER:
            self._lead(name, created=old is None)
        for listener in self._listeners:
            listener(name, before, after, new)

    def _lead(self, name: str, *, created: bool) -> None:
        engine = self._engine
        assert engine is not None, "placement heard before the engine was attached"
        if created and self._live and engine.exists(name):
            log.warning("stream %r: wiping this node's copy of an older stream of that name", name)
            self._delete_copy(name)
        if not engine.exists(name):
            if not (created and self._live):
                log.warning("stream %r: this node leads it but holds no copy of it; it starts empty", name)
            engine.create_stream(name)

    def _delete_copy(self, name: str) -> None:
        engine = self._engine
        if engine is None or name in self._deleting or not engine.exists(name):
            return
        engine.delete_stream(name)
        self._forget(name)
