"""deploy/k8s: every manifest valid against the Kubernetes schemas (offline, from the schemas the
kubernetes-validate package ships), and consistent with the server it runs: probes on the health
port the settings open, a grace period covering the drain, a restrictive security context."""

from __future__ import annotations

import sys
import tomllib
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.common import free_port
from service.config import load_settings
from service.server import SERVICE_NAME
from tests.ops.helpers import K8S, Process, kubernetes_errors, load_yaml_documents, wait_until

# The oldest release whose schemas we check (native gRPC probes are GA from 1.27), and the newest.
KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version())


def manifests() -> dict[str, list[dict[str, Any]]]:
    return {
        p.name: load_yaml_documents(p) for p in sorted(K8S.glob("*.yaml")) if p.name != "kustomization.yaml"
    }


def documents() -> list[dict[str, Any]]:
    return [doc for docs in manifests().values() for doc in docs]


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in documents() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def statefulset() -> dict[str, Any]:
    return one("StatefulSet")


def container() -> dict[str, Any]:
    (only,) = statefulset()["spec"]["template"]["spec"]["containers"]
    return only


def config_toml() -> str:
    return one("ConfigMap", "streamlog-config")["data"]["streamlog.toml"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_is_valid_for_kubernetes(version: str) -> None:
    assert kubernetes_errors(documents(), version) == []


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    assert sorted(kustomization["resources"]) == sorted(manifests())
    namespace = one("Namespace")["metadata"]["name"]
    assert kustomization["namespace"] == namespace
    assert [i["name"] for i in kustomization["images"]] == [container()["image"]]


def test_statefulset_keeps_data_per_pod_behind_a_headless_service() -> None:
    spec = statefulset()["spec"]
    headless = one("Service", spec["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    for service in (d for d in documents() if d["kind"] == "Service"):
        assert service["spec"]["selector"].items() <= labels.items()
    client = one("Service", "streamlog")
    assert client["spec"]["type"] == "ClusterIP"
    (claim,) = spec["volumeClaimTemplates"]
    assert (
        claim["spec"]["accessModes"] == ["ReadWriteOnce"]
        and claim["spec"]["resources"]["requests"]["storage"]
    )
    mounts = {m["name"]: m["mountPath"] for m in container()["volumeMounts"]}
    args = container()["args"]
    assert mounts[claim["metadata"]["name"]] == args[args.index("--data") + 1]
    pdb = one("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_configmap_holds_valid_settings_that_the_pod_reads(tmp_path: Path) -> None:
    path = tmp_path / "streamlog.toml"
    path.write_text(config_toml())
    settings = load_settings(config_file=path)
    env = {e["name"]: e["value"] for e in container()["env"]}
    mounts = {m["name"]: m["mountPath"] for m in container()["volumeMounts"]}
    volumes = {v["name"]: v for v in statefulset()["spec"]["template"]["spec"]["volumes"]}
    config_volume = next(
        n for n, v in volumes.items() if v.get("configMap", {}).get("name") == "streamlog-config"
    )
    assert env["STREAMLOG_CONFIG"] == f"{mounts[config_volume]}/streamlog.toml"
    ports = {p["name"]: p["containerPort"] for p in container()["ports"]}
    assert ports == {"grpc": settings.port, "health": settings.health_port, "metrics": settings.metrics_port}
    annotations = statefulset()["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == settings.metrics_port
    # Prometheus scrapes the pod's IP, so metrics must listen beyond the loopback (their default).
    assert annotations["prometheus.io/scrape"] == "true" and settings.metrics_host == "0.0.0.0"
    # The commented TLS and auth paths point into the optional Secret volumes.
    commented = [line.strip("# ").split(" = ") for line in config_toml().splitlines() if "_file = " in line]
    for name, value in commented:
        assert name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "tokens_file", "acl_file")
        directory = value.strip('"').rsplit("/", 1)[0]
        assert directory in mounts.values()
        volume = next(n for n, p in mounts.items() if p == directory)
        assert volumes[volume]["secret"]["optional"] is True


def test_probes_are_native_grpc_on_the_health_port() -> None:
    settings = tomllib.loads(config_toml())
    probes = {kind: container()[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    for kind, probe in probes.items():
        assert set(probe) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, kind
        assert probe["grpc"]["port"] == settings["health_port"], kind
    # Ready only while StreamLogService serves (not while recovering or draining).
    assert probes["readinessProbe"]["grpc"]["service"] == SERVICE_NAME
    assert probes["startupProbe"]["grpc"]["service"] == SERVICE_NAME
    # The startup probe gives recovery minutes before liveness may restart the pod.
    startup = probes["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120


def test_grace_period_covers_the_drain() -> None:
    grace_ms = tomllib.loads(config_toml())["shutdown_grace_ms"]
    period_s = statefulset()["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    # The drain, then at least 5 s to sync and close every stream, and not minutes more.
    assert grace_ms / 1000 + 5 <= period_s <= grace_ms / 1000 + 30


def test_security_context_is_restrictive() -> None:
    pod = statefulset()["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod["automountServiceAccountToken"] is False
    context = container()["securityContext"]
    assert context["runAsNonRoot"] is True
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["seccompProfile"]["type"] == "RuntimeDefault"
    assert "privileged" not in context and "hostNetwork" not in pod and "hostPath" not in str(pod["volumes"])
    resources = container()["resources"]
    for part in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(resources[part]), part
    # A read-only root: Python must not try to write bytecode, and /tmp is a volume.
    mounts = {m["mountPath"] for m in container()["volumeMounts"]}
    assert "/tmp" in mounts


def test_the_pod_command_line_and_settings_run_a_server_that_answers_the_probes(tmp_path: Path) -> None:
    """The entry point with the StatefulSet's args and the ConfigMap's settings, on the loopback."""
    config = tmp_path / "streamlog.toml"
    config.write_text(config_toml())
    args = [
        a.replace("/data", str(tmp_path / "data")).replace("0.0.0.0", "127.0.0.1")
        for a in container()["args"]
    ]
    ports = {name: free_port() for name in ("PORT", "HEALTH_PORT", "METRICS_PORT")}
    env = {"STREAMLOG_CONFIG": str(config), **{f"STREAMLOG_{k}": str(v) for k, v in ports.items()}}
    env["STREAMLOG_METRICS_HOST"] = "127.0.0.1"  # the loopback standing in for the pod's 0.0.0.0
    bin_dir = Path(sys.executable).parent
    annotations = statefulset()["spec"]["template"]["metadata"]["annotations"]
    server = Process([str(bin_dir / "streamlog"), "serve", *args], env, cwd=tmp_path)
    try:

        def serving() -> bool:
            with grpc.insecure_channel(f"127.0.0.1:{ports['HEALTH_PORT']}") as channel:
                try:
                    reply = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=1
                    )
                except grpc.RpcError:
                    return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING

        wait_until(serving)
        metrics_url = f"http://127.0.0.1:{ports['METRICS_PORT']}{annotations['prometheus.io/path']}"
        with urllib.request.urlopen(metrics_url, timeout=10) as reply:
            assert b"streamlog_ready 1.0" in reply.read()
    finally:
        code, output = server.stop()
    assert code == 0, output
    assert '"message":"settings"' in output  # log_format json, from the ConfigMap
