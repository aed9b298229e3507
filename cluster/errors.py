"""The cluster layer's exceptions, so callers never see an etcd client library's own.

`EtcdUnavailableError` is the one callers retry: etcd could not be reached or did not
answer in time, and a write's outcome is unknown (it may have been applied).
"""

from __future__ import annotations


class ClusterError(Exception):
    """Base of every error the cluster layer raises."""


class EtcdError(ClusterError):
    """etcd refused a request (a bug or a misconfigured etcd, not a lost connection)."""


class EtcdUnavailableError(EtcdError):
    """etcd could not be reached or did not answer in time; a write may or may not have happened."""


class EtcdCompactedError(EtcdError):
    """A watch asked for revisions etcd has compacted away; the watcher must read the keys again."""

    def __init__(self, compacted_revision: int) -> None:
        super().__init__(f"etcd compacted its history up to revision {compacted_revision}")
        self.compacted_revision = compacted_revision


class DuplicateNodeError(ClusterError):
    """Another live node is registered under this node's id."""


class PlacementError(ClusterError, ValueError):
    """A placement record that cannot be decoded, or an update that breaks its rules."""
