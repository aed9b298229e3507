"""TLS, mutual TLS and bearer tokens: the clients and the CLI against a real server that requires them."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from clients import AsyncClient, Client, PermissionDeniedError, UnauthenticatedError, UnavailableError
from clients.cli import EXIT_DENIED, main
from tests.service.helpers import ServerThread
from tests.service.secure import APP_TOKEN, VIEWER_TOKEN, Pki, secure_files


@pytest.fixture
def secure(start_server: Callable[..., ServerThread], tmp_path: Path) -> tuple[ServerThread, Pki]:
    """A server with mutual TLS (clients need a certificate from the CA) and bearer tokens."""
    settings, pki = secure_files(tmp_path)
    return start_server(**settings), pki


def _client(server: ServerThread, pki: Pki, **overrides) -> Client:
    options = dict(
        token=APP_TOKEN,
        root_certificates=pki.ca,  # a path; PEM bytes work too
        certificate_chain=pki.client_cert.read_bytes(),
        private_key=pki.client_key,
        timeout=5,
    )
    options.update(overrides)
    return Client(f"localhost:{server.server.port}", **options)


def test_mutual_tls_and_a_token(secure: tuple[ServerThread, Pki]) -> None:
    server, pki = secure
    with _client(server, pki) as client:
        assert client.append("secure", [b"a", b"b"]).last_offset == 1
        assert [e.payload for e in client.read("secure", 0)] == [b"a", b"b"]


def test_a_consume_session_carries_the_token(secure: tuple[ServerThread, Pki]) -> None:
    server, pki = secure
    with _client(server, pki) as client:
        client.append("secure", [b"a", b"b"])
        client.create_group("secure", "g")
        with client.consume("secure", "g", "c1", timeout=5) as session:
            batch = next(session)
            session.ack(e.offset for e in batch)
        assert session.result is not None and session.result.acknowledged == 2
    with _client(server, pki, token="not-a-token-0123456789") as client:
        session = client.consume("secure", "g", "c1", timeout=5)
        with session, pytest.raises(UnauthenticatedError):
            next(session)


def test_a_wrong_token_is_unauthenticated_and_a_weak_one_denied(secure: tuple[ServerThread, Pki]) -> None:
    server, pki = secure
    with _client(server, pki, token="not-a-token-0123456789") as client, pytest.raises(UnauthenticatedError):
        client.info("secure")
    with _client(server, pki, token=VIEWER_TOKEN) as client, pytest.raises(PermissionDeniedError):
        client.append("secure", b"x")


def test_untrusted_servers_and_missing_certificates_fail_the_handshake(
    secure: tuple[ServerThread, Pki],
) -> None:
    server, pki = secure
    with _client(server, pki, root_certificates=pki.other_ca) as client, pytest.raises(UnavailableError):
        client.info("secure", timeout=3)
    with (
        _client(server, pki, certificate_chain=None, private_key=None) as client,
        pytest.raises(UnavailableError),
    ):
        client.info("secure", timeout=3)
    with Client(server.target, token=APP_TOKEN, timeout=3) as plaintext, pytest.raises(UnavailableError):
        plaintext.info("secure")


def test_a_certificate_without_its_key_is_refused_at_once(tmp_path: Path) -> None:
    (tmp_path / "client.crt").write_text("not used")
    with pytest.raises(ValueError, match="private key"):
        Client("127.0.0.1:1", certificate_chain=tmp_path / "client.crt")


def test_async_client_over_mutual_tls(secure: tuple[ServerThread, Pki]) -> None:
    server, pki = secure

    async def scenario() -> int:
        async with AsyncClient(
            f"localhost:{server.server.port}",
            token=APP_TOKEN,
            root_certificates=pki.ca.read_bytes(),
            certificate_chain=pki.client_cert,
            private_key=pki.client_key,
            timeout=5,
        ) as client:
            await client.append("async", b"x")
            return (await client.info("async")).next_offset

    assert asyncio.run(scenario()) == 1


def test_cli_tls_and_token_flags(secure: tuple[ServerThread, Pki], monkeypatch: pytest.MonkeyPatch) -> None:
    server, pki = secure
    monkeypatch.setenv("STREAMLOG_TOKEN", APP_TOKEN)
    tls = ["--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key)]
    address = ["--address", f"localhost:{server.server.port}"]
    out = io.StringIO()
    assert main(["append", "cli", "one", *tls, *address], out=out) == 0
    out = io.StringIO()
    assert main(["info", "cli", "--json", *tls, *address], out=out) == 0
    assert json.loads(out.getvalue())["next_offset"] == 1
    assert main(["info", "cli", *tls, *address, "--token", VIEWER_TOKEN]) == 0  # reading is allowed
    assert main(["append", "cli", "x", *tls, *address, "--token", VIEWER_TOKEN]) == EXIT_DENIED
