"""bench.publish's bare server: its Subscribe relays what its Publish gets, so the Python
Publish -> Subscribe latency against it is grpc.aio's own floor (no storage in between)."""

from __future__ import annotations

import asyncio

from bench.publish import bare_server, python_publish_latency


def test_the_bare_server_relays_every_published_entry_to_its_subscriber() -> None:
    with bare_server() as (address, _pid):
        got = asyncio.run(python_publish_latency(address, 200, 1.0))
    assert got["received"] == 200
    assert 0 < got["p50_us"] <= got["p99_us"] < 10_000_000
