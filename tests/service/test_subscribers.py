"""Many idle subscribers on one stream cost memory, not threads, and each gets every entry once."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from tests.service.helpers import ServerThread

SUBSCRIBERS = 1000
BATCHES = 10
BATCH = 50
TOTAL = BATCHES * BATCH
CHANNELS = 4


def test_a_thousand_subscribers_each_receive_every_entry_in_order_exactly_once(server: ServerThread) -> None:
    threads_before = threading.active_count()

    async def scenario() -> tuple[list[list[int]], int, int]:
        channels = [grpc.aio.insecure_channel(server.target) for _ in range(CHANNELS)]
        try:
            stubs = [pb_grpc.StreamLogServiceStub(c) for c in channels]
            calls = [
                stubs[i % CHANNELS].Subscribe(
                    pb.SubscribeRequest(stream="fanout", start=pb.START_POSITION_LATEST), timeout=120
                )
                for i in range(SUBSCRIBERS)
            ]
            # The first reply of each comes at once and says where it starts: 0.
            firsts = await asyncio.gather(*(call.read() for call in calls))
            assert all(f.next_offset == 0 and not f.entries for f in firsts)
            waiting = server.call(lambda: server.server.servicer.subscriptions)
            threads_idle = threading.active_count()

            async def consume(call: grpc.aio.UnaryStreamCall) -> list[int]:
                offsets: list[int] = []
                while len(offsets) < TOTAL:
                    reply = await call.read()
                    assert reply is not grpc.aio.EOF
                    offsets += [e.offset for e in reply.entries]
                call.cancel()
                return offsets

            consumers = [asyncio.create_task(consume(call)) for call in calls]
            for batch in range(BATCHES):
                entries = [pb.Entry(payload=b"%d" % (batch * BATCH + i)) for i in range(BATCH)]
                await stubs[0].Append(pb.AppendRequest(stream="fanout", entries=entries), timeout=30)
            received = await asyncio.wait_for(asyncio.gather(*consumers), timeout=100)
            return received, waiting, threads_idle
        finally:
            for channel in channels:
                await channel.close()

    started = time.monotonic()
    received, waiting, threads_idle = asyncio.run(scenario())
    elapsed = time.monotonic() - started

    assert waiting == SUBSCRIBERS
    # Idle subscribers hold no threads: the count is what it was before (grpc's own
    # poller threads aside, which do not grow with the number of calls).
    assert threads_idle - threads_before < 10
    assert len(received) == SUBSCRIBERS
    for offsets in received:
        assert offsets == list(range(TOTAL))
    print(f"{SUBSCRIBERS} subscribers x {TOTAL} entries in {elapsed:.1f}s")


def test_a_burst_of_subscribers_opened_at_once_is_let_in_whole(server: ServerThread) -> None:
    """gRPC refuses calls the event loop has not taken yet past 1,000 waiting (CANCELLED, with
    nothing logged) unless told otherwise: subscribers coming back together after a restart
    must all get in. Here 4,000 are opened before any reply is read."""
    burst, channels_n = 4000, 8

    async def scenario() -> list[object]:
        # A subchannel pool of its own each: separate connections, as separate client processes.
        options = [("grpc.use_local_subchannel_pool", 1)]
        channels = [grpc.aio.insecure_channel(server.target, options=options) for _ in range(channels_n)]
        try:
            stubs = [pb_grpc.StreamLogServiceStub(c) for c in channels]
            calls = [
                stubs[i % channels_n].Subscribe(
                    pb.SubscribeRequest(stream="burst", start=pb.START_POSITION_LATEST), timeout=120
                )
                for i in range(burst)
            ]

            async def first(call: grpc.aio.UnaryStreamCall) -> object:
                try:
                    reply = await call.read()
                    return "ok" if reply is not grpc.aio.EOF else await call.code()
                except grpc.aio.AioRpcError as exc:
                    return f"{exc.code()}: {exc.details()}"
                finally:
                    call.cancel()

            return await asyncio.wait_for(asyncio.gather(*(first(call) for call in calls)), timeout=100)
        finally:
            for channel in channels:
                await channel.close()

    outcomes = asyncio.run(scenario())
    refused = [o for o in outcomes if o != "ok"]
    assert refused == [], f"{len(refused)} of {burst} refused: {sorted(set(map(str, refused)))}"
