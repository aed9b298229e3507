"""SIGHUP re-reads the token and ACL files of a running `streamlog serve` process."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import grpc
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from bench.common import free_port
from tests.ops.helpers import Process, wait_until

TOKEN = "sighup-token-0123456789"
READ_ONLY = '[[rules]]\nprincipals = ["ops"]\nstreams = ["*"]\npermissions = ["read"]\n'


def test_sighup_reloads_tokens_and_rules(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[[tokens]]\nprincipal = "ops"\ntoken = "{TOKEN}"\n')
    rules = tmp_path / "acl.toml"
    rules.write_text(READ_ONLY)
    port = free_port()
    env = {
        "STREAMLOG_TOKENS_FILE": str(tokens),
        "STREAMLOG_ACL_FILE": str(rules),
        "STREAMLOG_RELOAD_INTERVAL_MS": "0",  # no file watching: only the signal reloads
    }
    argv = [str(Path(sys.executable).parent / "streamlog"), "serve", "--data", str(tmp_path / "data")]
    server = Process([*argv, "--host", "127.0.0.1", "--port", str(port)], env, cwd=tmp_path)
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    request = pb.AppendRequest(stream="s", payloads=[b"x"])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.StreamLogServiceStub(channel)

            def append_code() -> grpc.StatusCode:
                try:
                    stub.Append(request, metadata=metadata, timeout=5)
                    return grpc.StatusCode.OK
                except grpc.RpcError as exc:
                    return exc.code()

            wait_until(lambda: append_code() == grpc.StatusCode.PERMISSION_DENIED)
            rules.write_text(READ_ONLY.replace('["read"]', '["admin"]'))
            assert append_code() == grpc.StatusCode.PERMISSION_DENIED  # not watched: unchanged
            server.process.send_signal(signal.SIGHUP)
            wait_until(lambda: append_code() == grpc.StatusCode.OK, timeout_s=10)
    finally:
        code, output = server.stop()
    assert code == 0, output
    assert "reloaded TLS and auth files (SIGHUP)" in output
