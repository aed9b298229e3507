"""Channels to the other nodes of a cluster: one grpc.aio channel per peer, reused by every call.

A peer is dialled at its advertised address, or at the one `peer_addresses` gives for
its id (NAT, tunnels, the tests' fault proxies). A peer that comes back at another
address gets a new channel; the old one is closed. With TLS on, peers are dialled
over TLS too, checked against `peer_ca_file` (else `tls_client_ca_file`, else the
system's roots); under mutual TLS this node presents its own certificate.

Reconnection is kept quick (at most `_MAX_RECONNECT_BACKOFF_MS` between attempts): a
peer that restarts is a stream leader coming back, and gRPC's default backoff would
fail calls to it for up to two minutes after it is up.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc

from cluster.addresses import parse_peer_addresses
from service.config import Settings

_MAX_RECONNECT_BACKOFF_MS = 1000


def _target(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def peer_credentials(settings: Settings) -> grpc.ChannelCredentials | None:
    """TLS credentials for calls to peers when the server runs TLS; None for plaintext."""
    if not settings.tls_cert_file:
        return None
    ca_file = settings.peer_ca_file or settings.tls_client_ca_file
    roots = Path(ca_file).read_bytes() if ca_file else None
    if not settings.tls_client_ca_file:
        return grpc.ssl_channel_credentials(roots)
    # Mutual TLS: peers ask for a client certificate; a node presents its own.
    key, chain = Path(settings.tls_key_file).read_bytes(), Path(settings.tls_cert_file).read_bytes()
    return grpc.ssl_channel_credentials(roots, key, chain)


class PeerChannels:
    """The channels of one node to its peers. Event loop only."""

    def __init__(self, settings: Settings) -> None:
        self._overrides = {
            node: _target(host, port)
            for node, (host, port) in parse_peer_addresses(settings.peer_addresses).items()
        }
        self._credentials = peer_credentials(settings)
        self._options: list[tuple[str, Any]] = [
            ("grpc.max_send_message_length", settings.max_message_bytes),
            ("grpc.max_receive_message_length", settings.max_message_bytes),
            ("grpc.keepalive_time_ms", settings.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", settings.keepalive_timeout_ms),
            ("grpc.max_reconnect_backoff_ms", _MAX_RECONNECT_BACKOFF_MS),
        ]
        # node id -> (target, channel, method path -> multicallable)
        self._peers: dict[str, tuple[str, grpc.aio.Channel, dict[str, Any]]] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def target(self, node_id: str, advertised: str) -> str:
        """Where this node dials `node_id`."""
        return self._overrides.get(node_id, advertised)

    def method(self, node_id: str, advertised: str, path: str, kind: str, **serializers: Any) -> Any:
        """The multicallable for `path` on the peer's channel; `kind` is the channel method that
        makes it (`unary_unary`, `unary_stream`, `stream_stream`)."""
        target = self.target(node_id, advertised)
        peer = self._peers.get(node_id)
        if peer is None or peer[0] != target:
            if peer is not None:  # the peer came back elsewhere: its old address is dead
                self._close_later(peer[1])
            peer = (target, self._open(target), {})
            self._peers[node_id] = peer
        callables = peer[2]
        multicallable = callables.get(path)
        if multicallable is None:
            multicallable = callables[path] = getattr(peer[1], kind)(path, **serializers)
        return multicallable

    def _open(self, target: str) -> grpc.aio.Channel:
        if self._credentials is None:
            return grpc.aio.insecure_channel(target, options=self._options)
        return grpc.aio.secure_channel(target, self._credentials, options=self._options)

    def _close_later(self, channel: grpc.aio.Channel) -> None:
        task = asyncio.get_running_loop().create_task(channel.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        channels = [channel for _, channel, _ in self._peers.values()]
        self._peers.clear()
        await asyncio.gather(*(channel.close() for channel in channels), *self._closing)
