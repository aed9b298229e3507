"""The engine's consumer-group calls: each one hands over to the GroupManager (storage/groupmanager.py)
or its delivery (storage/groupdelivery.py: reads, claims, acks), where it is documented. `Engine`
takes them from `GroupCalls`, so the engine's own file stays about streams.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from storage.errors import InvalidArgumentError
from storage.groupmanager import GroupListener, GroupManager
from storage.groupops import decode_ops
from storage.groupstore import BatchListener
from storage.grouptypes import (
    AckResult,
    GroupConfig,
    GroupInfo,
    GroupReadOptions,
    GroupReadResult,
    NackResult,
    PendingInfo,
)


class GroupCalls:
    _groups: GroupManager  # set by the engine
    _in_directory: Callable[[str], None]

    def create_group(
        self,
        stream: str,
        group: str,
        *,
        start: str | int = "oldest",
        entries_read: int | None = None,
        config: GroupConfig | None = None,
    ) -> GroupInfo:
        self._in_directory(stream)  # group files live beside its segments: not in a slot
        return self._groups.create_group(stream, group, start=start, entries_read=entries_read, config=config)

    def delete_group(self, stream: str, group: str) -> None:
        self._groups.delete_group(stream, group)

    def list_groups(self, stream: str) -> list[GroupInfo]:
        return self._groups.list_groups(stream)

    def group_streams(self) -> list[str]:
        """The streams that have consumer groups, in no particular order."""
        return self._groups.group_streams()

    def group_info(self, stream: str, group: str) -> GroupInfo:
        return self._groups.group_info(stream, group)

    def set_group_offset(
        self, stream: str, group: str, offset: str | int, entries_read: int | None = None
    ) -> GroupInfo:
        return self._groups.set_group_offset(stream, group, offset, entries_read)

    def set_group_config(self, stream: str, group: str, config: GroupConfig) -> GroupInfo:
        return self._groups.set_group_config(stream, group, config)

    def consumer_count(self, stream: str, group: str, consumer: str) -> tuple[int, bool]:
        return self._groups.consumer_count(stream, group, consumer)

    def delete_consumer(self, stream: str, group: str, consumer: str) -> int:
        return self._groups.delete_consumer(stream, group, consumer)

    def read_group(self, stream: str, group: str, options: GroupReadOptions) -> GroupReadResult:
        return self._groups.delivery.read_group(stream, group, options)

    def ack(
        self, stream: str, group: str, offsets: Sequence[int] = (), ranges: Sequence[tuple[int, int]] = ()
    ) -> AckResult:
        return self._groups.delivery.ack(stream, group, offsets, ranges)

    def nack(self, stream: str, group: str, offsets: Sequence[int], delay_ms: int = 0) -> NackResult:
        return self._groups.delivery.nack(stream, group, offsets, delay_ms)

    def claim(
        self, stream: str, group: str, consumer: str, min_idle_ms: int, offsets: Sequence[int]
    ) -> GroupReadResult:
        return self._groups.delivery.claim(stream, group, consumer, min_idle_ms, offsets)

    def autoclaim(
        self, stream: str, group: str, consumer: str, min_idle_ms: int, cursor: int = 0, count: int = 100
    ) -> tuple[int, GroupReadResult]:
        return self._groups.delivery.autoclaim(stream, group, consumer, min_idle_ms, cursor, count)

    def pending(
        self,
        stream: str,
        group: str,
        *,
        consumer: str | None = None,
        min_idle_ms: int = 0,
        start: int = 0,
        end: int | None = None,
        count: int = 100,
    ) -> PendingInfo:
        return self._groups.delivery.pending(
            stream, group, consumer=consumer, min_idle_ms=min_idle_ms, start=start, end=end, count=count
        )

    def add_group_listener(self, listener: GroupListener) -> None:
        self._groups.add_listener(listener)

    # -- replication of group state (storage/groupstore.py's module doc)

    def group_seq(self, stream: str) -> int:
        """The op sequence number of the stream's groups: op batches made (or applied) so far."""
        store = self._groups.stores.find(stream)
        return 0 if store is None else store.op_seq

    def group_ops_since(
        self, stream: str, op_seq: int, max_bytes: int = 1 << 20
    ) -> list[tuple[int, bytes]] | None:
        """The op batches after `op_seq` as (seq, encoded ops), oldest first, within about
        `max_bytes` (at least one); None when they are not retained: send a snapshot."""
        store = self._groups.stores.find(stream)
        if store is None:  # none made yet: as batches_since of a store at seq 0 that retains none
            return [] if op_seq == 0 else None
        return store.batches_since(op_seq, max_bytes)

    def group_snapshot(self, stream: str) -> tuple[int, bytes]:
        """(op seq, encoded ops that rebuild the groups). Batches made from now on are retained
        for `group_ops_since` (a node that never ships a snapshot keeps none). A stream with no
        group store gets an empty store's snapshot without one being made."""
        return self._groups.stores.snapshot(stream)

    def apply_group_ops(self, stream: str, op_seq: int, body: bytes) -> None:
        """A follower applies its leader's op batch `op_seq` (the one after `group_seq`), durably.
        CorruptionError for bytes that do not decode or ops that do not apply, PreconditionError
        for a batch out of sequence."""
        ops = decode_ops(body)
        if not ops:
            raise InvalidArgumentError("a group op batch holds at least one op")
        self._in_directory(stream)  # as create_group: the ops may make its first group
        self._groups.stores.apply_batch(stream, op_seq, ops)

    def install_group_snapshot(self, stream: str, op_seq: int, body: bytes) -> None:
        """A follower replaces the stream's groups with its leader's snapshot at `op_seq`, durably."""
        if not isinstance(op_seq, int) or op_seq < 0:
            raise InvalidArgumentError("a group op seq must be a non-negative integer")
        ops = decode_ops(body)
        if not ops and op_seq == 0 and self._groups.stores.find(stream) is None:
            return  # an empty store's snapshot, on a stream with no store: no store made, no promotion
        self._in_directory(stream)  # as create_group: its group files go beside its segments
        self._groups.stores.install(stream, op_seq, ops)

    def set_groups_active(self, stream: str, active: bool) -> None:
        """Active: the stream's groups serve calls (this node leads it, or there is no cluster).
        Passive: they only follow a leader's ops; no deliveries, redeliveries, expiry or dead
        letters. Stores start as `EngineConfig.groups_passive` says."""
        self._groups.stores.set_active(stream, active)

    def add_group_batch_listener(self, listener: BatchListener) -> None:
        """`listener(stream, op_seq)` after a stream whose batches are retained made one."""
        self._groups.stores.add_batch_listener(listener)
