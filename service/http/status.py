"""gRPC status codes as HTTP statuses, and the JSON body of an error.

The mapping is Google's (google/rpc/code.proto, as grpc-gateway and Google's
HTTP APIs use it), so a client that knows one knows this one. The body is a
google.rpc.Status in its JSON form, with the code's name beside its number:
`{"code": 3, "status": "INVALID_ARGUMENT", "message": "..."}`. Trailing metadata
a refusal carries (a failed conditional append's `streamlog-next-offset`) becomes
response headers of the same names.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import grpc
from aiohttp import web

HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DATA_LOSS: 500,
}


def error_body(code: grpc.StatusCode, message: str) -> dict[str, object]:
    return {"code": code.value[0], "status": code.name, "message": message}


def error_response(
    code: grpc.StatusCode,
    message: str,
    headers: Iterable[tuple[str, str | bytes]] = (),
    http_status: int | None = None,
) -> web.Response:
    """An error answer; `http_status` overrides the mapped one where HTTP has a more precise
    status for the same cause (405, 413, 415)."""
    response = web.Response(
        status=http_status or HTTP_STATUS[code],
        text=json.dumps(error_body(code, message)),
        content_type="application/json",
    )
    if code == grpc.StatusCode.UNAUTHENTICATED:
        response.headers["WWW-Authenticate"] = 'Bearer realm="streamlog"'
    add_headers(response, headers)
    return response


def add_headers(response: web.StreamResponse, metadata: Iterable[tuple[str, str | bytes]]) -> None:
    """A call's trailing metadata as headers; binary (-bin) values have no place in HTTP headers."""
    for key, value in metadata:
        if isinstance(value, str):
            response.headers[key] = value
