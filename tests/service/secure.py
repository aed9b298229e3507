"""A test server's mutual TLS, bearer tokens and ACL: the files it loads, and what clients need.

Clients need a certificate from the CA; the "app" token may do anything, the
"viewer" token only read. Shared by the client, CLI and Spark connector tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.service.certs import CertificateAuthority

APP_TOKEN = "app-token-0123456789abcdef"
VIEWER_TOKEN = "viewer-token-0123456789abc"
TOKENS_TOML = f"""
[[tokens]]
principal = "app"
token = "{APP_TOKEN}"

[[tokens]]
principal = "viewer"
token = "{VIEWER_TOKEN}"
"""
ACL_TOML = """
[[rules]]
principals = ["app"]
streams = ["*"]
permissions = ["admin"]

[[rules]]
principals = ["viewer"]
streams = ["*"]
permissions = ["read"]
"""


@dataclass(frozen=True)
class Pki:
    ca: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA that signed neither side


def secure_files(directory: Path) -> tuple[dict[str, str], Pki]:
    """Write certificates, tokens and rules into `directory`; the server's settings and the client files."""
    ca, other = CertificateAuthority(), CertificateAuthority("another CA")
    server_cert, server_key = ca.issue("server", server=True).write(directory, "server")
    client_cert, client_key = ca.issue("client", server=False).write(directory, "client")
    (directory / "ca.crt").write_bytes(ca.cert_pem)
    (directory / "other.crt").write_bytes(other.cert_pem)
    (directory / "tokens.toml").write_text(TOKENS_TOML)
    (directory / "acl.toml").write_text(ACL_TOML)
    settings = dict(
        tls_cert_file=str(server_cert),
        tls_key_file=str(server_key),
        tls_client_ca_file=str(directory / "ca.crt"),
        tokens_file=str(directory / "tokens.toml"),
        acl_file=str(directory / "acl.toml"),
    )
    return settings, Pki(directory / "ca.crt", client_cert, client_key, directory / "other.crt")
