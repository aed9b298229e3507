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


def test_a_single_server_never_loads_the_cluster_layer() -> None:
    # Serving without --cluster (start, calls, stop) loads no etcd client, none of cluster/ but
    # the settings' parsers, and none of the service's cluster modules.
    code = """
import asyncio, sys, tempfile
import grpc
from streamlog.v1 import streamlog_pb2 as pb, streamlog_pb2_grpc as pb_grpc
from service.config import Settings
from service.server import StreamLogServer

async def main():
    server = StreamLogServer(Settings(data_dir=tempfile.mkdtemp(), port=0, log_level="warning"))
    await server.start()
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = pb_grpc.StreamLogServiceStub(channel)
        await stub.Append(pb.AppendRequest(stream="s", payloads=[b"x"]), timeout=10)
        await stub.Read(pb.ReadRequest(stream="s"), timeout=10)
        await stub.ListStreams(pb.ListStreamsRequest(), timeout=10)
        await stub.DescribeCluster(pb.DescribeClusterRequest(), timeout=10)
    await server.stop()

asyncio.run(main())
cluster_modules = ("service.clusternode", "service.routing", "service.forwarding", "service.peers",
                   "service.replicas", "service.resume")
print(sorted(m for m in sys.modules if m.split(".")[0] in ("aetcd", "cluster") or m in cluster_modules))
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "['cluster', 'cluster.addresses']"
