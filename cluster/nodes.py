"""The live nodes: one `nodes/<id>` key per node, which exists exactly while its lease lives.

Why a view of its own: the controller (who died, who came back), replica choice for a
new stream (who can hold one) and the router (where does a leader listen) all ask the
same question, and must get the answer that matches the placement they read from the
same mirror.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping

from cluster.etcd import KeyValue
from cluster.keys import KeyLayout
from cluster.mirror import Mirror, MirrorView


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    """What a node publishes about itself in `nodes/<id>`."""

    node_id: str
    address: str  # host:port where peers and forwarded calls reach it
    started_ms: int  # wall-clock start time, for operators
    version: str  # streamlog version it runs

    def to_json(self) -> bytes:
        return json.dumps(
            {"address": self.address, "started_ms": self.started_ms, "version": self.version},
            sort_keys=True,
        ).encode()

    @classmethod
    def from_kv(cls, node_id: str, kv: KeyValue) -> NodeInfo:
        """Decode a `nodes/<id>` value; ValueError if it is not one."""
        try:
            fields = json.loads(kv.value)
            if not isinstance(fields["address"], str):
                raise TypeError("the address is not a string")
            return cls(node_id, fields["address"], int(fields["started_ms"]), str(fields["version"]))
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"node {node_id!r}: not a node record ({exc!r}): {kv.value!r}") from None


# A listener gets (node id, info before, info after); None means not live.
NodeListener = Callable[[str, NodeInfo | None, NodeInfo | None], None]


class NodeDirectory:
    """The nodes etcd holds as live, by id, as of the mirror's revision."""

    def __init__(self, mirror: Mirror, keys: KeyLayout) -> None:
        self._view = MirrorView(mirror, keys.node_id, NodeInfo.from_kv)

    def live(self) -> Mapping[str, NodeInfo]:
        return self._view.records

    def add_listener(self, listener: NodeListener) -> None:
        self._view.add_listener(listener)
