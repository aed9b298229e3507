"""TLS (server verification, client certificates) and bearer tokens, against a TLS server."""

from __future__ import annotations

import asyncio

import pytest

from clients import AsyncClient, Client, UnauthenticatedError, UnavailableError
from tests.clients.tlsserver import TOKEN, Certs, TlsServer


def _tls_client(server: TlsServer, certs: Certs, **overrides) -> Client:
    options = dict(
        token=TOKEN,
        root_certificates=certs.ca,  # a path; PEM bytes work too
        certificate_chain=certs.client_cert.read_bytes(),
        private_key=certs.client_key,
        timeout=5,
    )
    options.update(overrides)
    return Client(server.target, **options)


def test_tls_with_a_client_certificate_and_a_token(tls_server: TlsServer, certs: Certs) -> None:
    with _tls_client(tls_server, certs) as client:
        info = client.info("secure")
    assert (info.name, info.next_offset) == ("secure", 42)


def test_a_wrong_token_is_unauthenticated(tls_server: TlsServer, certs: Certs) -> None:
    with _tls_client(tls_server, certs, token="wrong") as client, pytest.raises(UnauthenticatedError):
        client.info("secure")


def test_a_server_the_roots_do_not_vouch_for_is_unreachable(tls_server: TlsServer, certs: Certs) -> None:
    # The client's own certificate is not a CA that signed the server's: the handshake fails.
    with (
        _tls_client(tls_server, certs, root_certificates=certs.client_cert) as client,
        pytest.raises(UnavailableError),
    ):
        client.info("secure", timeout=3)


def test_plaintext_to_a_tls_server_fails(tls_server: TlsServer) -> None:
    with Client(tls_server.target, token=TOKEN, timeout=3) as client, pytest.raises(UnavailableError):
        client.info("secure")


def test_a_certificate_without_its_key_is_refused_at_once(certs: Certs) -> None:
    with pytest.raises(ValueError, match="private key"):
        Client("127.0.0.1:1", certificate_chain=certs.client_cert)


def test_async_client_over_tls(tls_server: TlsServer, certs: Certs) -> None:
    async def scenario() -> str:
        async with AsyncClient(
            tls_server.target,
            token=TOKEN,
            root_certificates=certs.ca.read_bytes(),
            certificate_chain=certs.client_cert,
            private_key=certs.client_key,
            timeout=5,
        ) as client:
            return (await client.info("async")).name

    assert asyncio.run(scenario()) == "async"
