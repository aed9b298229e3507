"""The HTTP/JSON API against a real server: RPCs mirrored in the protobuf JSON mapping, statuses
mapped from gRPC's, bad input refused with 4xx and nothing changed, SSE, limits, shutdown."""

from __future__ import annotations

import base64
import json
import threading
import time
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from bench.common import free_port
from service.config import ConfigError, Settings, validate
from service.http.routes import REST_ROUTES, routes
from service.server import SERVICE
from tests.service.helpers import ServerThread
from tests.service.http_client import HttpApi, quote


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture
def http_server(start_server) -> ServerThread:
    return start_server(http_port=free_port())


@pytest.fixture
def api(http_server: ServerThread) -> HttpApi:
    return HttpApi.of(http_server)


@pytest.fixture
def grpc_stub(http_server: ServerThread):
    with grpc.insecure_channel(http_server.target) as channel:
        yield pb_grpc.StreamLogServiceStub(channel)


def test_every_rpc_but_the_session_has_a_post_route_and_rest_routes_name_real_rpcs() -> None:
    found = {(r.http_method, r.path): r for r in routes(SERVICE)}
    for method in SERVICE.methods:
        assert (("POST", f"/v1/{method.name}") in found) == (not method.client_streaming), method.name
    assert found[("POST", "/v1/Subscribe")].streaming and not found[("POST", "/v1/Read")].streaming
    # REST routes for RPCs the service lacks are left out.
    for route in REST_ROUTES:
        assert ((route.http_method, route.path) in found) == (route.rpc in SERVICE.methods_by_name)


def test_append_and_read_are_grpcurl_json_and_agree_with_grpc(api: HttpApi, grpc_stub) -> None:
    entry = {"payload": b64(b"hello"), "tag": "t1", "headers": {"k": b64(b"v")}}
    reply = api.post("Append", {"stream": "orders", "entries": [entry, {"payload": b64(b"two")}]})
    assert reply.status == 200
    assert reply.json["last_offset"] == "1" and "first_offset" not in reply.json  # 0: left out, as grpcurl
    read = api.get("/v1/streams/orders/entries", offset=0, count=10)
    assert read.status == 200 and read.headers["Content-Type"].startswith("application/json")
    by_grpc = grpc_stub.Read(pb.ReadRequest(stream="orders", offset=0, count=10))
    assert read.json == json_format.MessageToDict(by_grpc, preserving_proto_field_name=True)
    assert read.json["entries"][0]["headers"] == {"k": b64(b"v")}
    # The same RPC by its POST route, with a body; JSON names are accepted too.
    posted = api.post("Read", {"stream": "orders", "offset": "1", "count": 1})
    assert [e["payload"] for e in posted.json["entries"]] == [b64(b"two")]
    assert api.post("Read", {"stream": "orders", "offset": 1, "maxBytes": "100"}).status == 200


def test_append_many_is_served_by_its_post_route_with_per_batch_results(api: HttpApi, grpc_stub) -> None:
    # Mapped from the proto like every RPC: no route of its own.
    batches = [
        {"stream": "m1", "payloads": [b64(b"a"), b64(b"b")]},
        {"stream": "", "payloads": [b64(b"x")]},  # a bad batch: its own error, the others written
        {"stream": "m2", "entries": [{"payload": b64(b"c"), "tag": "t"}]},
    ]
    reply = api.post("AppendMany", {"batches": batches})
    assert reply.status == 200
    first, bad, last = reply.json["results"]
    assert (first.get("first_offset", "0"), first["last_offset"]) == ("0", "1")
    assert bad["error"]["code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "stream" in bad["error"]["message"]
    assert "error" not in last and "timestamp_ms" in last
    read = grpc_stub.Read(pb.ReadRequest(stream="m2", offset=0, count=10))
    assert [(e.payload, e.tag) for e in read.entries] == [(b"c", "t")]
    empty = api.post("AppendMany", {"batches": []})
    assert empty.status == 400 and "at least one batch" in empty.json["message"]


def test_rest_routes_take_path_segments_and_query_parameters(api: HttpApi, grpc_stub) -> None:
    name = "a/b é"  # any stream name, as one encoded path segment
    grpc_stub.Append(pb.AppendRequest(stream=name, payloads=[b"x"] * 5))
    grpc_stub.CreateGroup(pb.CreateGroupRequest(stream=name, group="g/1"))
    grpc_stub.Read(pb.ReadRequest(stream=name, group="g/1", consumer="c", count=3))
    info = api.get(f"/v1/streams/{quote(name)}").json["info"]
    assert (info["name"], info["next_offset"]) == (name, "5")
    reverse = api.get(f"/v1/streams/{quote(name)}/entries", offset=10, count=2, reverse="true").json
    assert [e.get("offset", "0") for e in reverse["entries"]] == ["4", "3"]
    group = api.get(f"/v1/streams/{quote(name)}/groups/{quote('g/1')}").json["group"]
    assert (group["pending"], group["lag"]) == ("3", "2")
    pending = api.get(
        f"/v1/streams/{quote(name)}/groups/{quote('g/1')}/pending", start_offset=1, count=1
    ).json
    assert pending["count"] == "3" and [e["offset"] for e in pending["entries"]] == ["1"]
    assert api.get(f"/v1/streams/{quote(name)}/count", start_offset=1).json["count"] == "4"
    assert api.get(f"/v1/streams/{quote(name)}/seek", timestamp_ms=0).json == {}  # offset 0
    assert [g["name"] for g in api.get(f"/v1/streams/{quote(name)}/groups").json["groups"]] == ["g/1"]
    assert api.get("/v1/streams", prefix="a/").json["streams"] == [name]


def test_errors_have_the_mapped_status_and_a_json_body_with_code_and_message(api: HttpApi) -> None:
    missing = api.get("/v1/streams/nope")
    assert missing.status == 404
    assert missing.json == {"code": 5, "status": "NOT_FOUND", "message": "stream 'nope' does not exist"}
    api.post("Append", {"stream": "s", "payloads": [b64(b"a")]})
    exists = api.post("CreateGroup", {"stream": "s", "group": "g"})
    assert exists.status == 200
    again = api.post("CreateGroup", {"stream": "s", "group": "g"})
    assert (again.status, again.json["status"]) == (409, "ALREADY_EXISTS")
    past = api.post("SetGroupOffset", {"stream": "s", "group": "g", "offset": "99"})
    assert (past.status, past.json["status"]) == (400, "OUT_OF_RANGE")
    # A failed conditional append: FAILED_PRECONDITION, and the trailer as a header.
    stale = api.post("Append", {"stream": "s", "payloads": [b64(b"b")], "expected_next_offset": "0"})
    assert (stale.status, stale.json["status"], stale.headers["streamlog-next-offset"]) == (
        400,
        "FAILED_PRECONDITION",
        "1",
    )


@pytest.mark.parametrize(
    ("body", "content_type", "status", "needle"),
    [
        (b"{not json", "application/json", 400, "not JSON"),
        (b"[1, 2]", "application/json", 400, "must be a JSON object"),
        (b'{"stream": "s", "bogus": 1}', "application/json", 400, "bogus"),
        (b'{"stream": 7}', "application/json", 400, "stream"),
        (b'{"stream": "s", "payloads": ["%%%"]}', "application/json", 400, "payloads"),
        (
            b'{"stream": "s", "payloads": [], "producer_sequence": "1e99"}',
            "application/json",
            400,
            "producer",
        ),
        (b"[" * 100_000, "application/json", 400, "not JSON"),
        (b'{"stream": "s", "payloads": ["YQ=="]}', "text/plain", 415, "application/json"),
        (b'{"stream": "s", "payloads": ["YQ=="], "entries": [{}]}', "application/json", 400, "not both"),
        (b'{"stream": "", "payloads": ["YQ=="]}', "application/json", 400, "stream"),
    ],
)
def test_bad_bodies_get_4xx_with_a_message_and_change_nothing(
    api: HttpApi, body: bytes, content_type: str, status: int, needle: str
) -> None:
    api.post("Append", {"stream": "s", "payloads": [b64(b"kept")]})
    reply = api.request("POST", "/v1/Append", body, {"Content-Type": content_type})
    assert reply.status == status, reply.body
    assert needle in reply.json["message"] and reply.json["code"] == 3
    assert api.get("/v1/streams/s").json["info"]["next_offset"] == "1"
    assert api.get("/v1/streams").json["streams"] == ["s"]


@pytest.mark.parametrize(
    ("path", "status", "needle"),
    [
        ("/v1/streams/s/entries?bogus=1", 400, "unknown query parameter 'bogus'"),
        ("/v1/streams/s/entries?offset=abc", 400, "offset"),
        ("/v1/streams/s/entries?offset=1&offset=2", 400, "given 2 times"),
        ("/v1/streams/s/entries?reverse=maybe", 400, "true or false"),
        ("/v1/streams/s/entries?stream=t", 400, "given in the path"),
        ("/v1/streams/s/entries?offset=-1", 400, "offset"),
        ("/v1/streams/s/entries?block_ms=999999999", 400, "block_ms"),
        ("/v1/streams/s/entries?offset=99999999999999999999999", 400, "offset"),
        ("/v1/streams/s/events?start=START_POSITION_NOWHERE", 400, "start"),
        ("/v1/streams/s/groups/g/pending?ack_offsets=1", 400, "unknown query parameter"),
        ("/v1/nothing/here", 404, "no such route"),
    ],
)
def test_bad_queries_get_4xx_with_a_message(api: HttpApi, path: str, status: int, needle: str) -> None:
    api.post("Append", {"stream": "s", "payloads": [b64(b"kept")]})
    reply = api.request("GET", path)
    assert reply.status == status, reply.body
    assert needle in reply.json["message"], reply.json


def test_wrong_method_is_405_with_allow(api: HttpApi) -> None:
    reply = api.request("DELETE", "/v1/Append")
    assert reply.status == 405 and reply.headers["Allow"] == "POST"
    assert reply.json["status"] == "UNIMPLEMENTED"


def test_the_same_limits_as_grpc(start_server) -> None:
    server = start_server(http_port=free_port(), max_streams=2)
    api = HttpApi.of(server)
    limit = server.settings.max_message_bytes
    # A body past twice max_message_bytes is not read; a request past max_message_bytes is refused.
    huge = api.request("POST", "/v1/Append", b" " * (2 * limit + 1), {"Content-Type": "application/json"})
    assert (huge.status, huge.json["status"]) == (413, "RESOURCE_EXHAUSTED")
    big = api.post("Append", {"stream": "s", "payloads": [b64(b"x" * 1000)] * (limit // 1000 + 1)})
    assert (big.status, big.json["status"]) == (429, "RESOURCE_EXHAUSTED")
    assert "max_message_bytes" in big.json["message"]
    # The limits interceptor's cross-call limits and the servicer's own.
    for name in ("a", "b"):
        assert api.post("Append", {"stream": name, "payloads": [b64(b"x")]}).status == 200
    third = api.post("Append", {"stream": "c", "payloads": [b64(b"x")]})
    assert (third.status, third.json["status"]) == (429, "RESOURCE_EXHAUSTED")
    assert "max_streams=2" in third.json["message"]
    batch = api.post("Append", {"stream": "a", "payloads": [b64(b"x")] * 101})
    assert batch.status == 429 and "max_batch_entries" in batch.json["message"]
    assert api.get("/v1/streams").json["streams"] == ["a", "b"]


def test_a_blocking_read_waits_for_an_append(api: HttpApi) -> None:
    api.post("Append", {"stream": "s", "payloads": [b64(b"0")]})
    timer = threading.Timer(0.3, lambda: api.post("Append", {"stream": "s", "payloads": [b64(b"1")]}))
    started = time.monotonic()
    timer.start()
    try:
        reply = api.get("/v1/streams/s/entries", offset=1, block_ms=5000)
    finally:
        timer.join()
    assert [e["payload"] for e in reply.json["entries"]] == [b64(b"1")]
    assert time.monotonic() - started < 4


def test_subscribe_is_server_sent_events_that_resume_from_last_event_id(api: HttpApi) -> None:
    api.post("Append", {"stream": "s", "payloads": [b64(b"0"), b64(b"1")]})
    events = api.events("/v1/streams/s/events?start=START_POSITION_OLDEST")
    try:
        assert events.status == 200
        assert events.response.headers["Content-Type"] == "text/event-stream"
        stream = iter(events)
        kind, ident, first = next(stream)
        assert (kind, ident, len(first["entries"]), first["next_offset"]) == ("message", "2", 2, "2")
        api.post("Append", {"stream": "s", "payloads": [b64(b"2")]})
        kind, ident, second = next(stream)
        assert (ident, second["entries"][0]["offset"]) == ("3", "2")
    finally:
        events.close()
    # A client reconnecting with Last-Event-ID continues there, without duplicates.
    resumed = api.events("/v1/streams/s/events", headers={"Last-Event-ID": "2"})
    try:
        _, ident, batch = next(iter(resumed))
        assert (ident, [e["offset"] for e in batch["entries"]]) == ("3", ["2"])
    finally:
        resumed.close()


def test_a_subscription_ends_with_an_error_event(api: HttpApi) -> None:
    api.post("Append", {"stream": "s", "payloads": [b64(b"0")]})
    events = api.events("/v1/streams/s/events?start=START_POSITION_LATEST")
    try:
        stream = iter(events)
        assert next(stream)[0] == "message"
        assert api.post("DeleteStream", {"stream": "s"}).status == 200
        kind, _, body = next(stream)
        assert (kind, body["status"]) == ("error", "NOT_FOUND")
    finally:
        events.close()
    # Refused before its first event: an ordinary status and JSON body.
    refused = api.request("GET", "/v1/streams/s/events?count=-1")
    assert (refused.status, refused.json["status"]) == (400, "INVALID_ARGUMENT")


def test_shutdown_ends_open_subscriptions_with_unavailable(start_server) -> None:
    server = start_server(http_port=free_port())
    api = HttpApi.of(server)
    api.post("Append", {"stream": "s", "payloads": [b64(b"0")]})
    events = api.events("/v1/streams/s/events")
    try:
        stream = iter(events)
        next(stream)
        stopper = threading.Thread(target=server.stop)
        stopper.start()
        kind, _, body = next(stream)
        stopper.join(timeout=30)
        assert (kind, body["status"]) == ("error", "UNAVAILABLE")
    finally:
        events.close()


def test_only_loopback_host_names_are_answered_on_a_loopback_port(api: HttpApi) -> None:
    assert api.request("GET", "/v1/streams", headers={"Host": "localhost:1"}).status == 200
    assert api.request("GET", "/v1/streams", headers={"Host": "[::1]:1"}).status == 200
    rebound = api.request("GET", "/v1/streams", headers={"Host": "attacker.example:80"})
    assert rebound.status == 403 and "loopback" in rebound.json["message"]


def test_http_calls_are_counted_in_the_metrics_like_grpc_ones(start_server) -> None:
    server = start_server(http_port=free_port(), metrics_port=free_port())
    api = HttpApi.of(server)
    api.post("Append", {"stream": "s", "payloads": [b64(b"x")]})
    api.get("/v1/streams/nope")
    metrics = server.server.ops.metrics  # type: ignore[union-attr]
    registry = metrics.registry
    ok = registry.get_sample_value("streamlog_rpc_duration_seconds_count", {"method": "Append", "code": "OK"})
    missing = registry.get_sample_value(
        "streamlog_rpc_duration_seconds_count", {"method": "GetStreamInfo", "code": "NOT_FOUND"}
    )
    assert (ok, missing) == (1.0, 1.0)


def test_history_counts_appends_and_group_lag(http_server: ServerThread, api: HttpApi) -> None:
    history = http_server.server.http.history  # type: ignore[union-attr]
    api.post("Append", {"stream": "s", "payloads": [b64(b"x")] * 7})
    api.post("CreateGroup", {"stream": "s", "group": "g", "start": "START_POSITION_OLDEST"})
    http_server.call(history.sample)
    api.post("Append", {"stream": "s", "payloads": [b64(b"x")] * 3})
    api.post("Read", {"stream": "s", "group": "g", "consumer": "c", "count": 4})
    http_server.call(history.sample)
    rates = api.get("/v1/streams/s/history").json
    assert rates["interval_ms"] == 5000
    assert [s["appended"] for s in rates["samples"]] == [7, 3]
    lag = api.get("/v1/streams/s/groups/g/history").json["samples"]
    assert [(s["lag"], s["pending"]) for s in lag] == [(7, 0), (6, 4)]
    assert api.get("/v1/streams/nope/history").status == 404
    assert api.get("/v1/streams/s/groups/nope/history").status == 404


def test_openapi_describes_every_route_from_the_proto(api: HttpApi) -> None:
    document = api.get("/openapi.json").json
    assert document["openapi"] == "3.1.0"
    for route in routes(SERVICE):
        assert route.http_method.lower() in document["paths"][route.path], route.path
    append = document["paths"]["/v1/Append"]["post"]
    assert append["description"].startswith("Append adds a batch of entries to the end of a stream")
    read = document["paths"]["/v1/streams/{stream}/entries"]["get"]
    names = {p["name"]: p["in"] for p in read["parameters"]}
    assert names["stream"] == "path" and names["block_ms"] == "query" and "ack_ranges" not in names
    schemas = document["components"]["schemas"]
    entry = schemas["Entry"]["properties"]
    assert entry["offset"]["format"] == "int64" and entry["payload"]["format"] == "byte"
    assert "Position of the entry in its stream" in entry["offset"]["description"]
    assert schemas["Gap"]["properties"]["reason"]["description"]
    # Every reference resolves.
    text = json.dumps(document)
    for ref in {part.split('"')[0] for part in text.split('"$ref": "#/components/schemas/')[1:]}:
        assert ref in schemas, ref


def test_the_console_page_and_its_assets_are_served_with_a_strict_policy(api: HttpApi) -> None:
    page = api.get("/")
    assert page.status == 200 and b"<html" in page.body
    assert "default-src 'self'" in page.headers["Content-Security-Policy"]
    assert api.get("/console/../server.py").status == 404


def test_http_settings_are_checked() -> None:
    assert Settings().http_port == 0 and Settings().http_host == "127.0.0.1"
    with pytest.raises(ConfigError, match=r"http_port .* must differ from port"):
        validate(Settings(http_port=7070))
    with pytest.raises(ConfigError, match=r"http_port .* must differ from metrics_port"):
        validate(Settings(http_port=9000, metrics_port=9000))
    with pytest.raises(ConfigError, match="http_host: must not be empty"):
        validate(Settings(http_host=" "))


def test_a_port_in_use_stops_start_up(start_server, tmp_path: Path) -> None:
    first = start_server(http_port=free_port())
    with pytest.raises(OSError):
        start_server(data_dir=tmp_path / "other", http_port=first.server.http.port)  # type: ignore[union-attr]


def test_reads_over_http_give_back_their_reply_budget(http_server: ServerThread, api: HttpApi) -> None:
    api.post("Append", {"stream": "s", "payloads": [b64(b"x" * 100)] * 50})
    for _ in range(3):
        assert len(api.get("/v1/streams/s/entries", count=50).json["entries"]) == 50
    refused = api.get("/v1/streams/nope/entries")
    assert refused.status == 404
    events = api.events("/v1/streams/s/events?start=START_POSITION_OLDEST")
    next(iter(events))
    events.close()
    budget = http_server.server.servicer.replies
    wait_for(lambda: http_server.call(lambda: budget.queued) == 0)


def wait_for(condition, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_a_quiet_subscription_gets_keep_alive_comments_and_then_its_next_event(start_server) -> None:
    # Proxies close idle connections; a tail with nothing to send writes a comment line every
    # http_keepalive_ms, which SSE parsers ignore.
    api = HttpApi.of(start_server(http_port=free_port(), http_keepalive_ms=200))
    api.post("Append", {"stream": "s", "payloads": [b64(b"0")]})
    events = api.events("/v1/streams/s/events?start=START_POSITION_OLDEST")
    try:
        first = [events.response.readline() for _ in range(3)]  # id, data, blank
        assert first[0].startswith(b"id: 1") and first[2] == b"\n"
        started = time.monotonic()
        assert events.response.readline() == b": keep-alive\n"
        assert time.monotonic() - started >= 0.15  # after a silence, not at once
        assert events.response.readline() == b"\n"
        api.post("Append", {"stream": "s", "payloads": [b64(b"1")]})
        kind, ident, body = next(iter(events))
        assert (kind, ident, [e["offset"] for e in body["entries"]]) == ("message", "2", ["1"])
    finally:
        events.close()
    assert Settings().http_keepalive_ms == 15_000
