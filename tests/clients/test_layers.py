"""The layering rule: clients talk to the service over gRPC only, never by importing it.

The one exception is the CLI's offline `inspect`, which calls the storage engine's
inspector on segment files.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

CLIENTS = Path(__file__).resolve().parents[2] / "clients"


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_clients_never_import_the_server_and_only_the_cli_reads_storage() -> None:
    modules = sorted(CLIENTS.glob("*.py"))
    assert modules, "no client modules found"
    for path in modules:
        imported = _imports(path)
        assert "service" not in imported, f"{path.name} imports the server"
        if path.name != "cli.py":
            assert "storage" not in imported, f"{path.name} imports the storage engine"


def test_the_cli_starts_without_loading_grpc_or_the_server() -> None:
    # `streamlog --help` and `streamlog serve` must work before any client call, so the
    # package loads gRPC and the generated code only when a command needs them.
    code = (
        "import sys; from clients.cli import build_parser; build_parser(); "
        "print(sorted(m for m in ('grpc', 'service', 'storage', 'streamlog') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[]"
