"""The layers of docs/ARCHITECTURE.md: imports point down only.

    clients/ (and pyspark_streamlog/ beside it) -> service/ -> cluster/ -> storage/

Every import of every module of a layer is checked, wherever it stands (inside a
function too, relative or absolute, or `importlib.import_module` of a constant):
- storage/ is a library on its own: no grpc (nor grpc_*), asyncio, protobuf, etcd,
  generated code, and nothing above it.
- cluster/ talks to etcd (aetcd) and to peers (grpc, and its own internal protocol
  package under `streamlog.`), never the public contract `streamlog.v1`, the service
  or the clients. (Today it imports aetcd and grpc, no generated code.)
- service/ never imports the clients; it may ask cluster/ (cluster.addresses).
- clients/ talk to servers over gRPC only: no service, no cluster; storage only in
  cli.py, for the offline `inspect` (storage.inspect).
- pyspark_streamlog/ is a client: of ours it imports only clients/ (and the public
  generated code, as clients do).
- No layer imports bench/ or tests/ (those two may import anything).
"""

from __future__ import annotations

import ast
import fnmatch
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
_ABOVE_ALL = ("bench", "tests")


@dataclass(frozen=True)
class Rule:
    """What modules of `package` must not import: dotted names, each component an fnmatch pattern
    (`grpc_*` is any top-level package whose name starts so; `storage` covers storage.inspect)."""

    package: str
    forbidden: tuple[str, ...]
    why: str
    # file (relative to the package) -> imports it alone may make, despite `forbidden`
    allowed: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


RULES = (
    Rule(
        "storage",
        ("grpc", "grpc_*", "asyncio", "google.protobuf", "aetcd", "streamlog", "service", "cluster",
         "clients", "pyspark_streamlog", *_ABOVE_ALL),
        "storage/ is the engine, usable on its own: no RPC, no event loop, no protobuf, no etcd, "
        "nothing above it",
    ),
    Rule(
        "cluster",
        ("streamlog.v1", "service", "clients", "pyspark_streamlog", *_ABOVE_ALL),
        "cluster/ sits below the service: it never imports the service, the clients or the public "
        "contract streamlog.v1 (its own protocols are internal)",
    ),
    Rule(
        "service",
        ("clients", "pyspark_streamlog", *_ABOVE_ALL),
        "the service never imports the clients",
    ),
    Rule(
        "clients",
        ("service", "cluster", "storage", "pyspark_streamlog", *_ABOVE_ALL),
        "clients talk to servers over gRPC only; the CLI's offline inspect alone reads storage",
        allowed={"cli.py": ("storage.inspect",)},
    ),
    Rule(
        "pyspark_streamlog",
        ("storage", "service", "cluster", *_ABOVE_ALL),
        "the Spark connector is a client: of ours it imports only clients/",
    ),
)


def _matches(module: str, pattern: str) -> bool:
    parts, wanted = module.split("."), pattern.split(".")
    return len(parts) >= len(wanted) and all(map(fnmatch.fnmatchcase, parts, wanted))


def imported_modules(source: str, module: str) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of every import in `source`, the code of module `module` (dotted, to
    resolve relative imports). `from a import b` gives `a.b`, which may name a module."""
    package = module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *filter(None, [base])])
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"
        elif (
            isinstance(node, ast.Call)
            and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__"))
            )
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.lineno, node.args[0].value


class Violation(NamedTuple):
    rule: Rule
    path: str  # relative to the package
    line: int
    module: str

    def __str__(self) -> str:
        return f"{self.rule.package}/{self.path}:{self.line} imports {self.module}: {self.rule.why}"


def violations(rule: Rule, modules: Iterable[tuple[str, str]]) -> list[Violation]:
    """The imports that break `rule` in `modules`: (path relative to the package, source) pairs."""
    found = []
    for path, source in modules:
        module = ".".join([rule.package, *Path(path).with_suffix("").parts])
        allowed = rule.allowed.get(path, ())
        for line, name in imported_modules(source, module):
            if any(_matches(name, p) for p in rule.forbidden) and not any(_matches(name, p) for p in allowed):
                found.append(Violation(rule, path, line, name))
    return found


def _package_modules(package: str) -> list[tuple[str, str]]:
    directory = ROOT / package
    return [(str(p.relative_to(directory)), p.read_text()) for p in sorted(directory.rglob("*.py"))]


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.package)
def test_the_layers_hold(rule: Rule) -> None:
    modules = _package_modules(rule.package)
    assert len(modules) > 3, f"no modules found in {rule.package}/"
    assert [str(found) for found in violations(rule, modules)] == []


# Every forbidden import of every rule, as a module name (`grpc_*` as grpc_health).
BREACHES = [(rule, pattern.replace("*", "health")) for rule in RULES for pattern in rule.forbidden]


@pytest.mark.parametrize(("rule", "name"), BREACHES, ids=[f"{r.package}-{name}" for r, name in BREACHES])
def test_every_rule_catches_its_breach(rule: Rule, name: str) -> None:
    # Inside a function, as a lazy import would be: the checker walks the whole tree.
    source = f"def later():\n    import {name}.sub\n"
    assert [str(found) for found in violations(rule, [("breach.py", source)])] == [
        f"{rule.package}/breach.py:2 imports {name}.sub: {rule.why}"
    ]


STORAGE, CLUSTER, SERVICE, CLIENTS, SPARK = RULES


@pytest.mark.parametrize(
    ("rule", "path", "source", "caught"),
    [
        (STORAGE, "x.py", "from google import protobuf", "google.protobuf"),
        (STORAGE, "x.py", "from asyncio import Event", "asyncio.Event"),
        (STORAGE, "sub/x.py", "from ...service import wire", "service.wire"),
        (STORAGE, "x.py", "import importlib\nimportlib.import_module('grpc')", "grpc"),
        (CLUSTER, "x.py", "from streamlog.v1 import streamlog_pb2", "streamlog.v1.streamlog_pb2"),
        (SERVICE, "http/x.py", "from clients import Client", "clients.Client"),
        (CLIENTS, "_convert.py", "from storage.inspect import main", "storage.inspect.main"),
        (CLIENTS, "cli.py", "import storage.engine", "storage.engine"),
        (SPARK, "x.py", "from service.streamwire import gap_to_proto", "service.streamwire.gap_to_proto"),
    ],
)
def test_the_checker_sees_every_form_of_import(rule: Rule, path: str, source: str, caught: str) -> None:
    assert [found.module for found in violations(rule, [(path, source)])] == [caught]


@pytest.mark.parametrize(
    ("rule", "path", "source"),
    [
        (STORAGE, "x.py", "import concurrent.futures\nfrom storage.fs import FileSystem\nimport grpcio_like"),
        (CLUSTER, "x.py", "import grpc, aetcd, storage\nfrom streamlog.internal import peer_pb2"),
        (SERVICE, "x.py", "from cluster.addresses import parse\nimport grpc_health.v1\nimport storage"),
        (CLIENTS, "cli.py", "def inspect():\n    from storage.inspect import main"),
        (CLIENTS, "aio.py", "import grpc\nfrom streamlog.v1 import streamlog_pb2"),
        (SPARK, "x.py", "from clients.types import Entry\nfrom streamlog.v1 import streamlog_pb2"),
    ],
)
def test_what_the_layers_allow_passes(rule: Rule, path: str, source: str) -> None:
    assert violations(rule, [(path, source)]) == []


@pytest.mark.parametrize(
    ("statement", "absent"),
    [
        # `streamlog --help` and `streamlog serve` must work before any client call, so the
        # package loads gRPC and the generated code only when a command needs them.
        ("from clients.cli import build_parser; build_parser()", ("grpc", "service", "storage", "streamlog")),
        # service/config.py checks cluster settings with cluster.addresses; a single server
        # (no --cluster) must not pay for the etcd client or its generated protobuf code.
        ("import service.config", ("aetcd", "cluster.etcd")),
    ],
)
def test_loading_stays_lazy(statement: str, absent: tuple[str, ...]) -> None:
    code = f"import sys; {statement}; print(sorted(m for m in {absent!r} if m in sys.modules))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True, cwd=ROOT
    )
    assert result.stdout.strip() == "[]"
