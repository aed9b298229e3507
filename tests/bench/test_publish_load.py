"""bench/publish_load.js (bench.publish's load from Node.js) against a grpc.aio server that notes
who calls: what its `rate` mode measures is what bench.publish's tables say it is."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import grpc
from streamlog.v1 import streamlog_pb2 as pb

from bench.publish import SERVICE
from tests.clients.nodejs import NODE, needs_node, npm_install

ROOT = Path(__file__).resolve().parents[2]


async def _rate_from(callers: int) -> tuple[dict[str, Any], set[str]]:
    """Run `rate ... append CALLERS` for a second; its result and the connections (peers) it used."""
    peers: set[str] = set()

    async def append(request: pb.AppendRequest, context: grpc.aio.ServicerContext) -> pb.AppendResponse:
        peers.add(context.peer())
        return pb.AppendResponse()

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                SERVICE,
                {
                    "Append": grpc.unary_unary_rpc_method_handler(
                        append,
                        request_deserializer=pb.AppendRequest.FromString,
                        response_serializer=pb.AppendResponse.SerializeToString,
                    )
                },
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        assert NODE is not None
        load = await asyncio.create_subprocess_exec(
            NODE,
            "bench/publish_load.js",
            "rate",
            f"127.0.0.1:{port}",
            "append",
            str(callers),
            "1",
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await asyncio.wait_for(load.communicate(), timeout=120)
        assert load.returncode == 0
        return json.loads(out), peers
    finally:
        await server.stop(None)


@needs_node
def test_rate_gives_each_caller_a_connection_of_its_own_as_redis_benchmark_does() -> None:
    # grpc-js shares one connection per address between a process's clients unless told not
    # to: 16 callers were then one HTTP/2 connection against redis-benchmark's 16.
    npm_install()
    result, peers = asyncio.run(_rate_from(4))
    assert result["calls"] > 4
    assert len(peers) == 4, peers
