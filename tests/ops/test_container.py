"""The Dockerfile, checked statically (no Docker engine runs here), its entry point run as the
container would run it, and docker-compose.yml validated against the Compose Specification's schema
(the copy check-jsonschema ships, so no network is needed)."""

from __future__ import annotations

import ast
import fnmatch
import importlib
import importlib.util
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import dockerfile
import pytest
import yaml

from bench.common import free_port
from tests.ops.helpers import ROOT, Process, compose_schema_errors, wait_until

DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "docker-compose.yml"
# What a runtime image must not contain or install: compilers, build tools, code generators.
BUILD_TOOLS = re.compile(
    r"\b(gcc|g\+\+|clang|make|build-essential|cmake|cargo|rustc|grpcio-tools|python3?-dev)\b"
)
ROOT_USERS = {"root", "0", "0:0", "root:root"}


class Stage:
    def __init__(self, name: str, base: str) -> None:
        self.name, self.base = name, base
        self.commands: list[Any] = []

    def all(self, cmd: str) -> list[Any]:
        return [c for c in self.commands if c.cmd == cmd]

    def last(self, cmd: str) -> Any:
        found = self.all(cmd)
        assert found, f"stage {self.name} has no {cmd}"
        return found[-1]


def parse() -> tuple[dict[str, str], list[Stage]]:
    """The Dockerfile's global ARG defaults and its stages, in order (BuildKit's own parser)."""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for command in dockerfile.parse_file(str(DOCKERFILE)):
        if command.cmd == "FROM":
            value = command.value
            name = value[2] if len(value) == 3 and value[1].upper() == "AS" else f"#{len(stages)}"
            stages.append(Stage(name, value[0]))
        elif not stages and command.cmd == "ARG":
            key, _, default = command.value[0].partition("=")
            args[key] = default
        else:
            stages[-1].commands.append(command)
    return args, stages


def base_image(stage: Stage, args: dict[str, str], stages: list[Stage]) -> str:
    """The registry image a stage starts from, following FROM <earlier stage> and ${ARG}s."""
    names = {s.name: s for s in stages}
    base = stage.base
    while base in names:
        base = names[base].base
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)


def runtime_stages() -> list[Stage]:
    # Stages that become images people run: every stage no other stage builds upon or copies from,
    # except the builders.
    _, stages = parse()
    return [s for s in stages if not s.name.endswith("builder")]


def entry_argv() -> list[str]:
    _, stages = parse()
    final = stages[-1]
    entrypoint, cmd = final.last("ENTRYPOINT"), final.last("CMD")
    assert entrypoint.json and cmd.json, "exec form, so SIGTERM reaches the server and not a shell"
    return [*entrypoint.value, *cmd.value]


def healthcheck_argv() -> list[str]:
    _, stages = parse()
    check = stages[-1].last("HEALTHCHECK")
    assert check.value[0] == "CMD" and check.json, "exec form: no shell in the health check"
    return list(check.value[1:])


# ---------------------------------------------------------------------------- Dockerfile


def test_dockerfile_is_multi_stage_with_a_slim_python_final_stage() -> None:
    args, stages = parse()
    assert len(stages) >= 2
    final = stages[-1]
    assert final.name == "server"
    assert re.fullmatch(r"python:3\.11-slim(-\w+)?", base_image(final, args, stages))
    # The final stage starts from a clean base, not from a builder, and takes only the venv from it.
    assert final.base not in {s.name for s in stages}
    copies = final.all("COPY")
    assert copies and all(any(f.startswith("--from=") for f in c.flags) for c in copies)
    assert [c.value for c in copies] == [("/opt/streamlog", "/opt/streamlog")]


def test_runtime_stages_run_unprivileged_without_build_tools() -> None:
    for stage in runtime_stages():
        user = stage.last("USER").value[0]
        assert user not in ROOT_USERS, stage.name
        # USER comes after every RUN: nothing runs as root once the image is started.
        assert stage.commands.index(stage.last("USER")) > max(
            (stage.commands.index(c) for c in stage.all("RUN")), default=-1
        )
        for run in stage.all("RUN"):
            assert not BUILD_TOOLS.search(run.value[0]), f"{stage.name}: {run.original}"
            assert "pip install" not in run.value[0], f"{stage.name} installs packages: {run.original}"


def test_final_stage_declares_volume_health_check_and_entry_point() -> None:
    _, stages = parse()
    final = stages[-1]
    volumes = [v for c in final.all("VOLUME") for v in c.value]
    assert volumes == ["/data"]
    assert healthcheck_argv()[:3] == ["python", "-m", "service.probe"]
    argv = entry_argv()
    assert argv[:2] == ["streamlog", "serve"]
    assert argv[argv.index("--data") + 1] == "/data"
    assert argv[argv.index("--host") + 1] == "0.0.0.0"
    # No STREAMLOG_* defaults baked in: they would override the operator's TOML file.
    for env in final.all("ENV"):
        assert not any(str(v).startswith("STREAMLOG_") for v in env.value[::2])
    assert final.last("STOPSIGNAL").value[0] == "SIGTERM"


def test_the_builder_generates_the_grpc_code_and_installs_the_package() -> None:
    _, stages = parse()
    builder = stages[0]
    runs = " ".join(c.value[0] for c in builder.all("RUN"))
    assert "protos/generate.py" in runs
    assert re.search(r"/opt/streamlog/bin/pip install \.", runs)


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def ignored(path: str, patterns: list[str]) -> bool:
    parts = Path(path.rstrip("/")).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(
        fnmatch.fnmatch(prefix, pattern.removeprefix("**/"))
        or fnmatch.fnmatch(parts[-1], pattern.removeprefix("**/"))
        for pattern in patterns
        for prefix in prefixes
    )


def test_every_copied_path_exists_and_is_in_the_build_context() -> None:
    _, stages = parse()
    patterns = dockerignore_patterns()
    for stage in stages:
        for copy in stage.all("COPY"):
            if any(f.startswith("--from=") for f in copy.flags):
                continue
            for source in copy.value[:-1]:
                assert (ROOT / source).exists(), f"{stage.name}: COPY {source}: no such path in the repo"
                assert not ignored(source, patterns), (
                    f"{stage.name}: COPY {source} is excluded by .dockerignore"
                )
    # Local state never enters the context.
    for private in (".venv", ".git", "data", "protos/gen", "tests"):
        assert ignored(private, patterns), private


def test_the_entry_point_serves_and_the_health_check_passes(tmp_path: Path) -> None:
    """ENTRYPOINT + CMD as the container runs them: /data is a temp dir, the loopback stands in for
    0.0.0.0, and the port comes from the environment; then HEALTHCHECK's command, as Docker runs it."""
    bin_dir = Path(sys.executable).parent
    argv = [a.replace("/data", str(tmp_path / "data")).replace("0.0.0.0", "127.0.0.1") for a in entry_argv()]
    argv[0] = str(bin_dir / argv[0])
    env = {"STREAMLOG_PORT": str(free_port()), "STREAMLOG_LOG_FORMAT": "json"}
    server = Process(argv, env, cwd=tmp_path)
    check = healthcheck_argv()
    check[0] = sys.executable
    try:

        def healthy() -> bool:
            probe = subprocess.run(check, env={**env, "PATH": str(bin_dir)}, capture_output=True, timeout=30)
            return probe.returncode == 0

        wait_until(healthy)
    finally:
        code, output = server.stop()
    assert code == 0, output
    events = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    assert [e["message"] for e in events if e["message"] in ("settings", "stopped")] == [
        "settings",
        "stopped",
    ]


# ---------------------------------------------------------------------------- docker compose


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_file_follows_the_compose_specification() -> None:
    assert compose_schema_errors(compose()) == []


def test_compose_runs_the_server_and_the_demo_against_it() -> None:
    spec = compose()
    services = spec["services"]
    _, stages = parse()
    targets = {s.name for s in stages}
    server = services["streamlog"]
    assert server["build"]["target"] == "server"
    volume, _, mount = server["volumes"][0].partition(":")
    assert mount == "/data" and volume in spec["volumes"]
    assert any(str(port).endswith(":7070") for port in server["ports"])
    # Published on the host's loopback only; inside the container, metrics listen on every
    # interface, or the published port would find nothing (the default is the loopback).
    published = [port for service in services.values() for port in service.get("ports", [])]
    assert published and all(str(port).startswith("127.0.0.1:") for port in published)
    assert server["environment"]["STREAMLOG_METRICS_HOST"] == "0.0.0.0"
    assert server["read_only"] is True and server["cap_drop"] == ["ALL"]
    assert services["setup"]["depends_on"] == {"streamlog": {"condition": "service_healthy"}}
    for name, service in services.items():
        assert service["build"]["target"] in targets, name
        for volume_mount in service.get("volumes", []):
            assert volume_mount.partition(":")[0] in spec["volumes"], name
        if name in ("streamlog", "setup"):
            continue
        # The examples start once the stream and groups exist (setup waited for a healthy server).
        assert service["depends_on"] == {"setup": {"condition": "service_completed_successfully"}}, name
        assert "streamlog:7070" in " ".join(service["command"]), name
    workers = [s for s in services.values() if "examples.rides.worker" in s.get("command", [])]
    names = {w["command"][w["command"].index("--name") + 1] for w in workers}
    assert names == {"consumer0", "consumer1"}
    assert "api.simulate" in services["rides-api"]["command"][2]
    assert services["spark-job"]["build"]["target"] == "spark"
    assert "spark_job.totals_query" in services["spark-job"]["command"][2]


def example_commands() -> list[tuple[str, list[str]]]:
    return [(name, s["command"]) for name, s in compose()["services"].items() if name != "streamlog"]


def test_compose_module_commands_use_options_the_examples_accept() -> None:
    for service, command in example_commands():
        if "-m" not in command:
            continue
        module = command[command.index("-m") + 1]
        assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), f"{service}: no module {module}"
        usage = subprocess.run(
            [sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert usage.returncode == 0, usage.stderr
        for option in (arg for arg in command if arg.startswith("--")):
            assert option in usage.stdout, f"{service}: {module} has no option {option}"


def called_functions(code: str) -> list[tuple[str, str, ast.Call]]:
    """(module alias, function, call) for each `alias.function(...)` whose alias an import bound."""
    tree = ast.parse(code)
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for name in node.names:
                aliases[name.asname or name.name] = f"{node.module}.{name.name}"
    # `with Client(...) as client`: calls on `client` are methods of the imported class.
    for node in ast.walk(tree):
        if isinstance(node, ast.With):
            for item in node.items:
                made = item.context_expr
                if (
                    isinstance(made, ast.Call)
                    and isinstance(made.func, ast.Name)
                    and made.func.id in aliases
                    and isinstance(item.optional_vars, ast.Name)
                ):
                    aliases[item.optional_vars.id] = aliases[made.func.id]
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func.value
            if isinstance(target, ast.Name) and target.id in aliases:
                calls.append((aliases[target.id], node.func.attr, node))
    return calls


def test_compose_inline_programs_match_the_examples_api() -> None:
    """The `python -c` programs call the examples' functions as they are: names and arguments."""
    checked = 0
    for service, command in example_commands():
        if "-c" not in command:
            continue
        code = command[command.index("-c") + 1]
        compile(code, service, "exec")
        if "spark_job" in code:
            pytest.importorskip("pyspark")
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.ImportFrom):
                module = importlib.import_module(node.module)
                for name in node.names:
                    assert hasattr(module, name.name) or importlib.util.find_spec(
                        f"{node.module}.{name.name}"
                    )
        for qualified, function, call in called_functions(code):
            if importlib.util.find_spec(qualified) is not None:  # `from package import module`
                target, args = importlib.import_module(qualified), list(range(len(call.args)))
            else:  # an instance of an imported class: `self` is the first placeholder
                owner_module, _, owner = qualified.rpartition(".")
                target = getattr(importlib.import_module(owner_module), owner)
                assert inspect.isclass(target), qualified
                args = [None, *range(len(call.args))]
            signature = inspect.signature(getattr(target, function))
            # Bind placeholders in the call's shape: a wrong count or keyword raises TypeError.
            signature.bind(*args, **{k.arg: None for k in call.keywords if k.arg})
            checked += 1
    # client.create_group, api.simulate, spark_job.session, spark_job.totals_query
    assert checked >= 4


@pytest.mark.parametrize("path", [DOCKERFILE, COMPOSE, ROOT / ".dockerignore"])
def test_files_have_no_tabs_or_trailing_spaces(path: Path) -> None:
    for number, line in enumerate(path.read_text().splitlines(), 1):
        assert "\t" not in line and line == line.rstrip(), f"{path.name}:{number}"
