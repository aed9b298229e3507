"""Server-Sent Events: the replies of a streaming RPC (Subscribe) over HTTP.

Each reply is one event whose data is the reply in JSON, on one line. A plain
subscription's events carry its `next_offset` as their id, so a client that
reconnects with `Last-Event-ID` (as EventSource does by itself) continues where
it was, without loss or duplicates. The response starts with the first reply
(Subscribe sends one at once): a call refused before it gets an ordinary HTTP
error status and JSON body; one that ends later gets a last `error` event with
the same JSON body, then the response ends. While a subscription has nothing to
send, a comment line goes out every `http_keepalive_ms`, so proxies and load
balancers that close idle connections keep it open (EventSource ignores comments).
"""

from __future__ import annotations

import asyncio
import json

import grpc
from aiohttp import web
from google.protobuf import json_format
from google.protobuf.message import Message
from streamlog.v1 import streamlog_pb2 as pb

from service.http.status import error_body

HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    # Proxies that buffer responses (nginx) would hold the events back.
    "X-Accel-Buffering": "no",
}


def resume(request: web.Request, message: Message) -> None:
    """Continue a plain subscription from the Last-Event-ID a reconnecting client sends."""
    last = request.headers.get("Last-Event-ID", "").strip()
    # (At most 18 digits: any larger number is no offset, and would not fit an int64.)
    offset = last.isascii() and last.isdigit() and len(last) <= 18
    if offset and isinstance(message, pb.SubscribeRequest) and not message.group:
        message.start = pb.START_POSITION_OFFSET
        message.offset = int(last)


class EventStream:
    """One SSE response; `send` each reply, `fail` to end with an error event."""

    def __init__(self, request: web.Request, keepalive_ms: int) -> None:
        """`keepalive_ms`: the longest silence before a comment line goes out (0: none)."""
        self._request = request
        self._keepalive_s = keepalive_ms / 1000
        self.response: web.StreamResponse | None = None
        self._written = asyncio.Event()  # set by each event: the keep-alive's clock restarts
        self._writing = asyncio.Lock()  # an event and a keep-alive never interleave
        self._keepalive: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def started(self) -> bool:
        return self.response is not None

    async def send(self, message: Message) -> None:
        data = json_format.MessageToJson(message, preserving_proto_field_name=True, indent=None)
        next_offset = getattr(message, "next_offset", 0)
        head = f"id: {next_offset}\n" if next_offset else ""
        await self._write(f"{head}data: {data}\n\n")

    async def fail(self, code: grpc.StatusCode, message: str) -> None:
        await self._write(f"event: error\ndata: {json.dumps(error_body(code, message))}\n\n")

    async def finish(self) -> web.StreamResponse:
        """The response, ended; started here if the call sent nothing."""
        response = self.response if self.response is not None else await self._start()
        await self.close()
        return response

    async def close(self) -> None:
        """No more keep-alives (the call ended, however it ended)."""
        self._closed = True
        if self._keepalive is not None:
            self._keepalive.cancel()
            await asyncio.wait({self._keepalive})  # its end, not its CancelledError

    async def _start(self) -> web.StreamResponse:
        self.response = response = web.StreamResponse(headers=HEADERS)
        await response.prepare(self._request)
        if self._keepalive_s > 0 and not self._closed:
            self._keepalive = asyncio.create_task(self._keep_alive(response))
        return response

    async def _keep_alive(self, response: web.StreamResponse) -> None:
        while True:
            try:
                await asyncio.wait_for(self._written.wait(), self._keepalive_s)
            except TimeoutError:
                try:
                    async with self._writing:
                        await response.write(b": keep-alive\n\n")
                except ConnectionError:
                    return  # the client went away; the call ends by itself
            self._written.clear()

    async def _write(self, text: str) -> None:
        response = self.response if self.response is not None else await self._start()
        # Waits while the client's TCP window is full: the server's send timeout
        # (subscriber_send_timeout_ms) cuts off a client that stops reading, as on gRPC.
        async with self._writing:
            await response.write(text.encode())
        self._written.set()
