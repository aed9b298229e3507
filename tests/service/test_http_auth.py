"""The HTTP API under the gRPC server's tokens, access rules and TLS: the same decisions, as
401 and 403, for every RPC it serves; ListStreams filtered; certificates from the same files."""

from __future__ import annotations

import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format

from bench.common import free_port
from service import auth
from service.server import SERVICE
from storage import AppendBatch
from tests.service.helpers import ServerThread
from tests.service.http_client import HttpApi
from tests.service.test_auth import (
    ACL_TOML,
    ALLOWED,
    EXPECTED_CLASS,
    TOKENS,
    TOKENS_TOML,
    pki,  # noqa: F401 (a fixture)
    request_for,
    tls_files,
    write,
)

DENIED = (401, 403)
PERMISSION_DENIED = 7


@pytest.fixture
def auth_server(start_server: Callable[..., ServerThread], tmp_path: Path) -> ServerThread:
    server = start_server(
        http_port=free_port(),
        tokens_file=write(tmp_path / "tokens.toml", TOKENS_TOML),
        acl_file=write(tmp_path / "acl.toml", ACL_TOML),
    )
    server.server.engine.append("s1", AppendBatch([b"a", b"b"]))
    server.server.engine.append("t1", AppendBatch([b"hidden"]))
    return server


def status_of(api: HttpApi, method: Any) -> int:
    body = json_format.MessageToDict(request_for(method), preserving_proto_field_name=True)
    if method.name == "AppendMany":
        # A batch refused is answered in its result, the call with 200: its code, as HTTP's.
        reply = api.post(method.name, body)
        errors = [r["error"]["code"] for r in reply.json.get("results", []) if "error" in r]
        return {PERMISSION_DENIED: 403}.get(errors[0], 500) if errors else reply.status
    if not method.server_streaming:
        return api.post(method.name, body).status
    # Subscribe: the status line comes with the first event, or with the refusal.
    reader = api.events(f"/v1/streams/{body['stream']}/events")
    try:
        return reader.status
    finally:
        reader.close()


def test_the_allow_deny_matrix_over_http(auth_server: ServerThread) -> None:
    methods = [m for m in SERVICE.methods if m.name not in auth.CATALOG_METHODS and not m.client_streaming]
    mismatches = []
    for method in methods:
        allowed = ALLOWED[EXPECTED_CLASS[method.name]]
        for principal, token in TOKENS.items():
            status = status_of(HttpApi.of(auth_server, token=token), method)
            if (principal in allowed) == (status in DENIED):
                mismatches.append((method.name, principal, status))
            if principal not in allowed and status != 403:
                mismatches.append((method.name, principal, status, "expected 403"))
        for token in (None, "not-a-known-token"):
            status = status_of(HttpApi.of(auth_server, token=token), method)
            if status != 401:
                mismatches.append((method.name, token, status, "expected 401"))
    assert mismatches == []


def test_refusals_say_why_and_ask_for_a_bearer_token(auth_server: ServerThread) -> None:
    anonymous = HttpApi.of(auth_server).get("/v1/streams/s1")
    assert (anonymous.status, anonymous.json["status"]) == (401, "UNAUTHENTICATED")
    assert anonymous.headers["WWW-Authenticate"].startswith("Bearer")
    assert "credentials" in anonymous.json["message"]
    reader = HttpApi.of(auth_server, token=TOKENS["reader"])
    append = reader.post("Append", {"stream": "s1", "payloads": ["eA=="]})
    assert (append.status, append.json["status"]) == (403, "PERMISSION_DENIED")
    assert "'reader' may not Append on stream 's1'" in append.json["message"]
    # Two authorization headers are refused, as two metadata values are on gRPC.
    doubled = reader.request(
        "GET", "/v1/streams/s1", headers={"authorization": f"Bearer {TOKENS['reader']}", "Authorization": "x"}
    )
    assert doubled.status == 401 and "more than one" in doubled.json["message"]
    # The console's history: allowed to whoever may read the same thing.
    assert reader.get("/v1/streams/s1/history").status == 200
    assert reader.get("/v1/streams/t1/history").status == 403
    assert HttpApi.of(auth_server, token=TOKENS["worker"]).get("/v1/streams/s1/history").status == 403


def test_list_streams_shows_only_what_the_token_may_touch(auth_server: ServerThread) -> None:
    assert HttpApi.of(auth_server, token=TOKENS["reader"]).get("/v1/streams").json["streams"] == ["s1"]
    assert HttpApi.of(auth_server, token=TOKENS["admin"]).get("/v1/streams").json["streams"] == ["s1", "t1"]
    assert HttpApi.of(auth_server, token=TOKENS["stranger"]).get("/v1/streams").json == {}


def _client_tls(certs: dict[str, Any], directory: Path | None = None, client: Any = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cadata=certs["ca"].cert_pem.decode())
    if client is not None and directory is not None:
        context.load_cert_chain(*client.write(directory, "client"))
    return context


def test_tls_with_the_grpc_certificates(
    start_server: Callable[..., ServerThread],
    tmp_path: Path,
    pki: dict[str, Any],  # noqa: F811
) -> None:
    server = start_server(http_port=free_port(), **tls_files(tmp_path, pki, mutual=False))
    server.server.engine.append("s1", AppendBatch([b"x"]))
    secure = HttpApi.of(server, tls=_client_tls(pki), host="localhost")
    assert secure.get("/v1/streams/s1").json["info"]["name"] == "s1"
    with pytest.raises((ConnectionError, OSError)):
        HttpApi.of(server).get("/v1/streams/s1")  # plaintext to a TLS port


def test_mutual_tls_names_the_principal_by_its_certificate(
    start_server: Callable[..., ServerThread],
    tmp_path: Path,
    pki: dict[str, Any],  # noqa: F811
) -> None:
    rules = write(
        tmp_path / "acl.toml",
        '[[rules]]\nprincipals = ["alice"]\nstreams = ["s1"]\npermissions = ["read"]\n' + ACL_TOML,
    )
    server = start_server(
        http_port=free_port(),
        **tls_files(tmp_path, pki, mutual=True),
        acl_file=rules,
        tokens_file=write(tmp_path / "tokens.toml", TOKENS_TOML),
    )
    server.server.engine.append("s1", AppendBatch([b"x"]))
    alice = HttpApi.of(server, tls=_client_tls(pki, tmp_path, pki["alice"]), host="localhost")
    assert alice.get("/v1/streams/s1").status == 200
    assert alice.post("Append", {"stream": "s1", "payloads": ["eA=="]}).status == 403
    # A token, when sent, names the caller instead.
    stranger = HttpApi.of(
        server, tls=_client_tls(pki, tmp_path, pki["alice"]), host="localhost", token=TOKENS["stranger"]
    )
    assert stranger.get("/v1/streams/s1").status == 403
    with pytest.raises((ConnectionError, OSError, ssl.SSLError)):
        HttpApi.of(server, tls=_client_tls(pki), host="localhost").get("/v1/streams/s1")  # no certificate
