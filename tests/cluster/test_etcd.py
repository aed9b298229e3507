"""The etcd wrapper on a real etcd: conditional writes, leases, errors, and watches that outlive members."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import aetcd
import pytest

from cluster.errors import EtcdError, EtcdUnavailableError
from cluster.etcd import Condition, EtcdClient, KeyValue
from cluster.mirror import Mirror
from tests.cluster.etcd_server import EtcdCluster
from tests.cluster.helpers import nodes, run, until

# Under the test cluster's prefix, so that a coordinator's mirror sees them.
PROBES = b"/test/probe/"


def test_conditional_writes_return_the_key_as_it_is_after_them(etcd: EtcdCluster) -> None:
    async def scenario() -> None:
        client = EtcdClient(etcd.endpoints, timeout_s=2)
        absent = Condition(b"/k", 0, "create")
        created = await client.put_if(b"/k", b"1", [absent])
        assert created.succeeded and created.kv.value == b"1"
        assert created.revision == created.kv.mod_revision == created.kv.create_revision
        again = await client.put_if(b"/k", b"2", [absent])
        assert (again.succeeded, again.kv, again.revision) == (False, created.kv, 0)
        stale = await client.put_if(b"/k", b"3", [Condition(b"/k", created.kv.mod_revision - 1)])
        assert not stale.succeeded and stale.kv == created.kv
        swapped = await client.put_if(b"/k", b"4", [Condition(b"/k", created.kv.mod_revision)])
        assert swapped.succeeded and swapped.kv.value == b"4"
        assert swapped.kv.create_revision == created.kv.create_revision < swapped.kv.mod_revision
        deleted = await client.delete_if(b"/k", [Condition(b"/k", created.kv.create_revision, "create")])
        assert deleted.succeeded and deleted.kv is None and deleted.revision > swapped.revision
        assert await client.get(b"/k") is None
        await client.close()

    run(scenario())


def test_a_lease_lives_while_kept_alive_and_its_keys_go_with_it(etcd: EtcdCluster) -> None:
    async def scenario() -> None:
        client = EtcdClient(etcd.endpoints, timeout_s=2)
        lease = await client.grant_lease(1)
        assert lease.ttl_s >= 2  # etcd's minimum TTL with its default timing
        assert (await client.put_if(b"/leased", b"x", [], lease=lease.lease_id)).kv.lease == lease.lease_id
        assert await client.keep_alive(lease.lease_id) == lease.ttl_s
        await client.revoke_lease(lease.lease_id)
        assert await client.get(b"/leased") is None
        assert await client.keep_alive(lease.lease_id) == 0
        await client.revoke_lease(lease.lease_id)  # already gone: not an error
        with pytest.raises(EtcdError, match="requested lease not found"):
            await client.put_if(b"/leased", b"x", [], lease=lease.lease_id)
        await client.close()

    run(scenario())


def test_an_unreachable_etcd_is_reported_as_unavailable() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    async def scenario() -> None:
        client = EtcdClient([("127.0.0.1", port)], timeout_s=1)
        with pytest.raises(EtcdUnavailableError, match=f"etcd at 127.0.0.1:{port} did not answer"):
            await client.get(b"/k")
        await client.close()

    run(scenario())


class KeyRecorder:
    """The changes a mirror reports for keys under PROBES, in order, with an event to wait on."""

    def __init__(self, mirror: Mirror) -> None:
        self.changes: list[tuple[bytes, bytes | None]] = []
        self.event = asyncio.Event()
        mirror.add_listener(self._record)

    @property
    def values(self) -> list[bytes]:
        return [value for _, value in self.changes if value is not None]

    def _record(self, key: bytes, _old: KeyValue | None, new: KeyValue | None) -> None:
        if key.startswith(PROBES):
            self.changes.append((key, None if new is None else new.value))
            self.event.set()


async def write_with_retry(write: Callable[[], Awaitable[object]]) -> None:
    """A write that etcd may refuse for a moment after losing a member (it elects a new leader)."""
    async with asyncio.timeout(20):
        while True:
            try:
                await write()
                return
            except EtcdUnavailableError:
                await asyncio.sleep(0.1)


async def write_probes(client: EtcdClient, values: range) -> None:
    for value in values:
        await write_with_retry(
            lambda value=value: client.put_if(PROBES + b"%d" % (value % 3), b"%d" % value, [])
        )


def expected(values: range) -> list[bytes]:
    return [b"%d" % value for value in values]


def test_a_watch_resumes_where_it_was_when_the_only_etcd_restarts(etcd: EtcdCluster) -> None:
    async def scenario() -> None:
        client = EtcdClient(etcd.endpoints, timeout_s=2)
        mirror = Mirror(client, b"/")
        probes = KeyRecorder(mirror)
        await mirror.start()
        await write_probes(client, range(0, 5))
        await until(lambda: len(probes.values) == 5, probes.event)
        etcd.kill(0)
        await asyncio.to_thread(etcd.restart, 0)
        await write_probes(client, range(5, 10))
        await until(lambda: len(probes.values) >= 10, probes.event)
        assert probes.values == expected(range(10))
        await mirror.stop()
        await client.close()

    run(scenario())


def test_a_watch_moves_to_another_member_and_misses_nothing_when_members_die(
    etcd_cluster: Callable[..., EtcdCluster],
) -> None:
    etcd = etcd_cluster(3)

    async def scenario() -> None:
        async with nodes(etcd.endpoints, "a") as (a,):
            probes = KeyRecorder(a.mirror)
            # Writes go through another client, to the last member.
            writer = EtcdClient(etcd.endpoints[::-1], timeout_s=2)
            await write_probes(writer, range(0, 5))
            await until(lambda: len(probes.values) == 5, probes.event)
            assert a.etcd.endpoint == etcd.endpoints[0]

            etcd.kill(0)  # the member a is connected to
            await write_probes(writer, range(5, 10))  # while a's watch is broken
            await until(lambda: len(probes.values) >= 10, probes.event)
            assert a.etcd.endpoint != etcd.endpoints[0]
            await asyncio.to_thread(etcd.restart, 0)

            etcd.kill(await asyncio.to_thread(etcd.leader))  # etcd's own leader: the others elect another
            await write_probes(writer, range(10, 15))
            await until(lambda: len(probes.values) >= 15, probes.event, timeout_s=20)
            assert probes.values == expected(range(15))
            assert a.membership.lease_valid()  # etcd's leader change kept leases alive
            await writer.close()

    run(scenario(), timeout_s=90)


def test_a_mirror_behind_a_compaction_reads_everything_again_and_reports_the_differences(
    etcd_cluster: Callable[..., EtcdCluster],
) -> None:
    etcd = etcd_cluster(3)

    async def scenario() -> None:
        client = EtcdClient(etcd.endpoints[:1], timeout_s=2)  # member 0 only
        writer = EtcdClient(etcd.endpoints[1:], timeout_s=2)
        for name in (b"a", b"b", b"c"):
            await writer.put_if(PROBES + name, b"1", [])
        mirror = Mirror(client, PROBES)
        probes = KeyRecorder(mirror)
        await mirror.start()
        assert sorted(probes.changes) == [(PROBES + name, b"1") for name in (b"a", b"b", b"c")]
        probes.changes.clear()

        etcd.kill(0)  # the mirror's only member: it falls behind while the others go on
        await write_probes_and_compact(writer, etcd)
        await asyncio.to_thread(etcd.restart, 0)
        await until(lambda: len(probes.changes) >= 3, probes.event, timeout_s=20)
        assert probes.changes == [(PROBES + b"a", b"2"), (PROBES + b"b", None), (PROBES + b"d", b"1")]
        kvs, revision = await writer.get_prefix(PROBES)
        assert mirror.revision >= revision
        assert {kv.key: kv for kv in kvs} == {kv.key: kv for kv in mirror.items(PROBES)}
        await mirror.stop()
        await client.close()
        await writer.close()

    run(scenario(), timeout_s=90)


async def write_probes_and_compact(writer: EtcdClient, etcd: EtcdCluster) -> None:
    """Change, delete and add a key, then compact etcd's history past those changes."""
    await write_with_retry(lambda: writer.put_if(PROBES + b"a", b"2", []))
    await write_with_retry(lambda: writer.delete_if(PROBES + b"b", []))
    await write_with_retry(lambda: writer.put_if(PROBES + b"d", b"1", []))
    _, revision = await writer.get_prefix(PROBES)
    host, port = etcd.endpoints[1]
    async with aetcd.Client(host=host, port=port, timeout=5) as admin:
        await admin.compact(revision, physical=True)
