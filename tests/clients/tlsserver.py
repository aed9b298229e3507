"""A small TLS gRPC server speaking part of StreamLogService, to test the clients' TLS and token options.

The streamlog server itself listens in plaintext (TLS is for a proxy or mesh in
front of it), so this stand-in checks what the clients send: a TLS handshake with
the test CA's certificates, a client certificate, and `authorization: Bearer`.
Certificates come from the openssl command, made fresh for each test session.
"""

from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
from streamlog.v1 import streamlog_pb2 as pb

TOKEN = "tls-test-token"


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def make_certs(directory: Path) -> Certs:
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate, all signed by the CA."""
    if shutil.which("openssl") is None:
        raise RuntimeError("the TLS tests need the openssl command")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl(
        "req",
        "-x509",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=test-ca",
        cwd=directory,
    )
    (directory / "server.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name in ("server", "client"):
        _openssl(
            "req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=directory
        )
        extra = ("-extfile", "server.ext") if name == "server" else ()
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "2",
            *extra,
            cwd=directory,
        )
    return Certs(
        directory / "ca.pem",
        directory / "server.pem",
        directory / "server.key",
        directory / "client.pem",
        directory / "client.key",
    )


class TlsServer:
    """Answers GetStreamInfo (naming the stream asked for) to callers with the right token."""

    def __init__(self, certs: Certs) -> None:
        self._server = grpc.server(ThreadPoolExecutor(max_workers=2))
        handler = grpc.unary_unary_rpc_method_handler(
            self._info,
            request_deserializer=pb.GetStreamInfoRequest.FromString,
            response_serializer=pb.GetStreamInfoResponse.SerializeToString,
        )
        self._server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "streamlog.v1.StreamLogService", {"GetStreamInfo": handler}
                ),
            )
        )
        credentials = grpc.ssl_server_credentials(
            [(certs.server_key.read_bytes(), certs.server_cert.read_bytes())],
            root_certificates=certs.ca.read_bytes(),
            require_client_auth=True,
        )
        self.port = self._server.add_secure_port("127.0.0.1:0", credentials)
        self._server.start()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _info(
        self, request: pb.GetStreamInfoRequest, context: grpc.ServicerContext
    ) -> pb.GetStreamInfoResponse:
        if ("authorization", f"Bearer {TOKEN}") not in context.invocation_metadata():
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        return pb.GetStreamInfoResponse(info=pb.StreamInfo(name=request.stream, next_offset=42))

    def stop(self) -> None:
        self._server.stop(grace=None).wait(10)
