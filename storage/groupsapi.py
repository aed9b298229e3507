"""The engine's consumer-group calls: each one hands over to the GroupManager (storage/groupmanager.py)
or its delivery (storage/groupdelivery.py: reads, claims, acks), where it is documented. `Engine`
takes them from `GroupCalls`, so the engine's own file stays about streams.
"""

from __future__ import annotations

from collections.abc import Sequence

from storage.groupmanager import GroupListener, GroupManager
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

    def create_group(
        self,
        stream: str,
        group: str,
        *,
        start: str | int = "oldest",
        entries_read: int | None = None,
        config: GroupConfig | None = None,
    ) -> GroupInfo:
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
