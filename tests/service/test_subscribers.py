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
