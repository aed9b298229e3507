"""Replication of streams between the nodes of a cluster (Kafka's model; docs/CLUSTER.md).

wire: replica chunks <-> the internal protocol; leader: a led stream's followers, high
watermark, in-sync set and commit barrier; follower: a followed stream's fetch loop;
manager: this node's roles, from the placement table; service: the ReplicaService
that leaders serve to their followers.
"""
