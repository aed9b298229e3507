"""Build, start and stop a streamlog server: gRPC service, health, reflection, engine.

Start-up order: the port is bound and answering first, with health NOT_SERVING,
then the engine opens (recovery may take a while on a large data directory) off
the event loop, then health turns SERVING. Probes thus see "not ready" instead of
"connection refused" during recovery, and StreamLogService calls get UNAVAILABLE.

Shutdown (SIGTERM, SIGINT or `stop()`): health NOT_SERVING, new calls refused with
UNAVAILABLE, blocked reads answered empty and subscriptions ended with
UNAVAILABLE, in-flight calls given `shutdown_grace_ms` to finish, then the engine
synced and closed.

In a cluster (`--cluster`, service/clusternode.py), the node joins after its engine
has recovered and before health turns SERVING (the overall health, ""; StreamLogService's
once its copies have caught up: readiness), and leaves after the calls have
drained, before the engine closes. A node that can no longer act as a member (its id
taken while it was cut off from etcd) shuts down like this and exits with an error.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import signal
import socket
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc
from streamlog.v1 import streamlog_pb2 as pb

from service.config import Settings, engine_config
from service.http.calls import Dispatcher
from service.http.gateway import HttpGateway
from service.ops import Operations
from service.servicer import StreamLogServicer
from service.waiters import Waiters
from storage import Engine
from storage.fs import FileSystem

if TYPE_CHECKING:
    from service.clusternode import ClusterNode

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["StreamLogService"]
SERVICE_NAME = SERVICE.full_name
# RPCs whose servicer methods return the serialized reply (stored records + fields).
RAW_REPLY_METHODS = frozenset({"Read", "Subscribe", "Consume", "Claim", "AutoClaim"})

_HANDLER_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _pass_through(reply: bytes) -> bytes:
    return reply


def method_handlers(servicer: StreamLogServicer) -> dict[str, grpc.RpcMethodHandler]:
    """A handler per RPC of the proto's service, built from its descriptor.

    Built here rather than by the generated `add_..._to_server` so Read and Subscribe
    can send bytes as they are; going through the descriptor also means an RPC added
    to the proto without a servicer method fails at start-up, not at the first call.
    """
    handlers = {}
    for method in SERVICE.methods:
        request_type = getattr(pb, method.input_type.name)
        response_type = getattr(pb, method.output_type.name)
        factory = _HANDLER_FACTORIES[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = factory(
            getattr(servicer, method.name),
            request_deserializer=request_type.FromString,
            response_serializer=_pass_through
            if method.name in RAW_REPLY_METHODS
            else response_type.SerializeToString,
        )
    return handlers


class GenericHandlersOnly:
    """A server as generated `add_..._to_server` functions see it: it takes their handlers as a
    generic handler and registers no method.

    grpc.aio keeps a request open for the next call of each registered method and, after
    every call it accepts, waits on all of them again: about 9 Python calls per registered
    method and call, whatever the method. StreamLogService's 27, health's 3, reflection's 1
    (and a cluster node's ReplicaService's 2) cost about 280 per unary Append (a bare
    handler's whole call takes about 260); a generic handler costs one dictionary lookup.
    """

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        """Not registered: the generic handler given beside them serves the same methods."""


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class PortInUseError(OSError):
    """A port the settings name is taken: the server starts nothing and says which one."""


def check_port_free(host: str, port: int, setting: str) -> None:
    """Raise PortInUseError if `port` on `host` cannot be listened on because it is taken.

    Checked before anything starts, so that a taken port is one clear line (gRPC's own
    bind failure is a core log line and a message pointing to GRPC_VERBOSITY). Port 0
    is always free. The probe binds as gRPC does (SO_REUSEADDR) and closes at once.
    """
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return  # an unresolvable host: gRPC reports it when it binds
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    return  # not ours to judge (no such local address, ...): gRPC's bind reports it
                raise PortInUseError(
                    f"{setting} {port} on {host} is in use by another process; stop it, or choose "
                    f"another {setting} (0 picks a free one)",
                ) from None


class StreamLogServer:
    """One server: call `await start()`, later `await stop()`, on the same event loop."""

    def __init__(self, settings: Settings, *, fs: FileSystem | None = None) -> None:
        self.settings = settings
        # Tests only: the engine's file system (tests/cluster/powernode.py runs a server on
        # one that keeps only what was synced, to cut its power). None: the real one.
        self._fs = fs
        self.port: int | None = None
        self.engine: Engine | None = None
        self._server: grpc.aio.Server | None = None
        self._health: Any = None
        self._servicer: StreamLogServicer | None = None
        self._waiters: Waiters | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._stopped = False
        self.ops: Operations | None = None
        self.http: HttpGateway | None = None
        self.cluster: ClusterNode | None = None
        self._ready_task: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        """host:port the server listens on (after start)."""
        return _address(self.settings.host, self.port or 0)

    @property
    def servicer(self) -> StreamLogServicer:
        assert self._servicer is not None, "server not started"
        return self._servicer

    async def start(self) -> None:
        settings = self.settings
        check_port_free(settings.host, settings.port, "port")
        if settings.health_port:
            check_port_free(settings.host, settings.health_port, "health_port")
        loop = asyncio.get_running_loop()
        self._executor = ThreadPoolExecutor(
            max_workers=settings.append_threads, thread_name_prefix="streamlog-io"
        )
        self._waiters = Waiters()
        self._servicer = StreamLogServicer(settings, self._waiters, self._executor)
        self._health = health.aio.HealthServicer()
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if settings.cluster:
            # Imported here: a single server never loads the cluster layer or the etcd client.
            from service.clusternode import ClusterNode

            self.cluster = ClusterNode(settings, SERVICE, RAW_REPLY_METHODS)
        # TLS, auth, limits, metrics (service/ops.py); bad TLS, token or ACL files stop start-up here.
        servicer = self._servicer
        self.ops = ops = Operations(
            settings,
            SERVICE,
            lambda: self.engine,
            lambda: servicer.subscriptions,
            servicer.replies,
            self.cluster.routing if self.cluster is not None else None,
        )

        # The servicer's handlers, wrapped by the interceptors once, here (service/interceptors.py).
        interceptors = ops.interceptors(method_handlers(self._servicer))
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", settings.max_message_bytes),
                ("grpc.max_send_message_length", settings.max_message_bytes),
                # Without this, a second server on the same port would silently share
                # it (SO_REUSEPORT) instead of failing to start.
                ("grpc.so_reuseport", 0),
                *ops.server_options(),
            ],
            interceptors=interceptors.server_interceptors(),
        )
        # Generic handlers only, no registered methods (see GenericHandlersOnly).
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, interceptors.handlers),)
        )
        services = GenericHandlersOnly(server)
        if self.cluster is not None:
            self.cluster.add_services(services)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, services)
        # What reflection.enable_server_reflection does for a grpc.aio server, registering nothing.
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
            reflection.aio.ReflectionServicer((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)),
            services,
        )
        self.port = ops.add_port(server, _address(settings.host, settings.port))
        self._server = server
        await server.start()
        log.info("listening on %s (data %s, fsync %s)", self.address, settings.data_dir, settings.fsync)
        try:
            await ops.start(self._health, _address)
            if self.cluster is not None:
                ops.watch_cluster(self.cluster.metrics_state)
            if settings.http_port:
                # The HTTP API runs every call through these same handlers and interceptors.
                dispatcher = Dispatcher(SERVICE, interceptors)
                self.http = HttpGateway(settings, dispatcher, ops.security)
                await self.http.start()
        except BaseException:
            await self.stop()
            raise

        try:
            self.engine = await loop.run_in_executor(self._executor, self._open_engine)
        except BaseException:
            await self.stop()
            raise
        self.engine.add_append_listener(self._waiters.on_append)
        self._servicer.listen_to(self.engine)
        self._servicer.attach_engine(self.engine)
        if self.cluster is not None:
            try:
                await self.cluster.start(
                    self.engine, self._forget_stream, self.ops.open_calls, self._waiters.hops
                )
            except BaseException:
                await self.stop()
                raise
        if self.http is not None:
            await self.http.attach(self.engine)
        if self.cluster is None:
            await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        else:
            # Alive and a member (liveness: the overall health); ready (StreamLogService) once
            # its copies have caught up (service/clusternode.py).
            await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
            self._ready_task = asyncio.create_task(self._serve_once_caught_up(self.cluster))
        log.info("serving %d streams", self.engine.stream_count())

    async def _serve_once_caught_up(self, cluster: ClusterNode) -> None:
        await cluster.wait_caught_up()
        log.info("caught up: every copy on this node is in sync; ready")
        await self._health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)

    def _open_engine(self) -> Engine:
        engine = Engine(self.settings.data_dir, config=engine_config(self.settings), fs=self._fs)
        for dirname in engine.unreadable:
            log.warning("stream directory %s failed its checks and is not served", dirname)
        return engine

    def _forget_stream(self, name: str) -> None:
        """A stream deleted by the cluster (not by a call here): its waiting readers end NOT_FOUND."""
        assert self._waiters is not None and self._servicer is not None
        self._waiters.on_delete(name)
        self._servicer.group_waits.on_delete(name)

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self._health.set(name, status)

    async def stop(self) -> None:
        """Drain and stop; safe to call more than once, and after a failed start."""
        if self._stopped:
            return
        self._stopped = True
        # A start that failed before listening (a taken port) has nothing to drain: say nothing.
        started = self._server is not None
        if started:
            log.info("draining")
        if self._ready_task is not None:
            self._ready_task.cancel()
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._servicer is not None:
            self._servicer.start_draining()
        if self.cluster is not None:
            self.cluster.drain()
        if self._waiters is not None:
            self._waiters.close()
        if self._servicer is not None:
            self._servicer.group_waits.close()
        if self.http is not None:
            await self.http.stop()
        if self._server is not None:
            await self._server.stop(self.settings.shutdown_grace_ms / 1000)
        if self.ops is not None:
            await self.ops.stop(self.settings.shutdown_grace_ms / 1000)
        if self.cluster is not None:
            await self.cluster.stop()
        if self._executor is not None:
            # Appends still in a thread finish before the engine closes under them.
            await asyncio.to_thread(self._executor.shutdown, wait=True)
        if self.engine is not None:
            engine, self.engine = self.engine, None
            await asyncio.to_thread(_sync_and_close, engine)
        if started:
            log.info("stopped")


def _sync_and_close(engine: Engine) -> None:
    engine.sync()
    engine.close()


async def serve(
    settings: Settings, stop: asyncio.Event | None = None, *, fs: FileSystem | None = None
) -> None:
    """Run a server until SIGTERM or SIGINT (or `stop` is set), then shut it down gracefully.

    `fs`: the engine's file system, for tests (see StreamLogServer); None, the real one.
    """
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)
    for signum in signals:
        loop.add_signal_handler(signum, stop.set)
    server = StreamLogServer(settings, fs=fs)
    # SIGHUP re-reads the TLS certificates, tokens and access rules (see service/auth.py).
    loop.add_signal_handler(signal.SIGHUP, lambda: server.ops and server.ops.reload("SIGHUP"))
    signals = (*signals, signal.SIGHUP)
    try:
        await server.start()
        _tune_for_latency()
        await _stop_requested(stop, server.cluster)
    finally:
        await server.stop()
        for signum in signals:
            loop.remove_signal_handler(signum)
    if server.cluster is not None and server.cluster.error is not None:
        raise RuntimeError(f"left the cluster: {server.cluster.error}")


async def _stop_requested(stop: asyncio.Event, cluster: ClusterNode | None) -> None:
    """Until `stop` is set, or the cluster says this node can no longer act as a member."""
    waits = [asyncio.ensure_future(stop.wait())]
    if cluster is not None:
        waits.append(asyncio.ensure_future(cluster.failed.wait()))
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
    if stop.is_set():
        log.info("shutdown requested")
    else:
        log.error("shutting down: this node can no longer act as a cluster member")


# Tracked objects allocated (net of those freed) between two young collections; Python's is 700.
GC_YOUNG_OBJECTS = 100_000


def _tune_for_latency() -> None:
    """Process settings that cut the latency tail and the CPU of a long-running server.

    A thread waiting for the GIL (the event loop, behind a maintenance or
    append-executor thread) waits up to the switch interval: 0.5 ms instead of
    the default 5 ms. Objects alive after start-up (the engine's index, the
    generated code) are moved out of the garbage collector's reach so its full
    passes stay short.

    A young collection every GC_YOUNG_OBJECTS tracked objects, not every 700: a call's
    objects (an AppendMany's batches, the streams it opens) live for the call or the
    open-stream cache's turn, so at 700 each was walked by a young, a middle and then
    every full collection, a fifth of an AppendMany load's CPU (docs/PERFORMANCE.md, perf29);
    at 100,000 most are freed by their last reference before any collection sees them.
    The server makes little cyclic garbage (about 2,000 objects over that load), which
    waits for a collection at most this many allocations longer.
    """
    sys.setswitchinterval(0.0005)
    gc.freeze()
    gc.set_threshold(GC_YOUNG_OBJECTS, *gc.get_threshold()[1:])
