"""The `streamlog` command. Subcommands: `serve` (run a server).

Each subcommand is a subparser with a `handler`; later subcommands (append, read,
tail, info, ...) add theirs in `build_parser`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from service import logs
from service.config import (
    FSYNC_POLICIES,
    LOG_FORMATS,
    LOG_LEVELS,
    ConfigError,
    Settings,
    load_settings,
    setting_names,
)

_DEFAULTS = Settings()
EXIT_USAGE = 2  # argparse's code for bad command lines; bad settings are the same kind of mistake
EXIT_FAILURE = 1


def _key_value(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name.strip(), value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamlog", description="streamlog: a persistent, append-only stream service over gRPC."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="run a server",
        description="Run a streamlog server until SIGTERM or SIGINT. Settings come from defaults, "
        "then the TOML file (--config or STREAMLOG_CONFIG), then STREAMLOG_<NAME> environment "
        "variables, then these flags.",
        epilog="Every setting, with its default and meaning: the settings table in README.md "
        "(Running the server) and docs/OPERATIONS.md (Configure). Set any of them with "
        "--set NAME=VALUE, STREAMLOG_<NAME>=VALUE or a NAME = VALUE line in the TOML file (there, "
        "sizes are numbers of bytes; elsewhere they accept KiB, MiB and GiB). Settings: "
        + ", ".join(setting_names())
        + ".",
    )
    # Flag defaults are None so that a flag left out does not override the file or
    # the environment; the help shows the built-in default instead.
    serve.add_argument(
        "--data",
        dest="data_dir",
        type=Path,
        metavar="DIR",
        help=f"data directory (default: ./{_DEFAULTS.data_dir})",
    )
    serve.add_argument("--host", help=f"address to listen on (default: {_DEFAULTS.host})")
    serve.add_argument(
        "--port", type=int, help=f"port to listen on; 0 picks a free one (default: {_DEFAULTS.port})"
    )
    serve.add_argument("--config", type=Path, metavar="FILE", help="TOML file of settings")
    serve.add_argument(
        "--fsync", choices=FSYNC_POLICIES, help=f"default durability policy (default: {_DEFAULTS.fsync})"
    )
    serve.add_argument("--log-level", choices=LOG_LEVELS, help=f"(default: {_DEFAULTS.log_level})")
    serve.add_argument(
        "--log-format", choices=LOG_FORMATS, help=f"one line per event (default: {_DEFAULTS.log_format})"
    )
    # Cluster mode (docs/CLUSTER.md): all three together, or none for a single server.
    serve.add_argument("--cluster", metavar="ENDPOINTS", help="join a cluster: etcd endpoints HOST:PORT,...")
    serve.add_argument("--node-id", metavar="ID", help="this node's id in the cluster (unique)")
    serve.add_argument("--advertise", metavar="HOST:PORT", help="the address other nodes dial this node at")
    serve.add_argument(
        "--set",
        dest="overrides",
        type=_key_value,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set any setting, e.g. --set max_entry_bytes=2MiB (repeatable)",
    )
    serve.set_defaults(handler=_serve)
    return parser


def serve_settings(args: argparse.Namespace, env: Mapping[str, str]) -> Settings:
    """The settings `serve` runs with: its flags over the environment and the config file."""
    return load_settings(
        config_file=args.config,
        env=env,
        flags={
            "data_dir": args.data_dir,
            "host": args.host,
            "port": args.port,
            "fsync": args.fsync,
            "log_level": args.log_level,
            "log_format": args.log_format,
            "cluster": args.cluster,
            "node_id": args.node_id,
            "advertise": args.advertise,
        },
        overrides=dict(args.overrides),
    )


def _serve(args: argparse.Namespace) -> int:
    try:
        settings = serve_settings(args, os.environ)
    except ConfigError as exc:
        print(f"streamlog serve: {exc}", file=sys.stderr)
        return EXIT_USAGE
    logs.configure(settings.log_level, settings.log_format)
    # Imported here so `streamlog --help` works before the code is generated.
    try:
        from service.server import serve
    except ImportError as exc:
        print(f"streamlog serve: {exc}; is the protobuf code generated? run `make gen`", file=sys.stderr)
        return EXIT_FAILURE
    from storage import StorageError

    try:
        asyncio.run(serve(settings))
    except ConfigError as exc:
        # TLS, token or ACL files that do not load: the same kind of mistake as a bad setting.
        logging.getLogger("streamlog").error("cannot run the server: %s", exc)
        return EXIT_USAGE
    except (StorageError, OSError, RuntimeError) as exc:
        # Start-up failures: data directory locked or unreadable, port taken, ...
        logging.getLogger("streamlog").error("cannot run the server: %s", exc)
        return EXIT_FAILURE
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
