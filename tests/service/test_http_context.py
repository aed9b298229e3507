"""The HTTP gateway's stand-in for a gRPC call context: what it keeps of a call's trailing metadata."""

from __future__ import annotations

from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from service.http.context import HttpContext
from service.http.status import add_headers


def test_trailing_metadata_set_on_a_call_becomes_the_replys_headers_without_binary_values() -> None:
    # A call forwarded to a stream's leader relays the leader's trailers (service/forwarding.py);
    # over HTTP they become headers of the reply, and binary ones have no place there.
    context = HttpContext(make_mocked_request("POST", "/v1/Append"))
    context.set_trailing_metadata([("streamlog-leader-id", "b"), ("trace-bin", b"\x00\x01")])
    response = web.Response(text="{}")
    add_headers(response, context.trailing_metadata)
    assert response.headers["streamlog-leader-id"] == "b"
    assert "trace-bin" not in response.headers
