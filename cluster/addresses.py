"""Parsing the names and addresses the cluster settings carry, with one error type.

service/config.py checks the settings with these (so a bad `--cluster` stops start-up
with a clear message), and the cluster layer uses the same parsed forms. Each parser
raises ValueError with a message that says what is allowed.
"""

from __future__ import annotations

import re

# Node ids and the cluster name become parts of etcd keys and appear in logs and
# metadata: a short word of safe characters, never a '/'.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


def check_name(kind: str, text: str) -> str:
    """A node id or cluster name: 1..63 of letters, digits, '.', '_', '-', starting alphanumeric."""
    if not _NAME.fullmatch(text):
        raise ValueError(
            f"{kind} must be 1 to 63 letters, digits, '.', '_' or '-', starting with a letter or "
            f"digit, got {text!r}"
        )
    return text


def parse_host_port(text: str) -> tuple[str, int]:
    """`host:port` (IPv6 as `[addr]:port`) -> (host, port); the port must be 1..65535."""
    host, sep, port = text.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65_536 or "/" in host:
        raise ValueError(f"expected HOST:PORT with a port from 1 to 65535, got {text!r}")
    return host, int(port)


def parse_endpoints(text: str) -> tuple[tuple[str, int], ...]:
    """Comma-separated `host:port` etcd endpoints (at least one, no repeats)."""
    endpoints = tuple(parse_host_port(part) for part in text.split(",") if part.strip())
    if not endpoints:
        raise ValueError(f"expected one or more etcd endpoints HOST:PORT separated by commas, got {text!r}")
    if len(set(endpoints)) != len(endpoints):
        raise ValueError(f"an etcd endpoint is listed twice in {text!r}")
    return endpoints


def parse_peer_addresses(text: str) -> dict[str, tuple[str, int]]:
    """`ID=HOST:PORT,...` (may be empty): where to dial these peers instead of their advertised address."""
    peers: dict[str, tuple[str, int]] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        node_id, sep, address = part.partition("=")
        if not sep:
            raise ValueError(f"expected ID=HOST:PORT, got {part.strip()!r}")
        node_id = check_name("a node id", node_id.strip())
        if node_id in peers:
            raise ValueError(f"node {node_id!r} is listed twice")
        peers[node_id] = parse_host_port(address)
    return peers
