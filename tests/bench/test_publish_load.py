"""bench/publish_load.js (bench.publish's load from Node.js) against a grpc.aio server that notes
who calls: what its `rate` mode measures is what bench.publish's tables say it is."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from streamlog.v1 import streamlog_pb2 as pb

from bench.publish import SERVICE, bare_handler
from tests.clients.nodejs import NODE, needs_node, npm_install

ROOT = Path(__file__).resolve().parents[2]


async def _load_against(handlers: tuple[grpc.GenericRpcHandler, ...], *args: str) -> dict[str, Any]:
    """bench/publish_load.js `args[0]` ADDRESS `args[1:]` against a grpc.aio server with `handlers`
    (the first that has a method serves it); the load's JSON result."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(handlers)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        assert NODE is not None
        command, *rest = args
        load = await asyncio.create_subprocess_exec(
            NODE,
            "bench/publish_load.js",
            command,
            f"127.0.0.1:{port}",
            *rest,
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(load.communicate(), timeout=120)
        assert load.returncode == 0, err.decode()
        return json.loads(out)
    finally:
        await server.stop(None)


async def _rate_from(callers: int) -> tuple[dict[str, Any], set[str]]:
    """Run `rate ... append CALLERS` for a second; its result and the connections (peers) it used."""
    peers: set[str] = set()

    async def append(request: pb.AppendRequest, context: grpc.aio.ServicerContext) -> pb.AppendResponse:
        peers.add(context.peer())
        return pb.AppendResponse()

    append_handler = grpc.unary_unary_rpc_method_handler(
        append,
        request_deserializer=pb.AppendRequest.FromString,
        response_serializer=pb.AppendResponse.SerializeToString,
    )
    handlers = (grpc.method_handlers_generic_handler(SERVICE, {"Append": append_handler}),)
    return await _load_against(handlers, "rate", "append", str(callers), "1"), peers


async def _most_unanswered(in_flight: int) -> tuple[dict[str, Any], int]:
    """Run `rate ... publish 1 1 IN_FLIGHT` against a Publish that holds its messages unanswered
    until none came for 50 ms, then answers them in order; the load's result and the most
    messages it ever held (what the load sends before it waits)."""
    most = 0

    async def publish(requests: AsyncIterator[pb.PublishRequest], context: Any) -> AsyncIterator[bytes]:
        nonlocal most
        arrived: asyncio.Queue[pb.PublishRequest | None] = asyncio.Queue()  # None: the client is done

        async def take() -> None:
            async for request in requests:
                arrived.put_nowait(request)
            arrived.put_nowait(None)

        taking = asyncio.create_task(take())
        held: list[int] = []
        while True:
            try:
                request = await asyncio.wait_for(arrived.get(), timeout=0.05) if held else await arrived.get()
            except TimeoutError:  # none came for 50 ms: answer what is held
                for request_id in held:
                    yield pb.PublishResponse(request_id=request_id).SerializeToString()
                held.clear()
                continue
            if request is None:
                break
            held.append(request.request_id)
            most = max(most, len(held))
        for request_id in held:
            yield pb.PublishResponse(request_id=request_id).SerializeToString()
        await taking

    # Its first call, an Append (the stream exists before the clock starts), is the bare handler's.
    publish_handler: grpc.RpcMethodHandler = grpc.stream_stream_rpc_method_handler(
        publish, request_deserializer=pb.PublishRequest.FromString
    )
    handlers = (grpc.method_handlers_generic_handler(SERVICE, {"Publish": publish_handler}), bare_handler())
    return await _load_against(handlers, "rate", "publish", "1", "1", str(in_flight)), most


@needs_node
def test_rate_gives_each_caller_a_connection_of_its_own_as_redis_benchmark_does() -> None:
    # grpc-js shares one connection per address between a process's clients unless told not
    # to: 16 callers were then one HTTP/2 connection against redis-benchmark's 16.
    npm_install()
    result, peers = asyncio.run(_rate_from(4))
    assert result["calls"] > 4
    assert len(peers) == 4, peers


@needs_node
def test_rate_keeps_exactly_in_flight_publish_messages_unanswered() -> None:
    # Its window (bench/publish_load.js's Window) is what the rows' "in_flight" says: the load
    # keeps that many messages unanswered, not fewer (nor more: the Publisher's maxInFlight).
    npm_install()
    result, most = asyncio.run(_most_unanswered(8))
    assert result["calls"] > 8
    assert most == 8
