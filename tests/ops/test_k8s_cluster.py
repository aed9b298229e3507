"""deploy/k8s-cluster: the overlay that makes the single-server manifests (deploy/k8s, its base) a
3-member cluster with a 3-member etcd. Rendered as `kubectl apply -k` would (`kubectl kustomize`,
offline), validated against the Kubernetes schemas, and checked for consistency: each pod's node
id and advertised name, the etcd endpoints and members, the disruption budgets' quorums, the
probes."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.addresses import parse_endpoints
from service.config import load_settings
from service.server import SERVICE_NAME
from tests.ops.helpers import K8S, ROOT, kubernetes_errors
from tests.ops.test_k8s import KUBERNETES_VERSIONS

OVERLAY = ROOT / "deploy" / "k8s-cluster"
KUBECTL = shutil.which("kubectl")
VARIABLE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@functools.cache
def render(directory: Path) -> tuple[dict[str, Any], ...]:
    if KUBECTL is None:
        pytest.skip("kubectl is not installed: kustomize (kubectl kustomize) renders the overlay")
    built = subprocess.run(
        [KUBECTL, "kustomize", str(directory)], capture_output=True, text=True, timeout=60, check=True
    )
    return tuple(doc for doc in yaml.safe_load_all(built.stdout) if doc)


def one(kind: str, name: str, directory: Path = OVERLAY) -> dict[str, Any]:
    found = [d for d in render(directory) if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def container(statefulset: dict[str, Any]) -> dict[str, Any]:
    (only,) = statefulset["spec"]["template"]["spec"]["containers"]
    return only


def pod_env(statefulset: dict[str, Any], ordinal: int) -> dict[str, str]:
    """The container's environment in pod `ordinal`, as the kubelet makes it: field references,
    ConfigMaps (envFrom), then $(VAR) expanded from the variables defined before."""
    pod, namespace = f"{statefulset['metadata']['name']}-{ordinal}", statefulset["metadata"]["namespace"]
    fields = {"metadata.name": pod, "metadata.namespace": namespace}
    spec = container(statefulset)
    env: dict[str, str] = {}
    for source in spec.get("envFrom", []):
        env.update(one("ConfigMap", source["configMapRef"]["name"])["data"])
    for variable in spec["env"]:
        if "valueFrom" in variable:
            env[variable["name"]] = fields[variable["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[variable["name"]] = VARIABLE.sub(lambda m: env.get(m.group(1), m.group(0)), variable["value"])
    return env


def expanded(args: list[str], env: dict[str, str]) -> list[str]:
    return [VARIABLE.sub(lambda m: env[m.group(1)], arg) for arg in args]


def flag(args: list[str], name: str) -> str:
    (value,) = [arg.split("=", 1)[1] for arg in args if arg.startswith(f"--{name}=")]
    return value


def stable_name(statefulset: dict[str, Any], ordinal: int) -> str:
    """Pod `ordinal`'s DNS name behind the StatefulSet's headless Service."""
    meta, spec = statefulset["metadata"], statefulset["spec"]
    return f"{meta['name']}-{ordinal}.{spec['serviceName']}.{meta['namespace']}.svc.cluster.local"


def port(statefulset: dict[str, Any], name: str) -> int:
    return next(p["containerPort"] for p in container(statefulset)["ports"] if p["name"] == name)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_rendered_cluster_is_valid_for_kubernetes(version: str) -> None:
    assert kubernetes_errors(render(OVERLAY), version) == []


def test_the_base_stays_a_single_server_and_the_overlay_adds_the_cluster() -> None:
    base = {(d["kind"], d["metadata"]["name"]) for d in render(K8S)}
    overlay = {(d["kind"], d["metadata"]["name"]) for d in render(OVERLAY)}
    assert overlay - base == {
        ("ConfigMap", "streamlog-cluster"),
        ("Service", "etcd"),
        ("StatefulSet", "etcd"),
        ("PodDisruptionBudget", "etcd"),
    }
    assert base <= overlay
    single = one("StatefulSet", "streamlog", K8S)
    assert single["spec"]["replicas"] == 1
    assert not any(e["name"].startswith("STREAMLOG_CLUSTER") for e in container(single)["env"])
    assert one("StatefulSet", "streamlog")["spec"]["replicas"] == 3


def test_each_member_is_its_pod_advertising_its_stable_name(tmp_path: Path) -> None:
    members = one("StatefulSet", "streamlog")
    headless = one("Service", members["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    config = tmp_path / "streamlog.toml"
    config.write_text(one("ConfigMap", "streamlog-config")["data"]["streamlog.toml"])
    for ordinal in range(members["spec"]["replicas"]):
        env = pod_env(members, ordinal)
        assert env["STREAMLOG_CONFIG"].startswith("/etc/streamlog/config/")
        settings = load_settings(config_file=config, env=env)  # ConfigError if any setting is wrong
        assert settings.node_id == f"streamlog-{ordinal}"
        assert settings.advertise == f"{stable_name(members, ordinal)}:{port(members, 'grpc')}"
        assert settings.port == port(members, "grpc")
        assert settings.default_replication_factor == 3


def test_the_endpoints_name_every_etcd_member_and_the_members_name_each_other() -> None:
    etcd = one("StatefulSet", "etcd")
    service = one("Service", etcd["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    # etcd members need one another's names before any of them is ready.
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert {p["port"] for p in service["spec"]["ports"]} == {port(etcd, "client"), port(etcd, "peer")}
    replicas = etcd["spec"]["replicas"]
    assert replicas == 3
    names = [stable_name(etcd, ordinal) for ordinal in range(replicas)]
    endpoints = parse_endpoints(pod_env(one("StatefulSet", "streamlog"), 0)["STREAMLOG_CLUSTER"])
    assert list(endpoints) == [(name, port(etcd, "client")) for name in names]
    peers = {f"etcd-{ordinal}": f"http://{name}:{port(etcd, 'peer')}" for ordinal, name in enumerate(names)}
    for ordinal in range(replicas):
        args = expanded(container(etcd)["args"], pod_env(etcd, ordinal))
        assert flag(args, "name") == f"etcd-{ordinal}"
        assert dict(m.split("=", 1) for m in flag(args, "initial-cluster").split(",")) == peers
        assert flag(args, "initial-advertise-peer-urls") == peers[f"etcd-{ordinal}"]
        assert flag(args, "advertise-client-urls") == f"http://{names[ordinal]}:{port(etcd, 'client')}"
        mount = container(etcd)["volumeMounts"][0]
        assert mount["name"] == etcd["spec"]["volumeClaimTemplates"][0]["metadata"]["name"]
        assert flag(args, "data-dir").startswith(mount["mountPath"] + "/")


def test_disruption_budgets_keep_a_quorum_of_each() -> None:
    budgets = [d for d in render(OVERLAY) if d["kind"] == "PodDisruptionBudget"]
    for name in ("streamlog", "etcd"):
        statefulset = one("StatefulSet", name)
        labels = statefulset["spec"]["template"]["metadata"]["labels"]
        (budget,) = [b for b in budgets if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        replicas, down = statefulset["spec"]["replicas"], budget["spec"]["maxUnavailable"]
        # etcd's members, and a stream's replicas (one per member at factor 3): a majority stays.
        assert down == 1 and replicas - down > replicas // 2, name
        assert statefulset["spec"]["podManagementPolicy"] == "Parallel", name  # all start together


def test_ready_once_caught_up_started_once_joined() -> None:
    probes = container(one("StatefulSet", "streamlog"))
    # StreamLogService turns SERVING once the node's copies are in sync; "" once it has
    # recovered its data and joined: a long catch-up keeps the pod unready, not restarted.
    assert probes["readinessProbe"]["grpc"]["service"] == SERVICE_NAME
    assert "service" not in probes["startupProbe"]["grpc"]
    assert "service" not in probes["livenessProbe"]["grpc"]


def test_etcd_runs_as_the_namespace_requires() -> None:
    namespace = one("Namespace", "streamlog")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    pod = one("StatefulSet", "etcd")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    context = container(one("StatefulSet", "etcd"))["securityContext"]
    assert context["allowPrivilegeEscalation"] is False and context["capabilities"] == {"drop": ["ALL"]}
    assert context["readOnlyRootFilesystem"] is True
