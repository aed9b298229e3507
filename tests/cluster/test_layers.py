"""The layering rule for cluster/: it sits below the service and never imports it or the clients."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.clients.test_layers import _imports as top_level_imports

CLUSTER = Path(__file__).resolve().parents[2] / "cluster"


def test_the_cluster_layer_never_imports_the_service_or_the_clients() -> None:
    modules = sorted(CLUSTER.glob("*.py"))
    assert len(modules) > 5, "no cluster modules found"
    for path in modules:
        imported = top_level_imports(path)
        assert not imported & {"service", "clients", "streamlog"}, f"{path.name} imports {imported}"


def test_checking_the_settings_does_not_load_the_etcd_client() -> None:
    # service/config.py checks cluster settings with cluster.addresses; a single server
    # (no --cluster) must not pay for the etcd client or its generated protobuf code.
    code = (
        "import sys, service.config; print(sorted(m for m in ('aetcd', 'cluster.etcd') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[]"
