"""The send timeout of open streaming calls (service/limits.py's SendTimeout): one timer per call,
however many replies it sends, and a stalled send still cut off once it has waited the timeout."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from service.limits import SendTimeout
from service.opencalls import OpenCall


class _Context:
    """What SendTimeout and OpenCall use of a call's context; `stall` holds the next write."""

    def __init__(self) -> None:
        self.written: list[Any] = []
        self.stall: asyncio.Event | None = None
        self.code: grpc.StatusCode | None = None

    async def write(self, reply: Any) -> None:
        if self.stall is not None:
            await self.stall.wait()
        self.written.append(reply)

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"


class _Request:
    stream = "s"


def test_the_replies_of_a_call_share_one_timer() -> None:
    async def main() -> int:
        loop = asyncio.get_running_loop()
        timers = 0
        call_at = loop.call_at

        def counted(*args: Any, **kwargs: Any) -> asyncio.TimerHandle:
            nonlocal timers
            timers += 1
            return call_at(*args, **kwargs)

        context = _Context()
        call = OpenCall("Subscribe", _Request(), context)  # type: ignore[arg-type]
        sender = SendTimeout(30_000)
        loop.call_at = counted  # type: ignore[method-assign]
        try:
            for i in range(200):
                await sender.send(call, i)
        finally:
            del loop.call_at
        assert context.written == list(range(200))
        return timers

    assert asyncio.run(main()) == 1  # (an asyncio.timeout per send armed 200)


def test_a_send_that_stalls_after_the_timer_fired_between_sends_is_cut_off() -> None:
    async def main() -> tuple[tuple[grpc.StatusCode, str] | None, int, list[Any]]:
        context = _Context()
        sender = SendTimeout(100)
        ended: list[OpenCall] = []

        async def serve() -> None:
            call = OpenCall("Subscribe", _Request(), context)  # type: ignore[arg-type]
            ended.append(call)
            with call.interruptible():
                await sender.send(call, "first")  # arms the timer
                await asyncio.sleep(0.06)  # the timer fires after this send ended: nothing to cut
                context.stall = asyncio.Event()  # never set: the client stopped reading
                await sender.send(call, "second")
                raise AssertionError("the stalled send returned")

        await asyncio.wait_for(serve(), timeout=30)
        return ended[0].ending, sender.cut_off, context.written

    ending, cut_off, written = asyncio.run(main())
    assert ending is not None and ending[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "subscriber_send_timeout_ms=100" in ending[1]
    assert cut_off == 1
    assert written == ["first"]
