"""The HTTP server: the JSON API, its OpenAPI document, the console's history and its assets.

One aiohttp application on `http_host:http_port`, on the gRPC server's event loop,
over TLS with the gRPC server's certificates when those are set. Every API call is
an RPC run through the gRPC server's own handlers (service/http/calls.py), so the
tokens, access rules, limits, metrics and status codes are those of gRPC. What HTTP
adds is checked here, before any RPC runs:

- a request body is JSON (`Content-Type: application/json`): a web page of another
  origin cannot send that without the browser asking first (CORS), and this server
  allows no other origin, so no page can make a browser act on the API for it;
- on a loopback address, the Host header names the loopback (a public name that
  resolves to 127.0.0.1, DNS rebinding, would otherwise give a web page the API);
- bodies are at most twice max_message_bytes (JSON carries bytes in base64), and the
  request they make at most max_message_bytes, as on gRPC.
"""

from __future__ import annotations

import importlib.metadata
import ipaddress
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web
from google.protobuf import json_format
from google.protobuf.message import Message

from service.auth import Security
from service.config import Settings
from service.http import openapi, sse
from service.http.calls import Dispatcher
from service.http.context import CallAborted, HttpContext
from service.http.history import History
from service.http.routes import RequestError, Route, from_json, from_query, routes
from service.http.status import add_headers, error_response
from storage import Engine

log = logging.getLogger(__name__)

CONSOLE_DIR = Path(__file__).resolve().parents[1] / "console"
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "ip6-localhost"})
# The console loads nothing from elsewhere and runs no inline script.
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def to_json(message: Message) -> str:
    """A reply as grpcurl prints it: field names as in the proto, defaults left out."""
    return json_format.MessageToJson(message, preserving_proto_field_name=True, indent=2)


def _host_name(host: str) -> str:
    """The name in a Host header, without its port: `[::1]:80` -> `::1`, `a:80` -> `a`."""
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host.lower() in _LOOPBACK_NAMES


class HttpGateway:
    """The HTTP API and console of one server: `start`, `attach` the engine, later `stop`."""

    def __init__(self, settings: Settings, dispatcher: Dispatcher, security: Security) -> None:
        self.settings = settings
        self.dispatcher = dispatcher
        self.history = History()
        self.port: int | None = None
        self._ssl = security.tls.ssl_context() if security.tls is not None else None
        self._check_host = _loopback(settings.http_host)
        self._max_request = settings.max_message_bytes
        self._routes = routes(dispatcher.service)
        self._openapi: bytes | None = None
        self._runner: web.AppRunner | None = None

    @property
    def scheme(self) -> str:
        return "https" if self._ssl is not None else "http"

    def _application(self) -> web.Application:
        app = web.Application(client_max_size=2 * self._max_request, middlewares=[self._guard])
        for route in self._routes:
            app.router.add_route(route.http_method, route.path, self._api(route))
        app.router.add_get("/v1/streams/{stream}/history", self._stream_history)
        app.router.add_get("/v1/streams/{stream}/groups/{group}/history", self._group_history)
        app.router.add_get("/openapi.json", self._openapi_document)
        app.router.add_get("/", self._index)
        app.router.add_static("/console/", CONSOLE_DIR)
        return app

    async def start(self) -> None:
        # handler_cancellation: a client that goes away cancels its call (a blocking read, a
        # subscription), as gRPC does.
        self._runner = web.AppRunner(
            self._application(),
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=self.settings.shutdown_grace_ms / 1000,
        )
        await self._runner.setup()
        site = web.TCPSite(
            self._runner, self.settings.http_host, self.settings.http_port, ssl_context=self._ssl
        )
        await site.start()
        self.port = self._runner.addresses[0][1]
        log.info("HTTP API and console on %s://%s:%d/", self.scheme, self.settings.http_host, self.port)

    async def attach(self, engine: Engine) -> None:
        """The engine has recovered: keep the console's history from now on."""
        await self.history.start(engine)

    async def stop(self) -> None:
        """Close the port; calls still running get shutdown_grace_ms to finish."""
        await self.history.stop()
        if self._runner is not None:
            await self._runner.cleanup()

    # -- what every request goes through

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        host = request.headers.get("Host", "")
        if self._check_host and host and not _loopback(_host_name(host)):
            response: web.StreamResponse = error_response(
                grpc.StatusCode.PERMISSION_DENIED,
                f"Host {host!r}: this server listens on the loopback and answers only "
                "requests addressed to it (localhost, 127.0.0.1, [::1])",
            )
        else:
            try:
                response = await handler(request)
            except web.HTTPException as exc:  # no such route, method, body too large: as JSON too
                response = _http_error(exc, self._max_request)
            except Exception:
                log.exception("HTTP %s %s failed unexpectedly", request.method, request.path)
                response = error_response(
                    grpc.StatusCode.INTERNAL, "internal error; the server log has the details"
                )
        if not response.prepared:
            response.headers.update(_HEADERS)
        return response

    # -- the API

    def _api(self, route: Route) -> Handler:
        rpc, streaming = route.rpc, route.streaming
        request_class = self.dispatcher.request_class(rpc)

        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                message = await self._request(request, route, request_class)
            except RequestError as exc:
                return error_response(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            if message.ByteSize() > self._max_request:
                return error_response(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the request is {message.ByteSize()} bytes in protobuf form "
                    f"(limit max_message_bytes={self._max_request})",
                )
            if streaming:
                return await self._stream(request, rpc, message)
            context = HttpContext(request)
            try:
                reply = await self.dispatcher.unary(rpc, message, context)
            except CallAborted as aborted:
                return error_response(aborted.code, aborted.details, aborted.trailing_metadata)
            finally:
                context.done()
            response = web.Response(text=to_json(reply), content_type="application/json")
            add_headers(response, context.trailing_metadata)
            return response

        return handle

    async def _request(self, request: web.Request, route: Route, request_class: type[Message]) -> Message:
        if request.method == "GET":
            return from_query(request_class, dict(request.match_info), request.query)
        body = await request.read()
        if body.strip() and request.content_type != "application/json":
            raise web.HTTPUnsupportedMediaType(
                text=f"Content-Type {request.content_type!r}: send the request as application/json"
            )
        return from_json(request_class, body)

    async def _stream(self, request: web.Request, rpc: str, message: Message) -> web.StreamResponse:
        sse.resume(request, message)
        events = sse.EventStream(request, self.settings.http_keepalive_ms)

        async def send(reply: Any) -> None:
            await events.send(self.dispatcher.as_message(rpc, reply))

        context = HttpContext(request, send)
        try:
            await self.dispatcher.stream(rpc, message, context)
        except CallAborted as aborted:
            if not events.started:
                return error_response(aborted.code, aborted.details, aborted.trailing_metadata)
            await events.fail(aborted.code, aborted.details)
        except ConnectionResetError:
            pass  # the client went away mid-write
        finally:
            context.done()
            await events.close()
        return await events.finish()

    # -- the console's history (not RPCs: allowed to whoever the RPC looking at the same thing allows)

    async def _stream_history(self, request: web.Request) -> web.Response:
        stream = request.match_info["stream"]
        # Authorized as SeekTime, the cheapest RPC that needs read on the stream (GetStreamInfo
        # would measure the stream's files for nothing: the console asks for both per row).
        return await self._history(
            request,
            "SeekTime",
            {"stream": stream},
            lambda: [{"time_ms": t, "appended": n} for t, n in self.history.appended(stream)],
        )

    async def _group_history(self, request: web.Request) -> web.Response:
        stream, group = request.match_info["stream"], request.match_info["group"]
        return await self._history(
            request,
            "GetGroupInfo",
            {"stream": stream, "group": group},
            lambda: [
                {"time_ms": t, "lag": lag, "pending": pending}
                for t, lag, pending in self.history.group(stream, group)
            ],
        )

    async def _history(
        self, request: web.Request, rpc: str, fields: dict[str, str], samples: Callable[[], list[Any]]
    ) -> web.Response:
        try:
            check = from_query(self.dispatcher.request_class(rpc), fields, request.query)
            context = HttpContext(request)
            try:
                await self.dispatcher.unary(rpc, check, context)
            finally:
                context.done()
        except RequestError as exc:
            return error_response(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except CallAborted as aborted:
            return error_response(aborted.code, aborted.details, aborted.trailing_metadata)
        body = {"interval_ms": int(self.history.interval_s * 1000), "samples": samples()}
        return web.json_response(body)

    # -- documents and assets

    async def _openapi_document(self, request: web.Request) -> web.Response:
        if self._openapi is None:
            document = openapi.document(
                self.dispatcher.service,
                self._routes,
                HISTORY_PATHS,
                title="streamlog HTTP API",
                version=importlib.metadata.version("streamlog"),
            )
            self._openapi = json.dumps(document, indent=2).encode()
        return web.Response(body=self._openapi, content_type="application/json")

    async def _index(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(CONSOLE_DIR / "index.html")


def _http_error(exc: web.HTTPException, max_request: int) -> web.Response:
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        code = grpc.StatusCode.RESOURCE_EXHAUSTED
        message = f"request body too large (limit 2 x max_message_bytes={max_request})"
    elif exc.status == 404:
        code, message = grpc.StatusCode.NOT_FOUND, "no such route; the API is described at /openapi.json"
    elif exc.status == 405:
        code, message = grpc.StatusCode.UNIMPLEMENTED, f"method not allowed: {exc.text}"
    else:
        code = grpc.StatusCode.INVALID_ARGUMENT if exc.status < 500 else grpc.StatusCode.INTERNAL
        message = exc.text or exc.reason
    headers = [(k, v) for k, v in exc.headers.items() if k.lower() == "allow"]
    return error_response(code, message, headers, http_status=exc.status)


def _history_path(parameters: list[str], about: str, sample: dict[str, Any]) -> dict[str, Any]:
    return {
        "get": {
            "operationId": f"get{about.title().replace(' ', '')}History",
            "summary": f"{about.capitalize()} history",
            "description": f"The console's {about} over the last minutes, one sample per interval, "
            "oldest first, kept in the server's memory. Allowed to whoever may read the same thing "
            "through the RPCs.",
            "parameters": [
                {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                for name in parameters
            ],
            "responses": {
                "200": {
                    "description": "Samples",
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "properties": {
                                    "interval_ms": {"type": "integer"},
                                    "samples": {
                                        "type": "array",
                                        "items": {"type": "object", "properties": sample},
                                    },
                                },
                            }
                        }
                    },
                },
                "default": {
                    "description": "Error",
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
                },
            },
        }
    }


HISTORY_PATHS = {
    "/v1/streams/{stream}/history": _history_path(
        ["stream"],
        "append rate",
        {"time_ms": {"type": "integer"}, "appended": {"type": "integer"}},
    ),
    "/v1/streams/{stream}/groups/{group}/history": _history_path(
        ["stream", "group"],
        "group lag",
        {
            "time_ms": {"type": "integer"},
            "lag": {"type": ["integer", "null"]},
            "pending": {"type": "integer"},
        },
    ),
}
