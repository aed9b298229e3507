"""Membership against a real etcd: registration, lease expiry and validity, re-registration, duplicates."""

from __future__ import annotations

import asyncio
import time

import pytest

from cluster.coordinator import Coordinator
from cluster.errors import DuplicateNodeError
from cluster.etcd import Condition, EtcdClient
from cluster.keys import KeyLayout
from tests.cluster.etcd_server import EtcdCluster
from tests.cluster.helpers import TEST_TTL_MS, config, nodes, run, settled
from tests.cluster.proxy import FaultProxy

TTL_S = TEST_TTL_MS / 1000
KEYS = KeyLayout("test")


def _on_removal(observer: Coordinator, node_id: str, action) -> asyncio.Event:
    """An event set when `observer` sees `node_id` leave, after calling `action()` right then."""
    gone = asyncio.Event()

    def listener(changed: str, _old: object, new: object) -> None:
        if changed == node_id and new is None and not gone.is_set():
            action()
            gone.set()

    observer.nodes.add_listener(listener)
    return gone


def test_a_node_cut_off_from_etcd_knows_its_lease_is_gone_before_etcd_removes_it(etcd: EtcdCluster) -> None:
    async def scenario() -> None:
        proxy = FaultProxy(etcd.endpoints[0])
        await proxy.start()
        async with nodes(etcd.endpoints, "observer") as (observer,), nodes([proxy.address], "a") as (a,):
            await settled([observer, a])
            assert observer.nodes.live()["a"].address == a.config.advertise
            assert a.membership.lease_valid()
            first_lease = a.membership.lease_id
            seen: dict[str, float | bool] = {}
            gone = _on_removal(
                observer, "a", lambda: seen.update(at=time.monotonic(), valid=a.membership.lease_valid())
            )

            proxy.block()  # keep-alives stop reaching etcd
            blocked_at = time.monotonic()
            async with asyncio.timeout(TTL_S + 5):
                await gone.wait()
            # etcd expired the lease within a TTL (plus its expiry check) of the last keep-alive...
            assert seen["at"] - blocked_at < TTL_S + 1.5
            # ...and the node stopped trusting it no later than that.
            assert seen["valid"] is False
            assert a.membership.lease_valid_until <= seen["at"]

            registered = asyncio.Event()
            a.membership.add_listener(lambda _lease_id: registered.set())
            proxy.unblock()
            async with asyncio.timeout(10):
                await registered.wait()
            assert a.membership.lease_valid()
            assert a.membership.lease_id != first_lease
            await settled([observer, a])
            assert observer.mirror.get(KEYS.node("a")).lease == a.membership.lease_id
            assert "a" in observer.nodes.live()
        await proxy.stop()

    run(scenario())


def test_a_node_whose_key_is_deleted_registers_again_under_a_new_lease(etcd: EtcdCluster) -> None:
    async def scenario() -> None:
        async with nodes(etcd.endpoints, "a") as (a,):
            first_lease = a.membership.lease_id
            registered = asyncio.Event()
            a.membership.add_listener(lambda _lease_id: registered.set())
            key = KEYS.node("a")
            deleted = await a.etcd.delete_if(key, [])  # as an operator might, by hand
            assert deleted.succeeded
            async with asyncio.timeout(10):
                await registered.wait()
            assert a.membership.lease_id != first_lease and a.membership.lease_valid()
            await settled([a])
            assert a.mirror.get(key).lease == a.membership.lease_id

    run(scenario())


def test_a_second_node_with_a_live_nodes_id_is_refused(etcd: EtcdCluster) -> None:
    async def scenario() -> None:
        async with nodes(etcd.endpoints, "a") as (a,):
            twin = Coordinator(config(etcd.endpoints, "a", advertise="127.0.0.1:9999"))
            with pytest.raises(DuplicateNodeError, match="give this one another --node-id"):
                await twin.start()
            # The live node kept its registration and its address.
            await settled([a])
            assert a.membership.lease_valid()
            assert a.nodes.live()["a"].address == a.config.advertise
            assert a.mirror.get(KEYS.node("a")).lease == a.membership.lease_id

    run(scenario())


def test_a_node_whose_id_was_taken_while_it_was_cut_off_reports_that_it_failed(etcd: EtcdCluster) -> None:
    async def scenario() -> None:
        proxy = FaultProxy(etcd.endpoints[0])
        await proxy.start()
        async with nodes(etcd.endpoints, "observer") as (observer,), nodes([proxy.address], "a") as (a,):
            gone = _on_removal(observer, "a", lambda: None)
            proxy.block()
            async with asyncio.timeout(TTL_S + 5):
                await gone.wait()
            # Another process takes the id while `a` cannot reach etcd.
            async with nodes(etcd.endpoints, "a", advertise="127.0.0.1:9999"):
                assert not a.membership.failed.is_set()
                proxy.unblock()
                # `a` finds its lease gone, waits a TTL for the holder to go, then gives up.
                async with asyncio.timeout(2 * TTL_S + 10):
                    await a.membership.failed.wait()
                assert isinstance(a.membership.error, DuplicateNodeError)
                assert not a.membership.lease_valid()
                await settled([observer])
                assert observer.nodes.live()["a"].address == "127.0.0.1:9999"
        await proxy.stop()

    run(scenario())


def test_a_restarted_node_takes_its_id_back_once_its_dead_predecessors_lease_expires(
    etcd: EtcdCluster,
) -> None:
    async def scenario() -> None:
        # The previous run registered and died: its lease is not kept alive any more.
        etcd_client = EtcdClient(etcd.endpoints, timeout_s=2)
        lease = await etcd_client.grant_lease(int(TTL_S))
        key = KEYS.node("a")
        put = await etcd_client.put_if(
            key, b'{"address": "old"}', [Condition(key, 0, "create")], lease=lease.lease_id
        )
        assert put.succeeded
        async with nodes(etcd.endpoints, "a") as (a,):
            assert a.membership.lease_id != lease.lease_id
            assert a.mirror.get(key).lease == a.membership.lease_id
            assert a.nodes.live()["a"].address == a.config.advertise
        await etcd_client.close()

    run(scenario())


def test_a_node_that_stops_leaves_at_once(etcd: EtcdCluster) -> None:
    async def scenario() -> None:
        async with nodes(etcd.endpoints, "observer", "a") as (observer, a):
            seen: dict[str, float] = {}
            gone = _on_removal(observer, "a", lambda: seen.update(at=time.monotonic()))
            stopped_at = time.monotonic()
            await a.stop()
            async with asyncio.timeout(TTL_S):  # revoked, not left to expire
                await gone.wait()
            assert not a.membership.lease_valid()
            assert seen["at"] - stopped_at < TTL_S

    run(scenario())
