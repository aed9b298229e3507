"""Connection settings shared by Client, AsyncClient and the Spark connector: TLS, token, channel options."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc

DEFAULT_ADDRESS = "localhost:7070"
DEFAULT_TIMEOUT_S = 30.0
# Replies are capped by the server (max_read_bytes, 8 MiB by default, plus framing);
# gRPC's default 4 MiB receive limit would refuse the largest ones.
_MAX_RECEIVE_BYTES = 64 << 20

Pem = bytes | str | os.PathLike[str]


def _pem(value: Pem | None) -> bytes | None:
    """PEM bytes as given, or read from a file path."""
    if value is None or isinstance(value, bytes):
        return value
    return Path(value).read_bytes()


def channel_credentials(
    tls: bool,
    root_certificates: Pem | None,
    certificate_chain: Pem | None,
    private_key: Pem | None,
) -> grpc.ChannelCredentials | None:
    """TLS credentials when any TLS option is given, else None (plaintext)."""
    if (certificate_chain is None) != (private_key is None):
        raise ValueError("a client certificate needs its private key, and the other way round")
    if not (tls or root_certificates or certificate_chain):
        return None
    # No root certificates: gRPC uses the system's (or GRPC_DEFAULT_SSL_ROOTS_FILE_PATH).
    return grpc.ssl_channel_credentials(
        root_certificates=_pem(root_certificates),
        private_key=_pem(private_key),
        certificate_chain=_pem(certificate_chain),
    )


def channel_options(server_name: str | None, options: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    result: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", _MAX_RECEIVE_BYTES),
        # The server refuses what is too big with a message naming its limit.
        ("grpc.max_send_message_length", -1),
    ]
    if server_name:
        # Check the server's certificate against this name instead of the address's host.
        result.append(("grpc.ssl_target_name_override", server_name))
    result.extend(options)
    return result


def open_channel(
    channels: ModuleType,
    address: str,
    *,
    tls: bool = False,
    root_certificates: Pem | None = None,
    certificate_chain: Pem | None = None,
    private_key: Pem | None = None,
    server_name: str | None = None,
    options: Sequence[tuple[str, Any]] = (),
) -> Any:
    """A channel to `address` made by `channels`: the grpc module, or grpc.aio (they open channels alike).

    TLS when any TLS option is given (`tls=True` alone: the system's root certificates),
    else plaintext. The arguments are Client's (see there).
    """
    credentials = channel_credentials(tls, root_certificates, certificate_chain, private_key)
    opts = channel_options(server_name, options)
    if credentials is None:
        return channels.insecure_channel(address, options=opts)
    return channels.secure_channel(address, credentials, options=opts)


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying a bearer token (sent on every call, plaintext or TLS)."""
    if not token:
        return ()
    return (("authorization", f"Bearer {token}"),)


def call_timeout(default: float | None, timeout: float | None, block_ms: int = 0) -> float | None:
    """The deadline of one call: its own timeout, else the client's plus the time it may block."""
    if timeout is not None:
        return timeout
    if default is None:
        return None
    return default + block_ms / 1000
