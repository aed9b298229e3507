"""A single server (no --cluster) stays free of the cluster layer: no etcd client, no cluster/
beyond the settings' parsers, none of the service's cluster modules (tests/test_layers.py has the
import rules of every layer)."""

from __future__ import annotations

import subprocess
import sys


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
