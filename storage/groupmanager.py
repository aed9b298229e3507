"""Consumer groups on top of the engine: the parts put together, and the calls that manage groups.

Each job has its module:

- `storage.groupstate`: one stream's groups, a pure state machine changed by ops;
- `storage.groups`: what a group read or claim does (an I/O-free plan);
- `storage.groupstore`: each stream's groups kept (state, journal, lock, fsync policy);
- `storage.groupdelivery`: reads, claims, acks and nacks run against the stream;
- `storage.deadletters`: doomed entries dropped or dead-lettered.

They reach the streams only through the engine's public calls
(storage.groupstreams). This module adds what is left: creating, configuring,
moving, describing and deleting groups and consumers, the retention floor the
groups put under each stream, and periodic maintenance.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from storage.deadletters import DeadLetters
from storage.errors import InvalidArgumentError, PreconditionError, StorageError
from storage.fs import FileSystem
from storage.groupdelivery import GroupDelivery
from storage.groupstate import Group
from storage.groupstore import GroupListener, GroupStore, GroupStores
from storage.groupstreams import GroupStreams
from storage.grouptypes import GroupConfig, GroupInfo, check_non_negative, validate_label

log = logging.getLogger("streamlog.storage")

__all__ = ["GroupListener", "GroupManager"]


class GroupManager:
    """Every stream's consumer groups. The engine's group calls come here (storage.groupsapi);
    reads, claims, acks and nacks go to `delivery`."""

    def __init__(
        self,
        streams: GroupStreams,
        fs: FileSystem,
        clock: Callable[[], int],
        *,
        journal_bytes: int,
        passive: bool = False,
    ) -> None:
        self._streams = streams
        self._clock = clock
        self.stores = GroupStores(streams, fs, journal_bytes=journal_bytes, passive=passive)
        self.delivery = GroupDelivery(self.stores, streams, DeadLetters(streams), self._now)

    def _now(self) -> int:
        return max(self._clock(), 0)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        self.stores.close()

    def drop_stream(self, stream: str) -> None:
        """The stream is being deleted: forget its groups (its directory, files included, goes next)."""
        self.stores.drop(stream)

    def add_listener(self, listener: GroupListener) -> None:
        self.stores.add_listener(listener)

    def sync(self) -> None:
        for store in self.stores.all():
            store.sync()

    def maintain(self) -> None:
        """Retire expired entries (dead letters included; not in passive stores: their leader's
        calls do it), sync everysec journals, compact big journals."""
        now = self._now()
        for store in self.stores.all():
            if store.closed or store.broken is not None:
                continue
            if store.log is None and not store.state.groups:
                # Never a group (a lookup made it: a metrics scrape lists every open stream's):
                # nothing to settle or sync, and its fsync policy would open its stream if closed,
                # closing another (issue 17: a round over every stream a scrape saw, 1,024 and more).
                continue
            name = store.name
            try:
                if not store.passive:
                    with self.stores.writing(name) as st:
                        for group in list(st.state.groups.values()):
                            self.delivery.settle(name, group, now)
                store.maintain_journal(self._streams.fsync_policy(name))
            except StorageError as exc:
                log.error("maintenance of the consumer groups of stream %r failed: %s", name, exc)

    # ------------------------------------------------------------------ retention

    def retention_holder(self, stream: str) -> tuple[str, int] | None:
        """(group, offset) of the group holding the stream's retention back, or None. Lock-free."""
        store = self.stores.peek(stream)
        if store is None or not store.holds:
            return None
        return store.retention_holder(self._now())

    def retention_floor(self, stream: str) -> int | None:
        """The engine's `retention_floor`: retention never evicts at or above this offset."""
        holder = self.retention_holder(stream)
        return None if holder is None else holder[1]

    # ------------------------------------------------------------------ group calls

    def _position(self, stream: str, start: str | int, entries_read: int | None) -> tuple[int, int]:
        """A group's cursor and entries_read for `start` (and an explicit entries_read, if given).

        A group cannot have read more entries than the stream ever had (its entries_added): a
        larger count would also run past int64 as the group reads on.
        """
        check_non_negative("entries_read", entries_read, optional=True)
        bounds = self._streams.bounds(stream)
        end = bounds.end_offset
        if start == "oldest":
            cursor = bounds.first_offset
        elif start == "newest":
            cursor = end
        elif not isinstance(start, int) or isinstance(start, bool) or start < 0:
            raise InvalidArgumentError('start must be "oldest", "newest" or a non-negative offset')
        elif start > end:
            raise InvalidArgumentError(f"offset {start} is past the end of stream {stream!r} ({end})")
        else:
            cursor = start
        if entries_read is None:
            return cursor, cursor
        if entries_read > end:
            raise InvalidArgumentError(
                f"entries_read {entries_read} is more than stream {stream!r} has had (entries_added {end})"
            )
        return cursor, entries_read

    def _check_config(self, stream: str, config: GroupConfig) -> None:
        if not isinstance(config, GroupConfig):
            raise InvalidArgumentError("config must be a GroupConfig")
        if config.dead_letter_stream == stream:
            raise InvalidArgumentError("a group's dead-letter stream must not be the stream itself")

    def create_group(
        self,
        stream: str,
        group: str,
        *,
        start: str | int = "oldest",
        entries_read: int | None = None,
        config: GroupConfig | None = None,
    ) -> GroupInfo:
        validate_label("group", group)
        config = config or GroupConfig()
        self._check_config(stream, config)
        cursor, entries_read = self._position(stream, start, entries_read)
        with self.stores.writing(stream) as store:
            if group in store.state.groups:
                raise PreconditionError(f"consumer group {group!r} already exists on stream {stream!r}")
            created = store.state.create(group, config, cursor, entries_read, self._now())
            return self._info(stream, store, created)

    def delete_group(self, stream: str, group: str) -> None:
        with self.stores.writing(stream, group=group) as store:
            store.state.drop(group)

    def list_groups(self, stream: str) -> list[GroupInfo]:
        if self.stores.find(stream, serving=True) is None:
            return []  # makes no store (GroupStores.find)
        with self.stores.writing(stream) as store:
            now = self._now()
            out = []
            for name in sorted(store.state.groups):
                group = store.state.groups[name]
                self.delivery.settle(stream, group, now)
                out.append(self._info(stream, store, group))
            return out

    def group_streams(self) -> list[str]:
        return [
            store.name
            for store in self.stores.all()
            if store.state.groups and not store.closed and not store.passive
        ]

    def group_info(self, stream: str, group: str) -> GroupInfo:
        with self.stores.writing(stream, group=group) as store:
            found = store.state.group(group)
            self.delivery.settle(stream, found, self._now())
            return self._info(stream, store, found)

    def consumer_count(self, stream: str, group: str, consumer: str) -> tuple[int, bool]:
        """How many consumers the group has, and whether `consumer` is one of them.

        O(1), and changes nothing (no settling, no journal): for a limit checked before every call
        that may add a consumer, whose cost must not grow with the group.
        """
        store = self.stores.having(stream, group, serving=False)
        with store.lock:
            store.check_open()
            consumers = store.state.group(group).consumers
            return len(consumers), consumer in consumers

    def _info(self, stream: str, store: GroupStore, group: Group) -> GroupInfo:
        end = self._streams.bounds(stream).end_offset
        lag = None
        if group.entries_read == group.cursor:
            lag = self._streams.count(stream, group.cursor, end) + len(group.scheduled)
        store.refresh_holds()
        holder = self.retention_holder(stream)
        return GroupInfo(
            stream=stream,
            name=group.name,
            config=group.config,
            cursor=group.cursor,
            entries_read=group.entries_read,
            lag=lag,
            entries_added=end,
            pending=len(group.pending),
            scheduled=len(group.scheduled),
            consumers=group.consumer_infos(),
            counters=group.counter_values(),
            created_ms=group.created_ms,
            active_ms=group.active_ms,
            hold_offset=group.hold_offset(),
            holds_retention=holder is not None and holder[0] == group.name,
        )

    def set_group_offset(
        self, stream: str, group: str, offset: str | int, entries_read: int | None = None
    ) -> GroupInfo:
        cursor, entries_read = self._position(stream, offset, entries_read)
        with self.stores.writing(stream, group=group) as store:
            found = store.state.group(group)
            found.seek(cursor, entries_read)
            return self._info(stream, store, found)

    def set_group_config(self, stream: str, group: str, config: GroupConfig) -> GroupInfo:
        self._check_config(stream, config)
        with self.stores.writing(stream, group=group) as store:
            found = store.state.group(group)
            found.set_config(config)
            return self._info(stream, store, found)

    def delete_consumer(self, stream: str, group: str, consumer: str) -> int:
        validate_label("consumer", consumer)
        with self.stores.writing(stream, group=group) as store:
            return store.state.group(group).delete_consumer(consumer, self._now())

    def dump(self, stream: str) -> dict:
        """The stream's group state as plain data (tests compare it across restarts and replicas)."""
        store = self.stores.find(stream)
        if store is None:
            return {}
        with store.lock:
            store.check_open()
            return store.state.dump()
