"""Publish: a producer's session on one bidirectional call, its messages coalesced into engine writes.

A session's messages are appends of their own (each names its stream, may carry a
producer id and sequence, and gets its own answer, in order). Two parts:

- `Coalescer` (one per server) gathers the messages of every open session for a
  stream during one turn of the event loop, and writes them as one
  `Engine.append_many` at the end of the turn: on the loop when the stream's fsync
  policy does not block, else in one thread hop with one sync for all of them. One
  such write per stream is in flight at a time; what arrives meanwhile forms the
  next one (group commit, with the batch growing as syncs get slower).
- `PublishSession` reads a call's messages on a task of its own, checks each and
  hands it to the coalescer, and answers them in order as their writes complete.
  It holds at most max_publish_messages messages and max_publish_bytes bytes
  unanswered: past either it stops reading, and HTTP/2 flow control then holds
  the client's sends back. A bad message (or one a layer refused:
  service/interceptors.py's Refused) is answered with its error; the session goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from streamlog.v1 import streamlog_pb2 as pb

from service import streamwire
from service.callcontext import CallContext
from service.errors import (
    ServiceError,
    status_for,
    translate_errors,
    unavailable,
)
from service.interceptors import Refused
from service.serving import Serving
from service.streamwire import Producer
from storage import AppendBatch, AppendResult, Engine

# What a write gives each message: its result, or the error that refused it.
Outcome = AppendResult | BaseException
_Pending = list[tuple[AppendBatch, Producer, "asyncio.Future[Outcome]"]]


class Coalescer:
    """Messages of all sessions for each stream, written together once per loop turn."""

    def __init__(self, serving: Serving) -> None:
        self._serving = serving
        self._pending: dict[str, _Pending] = {}
        self._writing: set[str] = set()  # streams with a write in a thread now

    def submit(
        self, engine: Engine, stream: str, batch: AppendBatch, producer: Producer
    ) -> asyncio.Future[Outcome]:
        """The outcome of appending `batch`, once the write that takes it completes."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Outcome] = loop.create_future()
        pending = self._pending.get(stream)
        if pending is None:
            pending = self._pending[stream] = []
            if stream not in self._writing:
                loop.call_soon(self._write, engine, stream)  # after the rest of this turn arrives
        pending.append((batch, producer, done))
        return done

    def _write(self, engine: Engine, stream: str) -> None:
        pending = self._pending.pop(stream)
        appends = [(batch, producer) for batch, producer, _ in pending]
        if engine.fsync_policy(stream).blocks:
            self._writing.add(stream)
            asyncio.get_running_loop().create_task(self._write_in_thread(engine, stream, appends, pending))
            return
        try:
            outcomes: list[Any] = engine.append_many(stream, appends)
        except Exception as exc:  # the stream as a whole refused the write (deleted, failed sync)
            outcomes = [exc] * len(pending)
        _settle(pending, outcomes)

    async def _write_in_thread(
        self, engine: Engine, stream: str, appends: list[tuple[AppendBatch, Producer]], pending: _Pending
    ) -> None:
        try:
            outcomes: list[Any] = await self._serving.in_thread(engine.append_many, stream, appends)
        except Exception as exc:
            outcomes = [exc] * len(pending)
        finally:
            self._writing.discard(stream)
            if stream in self._pending:  # arrived while this write ran: the next write
                asyncio.get_running_loop().call_soon(self._write, engine, stream)
        _settle(pending, outcomes)


def _settle(pending: _Pending, outcomes: list[Any]) -> None:
    for (_, _, done), outcome in zip(pending, outcomes, strict=True):
        if not done.done():  # (a session that ended no longer waits)
            done.set_result(outcome)


def _answer(request_id: int, outcome: Outcome) -> pb.PublishResponse:
    if isinstance(outcome, AppendResult):
        return pb.PublishResponse(**streamwire.appended(outcome), request_id=request_id)
    code, message = status_for(outcome)
    return _error(request_id, code.value[0], message)


def _error(request_id: int, code: int, message: str) -> pb.PublishResponse:
    return pb.PublishResponse(request_id=request_id, error=pb.PublishError(code=code, message=message))


class PublishSession:
    """One Publish call: its messages read and handed on, its answers in order, its bounds."""

    def __init__(self, serving: Serving, coalescer: Coalescer) -> None:
        self._serving = serving
        self._coalescer = coalescer
        settings = serving.settings
        self._max_messages = settings.max_publish_messages
        self._max_bytes = settings.max_publish_bytes
        self._max_entries = settings.max_batch_entries
        # Per message in order: (request id, its answer or the write that will give it, its size).
        self._held: deque[tuple[int, pb.PublishResponse | asyncio.Future[Outcome], int]] = deque()
        self._held_bytes = 0
        self._room = asyncio.Event()  # set while the session holds less than its bounds
        self._room.set()
        # Set when the first message held is answerable (its answer made, or its write settled),
        # or the client's side ends; `run` waits for it only while it holds nothing.
        self._news = asyncio.Event()
        self._client_done = False
        self._failure: BaseException | None = None

    async def run(self, requests: AsyncIterator[Any]) -> AsyncGenerator[pb.PublishResponse, None]:
        reader = asyncio.get_running_loop().create_task(self._read(requests))
        try:
            while True:
                if self._held:
                    request_id, answer, size = self._held[0]
                    if not isinstance(answer, pb.PublishResponse):
                        answer = _answer(request_id, await answer)
                    self._held.popleft()
                    self._held_bytes -= size
                    if len(self._held) < self._max_messages and self._held_bytes < self._max_bytes:
                        self._room.set()
                    yield answer
                    continue
                if self._failure is not None:
                    raise self._failure
                if self._client_done:
                    return
                self._news.clear()
                await self._news.wait()
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    def stop(self) -> None:
        """End the session after the answers it owes (the server is shutting down)."""
        if self._failure is None:
            self._failure = unavailable("server is shutting down; reconnect and resend what was not answered")
        self._news.set()

    async def _read(self, requests: AsyncIterator[Any]) -> None:
        try:
            async for request in requests:
                if self._failure is not None:
                    break  # stopped: this message is not taken (the client resends it)
                size = request.ByteSize() if not isinstance(request, Refused) else 0
                answer = self._take(request)
                self._held.append((_request_id(request), answer, size))
                self._held_bytes += size
                if len(self._held) == 1:  # (`run` waits for news only while it holds nothing)
                    self._news_when_answerable(answer)
                if len(self._held) >= self._max_messages or self._held_bytes >= self._max_bytes:
                    self._room.clear()
                    await self._room.wait()
            else:
                self._client_done = True
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # reading failed: it becomes the call's status
            self._failure = exc
        self._news.set()

    def _news_when_answerable(self, answer: pb.PublishResponse | asyncio.Future[Outcome]) -> None:
        if isinstance(answer, pb.PublishResponse):
            self._news.set()
            return
        # Once the write has settled, not now: woken now, `run` would be queued before the write
        # and send this answer ahead of the replies of the subscribers that the write wakes
        # (they are queued as it writes, before it settles its messages).
        answer.add_done_callback(lambda _: self._news.set())

    def _take(self, request: Any) -> pb.PublishResponse | asyncio.Future[Outcome]:
        """Check a message and hand it to the coalescer; its answer now if it is refused."""
        if isinstance(request, Refused):
            return _error(request.request.request_id, request.code.value[0], request.message)
        try:
            engine = self._serving.ready()
            stream, batch, producer = streamwire.checked_append(request, self._max_entries, "message")
        except ServiceError as exc:
            return _error(request.request_id, exc.code.value[0], exc.message)
        return self._coalescer.submit(engine, stream, batch, producer)


def _request_id(item: Any) -> int:
    return item.request.request_id if isinstance(item, Refused) else item.request_id


class PublishCalls:
    """The Publish RPC: a PublishSession per call, sharing the server's Coalescer."""

    def __init__(self, serving: Serving) -> None:
        self._serving = serving
        self._coalescer = Coalescer(serving)
        self._sessions: set[PublishSession] = set()

    def stop_all(self) -> None:
        """Have every open session end after the answers it owes (the server is shutting down)."""
        for session in self._sessions:
            session.stop()

    @translate_errors
    async def Publish(
        self, requests: AsyncIterator[Any], context: CallContext
    ) -> AsyncGenerator[pb.PublishResponse, None]:
        serving = self._serving
        serving.ready()
        session = PublishSession(serving, self._coalescer)
        with serving.subscription():
            self._sessions.add(session)
            try:
                async with contextlib.aclosing(session.run(requests)) as answers:
                    async for answer in answers:
                        yield answer
            finally:
                self._sessions.discard(session)
