"""A small blocking client for the HTTP API, for tests: JSON calls and Server-Sent Events."""

from __future__ import annotations

import http.client
import json
import ssl
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tests.service.helpers import ServerThread


@dataclass
class Reply:
    status: int
    headers: http.client.HTTPMessage
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body)


class HttpApi:
    """Calls to one server's HTTP port, with an optional bearer token."""

    def __init__(
        self, port: int, token: str | None = None, tls: ssl.SSLContext | None = None, host: str = "127.0.0.1"
    ) -> None:
        self.port, self.token, self.tls, self.host = port, token, tls, host

    @classmethod
    def of(cls, server: ServerThread, **kwargs: Any) -> HttpApi:
        assert server.server.http is not None and server.server.http.port
        return cls(server.server.http.port, **kwargs)

    def _connection(self, timeout_s: float) -> http.client.HTTPConnection:
        if self.tls is not None:
            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout_s, context=self.tls)
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout_s: float = 10,
    ) -> Reply:
        sent = dict(headers or {})
        if self.token is not None:
            sent.setdefault("Authorization", f"Bearer {self.token}")
        connection = self._connection(timeout_s)
        try:
            connection.request(method, path, body=body, headers=sent)
            response = connection.getresponse()
            return Reply(response.status, response.headers, response.read())
        finally:
            connection.close()

    def post(self, rpc: str, body: dict[str, Any] | None = None, **kwargs: Any) -> Reply:
        data = json.dumps(body or {}).encode()
        return self.request(
            "POST",
            f"/v1/{rpc}",
            data,
            {"Content-Type": "application/json", **kwargs.pop("headers", {})},
            **kwargs,
        )

    def get(self, path: str, timeout_s: float = 10, **query: Any) -> Reply:
        return self.request(
            "GET", path + ("?" + urllib.parse.urlencode(query) if query else ""), timeout_s=timeout_s
        )

    def events(
        self, path: str, headers: dict[str, str] | None = None, timeout_s: float = 10, body: str | None = None
    ) -> EventReader:
        """Open a Server-Sent Events response: GET, or POST with a JSON `body`."""
        sent = dict(headers or {})
        if self.token is not None:
            sent.setdefault("Authorization", f"Bearer {self.token}")
        connection = self._connection(timeout_s)
        if body is None:
            connection.request("GET", path, headers=sent)
        else:
            sent["Content-Type"] = "application/json"
            connection.request("POST", path, body=body.encode(), headers=sent)
        return EventReader(connection, connection.getresponse())


def quote(name: str) -> str:
    """A stream or group name as one path segment."""
    return urllib.parse.quote(name, safe="")


class EventReader:
    """The events of an SSE response, one at a time: (event type, id, data as JSON)."""

    def __init__(self, connection: http.client.HTTPConnection, response: http.client.HTTPResponse) -> None:
        self.connection, self.response = connection, response
        self.status = response.status

    def __iter__(self) -> Iterator[tuple[str, str, Any]]:
        event, ident, data = "message", "", []
        for raw in self.response:
            line = raw.decode().rstrip("\n")
            if not line:
                if data:
                    yield event, ident, json.loads("\n".join(data))
                event, ident, data = "message", "", []
            elif line.startswith("data: "):
                data.append(line[6:])
            elif line.startswith("id: "):
                ident = line[4:]
            elif line.startswith("event: "):
                event = line[7:]

    def close(self) -> None:
        self.connection.close()
