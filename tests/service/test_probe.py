"""The health probe (`python -m service.probe`), the plaintext health port, and the start-up settings log."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from bench.common import free_port
from service import config, probe
from tests.service.certs import CertificateAuthority
from tests.service.helpers import ServerThread


def test_probe_exit_codes(start_server: Callable[..., ServerThread]) -> None:
    server = start_server()
    assert probe.main(["--target", server.target]) == probe.EXIT_SERVING
    assert probe.main(["--target", server.target, "--service", "no.such.Service"]) == probe.EXIT_UNREACHABLE
    server.run(server.server._health.enter_graceful_shutdown())
    assert probe.main(["--target", server.target]) == probe.EXIT_NOT_SERVING
    assert probe.main(["--target", f"127.0.0.1:{free_port()}", "--timeout", "1"]) == probe.EXIT_UNREACHABLE


def test_probe_finds_the_server_from_its_settings(
    start_server: Callable[..., ServerThread], monkeypatch: pytest.MonkeyPatch
) -> None:
    health_port = free_port()
    server = start_server(health_port=health_port)
    monkeypatch.setenv("STREAMLOG_PORT", str(server.server.port))
    monkeypatch.setenv("STREAMLOG_HEALTH_PORT", str(health_port))
    assert probe.main([]) == probe.EXIT_SERVING
    monkeypatch.delenv("STREAMLOG_HEALTH_PORT")
    assert probe.main([]) == probe.EXIT_SERVING  # the main port, when there is no health port


def test_the_health_port_serves_health_only(
    start_server: Callable[..., ServerThread], tmp_path: Path
) -> None:
    ca = CertificateAuthority()
    cert, key = ca.issue("streamlog", server=True).write(tmp_path, "server")
    client_ca = tmp_path / "ca.crt"
    client_ca.write_bytes(ca.cert_pem)
    health_port = free_port()
    # Mutual TLS on the main port; the health port stays plaintext for kubelet probes.
    server = start_server(
        health_port=health_port,
        tls_cert_file=str(cert),
        tls_key_file=str(key),
        tls_client_ca_file=str(client_ca),
    )
    assert server.server.ops.health_port == health_port
    assert probe.check(f"127.0.0.1:{health_port}") == probe.EXIT_SERVING
    with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.StreamLogServiceStub(channel).ListStreams(pb.ListStreamsRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # The main port needs TLS, and a client certificate: the probe gets no answer there.
    assert probe.main(["--target", f"localhost:{server.server.port}", "--ca-file", str(client_ca)]) == 2


def test_probe_speaks_tls_to_the_main_port(start_server: Callable[..., ServerThread], tmp_path: Path) -> None:
    ca = CertificateAuthority()
    cert, key = ca.issue("streamlog", server=True).write(tmp_path, "server")
    (tmp_path / "ca.crt").write_bytes(ca.cert_pem)
    server = start_server(tls_cert_file=str(cert), tls_key_file=str(key))
    target = f"127.0.0.1:{server.server.port}"
    assert probe.main(["--target", target, "--ca-file", str(tmp_path / "ca.crt")]) == probe.EXIT_SERVING
    assert probe.main(["--target", target, "--timeout", "2"]) == probe.EXIT_UNREACHABLE  # plaintext


def test_settings_are_logged_at_start_up_with_secrets_masked(
    start_server: Callable[..., ServerThread], caplog: pytest.LogCaptureFixture
) -> None:
    # JSON logs carry every setting in one event (text logs list those not at their defaults:
    # tests/service/test_process.py).
    with caplog.at_level(logging.INFO, logger="service.ops"):
        server = start_server(max_streams=77, log_format="json")
    (record,) = [r for r in caplog.records if r.getMessage() == "settings"]
    logged = record.settings  # type: ignore[attr-defined]
    assert logged["max_streams"] == 77 and logged["data_dir"] == str(server.settings.data_dir)
    assert set(logged) == set(config.setting_names())
    # No setting holds a secret today (keys and tokens are in files); names that say so are masked.
    assert config.is_secret("admin_password") and config.is_secret("api_token")
    assert not config.is_secret("tokens_file") and not config.is_secret("tls_key_file")
