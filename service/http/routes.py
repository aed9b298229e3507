"""The HTTP API's routes, derived from the service descriptor, and requests built from HTTP.

Every RPC is `POST /v1/{Method}` with its request as a JSON body, in the protobuf
JSON mapping (field names as in the proto, as grpcurl prints them; 64-bit
integers as strings, bytes as base64). Unary RPCs answer their reply as JSON,
server-streaming ones (Subscribe) as Server-Sent Events. An RPC added to the proto
is served with no change here. Consume and Publish, sessions both ways on one call,
have no HTTP form (no client-streaming RPC has): group reads are Read (with `group`)
and Ack, appends Append.

The reads the console makes also have REST-style GET routes (REST_ROUTES, one
line each): path segments and query parameters name request fields
(`GET /v1/streams/orders/entries?offset=10&count=5` is Read with stream
"orders", offset 10, count 5).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from multidict import MultiMapping

_TRUE, _FALSE = frozenset({"true", "1"}), frozenset({"false", "0"})
_BASE64 = re.compile(r"[A-Za-z0-9+/_-]*={0,2}")


@dataclass(frozen=True)
class Route:
    http_method: str
    path: str  # aiohttp form; each {name} is a field of the request
    rpc: str
    streaming: bool = False  # answered as Server-Sent Events

    @property
    def path_fields(self) -> tuple[str, ...]:
        return tuple(part[1:-1] for part in self.path.split("/") if part.startswith("{"))


# GET routes for the reads the console makes. A route naming an RPC the service does not have
# is left out, and answers 404.
REST_ROUTES = (
    Route("GET", "/v1/streams", "ListStreams"),
    Route("GET", "/v1/streams/{stream}", "GetStreamInfo"),
    Route("GET", "/v1/streams/{stream}/entries", "Read"),
    Route("GET", "/v1/streams/{stream}/events", "Subscribe"),
    Route("GET", "/v1/streams/{stream}/seek", "SeekTime"),
    Route("GET", "/v1/streams/{stream}/count", "CountRange"),
    Route("GET", "/v1/streams/{stream}/groups", "ListGroups"),
    Route("GET", "/v1/streams/{stream}/groups/{group}", "GetGroupInfo"),
    Route("GET", "/v1/streams/{stream}/groups/{group}/pending", "GetPending"),
    Route("GET", "/v1/cluster", "DescribeCluster"),
)


def routes(service: Any) -> list[Route]:
    """Every route of the API for a service descriptor."""
    found = [
        Route("POST", f"/v1/{method.name}", method.name, method.server_streaming)
        for method in service.methods
        if not method.client_streaming
    ]
    for route in REST_ROUTES:
        method = service.methods_by_name.get(route.rpc)
        if method is not None and not method.client_streaming:
            found.append(Route(route.http_method, route.path, route.rpc, method.server_streaming))
    return found


class RequestError(ValueError):
    """What the client sent does not make a request; the message says why (INVALID_ARGUMENT)."""


def from_json(request_class: type[Message], body: bytes) -> Message:
    """A request from a JSON body; an empty body is the empty request."""
    message = request_class()
    if not body.strip():
        return message
    try:
        document = json.loads(body)
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than the parser goes
        raise RequestError(f"the body is not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise RequestError(f"the body must be a JSON object (a {request_class.DESCRIPTOR.name})")
    return _parse(document, message)


def from_query(request_class: type[Message], path: dict[str, str], query: MultiMapping[str]) -> Message:
    """A request from a route's path segments and its query parameters (scalar fields only;
    a repeated field takes the parameter repeated)."""
    descriptor = request_class.DESCRIPTOR
    document: dict[str, Any] = dict(path)
    for name in dict.fromkeys(query):
        field = descriptor.fields_by_name.get(name)
        if field is None:
            known = ", ".join(f.name for f in descriptor.fields if f.name not in path)
            raise RequestError(f"unknown query parameter {name!r}; known: {known}")
        if name in path:
            raise RequestError(f"{name}: given in the path; do not repeat it as a query parameter")
        if field.message_type is not None:
            raise RequestError(
                f"{name}: a message field cannot be a query parameter; send the request as a JSON "
                f"body to POST /v1/<Method>"
            )
        values = [_query_value(name, field.type, value) for value in query.getall(name)]
        if field.is_repeated:
            document[name] = values
        elif len(values) > 1:
            raise RequestError(f"{name}: given {len(values)} times; it takes one value")
        else:
            document[name] = values[0]
    return _parse(document, request_class())


def _query_value(name: str, field_type: int, text: str) -> Any:
    if field_type != FieldDescriptor.TYPE_BOOL:
        return text  # the JSON mapping parses numbers and enum names from strings
    lowered = text.lower()
    if lowered in _TRUE or lowered == "":
        return True  # `?reverse` alone means true
    if lowered in _FALSE:
        return False
    raise RequestError(f"{name}: expected true or false, got {text!r}")


def _check_base64(document: Any, descriptor: Any, where: str = "") -> None:
    """Refuse bytes that are not base64: the parser would drop the characters it does not know
    and store what is left (a payload of "%%%" would be appended empty)."""
    if not isinstance(document, dict):
        return
    for key, value in document.items():
        field = descriptor.fields_by_name.get(key) or descriptor.fields_by_camelcase_name.get(key)
        if field is None:
            continue  # the parser names it
        name = f"{where}{field.name}"
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            values = list(value.values()) if isinstance(value, dict) else []
            if value_field.message_type is not None:
                for item in values:
                    _check_base64(item, value_field.message_type, f"{name}.")
            elif value_field.type == FieldDescriptor.TYPE_BYTES:
                _check_values(values, name)
            continue
        values = value if field.is_repeated and isinstance(value, list) else [value]
        if field.message_type is not None:
            for item in values:
                _check_base64(item, field.message_type, f"{name}.")
        elif field.type == FieldDescriptor.TYPE_BYTES:
            _check_values(values, name)


def _check_values(values: list[Any], name: str) -> None:
    for value in values:
        if isinstance(value, str) and not _BASE64.fullmatch(value):
            raise RequestError(f"{name}: not base64 (standard or URL-safe alphabet): {value[:40]!r}")


def _parse(document: dict[str, Any], message: Message) -> Message:
    _check_base64(document, message.DESCRIPTOR)
    try:
        return json_format.ParseDict(document, message)
    except Exception as exc:  # ParseError, and whatever else odd input makes the parser raise
        raise RequestError(str(exc) or type(exc).__name__) from None
