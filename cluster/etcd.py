"""etcd access: the few etcd v3 operations the cluster layer needs, typed, with timeouts.

Why a wrapper around aetcd (the asyncio etcd client that works with our grpcio and
protobuf): the rest of cluster/ wants plain records (`KeyValue`, `WatchEvent`),
conditional writes in one call that also return the key as it now is, a watch that
survives a lost connection without losing or repeating an event, and the layer's own
exceptions (cluster/errors.py), never the library's.

Several endpoints: aetcd dials one address, so this client talks to one endpoint at a
time and moves to the next when a call fails to connect or times out there. Calls that
failed that way raise `EtcdUnavailableError` (callers retry; a write's outcome is then
unknown); the watch reconnects by itself and resumes after the last event it delivered.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Literal, TypeVar

import aetcd
import grpc
from aetcd import exceptions as aetcd_errors

from cluster.errors import EtcdCompactedError, EtcdError, EtcdUnavailableError

log = logging.getLogger("streamlog.cluster.etcd")

T = TypeVar("T")

# gRPC codes that mean "no answer": the request may or may not have been applied.
_UNAVAILABLE_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,  # the channel was closed under the call (endpoint switch)
    # etcd's own errors outside its table, e.g. "context deadline exceeded" from a member
    # that forwarded a lease renewal to a leader that went away.
    grpc.StatusCode.UNKNOWN,
}
# How long the watch waits before reconnecting: doubled per failure up to the maximum.
_RETRY_MIN_S = 0.05
_RETRY_MAX_S = 1.0
# gRPC pings find a connection that went silent (etcd refuses pings more often than 5 s).
_CHANNEL_OPTIONS = {"grpc.keepalive_time_ms": 10_000, "grpc.keepalive_timeout_ms": 5_000}


@dataclasses.dataclass(frozen=True, slots=True)
class KeyValue:
    """A key as etcd holds it. `create_revision` changes only when the key is created again."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclasses.dataclass(frozen=True, slots=True)
class WatchEvent:
    """A change to a key: its new value, or `kv` None when it was deleted at `revision`."""

    key: bytes
    revision: int
    kv: KeyValue | None


@dataclasses.dataclass(frozen=True, slots=True)
class Condition:
    """A key's `mod` or `create` revision must equal `revision` (create 0: the key is absent)."""

    key: bytes
    revision: int
    target: Literal["mod", "create"] = "mod"


@dataclasses.dataclass(frozen=True, slots=True)
class TxnResult:
    """Whether a conditional write applied, and the key as it is after it (None: absent)."""

    succeeded: bool
    kv: KeyValue | None
    revision: int  # the revision the write made; 0 when it did not apply


@dataclasses.dataclass(frozen=True, slots=True)
class Lease:
    """A granted lease: its id and the TTL etcd granted (at least etcd's minimum)."""

    lease_id: int
    ttl_s: int


def _key_value(kv: aetcd.rtypes.KeyValue) -> KeyValue:
    return KeyValue(kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.lease)


class EtcdClient:
    """An etcd client over one or more endpoints; every unary call times out after `timeout_s`."""

    def __init__(self, endpoints: Sequence[tuple[str, int]], *, timeout_s: float) -> None:
        if not endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        self._endpoints = tuple(endpoints)
        self._timeout_s = timeout_s
        self._index = 0
        self._client = self._connect()
        # Clients replaced by an endpoint switch, closing in the background.
        self._closing: set[asyncio.Task[None]] = set()

    @property
    def endpoint(self) -> tuple[str, int]:
        """The endpoint calls go to now."""
        return self._endpoints[self._index]

    def _connect(self) -> aetcd.Client:
        host, port = self._endpoints[self._index]
        return aetcd.Client(host=host, port=port, timeout=self._timeout_s, options=_CHANNEL_OPTIONS)

    def _failed(self, exc: aetcd_errors.ClientError, client: aetcd.Client, index: int) -> EtcdError:
        """Our exception for aetcd's; a lost endpoint makes the next call go to the next one.

        `client` and `index` are those the failed call used (another call may have
        switched endpoints since).
        """
        if isinstance(exc, aetcd_errors.RevisionCompactedError):
            return EtcdCompactedError(exc.compacted_revision)
        cause = exc.__cause__
        unavailable = isinstance(
            exc,
            aetcd_errors.ConnectionFailedError
            | aetcd_errors.ConnectionTimeoutError
            | aetcd_errors.WatchTimeoutError,
        ) or (isinstance(cause, grpc.aio.AioRpcError) and cause.code() in _UNAVAILABLE_CODES)
        if not unavailable:
            return EtcdError(f"etcd refused the request: {exc}")
        if client is self._client and len(self._endpoints) > 1:
            self._index = (self._index + 1) % len(self._endpoints)
            self._client = self._connect()
            task = asyncio.get_running_loop().create_task(client.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
            log.info(
                "etcd at %s:%d failed (%s); switching to %s:%d", *self._endpoints[index], exc, *self.endpoint
            )
        host, port = self._endpoints[index]
        return EtcdUnavailableError(f"etcd at {host}:{port} did not answer: {exc or type(exc).__name__}")

    async def _call(self, operation: Callable[[aetcd.Client], Awaitable[T]]) -> T:
        client, index = self._client, self._index
        try:
            return await operation(client)
        except aetcd_errors.ClientError as exc:
            raise self._failed(exc, client, index) from exc

    async def get(self, key: bytes) -> KeyValue | None:
        found = await self._call(lambda client: client.get(key))
        return None if found is None else _key_value(found)

    async def get_prefix(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        """Every key under `prefix`, and the store revision the read saw."""
        found = await self._call(lambda client: client.get_prefix(prefix))
        return [_key_value(kv) for kv in found], found.header.revision

    async def put_if(
        self, key: bytes, value: bytes, conditions: Sequence[Condition], *, lease: int = 0
    ) -> TxnResult:
        """Put `key` (attached to `lease`, if not 0) if every condition holds, in one transaction."""
        return await self._transaction(key, conditions, lambda tx: tx.put(key, value, lease=lease))

    async def delete_if(self, key: bytes, conditions: Sequence[Condition]) -> TxnResult:
        """Delete `key` if every condition holds, in one transaction."""
        return await self._transaction(key, conditions, lambda tx: tx.delete(key))

    async def _transaction(
        self,
        key: bytes,
        conditions: Sequence[Condition],
        write: Callable[[aetcd.client.Transactions], object],
    ) -> TxnResult:
        # Both branches end by reading the key back, so the caller learns the revisions
        # its write got or the value that beat it, without a second round trip.
        async def run(client: aetcd.Client) -> tuple[bool, list]:
            tx = client.transactions
            compare = [(tx.mod if c.target == "mod" else tx.create)(c.key) == c.revision for c in conditions]
            return await client.transaction(
                compare=compare, success=[write(tx), tx.get(key)], failure=[tx.get(key)]
            )

        succeeded, responses = await self._call(run)
        found = responses[-1]
        kv = _key_value(found[0][1]) if found else None
        if not succeeded:
            return TxnResult(False, kv, 0)
        written = responses[0]
        header = getattr(written, written.WhichOneof("response")).header
        return TxnResult(True, kv, header.revision)

    async def grant_lease(self, ttl_s: int) -> Lease:
        lease = await self._call(lambda client: client.lease(ttl_s))
        return Lease(lease.id, lease.ttl)

    async def keep_alive(self, lease_id: int) -> int:
        """Refresh a lease; its TTL in seconds from now, or 0 when etcd no longer has it."""
        reply = await self._call(lambda client: client.refresh_lease(lease_id))
        return 0 if reply is None else reply.TTL

    async def revoke_lease(self, lease_id: int) -> None:
        """Revoke a lease (deleting its keys at once); a lease already gone is not an error."""
        try:
            await self._call(lambda client: client.revoke_lease(lease_id))
        except EtcdError as exc:
            if "lease not found" not in str(exc):
                raise

    async def watch_prefix(self, prefix: bytes, start_revision: int) -> AsyncGenerator[WatchEvent, None]:
        """Every change under `prefix` from `start_revision` on, in revision order, forever.

        A broken connection is retried (on the next endpoint, if any) and the watch
        resumes after the last event delivered. Raises EtcdCompactedError when the
        revision to resume from is gone; the caller reads the keys again.
        """
        next_revision = start_revision
        delay = _RETRY_MIN_S
        while True:
            client, index = self._client, self._index
            try:
                watch = await client.watch_prefix(prefix, start_revision=next_revision)
                try:
                    async for event in watch:
                        delay = _RETRY_MIN_S
                        kv = _key_value(event.kv)
                        next_revision = kv.mod_revision + 1
                        yield WatchEvent(kv.key, kv.mod_revision, kv if event.kind == "PUT" else None)
                finally:
                    if client is self._client:  # a replaced client is closing, its watches with it
                        await watch.cancel()
            except aetcd_errors.ClientError as exc:
                error = self._failed(exc, client, index)
                if not isinstance(error, EtcdUnavailableError):
                    raise error from exc
                log.info("etcd watch on %r lost (%s); resuming at revision %d", prefix, error, next_revision)
            # Also reached when the watch ended because its client was closed by a switch.
            await asyncio.sleep(delay)
            delay = min(delay * 2, _RETRY_MAX_S)

    async def close(self) -> None:
        await self._client.close()
        await asyncio.gather(*self._closing, return_exceptions=True)
