"""A local copy of every key under the cluster's etcd prefix, kept current by one watch.

Why one watch for everything: etcd orders the events of one watch by revision, and
the views built on this copy (live nodes, the controller, placement) must agree with
each other. Were nodes and streams watched separately, a controller could see a
stream led by a node whose registration it has not seen yet and move the leadership
away for nothing. Here every listener sees every change once, in revision order, and
the copy as a whole is the store at `revision`.

After a compaction makes the watch's next revision unavailable, the copy is read
again and the differences are reported as changes (in key order: the revisions in
between are gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from cluster.errors import EtcdCompactedError, EtcdUnavailableError
from cluster.etcd import EtcdClient, KeyValue
from cluster.tasks import cancel_and_wait

log = logging.getLogger("streamlog.cluster.mirror")

# A listener gets (key, value before, value after); None means absent.
MirrorListener = Callable[[bytes, KeyValue | None, KeyValue | None], None]

_RELOAD_RETRY_S = 0.5

T = TypeVar("T")


class Mirror:
    """Every key under `prefix`, as of `revision`; listeners hear each change in order."""

    def __init__(self, etcd: EtcdClient, prefix: bytes) -> None:
        self._etcd = etcd
        self._prefix = prefix
        self._keys: dict[bytes, KeyValue] = {}
        self._listeners: list[MirrorListener] = []
        self._revision = 0
        self._advanced = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def revision(self) -> int:
        """The copy holds every change up to this revision."""
        return self._revision

    def add_listener(self, listener: MirrorListener) -> None:
        """Add before `start` to also hear the keys that already exist (as creations)."""
        self._listeners.append(listener)

    def get(self, key: bytes) -> KeyValue | None:
        return self._keys.get(key)

    def items(self, prefix: bytes) -> Iterator[KeyValue]:
        return (kv for key, kv in self._keys.items() if key.startswith(prefix))

    async def start(self) -> None:
        """Load every key, then follow changes in the background."""
        await self._load()
        self._task = asyncio.get_running_loop().create_task(self._follow())

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])

    async def wait_for(self, revision: int, timeout_s: float) -> bool:
        """Wait until the copy holds `revision`; False if it did not within the timeout."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while self._revision < revision:
                    await self._advanced.wait()
        return self._revision >= revision

    async def _load(self) -> None:
        """Read every key and report what differs from the copy (all of it, the first time)."""
        kvs, revision = await self._etcd.get_prefix(self._prefix)
        fresh = {kv.key: kv for kv in kvs}
        for key in sorted(fresh.keys() | self._keys.keys()):
            old, kv = self._keys.get(key), fresh.get(key)
            if (old and old.mod_revision) != (kv and kv.mod_revision):
                self._apply(key, kv)
        self._advance(revision)

    async def _follow(self) -> None:
        while True:
            try:
                async for event in self._etcd.watch_prefix(self._prefix, self._revision + 1):
                    self._apply(event.key, event.kv)
                    self._advance(event.revision)
            except EtcdCompactedError as exc:
                log.warning("etcd history compacted (%s); reading the cluster's keys again", exc)
                while True:
                    try:
                        await self._load()
                        break
                    except EtcdUnavailableError as error:
                        log.warning("cannot read the cluster's keys: %s", error)
                        await asyncio.sleep(_RELOAD_RETRY_S)

    def _apply(self, key: bytes, kv: KeyValue | None) -> None:
        old = self._keys.get(key)
        if kv is None:
            self._keys.pop(key, None)
        else:
            self._keys[key] = kv
        if old is None and kv is None:
            return
        for listener in self._listeners:
            try:
                listener(key, old, kv)
            except Exception:
                # One broken listener must not stop the others or the watch.
                log.exception("cluster listener failed on a change to %r", key)

    def _advance(self, revision: int) -> None:
        if revision > self._revision:
            self._revision = revision
            self._advanced.set()
            self._advanced = asyncio.Event()


class MirrorView(Generic[T]):
    """The records of one kind in a mirror (node infos, placements), decoded, by name.

    `name_of(key)` names the record a key holds (None: another kind); `decode(name, kv)`
    builds it, raising ValueError for a value none of our nodes wrote, which is logged
    and treated as absent. Listeners hear (name, before, after) when a record changes.
    """

    def __init__(
        self,
        mirror: Mirror,
        name_of: Callable[[bytes], str | None],
        decode: Callable[[str, KeyValue], T],
    ) -> None:
        self._name_of = name_of
        self._decode = decode
        self.records: dict[str, T] = {}
        self._listeners: list[Callable[[str, T | None, T | None], None]] = []
        mirror.add_listener(self._on_change)

    def add_listener(self, listener: Callable[[str, T | None, T | None], None]) -> None:
        self._listeners.append(listener)

    def _on_change(self, key: bytes, _old: KeyValue | None, new: KeyValue | None) -> None:
        name = self._name_of(key)
        if name is None:
            return
        before = self.records.pop(name, None)
        if new is not None:
            try:
                self.records[name] = self._decode(name, new)
            except ValueError as exc:
                log.error("ignoring the record at %r: %s", key, exc)
        after = self.records.get(name)
        if before != after:
            for listener in self._listeners:
                listener(name, before, after)
