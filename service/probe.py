"""A gRPC health probe: `python -m service.probe`, exit 0 when the server is SERVING.

The container's HEALTHCHECK runs it. With no --target it finds the server the way
the server finds its settings (defaults, STREAMLOG_CONFIG, STREAMLOG_* variables)
and asks on the loopback: the plaintext health port when `health_port` is set,
else the main port (over TLS when the server has TLS; pass --ca-file unless the
server's certificate is self-signed, and note that a server requiring client
certificates needs a health_port for probes).

Exit codes: 0 SERVING; 1 reachable but not serving (starting, draining); 2 no
answer (refused, timed out, handshake failed) or bad usage.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.config import ConfigError, load_settings

SERVICE = "streamlog.v1.StreamLogService"
EXIT_SERVING, EXIT_NOT_SERVING, EXIT_UNREACHABLE = 0, 1, 2


def _loopback(host: str) -> str:
    # A server bound to every address is asked on the loopback of the same family.
    return "[::1]" if ":" in host else "127.0.0.1"


def _target_from_settings(args: argparse.Namespace) -> tuple[str, grpc.ChannelCredentials | None]:
    settings = load_settings(config_file=args.config, env=os.environ)
    loopback = _loopback(settings.host)
    if settings.health_port:
        return f"{loopback}:{settings.health_port}", None
    if not settings.tls_cert_file:
        return f"{loopback}:{settings.port}", None
    ca_file = args.ca_file or settings.tls_cert_file
    return f"{loopback}:{settings.port}", grpc.ssl_channel_credentials(Path(ca_file).read_bytes())


def check(
    target: str,
    service: str = SERVICE,
    timeout_s: float = 3.0,
    credentials: grpc.ChannelCredentials | None = None,
    server_name: str | None = None,
) -> int:
    """Ask `target` for `service`'s health; return the exit code (see the module docstring)."""
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    channel = (
        grpc.secure_channel(target, credentials, options=options)
        if credentials is not None
        else grpc.insecure_channel(target)
    )
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            print(f"{target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return EXIT_UNREACHABLE
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{target}: {status}")
    return EXIT_SERVING if reply.status == health_pb2.HealthCheckResponse.SERVING else EXIT_NOT_SERVING


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="HOST:PORT to ask (default: from the server's settings)")
    parser.add_argument("--service", default=SERVICE, help=f"service name to ask about (default: {SERVICE})")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds (default: 3)")
    parser.add_argument("--config", type=Path, help="the server's TOML settings (default: STREAMLOG_CONFIG)")
    parser.add_argument("--tls", action="store_true", help="use TLS with --target")
    parser.add_argument("--ca-file", help="CA certificate that signed the server's certificate")
    parser.add_argument("--server-name", help="name to check the server's certificate against")
    args = parser.parse_args(argv)
    try:
        if args.target:
            credentials = None
            if args.tls or args.ca_file:
                roots = Path(args.ca_file).read_bytes() if args.ca_file else None
                credentials = grpc.ssl_channel_credentials(roots)
            target = args.target
        else:
            target, credentials = _target_from_settings(args)
    except (ConfigError, OSError) as exc:
        print(f"probe: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    return check(target, args.service, args.timeout, credentials, args.server_name)


if __name__ == "__main__":
    sys.exit(main())
