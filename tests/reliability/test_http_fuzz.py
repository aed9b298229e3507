"""Random and hostile requests to every route of the HTTP API of a real server.

Requests come from the same descriptor-driven generators as the gRPC fuzzing
(test_rpc_fuzz.py), sent as their JSON; beside them, JSON that is not a request
(wrong types, unknown fields, odd nesting) and query strings that are not one. The
only acceptable answers are a reply or a 4xx with a JSON message: never a 5xx,
never a server that stops serving, never a change to a stream no request named.
"""

from __future__ import annotations

import json
import urllib.parse

import pytest
from google.protobuf import json_format
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.common import free_port
from service.http.routes import REST_ROUTES
from tests.reliability.test_rpc_fuzz import CANARY, NAMES, SERVICE, message
from tests.service.helpers import ServerThread, small_settings
from tests.service.http_client import HttpApi, quote

METHODS = [m for m in SERVICE.methods if not m.client_streaming]
GET_ROUTES = [r for r in REST_ROUTES if r.rpc in SERVICE.methods_by_name]
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=3),
    max_leaves=10,
)


@st.composite
def bodies(draw):
    """(method, JSON body text): a generated request, or a document that is not one."""
    method = draw(st.sampled_from(METHODS))
    if draw(st.booleans()):
        request = draw(message(method.input_type))
        body = json_format.MessageToDict(request, preserving_proto_field_name=True)
        return method, json.dumps(body)
    fields = [f.name for f in method.input_type.fields]
    keys = st.sampled_from(fields) | st.text(max_size=12)
    document = draw(st.dictionaries(keys, JSON, max_size=4) | JSON)
    return method, json.dumps(document)


@st.composite
def queries(draw):
    """A GET route with random path segments and query parameters."""
    route = draw(st.sampled_from(GET_ROUTES))
    path = route.path
    for name in route.path_fields:
        path = path.replace("{" + name + "}", quote(draw(NAMES)) or "x")
    request = SERVICE.methods_by_name[route.rpc].input_type
    names = st.sampled_from([f.name for f in request.fields]) | st.text(max_size=8)
    values = st.text(max_size=12) | st.integers(-(2**70), 2**70).map(str) | st.sampled_from(["true", "x", ""])
    pairs = draw(st.lists(st.tuples(names, values), max_size=4))
    return f"{path}?{urllib.parse.urlencode(pairs)}" if pairs else path


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    server = ServerThread(
        small_settings(tmp_path_factory.mktemp("httpfuzz") / "data", max_block_ms=200, http_port=free_port())
    ).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def api(fuzz_server) -> HttpApi:
    return HttpApi.of(fuzz_server)


@pytest.fixture(scope="module", autouse=True)
def canary_written(api: HttpApi):
    api.post("Append", {"stream": CANARY, "payloads": ["b25l", "dHdv"]})
    for name in ("s", "fuzz"):
        api.post("Append", {"stream": name, "payloads": ["eA=="] * 30})
        api.post("CreateGroup", {"stream": name, "group": "g"})
    original = api.get(f"/v1/streams/{CANARY}/entries").body
    yield
    assert api.get(f"/v1/streams/{CANARY}/entries").body == original, (
        "fuzzing changed a stream no request named"
    )


def _answer(api: HttpApi, method, body: str) -> tuple[int, bytes]:
    if method.server_streaming:
        reader = api.events(f"/v1/{method.name}", body=body)
        try:
            return reader.status, b"" if reader.status == 200 else reader.response.read()
        finally:
            reader.close()
    reply = api.request("POST", f"/v1/{method.name}", body.encode(), {"Content-Type": "application/json"})
    return reply.status, reply.body


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bodies())
def test_every_post_route_answers_random_bodies_without_a_5xx(api: HttpApi, case) -> None:
    method, body = case
    status, reply = _answer(api, method, body)
    assert status < 500, f"POST /v1/{method.name} {body} answered {status}: {reply[:300]!r}"
    if status >= 400:
        assert json.loads(reply)["message"]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(queries())
def test_every_get_route_answers_random_queries_without_a_5xx(api: HttpApi, path: str) -> None:
    if "/events" in path:
        reader = api.events(path)
        status = reader.status
        reader.close()
    else:
        reply = api.request("GET", path)
        status = reply.status
        if status >= 400:
            assert json.loads(reply.body)["message"], path
    assert status < 500, f"GET {path} answered {status}"


def test_server_is_unharmed_after_fuzzing(api: HttpApi) -> None:
    assert api.post("Append", {"stream": "after-fuzz", "payloads": ["b2s="]}).status == 200
    assert api.get("/v1/streams/after-fuzz").json["info"]["next_offset"] == "1"
