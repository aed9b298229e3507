"""The reply budget (service/replybudget.py) and ending open calls (service/opencalls.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from service.config import ConfigError, Settings, validate
from service.errors import ServiceError
from service.replybudget import ReplyBudget
from tests.service.helpers import FakeContext, ServerThread

EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
MIB = 1 << 20


class PeerContext(FakeContext):
    def __init__(self, peer: str) -> None:
        super().__init__()
        self._peer = peer

    def peer(self) -> str:
        return self._peer

    def end(self) -> None:
        """The call ends: grpc.aio runs the done callbacks."""
        for callback in self.done_callbacks:
            callback(self)


def test_reads_reserve_settle_and_give_back_per_connection_and_in_total() -> None:
    async def main() -> None:
        budget = ReplyBudget(total=3 * MIB, per_connection=2 * MIB, wait_ms=0)
        a, b = PeerContext("a"), PeerContext("b")
        first, second = budget.charge(a), budget.charge(a)
        await first.reserve(MIB)
        first.settle(MIB + 10)  # the reply may pass its reservation by one entry
        assert (budget.queued, budget.on_peer("a")) == (MIB + 10, MIB + 10)
        with pytest.raises(ServiceError) as refused:  # past connection a's 2 MiB
            await second.reserve(MIB)
        assert refused.value.code == EXHAUSTED
        assert "max_connection_queued_reply_bytes=2097152" in refused.value.message
        other = budget.charge(b)
        await other.reserve(MIB)
        await budget.charge(PeerContext("c")).reserve(MIB // 2)
        with pytest.raises(ServiceError) as refused:  # past the server's 3 MiB
            await budget.charge(PeerContext("d")).reserve(MIB)
        assert "max_queued_reply_bytes=3145728" in refused.value.message
        assert budget.refused == 2
        first.settle(0)  # a stream's reply was sent
        a.end()
        b.end()
        assert (budget.queued, budget.on_peer("a"), budget.on_peer("b")) == (MIB // 2, 0, 0)

    asyncio.run(main())


def test_a_read_waits_for_room_and_is_served_in_arrival_order() -> None:
    async def main() -> None:
        budget = ReplyBudget(total=2 * MIB, per_connection=2 * MIB, wait_ms=5_000)
        holder = PeerContext("a")
        await budget.charge(holder).reserve(2 * MIB)
        order: list[str] = []

        async def read(name: str, nbytes: int) -> None:
            await budget.charge(PeerContext(name)).reserve(nbytes)
            order.append(name)

        waiting = [asyncio.create_task(read(name, MIB)) for name in ("b", "c", "d")]
        gone = asyncio.create_task(read("e", MIB))
        await asyncio.sleep(0.01)
        gone.cancel()  # a call that went away while waiting takes no room
        assert order == []
        holder.end()
        await asyncio.gather(*waiting[:2])
        assert order == ["b", "c"] and not waiting[2].done()
        assert budget.queued == 2 * MIB
        waiting[2].cancel()

    asyncio.run(main())


def test_the_budget_must_hold_the_largest_read() -> None:
    with pytest.raises(ConfigError, match=r"max_read_bytes .* must not be larger than max_connection_queued"):
        validate(Settings(max_read_bytes=8 * MIB, max_connection_queued_reply_bytes=4 * MIB))
    with pytest.raises(ConfigError, match=r"max_connection_queued_reply_bytes .* max_queued_reply_bytes"):
        validate(Settings(max_queued_reply_bytes=32 * MIB, max_connection_queued_reply_bytes=64 * MIB))


def _wait(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 15
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


async def _open_stalled_call(stub: pb_grpc.StreamLogServiceStub, kind: str) -> Any:
    """A call whose replies the client does not read (a grpc.aio call reads only when asked)."""
    if kind == "subscribe":
        return stub.Subscribe(pb.SubscribeRequest(stream="s"), timeout=60)
    await stub.CreateGroup(pb.CreateGroupRequest(stream="s", group="g"), timeout=10)
    if kind == "group subscribe":
        request = pb.SubscribeRequest(stream="s", group="g", consumer="c", noack=True)
        return stub.Subscribe(request, timeout=60)
    session = stub.Consume(timeout=60)
    await session.write(pb.ConsumeRequest(stream="s", group="g", consumer="c", noack=True, batches=100))
    return session


@pytest.mark.parametrize("kind", ["subscribe", "group subscribe", "consume"])
def test_a_connection_whose_client_stops_reading_waits_then_is_refused_while_others_are_served(
    start_server: Callable[..., ServerThread], kind: str
) -> None:
    server = start_server(
        segment_bytes=16 * MIB,
        max_entry_bytes=MIB,
        max_batch_bytes=2 * MIB,
        max_message_bytes=4 * MIB,
        max_read_bytes=MIB,
        max_connection_queued_reply_bytes=MIB,
        max_queued_reply_bytes=64 * MIB,
        queued_reply_wait_ms=300,
    )
    replies = server.server.servicer.replies

    def queued() -> int:
        return server.call(lambda: replies.queued)

    async def main() -> None:
        options = [("grpc.use_local_subchannel_pool", 1)]
        async with (
            grpc.aio.insecure_channel(server.target, options=options) as slow,
            grpc.aio.insecure_channel(server.target, options=options) as other,
        ):
            stub, other_stub = pb_grpc.StreamLogServiceStub(slow), pb_grpc.StreamLogServiceStub(other)
            for _ in range(16):
                await stub.Append(pb.AppendRequest(stream="s", payloads=[bytes(MIB - 100)]), timeout=10)
            # Replies of 1 MiB that the client does not read (a grpc.aio call reads only when asked):
            # 16 MiB are more than gRPC's flow-control windows let through, so one reply stays
            # unsent, and fills the connection's budget.
            subscription = await _open_stalled_call(stub, kind)
            await asyncio.to_thread(_wait, lambda: queued() > MIB - 100, "no reply built")

            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Read(pb.ReadRequest(stream="s", offset=0), timeout=10)
            assert refused.value.code() == EXHAUSTED
            assert "limit max_connection_queued_reply_bytes=1048576" in refused.value.details()
            assert (await other_stub.Read(pb.ReadRequest(stream="s", offset=0), timeout=10)).entries

            # Room comes back as the client reads: a read waiting for it is then served.
            waiting = asyncio.ensure_future(stub.Read(pb.ReadRequest(stream="s", offset=0), timeout=10))
            await asyncio.to_thread(
                _wait, lambda: server.call(lambda: len(replies._waiting)) == 1, "the read did not wait"
            )
            while not waiting.done():
                assert len((await subscription.read()).entries) <= 1  # a group's first reply may be empty
            assert (await waiting).entries
            subscription.cancel()
        await asyncio.to_thread(_wait, lambda: queued() == 0, "the replies were not given back")

    asyncio.run(main())


def test_an_open_subscription_can_be_ended_with_a_status_from_outside(
    start_server: Callable[..., ServerThread],
) -> None:
    server = start_server()
    calls = server.server.ops.open_calls
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        kept = stub.Subscribe(pb.SubscribeRequest(stream="kept"), timeout=30)
        ended = stub.Subscribe(pb.SubscribeRequest(stream="revoked"), timeout=30)
        next(kept), next(ended)  # both open, waiting for appends

        def end() -> int:
            return calls.end_where(
                lambda call: call.request.stream == "revoked",
                grpc.StatusCode.PERMISSION_DENIED,
                "token revoked",
            )

        assert server.call(end) == 1
        with pytest.raises(grpc.RpcError) as info:
            next(ended)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert info.value.details() == "token revoked"
        _wait(lambda: server.call(lambda: server.server.servicer.subscriptions) == 1, "not ended")
        assert [call.request.stream for call in server.call(lambda: list(calls))] == ["kept"]
        stub.Append(pb.AppendRequest(stream="kept", payloads=[b"still served"]), timeout=10)
        assert [e.payload for e in next(kept).entries] == [b"still served"]
        kept.cancel()
