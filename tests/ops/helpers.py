"""Shared by the deployment tests: paths, YAML loading, the Compose schema, free ports, commands run
as processes."""

from __future__ import annotations

import importlib.resources
import json
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
START_TIMEOUT_S = 30


def load_yaml_documents(path: Path) -> list[dict[str, Any]]:
    with path.open() as handle:
        return [doc for doc in yaml.safe_load_all(handle) if doc is not None]


def compose_schema_errors(spec: dict[str, Any]) -> list[str]:
    """Where a compose file breaks the Compose Specification (the schema check-jsonschema ships,
    so no network is needed)."""
    schema_file = importlib.resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    schema = json.loads(schema_file.read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(spec)]


def kubernetes_errors(docs: Sequence[dict[str, Any]], version: str) -> list[str]:
    """Where Kubernetes objects break the schemas of `version` (kubernetes-validate's, offline)."""
    errors = []
    for doc in docs:
        try:
            # strict: unknown fields (typos) are errors, as `kubectl apply --validate=strict` makes them.
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{doc.get('kind')} {doc.get('metadata', {}).get('name')}: {exc.message}")
    return errors


class Process:
    """A command run with a merged environment; always stopped (SIGTERM, then SIGKILL) by `stop`."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], cwd: Path) -> None:
        self.argv = list(argv)
        self.process = subprocess.Popen(
            self.argv,
            env={**os.environ, **env},
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def stop(self, timeout_s: float = 20) -> tuple[int, str]:
        """SIGTERM, wait for the exit code and everything it printed."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            output, _ = self.process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            output, _ = self.process.communicate(timeout=10)
        return self.process.returncode, output


def wait_until(check: Any, timeout_s: float = START_TIMEOUT_S, interval_s: float = 0.2) -> Any:
    """Call `check` until it returns something truthy; fail after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout_s} s: {check}")
        time.sleep(interval_s)
