"""What a server needs to be run by operators, assembled in one place for server.py.

TLS and auth (service/auth.py), limits (service/limits.py), metrics
(service/metrics.py), the plaintext health-only port, the reloading of TLS and
auth files (on SIGHUP and when they change), and the start-up log of settings.

The interceptors (service/interceptors.py), outermost first: the registry of open calls (it sends every
Subscribe reply itself, under the subscriber send timeout), metrics (so refused
calls are timed and counted too), auth (nothing unidentified reaches the limits'
counters), in a cluster the routing (service/routing.py: a call forwarded to its
stream's leader was authorized here, and meets the limits there), then limits. A
call without valid credentials is refused by auth before its request is read,
with a handler served as it is (no layer wraps it): it is counted as a refusal,
not timed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc

from service import auth, limits, metrics
from service.config import Settings, describe, describe_changes
from service.interceptors import Interceptors, WrappingInterceptor
from service.opencalls import OpenCalls, OpenCallsInterceptor
from service.replybudget import ReplyBudget
from storage import Engine

log = logging.getLogger(__name__)


class Operations:
    def __init__(
        self,
        settings: Settings,
        service: Any,
        engine: Callable[[], Engine | None],
        subscriptions: Callable[[], int],
        replies: ReplyBudget | None = None,
        routing: WrappingInterceptor | None = None,
    ) -> None:
        """`service`: the proto's service descriptor; `engine` is None until recovery ends;
        `replies`: the servicer's reply budget, for the metrics; `routing`: a cluster's."""
        self.settings = settings
        self._service_name = service.full_name
        # Open Subscribe and Consume calls and waiting Reads, each of which can be ended from here
        # (service/opencalls.py): by the send timeout, and by auth when a reload revokes them.
        self.open_calls = OpenCalls()
        self.security = auth.Security(settings)  # ConfigError for TLS, token or ACL files that do not load
        self.metrics = metrics.Metrics(settings.metrics_stream_series) if settings.metrics_port else None
        observer = self.metrics.refused if self.metrics is not None else None
        self.limits = limits.LimitsInterceptor(service.full_name, settings, engine, observer)
        self.send_timeout = limits.SendTimeout(settings.subscriber_send_timeout_ms, observer)
        chain: list[WrappingInterceptor | None] = [
            OpenCallsInterceptor(service.full_name, self.open_calls, self.send_timeout.send)
        ]
        if self.metrics is not None:
            chain.append(metrics.MetricsInterceptor(service.full_name, self.metrics, engine))
            self.metrics.registry.register(
                metrics.EngineCollector(engine, subscriptions, lambda: self.limits.blocked_reads)
            )
            if replies is not None:
                self.metrics.registry.register(metrics.ReplyBudgetCollector(replies))
        chain.append(self.security.interceptor(service, self.open_calls, observer))
        chain.append(routing)
        chain.append(self.limits)
        self._interceptors = [i for i in chain if i is not None]
        self.metrics_server: metrics.MetricsServer | None = None
        self.health_server: grpc.aio.Server | None = None
        self.health_port: int | None = None
        self._watch: asyncio.Task[None] | None = None

    def interceptors(self, handlers: Mapping[str, grpc.RpcMethodHandler]) -> Interceptors:
        """`handlers` (the servicer's, by method name) wrapped by the interceptors."""
        return Interceptors(self._service_name, self._interceptors, handlers)

    def server_options(self) -> list[tuple[str, Any]]:
        return limits.server_options(self.settings)

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Listen on `address` over TLS when configured, else plaintext; return the port."""
        return self.security.add_port(server, address)

    async def start(self, health_servicer: Any, address: Callable[[str, int], str]) -> None:
        """After the main server has started: log settings, open the health and metrics ports."""
        settings = self.settings
        if settings.log_format == "json":
            log.info("settings", extra={"settings": describe(settings)})  # one event: every setting
        else:
            log.info("%s", describe_changes(settings))  # for people: what differs, one per line
        if self.security.tls is not None:
            mutual = " with client certificates" if settings.tls_client_ca_file else ""
            log.info("TLS on%s", mutual)
        if self.security.auth is not None:
            log.info(
                "authorization on: %d tokens, %d rules",
                len(self.security.auth.tokens),
                len(self.security.auth.acl.rules),
            )
            if settings.tokens_file and self.security.tls is None:
                log.warning(
                    "bearer tokens are accepted over plaintext: whoever can watch the network between "
                    "clients and this server can read them and call as their principals; set "
                    "tls_cert_file and tls_key_file"
                )
        if settings.health_port:
            # Health only, plaintext: for probes that cannot do TLS (Kubernetes gRPC probes).
            server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
            self.health_port = server.add_insecure_port(address(settings.host, settings.health_port))
            self.health_server = server
            await server.start()
            log.info("health checks on port %d (plaintext)", self.health_port)
        if self.metrics is not None:
            self.metrics.registry.register(metrics.LoopLagCollector(asyncio.get_running_loop()))
            auth_state = self.security.auth
            self.metrics_server = metrics.MetricsServer(
                self.metrics,
                settings.metrics_host,
                settings.metrics_port,
                gate=auth_state.stream_filter if auth_state is not None else None,
            )
            await asyncio.to_thread(self.metrics_server.start)
        if settings.reload_interval_ms and (self.security.tls or self.security.auth):
            self._watch = asyncio.create_task(self._watch_files(settings.reload_interval_ms / 1000))

    def watch_cluster(self, state: Callable[[], metrics.ClusterState]) -> None:
        """Report a cluster node's state on /metrics (after `start`, on the event loop)."""
        if self.metrics is not None:
            self.metrics.registry.register(metrics.ClusterCollector(asyncio.get_running_loop(), state))

    async def _watch_files(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.security.reload_if_changed()

    def reload(self, reason: str = "SIGHUP") -> bool:
        """Re-read the TLS, token and ACL files now."""
        return self.security.reload(reason)

    async def stop(self, grace_s: float) -> None:
        """After the main server has stopped: close the other ports, stop watching files."""
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self.health_server is not None:
            await self.health_server.stop(grace_s)
        if self.metrics_server is not None:
            await asyncio.to_thread(self.metrics_server.stop)
