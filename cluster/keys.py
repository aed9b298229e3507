"""Where the cluster's records live in etcd: every key under `/<cluster_name>/`.

One place names the keys so that every module (and docs/CLUSTER.md) agrees:
`nodes/<id>` (a live node, under its lease), `controller` (the elected controller,
under its lease) and `streams/<name>` (a stream's placement). Stream names are any
UTF-8 (a '/' in one is just part of the key); node ids never hold a '/'.
"""

from __future__ import annotations

import dataclasses

from cluster.addresses import check_name


@dataclasses.dataclass(frozen=True)
class KeyLayout:
    """The etcd keys of one cluster (clusters sharing an etcd differ by name)."""

    cluster_name: str

    def __post_init__(self) -> None:
        check_name("the cluster name", self.cluster_name)

    @property
    def root(self) -> bytes:
        return f"/{self.cluster_name}/".encode()

    @property
    def nodes(self) -> bytes:
        return self.root + b"nodes/"

    @property
    def controller(self) -> bytes:
        return self.root + b"controller"

    @property
    def streams(self) -> bytes:
        return self.root + b"streams/"

    def node(self, node_id: str) -> bytes:
        return self.nodes + node_id.encode()

    def stream(self, name: str) -> bytes:
        return self.streams + name.encode()

    def node_id(self, key: bytes) -> str | None:
        """The node a `nodes/<id>` key names; None for any other key."""
        return key[len(self.nodes) :].decode() if key.startswith(self.nodes) else None

    def stream_name(self, key: bytes) -> str | None:
        """The stream a `streams/<name>` key names; None for any other key."""
        return key[len(self.streams) :].decode() if key.startswith(self.streams) else None
