"""Prometheus metrics, served over HTTP on `metrics_port` (`/metrics`).

Two sources:

- **Calls**, counted as they happen by `MetricsInterceptor`: RPC latency per
  method and status code; per stream, appends (calls, entries, request bytes),
  reads (calls and reply bytes, plain or group), subscriptions started and the
  replies and bytes they sent; refusals by the auth and limits layers; latency of
  appends to `fsync=always` streams.
- **State**, sampled from the engine at scrape time by `EngineCollector` (nothing
  on the hot path): streams, entries, segments, nodes and bytes on disk, in total
  and per stream; per consumer group its lag, pending, scheduled, consumers and
  counters (deliveries, redeliveries, acks, expiries, dead letters); active
  subscriptions and blocked reads.
- **Cluster** (a node run with `--cluster`), sampled by `ClusterCollector` on the
  event loop at scrape time from `ClusterState` (service/clusternode.py): live nodes,
  copies not yet in sync, the streams led here by replication factor and in-sync
  count, under-replicated streams (named: those only, so that the series stay few at
  many streams), replication lag per follower (entries summed, seconds the worst over
  the streams led here), leader changes, calls forwarded to leaders per method.

The engine does not expose the time of its fdatasync calls. The closest figure
the service sees is `streamlog_durable_append_seconds`: appends to `always`
streams, request to reply, each of which includes its (group-commit) fdatasync.

Series are labelled only with the names of streams that exist: a call on a name
that does not exist (a blocking read waiting for it) leaves none behind, and a
deleted stream's series are dropped. Group series are sampled from the engine,
so a deleted group's go with it.

Each server has its own registry, so several servers in one process (tests) do
not mix their figures.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import socket
import threading
import time
import wsgiref.simple_server
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Iterator
from typing import Any

import grpc
import prometheus_client
import prometheus_client.exposition
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from service.callcontext import CallContext
from service.interceptors import (
    MESSAGE_SESSIONS,
    SessionBehavior,
    StreamBehavior,
    UnaryBehavior,
    WrappingInterceptor,
    iterate,
    request_of,
)
from service.replybudget import ReplyBudget
from storage import Engine

log = logging.getLogger(__name__)

# From a cached read (~50 us) to a blocking read's wait (up to max_block_ms) and long Subscribes.
RPC_BUCKETS = (
    *(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05),
    *(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
# fdatasync on SSDs takes 0.1-10 ms; slow disks and group commit under load reach 100 ms and more.
DURABLE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2.5)

# Whether a stream exists now.
Exists = Callable[[str], bool]


def _code_name(context: CallContext, exc: BaseException | None) -> str:
    code = context.code()
    if code is not None:
        return code.name if isinstance(code, grpc.StatusCode) else str(code)
    if exc is None:
        return "OK"
    # A cancelled call (client gone, deadline passed) or an exception grpc reports as UNKNOWN.
    return "CANCELLED" if isinstance(exc, asyncio.CancelledError) else "UNKNOWN"


def _mode(request: Any) -> str:
    # getattr: Read and Subscribe requests gained `group` with consumer groups.
    return "group" if getattr(request, "group", "") else "plain"


def _size(reply: Any) -> int:
    # Read and Subscribe replies are sent as serialized bytes (see service/streamwire.py).
    return len(reply) if isinstance(reply, bytes) else reply.ByteSize()


# The `stream` label value of the streams past `stream_series`: empty, as no stream's name is, so no
# stream can share it. Prometheus stores an empty label as no label: PromQL selects it with
# `{stream=""}` and the named streams with `{stream!=""}`.
OTHER_STREAMS = ""


class Metrics:
    """The registry and the call metrics of one server.

    The per-stream counters give their own series to the first `stream_series` streams that
    use them (a deleted stream gives its place back); the calls on every stream past those
    are counted under `stream=""` (OTHER_STREAMS). A scrape costs what the series number, so a
    million streams must not make a million of each."""

    def __init__(self, stream_series: int = 1000) -> None:
        self._stream_series = stream_series
        self._labelled: set[str] = set()  # the streams that have series of their own
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.rpc_seconds = Histogram(
            "streamlog_rpc_duration_seconds",
            "StreamLogService calls by method and status code, from handler start to reply "
            "(for Subscribe: the subscription's lifetime).",
            ["method", "code"],
            buckets=RPC_BUCKETS,
            registry=r,
        )
        self.append_requests = Counter(
            "streamlog_append_requests",
            "Appends that succeeded (Append calls, Publish messages, AppendMany batches), per stream.",
            ["stream"],
            registry=r,
        )
        self.appended_entries = Counter(
            "streamlog_appended_entries",
            "Entries appended (duplicates of idempotent retries not counted), per stream.",
            ["stream"],
            registry=r,
        )
        self.append_bytes = Counter(
            "streamlog_append_request_bytes",
            "Serialized size of successful Append requests and Publish messages, per stream.",
            ["stream"],
            registry=r,
        )
        self.durable_append_seconds = Histogram(
            "streamlog_durable_append_seconds",
            "Appends to fsync=always streams, request to reply; each includes its group-commit fdatasync.",
            buckets=DURABLE_BUCKETS,
            registry=r,
        )
        self.read_requests = Counter(
            "streamlog_read_requests",
            "Read calls that succeeded, per stream and mode (plain or group).",
            ["stream", "mode"],
            registry=r,
        )
        self.read_bytes = Counter(
            "streamlog_read_reply_bytes", "Bytes of Read replies, per stream.", ["stream"], registry=r
        )
        self.subscriptions = Counter(
            "streamlog_subscriptions_started",
            "Subscribe and Consume calls, per stream and mode (plain or group), counted at their first "
            "reply sent while the stream exists.",
            ["stream", "mode"],
            registry=r,
        )
        self.subscribe_replies = Counter(
            "streamlog_subscribe_replies", "Replies sent to subscribers, per stream.", ["stream"], registry=r
        )
        self.subscribe_bytes = Counter(
            "streamlog_subscribe_reply_bytes", "Bytes sent to subscribers.", ["stream"], registry=r
        )
        self.refusals = Counter(
            "streamlog_refusals",
            "Calls refused before reaching the service: kind auth (reason missing, malformed, "
            "unknown_token, reserved_name, denied; revoked: ended by a reload of the token and ACL "
            "files) or limit (reason: the limit's name).",
            ["kind", "reason"],
            registry=r,
        )
        self._per_stream = (
            self.append_requests,
            self.appended_entries,
            self.append_bytes,
            self.read_bytes,
            self.subscribe_replies,
            self.subscribe_bytes,
        )
        self._per_stream_mode = (self.read_requests, self.subscriptions)
        # Per-stream children, looked up once per stream: `labels()` takes a lock and builds a
        # key on every call, several microseconds per call otherwise. Made only for streams
        # that exist (see `MetricsInterceptor`), dropped when they are deleted. The streams
        # past `stream_series` share OTHER_STREAMS's, kept under that name's key: such a
        # stream's key is only noted in a `_past` set (a tuple each was a tracked object for
        # the collector to walk, and three `labels()` calls, for every stream a load made).
        self._append_children: dict[str, tuple[Any, Any, Any]] = {}
        self._read_children: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._subscribe_children: dict[tuple[str, str], tuple[Any, Any, Any]] = {}
        self._append_past: set[str] = set()
        self._read_past: set[tuple[str, str]] = set()
        self._subscribe_past: set[tuple[str, str]] = set()

    def refused(self, kind: str, reason: str) -> None:
        """The observer given to the auth and limits interceptors."""
        self.refusals.labels(kind, reason).inc()

    def _label(self, stream: str) -> str:
        """The label value of `stream`'s series: its name while there is room, else OTHER_STREAMS."""
        if stream in self._labelled:
            return stream
        if len(self._labelled) < self._stream_series:
            self._labelled.add(stream)
            return stream
        return OTHER_STREAMS

    def append_children(self, stream: str, exists: Exists) -> tuple[Any, Any, Any] | None:
        """The Append counters of `stream`; None while it does not exist."""
        children = self._append_children.get(stream)
        if children is None:
            children = self._children(
                self._append_children,
                self._append_past,
                stream,
                stream,
                OTHER_STREAMS,
                exists,
                self._append_series,
            )
        return children

    def _append_series(self, label: str) -> tuple[Any, Any, Any]:
        return (
            self.append_requests.labels(label),
            self.appended_entries.labels(label),
            self.append_bytes.labels(label),
        )

    def read_children(self, stream: str, mode: str, exists: Exists) -> tuple[Any, Any] | None:
        """The Read counters of `stream` in `mode`; None while it does not exist."""
        children = self._read_children.get((stream, mode))
        if children is None:
            children = self._children(
                self._read_children,
                self._read_past,
                stream,
                (stream, mode),
                (OTHER_STREAMS, mode),
                exists,
                lambda label: (self.read_requests.labels(label, mode), self.read_bytes.labels(label)),
            )
        return children

    def subscribe_children(self, stream: str, mode: str, exists: Exists) -> tuple[Any, Any, Any] | None:
        """The subscription counters of `stream` in `mode` (started, replies, bytes); None while it
        does not exist."""
        children = self._subscribe_children.get((stream, mode))
        if children is None:
            children = self._children(
                self._subscribe_children,
                self._subscribe_past,
                stream,
                (stream, mode),
                (OTHER_STREAMS, mode),
                exists,
                lambda label: (
                    self.subscriptions.labels(label, mode),
                    self.subscribe_replies.labels(label),
                    self.subscribe_bytes.labels(label),
                ),
            )
        return children

    def _children(
        self,
        cache: dict[Any, Any],
        past: set[Any],
        stream: str,
        key: Any,
        other: Any,
        exists: Exists,
        make: Callable[[str], Any],
    ) -> Any:
        """The children of `stream` (`key` in `cache`, not there): OTHER_STREAMS's (`other` in
        `cache`) if it began past the limit (its key in `past`), else its own, made now; None
        while it does not exist."""
        if key not in past:
            if not exists(stream):
                return None
            label = self._label(stream)
            if label != OTHER_STREAMS:
                children = cache[key] = make(label)
                return children
            past.add(key)
        children = cache.get(other)
        if children is None:
            children = cache[other] = make(OTHER_STREAMS)
        return children

    def forget_stream(self, stream: str) -> None:
        """Drop a deleted stream's series, so deleted names do not accumulate (and its place)."""
        self._append_children.pop(stream, None)
        self._append_past.discard(stream)
        for mode in ("plain", "group"):
            self._read_children.pop((stream, mode), None)
            self._subscribe_children.pop((stream, mode), None)
            self._read_past.discard((stream, mode))
            self._subscribe_past.discard((stream, mode))
        if stream not in self._labelled:
            return  # counted under OTHER_STREAMS: that series stays, as the calls it counts happened
        self._labelled.discard(stream)
        for metric in self._per_stream:
            with contextlib.suppress(KeyError):
                metric.remove(stream)
        for metric in self._per_stream_mode:
            for mode in ("plain", "group"):
                with contextlib.suppress(KeyError):
                    metric.remove(stream, mode)

    def expose(self) -> bytes:
        """The text exposition format, as /metrics serves it."""
        return prometheus_client.generate_latest(self.registry)


class MetricsInterceptor(WrappingInterceptor):
    """Times every StreamLogService call and counts what it moved."""

    def __init__(self, service_name: str, metrics: Metrics, engine: Callable[[], Engine | None]) -> None:
        super().__init__(service_name)
        self._m = metrics
        self._engine = engine

    def _exists(self, stream: str) -> bool:
        # Series are labelled only with names of streams that exist: a read or subscription
        # waiting on any name a client makes up must not leave a series behind.
        engine = self._engine()
        return engine is not None and engine.exists(stream)

    def wrap_unary(self, method: str, behavior: UnaryBehavior) -> UnaryBehavior:
        m = self._m
        histogram = m.rpc_seconds
        ok = histogram.labels(method, "OK")  # bound once: the common case costs no label lookup
        account = getattr(self, f"_account_{method}", None)

        async def measured(request: Any, context: CallContext) -> Any:
            start = time.perf_counter()
            try:
                reply = await behavior(request, context)
            except BaseException as exc:
                histogram.labels(method, _code_name(context, exc)).observe(time.perf_counter() - start)
                raise
            elapsed = time.perf_counter() - start
            code = context.code()
            if code is None or code == grpc.StatusCode.OK:
                ok.observe(elapsed)
                if account is not None:
                    account(request, reply, elapsed)
            else:
                histogram.labels(method, _code_name(context, None)).observe(elapsed)
            return reply

        return measured

    def wrap_stream(self, method: str, behavior: StreamBehavior) -> StreamBehavior:
        m = self._m

        async def measured(request: Any, context: CallContext) -> AsyncIterator[Any]:
            start = time.perf_counter()
            counters = None
            failure: BaseException | None = None
            try:
                async for reply in iterate(behavior, request, context):
                    if counters is None:
                        # Counted from the first reply sent while the stream exists (a refused
                        # Subscribe sends none).
                        counters = m.subscribe_children(request.stream, _mode(request), self._exists)
                        if counters is not None:
                            counters[0].inc()
                    if counters is not None:
                        counters[1].inc()
                        counters[2].inc(_size(reply))
                    yield reply
            except BaseException as exc:
                failure = exc
                raise
            finally:
                self._observe(method, context, failure, start)

        return measured

    def _observe(
        self, method: str, context: CallContext, failure: BaseException | None, start: float
    ) -> None:
        """A streaming call's lifetime, in the call histogram by the code it ended with."""
        self._m.rpc_seconds.labels(method, _code_name(context, failure)).observe(time.perf_counter() - start)

    def wrap_session(self, method: str, behavior: SessionBehavior) -> SessionBehavior:
        if method not in MESSAGE_SESSIONS:
            return super().wrap_session(method, behavior)

        async def measured(requests: AsyncIterator[Any], context: CallContext) -> AsyncGenerator[Any, None]:
            # The session's lifetime in the call histogram; each message answered without an
            # error in the append counters of its stream, as an Append call is.
            start = time.perf_counter()
            taken: collections.deque[Any] = collections.deque()
            failure: BaseException | None = None

            async def noted(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
                async for request in requests:
                    taken.append(request)
                    yield request

            try:
                async with contextlib.aclosing(behavior(noted(requests), context)) as replies:
                    async for reply in replies:
                        request = request_of(taken.popleft())
                        if not reply.HasField("error"):
                            self._count_append(request, reply)
                        yield reply
            except BaseException as exc:
                failure = exc
                raise
            finally:
                self._observe(method, context, failure, start)

        return measured

    def _count_append(self, request: Any, reply: Any) -> bool:
        """Count a successful append (an Append call's or a Publish message's); False if its
        stream was deleted since."""
        counters = self._m.append_children(request.stream, self._exists)
        if counters is None:
            return False
        requests, entries, size = counters
        requests.inc()
        if not reply.duplicate:
            entries.inc(reply.last_offset - reply.first_offset + 1)
        size.inc(request.ByteSize())
        return True

    # Per-method accounting of successful calls: _account_<Method>(request, reply, elapsed_s).

    def _account_Append(self, request: Any, reply: Any, elapsed: float) -> None:
        if not self._count_append(request, reply):
            return  # deleted since
        engine = self._engine()
        if engine is not None and engine.fsync_policy(request.stream).blocks:
            self._m.durable_append_seconds.observe(elapsed)

    def _account_AppendMany(self, request: Any, reply: Any, elapsed: float) -> None:
        # Each batch written counts as an Append of its stream. The batches of streams that share
        # counters (all those past metrics_stream_series) are added up first: one increment of
        # each counter per call, not one per batch (each takes the counter's lock).
        sums: dict[tuple[Any, Any, Any], list[int]] = {}
        append_children, exists = self._m.append_children, self._exists
        for batch, result in zip(request.batches, reply.results, strict=True):
            if result.HasField("error"):
                continue
            counters = append_children(batch.stream, exists)
            if counters is None:
                continue  # deleted since
            added = sums.get(counters)
            if added is None:
                added = sums[counters] = [0, 0, 0]
            added[0] += 1
            if not result.duplicate:
                added[1] += result.last_offset - result.first_offset + 1
            added[2] += batch.ByteSize()
        for (requests, entries, size), (calls, written, sent) in sums.items():
            requests.inc(calls)
            entries.inc(written)
            size.inc(sent)

    def _account_Read(self, request: Any, reply: Any, elapsed: float) -> None:
        counters = self._m.read_children(request.stream, _mode(request), self._exists)
        if counters is not None:
            counters[0].inc()
            counters[1].inc(_size(reply))

    def _account_DeleteStream(self, request: Any, reply: Any, elapsed: float) -> None:
        self._m.forget_stream(request.stream)


class EngineCollector(Collector):
    """Engine and server state, read at scrape time (on the HTTP server's thread)."""

    def __init__(
        self,
        engine: Callable[[], Engine | None],
        subscriptions: Callable[[], int],
        blocked_reads: Callable[[], int],
    ) -> None:
        self._engine = engine
        self._subscriptions = subscriptions
        self._blocked_reads = blocked_reads

    def describe(self) -> list:
        return []  # the families depend on the engine's state: nothing to check at registration

    def collect(self) -> Iterator[Any]:
        engine = self._engine()
        ready = 1 if engine is not None else 0
        yield GaugeMetricFamily("streamlog_ready", "1 once the engine has recovered its data.", ready)
        yield GaugeMetricFamily(
            "streamlog_active_subscriptions", "Open Subscribe calls.", self._subscriptions()
        )
        blocked = self._blocked_reads()
        yield GaugeMetricFamily("streamlog_blocked_reads", "Reads waiting with block_ms.", blocked)
        if engine is None:
            return
        try:
            yield from self._engine_families(engine)
        except Exception as exc:  # the engine closing under a scrape (shutdown), or a bug: never a 500 loop
            log.warning("metrics: engine state unavailable: %s", exc)

    def _engine_families(self, engine: Engine) -> Iterator[Any]:
        stats = engine.stats()
        # A scrape opens no stream: the totals cover every stream (a closed one as of its last
        # close: storage/catalog.py), the per-stream families the open ones.
        totals = {
            "streams": "Streams the server holds.",
            "open_streams": "Streams open now (at most max_open_streams, but for streams in use).",
            "entries": "Entries retained.",
            "segments": "Segment files.",
            "nodes": "Macro nodes.",
            "bytes_on_disk": "Bytes of segment files (space reserved ahead included).",
        }
        for key, help_text in totals.items():
            yield GaugeMetricFamily(f"streamlog_{key}", help_text, stats[key])
        yield GaugeMetricFamily(
            "streamlog_streams_uncounted",
            "Slot streams whose figures the totals miss until maintenance reads them (after a crash).",
            engine.uncounted_streams(),
        )
        yield GaugeMetricFamily(
            "streamlog_closes_waiting",
            "Streams the cache closed whose writes wait for the maintenance round's sync.",
            stats["closes_waiting"],
        )
        yield GaugeMetricFamily(
            "streamlog_open_streams_unsynced",
            "Open streams with writes (or a creation) no sync has taken up yet.",
            stats["open_unsynced"],
        )
        yield GaugeMetricFamily(
            "streamlog_unreadable_streams",
            "Stream directories whose metadata failed its checks at start-up (not served).",
            len(stats["unreadable_streams"]),
        )
        times = stats["fsync_seconds"]
        if times is not None:
            buckets = [("+Inf" if math.isinf(le) else repr(le), count) for le, count in times.buckets()]
            yield HistogramMetricFamily(
                "streamlog_fsync_seconds",
                "Time of each fdatasync/fsync the engine made (segments, group journals, directories).",
                buckets=buckets,
                sum_value=times.total_s,
            )
        yield CounterMetricFamily("streamlog_node_cache_hits", "Node cache hits.", stats["cache_hits"])
        yield CounterMetricFamily(
            "streamlog_node_cache_misses", "Decoded-node cache misses.", stats["cache_misses"]
        )

        per_stream = {
            "entries": GaugeMetricFamily("streamlog_stream_entries", "Entries retained.", labels=["stream"]),
            "bytes_on_disk": GaugeMetricFamily(
                "streamlog_stream_bytes_on_disk", "Bytes of the stream's segment files.", labels=["stream"]
            ),
            "segments": GaugeMetricFamily("streamlog_stream_segments", "Segment files.", labels=["stream"]),
            "first_offset": GaugeMetricFamily(
                "streamlog_stream_first_offset", "Oldest retained offset.", labels=["stream"]
            ),
            "end_offset": GaugeMetricFamily(
                "streamlog_stream_next_offset", "Offset the next append gets.", labels=["stream"]
            ),
            "damaged": GaugeMetricFamily(
                "streamlog_stream_damaged_ranges", "Ranges lost to damage (CORRUPT gaps).", labels=["stream"]
            ),
        }
        added = CounterMetricFamily(
            "streamlog_stream_entries_added", "Entries ever appended to the stream.", labels=["stream"]
        )
        last_append = GaugeMetricFamily(
            "streamlog_stream_last_append_timestamp_seconds", "Time of the newest entry.", labels=["stream"]
        )
        for name, info in stats["per_stream"].items():
            for key, family in per_stream.items():
                value = len(info.damaged) if key == "damaged" else getattr(info, key)
                family.add_metric([name], value)
            added.add_metric([name], info.entries_added)
            if info.last_timestamp_ms:
                last_append.add_metric([name], info.last_timestamp_ms / 1000)
        yield from per_stream.values()
        yield added
        yield last_append
        yield from self._group_families(engine, list(stats["per_stream"]))

    @staticmethod
    def _group_families(engine: Engine, streams: list[str]) -> Iterator[Any]:
        labels = ["stream", "group"]
        gauges = {
            "lag": GaugeMetricFamily(
                "streamlog_group_lag", "Entries still to receive (absent when unknown).", labels=labels
            ),
            "pending": GaugeMetricFamily(
                "streamlog_group_pending", "Entries delivered and not acknowledged.", labels=labels
            ),
            "scheduled": GaugeMetricFamily(
                "streamlog_group_scheduled", "Delayed entries waiting to become due.", labels=labels
            ),
            "consumers": GaugeMetricFamily("streamlog_group_consumers", "Consumers.", labels=labels),
            "active": GaugeMetricFamily(
                "streamlog_group_last_active_timestamp_seconds",
                "Last read, acknowledgement or claim.",
                labels=labels,
            ),
        }
        counters = {
            name: CounterMetricFamily(f"streamlog_group_{name}", help_text, labels=labels)
            for name, help_text in (
                ("delivered", "First deliveries."),
                ("redelivered", "Redeliveries: retries, claims, deliveries of released entries."),
                ("acked", "Entries acknowledged."),
                ("expired", "Entries dropped by expire_ms or max_deliveries (no dead-letter stream)."),
                ("dead_lettered", "Entries appended to the dead-letter stream."),
                ("evicted", "Pending or delayed entries the stream no longer had."),
            )
        }
        for stream in streams:
            try:
                groups = engine.list_groups(stream)
            except Exception:  # deleted since the listing: nothing to report for it
                continue
            for info in groups:
                key = [stream, info.name]
                if info.lag is not None:
                    gauges["lag"].add_metric(key, info.lag)
                gauges["pending"].add_metric(key, info.pending)
                gauges["scheduled"].add_metric(key, info.scheduled)
                gauges["consumers"].add_metric(key, len(info.consumers))
                gauges["active"].add_metric(key, info.active_ms / 1000)
                for name, family in counters.items():
                    family.add_metric(key, getattr(info.counters, name))
        yield from gauges.values()
        yield from counters.values()


class ReplyBudgetCollector(Collector):
    """The reply budget (service/replybudget.py), read at scrape time."""

    def __init__(self, budget: ReplyBudget) -> None:
        self._budget = budget

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Any]:
        budget = self._budget
        yield GaugeMetricFamily(
            "streamlog_queued_reply_bytes",
            "Bytes of replies built and not yet taken by their clients (max_queued_reply_bytes bounds it).",
            budget.queued,
        )
        yield CounterMetricFamily(
            "streamlog_queued_reply_refusals",
            "Reads refused after waiting queued_reply_wait_ms for room in the reply budget.",
            budget.refused,
        )


class LoopLagCollector(Collector):
    """How long the event loop takes to run a callback handed to it, measured at each scrape.

    A busy or blocked loop delays every RPC; this is that delay, seen from outside the
    loop (the scrape runs on the HTTP server's thread), with no timer running between
    scrapes.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float = 5.0) -> None:
        self._loop = loop
        self._timeout_s = timeout_s

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Any]:
        ran = threading.Event()
        started = time.perf_counter()
        try:
            self._loop.call_soon_threadsafe(ran.set)
        except RuntimeError:  # the loop is closed: the server is stopping
            return
        lag = time.perf_counter() - started if ran.wait(self._timeout_s) else self._timeout_s
        yield GaugeMetricFamily(
            "streamlog_event_loop_lag_seconds",
            "Time the event loop took to run a callback at the last scrape (capped at 5 s).",
            lag,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterState:
    """A cluster node's figures at one moment (built on the event loop, read by a scrape)."""

    live_nodes: int
    copies_behind: int  # copies here out of their stream's in-sync set (readiness waits for 0)
    led_streams: dict[tuple[int, int], int]  # (replicas, in sync) -> streams led here
    under_replicated: dict[str, int]  # stream led here -> its in-sync replicas, when short
    lag_entries: dict[str, int]  # follower -> entries behind, summed over the streams led here
    lag_seconds: dict[str, float]  # follower -> time since caught up, the worst stream led here
    leader_changes: dict[str, int]  # "gained" (a follower here elected) or "lost" -> count
    forwarded: dict[str, int]  # method -> calls relayed to a leader


class ClusterCollector(Collector):
    """The cluster node's state: taken on the event loop (where it changes), reported here."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, state: Callable[[], ClusterState], timeout_s: float = 5.0
    ) -> None:
        self._loop, self._state, self._timeout_s = loop, state, timeout_s

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Any]:
        taken: concurrent.futures.Future[ClusterState] = concurrent.futures.Future()

        def take() -> None:
            try:
                taken.set_result(self._state())
            except Exception as exc:
                taken.set_exception(exc)

        try:
            self._loop.call_soon_threadsafe(take)
            state = taken.result(self._timeout_s)
        except RuntimeError:  # the loop is closed: the server is stopping
            return
        except Exception as exc:  # a loop too busy to answer in time, or a bug: never a 500 loop
            log.warning("metrics: cluster state unavailable: %s", exc)
            return
        yield from _cluster_families(state)


def _cluster_families(state: ClusterState) -> Iterator[Any]:
    prefix = "streamlog_cluster_"
    yield GaugeMetricFamily(
        f"{prefix}live_nodes", "Nodes registered in etcd, as this node sees.", state.live_nodes
    )
    yield GaugeMetricFamily(
        f"{prefix}copies_behind",
        "Copies on this node out of their stream's in-sync set while it has a leader (the node is "
        "not ready until 0).",
        state.copies_behind,
    )
    led = GaugeMetricFamily(
        f"{prefix}led_streams",
        "Streams this node leads, by replication factor and in-sync replicas.",
        labels=["replicas", "in_sync"],
    )
    for (replicas, in_sync), count in sorted(state.led_streams.items()):
        led.add_metric([str(replicas), str(in_sync)], count)
    yield led
    yield GaugeMetricFamily(
        f"{prefix}under_replicated_streams",
        "Streams this node leads with fewer in-sync replicas than replicas.",
        len(state.under_replicated),
    )
    yield _labelled(
        GaugeMetricFamily,
        f"{prefix}stream_in_sync_replicas",
        "In-sync replicas of each under-replicated stream this node leads (no series when in sync).",
        "stream",
        state.under_replicated.items(),
    )
    yield _labelled(
        GaugeMetricFamily,
        f"{prefix}replication_lag_entries",
        "Entries each follower lacks, summed over the streams this node leads.",
        "follower",
        sorted(state.lag_entries.items()),
    )
    yield _labelled(
        GaugeMetricFamily,
        f"{prefix}replication_lag_seconds",
        "Time since each follower last caught up, the worst of the streams this node leads.",
        "follower",
        sorted(state.lag_seconds.items()),
    )
    yield _labelled(
        CounterMetricFamily,
        f"{prefix}leader_changes",
        "Leadership changes on this node: gained (a follower here elected) or lost (a stream led here "
        "moved on).",
        "change",
        [(change, state.leader_changes.get(change, 0)) for change in ("gained", "lost")],
    )
    yield _labelled(
        CounterMetricFamily,
        f"{prefix}forwarded_calls",
        "Calls this node relayed to their stream's leader, per method.",
        "method",
        sorted(state.forwarded.items()),
    )


def _labelled(kind: Any, name: str, help_text: str, label: str, values: Iterable[tuple[str, float]]) -> Any:
    """A family of one label, a sample per (label value, value)."""
    family = kind(name, help_text, labels=[label])
    for key, value in values:
        family.add_metric([key], value)
    return family


# Which streams a scraper may see (by name).
StreamFilter = Callable[[str], bool]
# Given a scrape's Authorization header (None: none sent), what it may see; None: refused.
Gate = Callable[[str | None], StreamFilter | None]


class ScrapeView(Collector):
    """The registry as one scraper may see it: series labelled with a stream it may not see
    are left out; the server's own series (no stream label) stay."""

    def __init__(self, registry: Any, visible: StreamFilter) -> None:
        self._registry, self._visible = registry, visible

    def collect(self) -> Iterator[Any]:
        decided: dict[str, bool] = {}
        for family in self._registry.collect():
            # Collectors build fresh families at each collect: filtering in place is safe.
            family.samples = [
                sample
                for sample in family.samples
                if "stream" not in sample.labels or self._sees(sample.labels["stream"], decided)
            ]
            yield family

    def _sees(self, stream: str, decided: dict[str, bool]) -> bool:
        seen = decided.get(stream)
        if seen is None:
            seen = decided[stream] = self._visible(stream)
        return seen

    def restricted_registry(self, names: Any) -> ScrapeView:
        # prometheus_client asks for this when a scrape names metrics (`?name[]=...`).
        return ScrapeView(self._registry.restricted_registry(names), self._visible)


class _QuietHandler(wsgiref.simple_server.WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # no access log: one line per scrape says nothing


class MetricsServer:
    """The HTTP endpoint; `start` binds it, `stop` closes it.

    With a `gate` (authorization is on), each scrape sees what its bearer token's principal
    may: without a token, the server's own series and no stream or group name; with a token
    from the tokens file, the series of the streams its rules let it see (as ListStreams);
    with an unknown or malformed one, 401.
    """

    def __init__(self, metrics: Metrics, host: str, port: int, gate: Gate | None = None) -> None:
        self._metrics, self._host, self._port, self._gate = metrics, host, port, gate
        self._httpd: Any = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._httpd.server_port if self._httpd is not None else self._port

    @property
    def host(self) -> str:
        """The address it listens on (once started)."""
        return self._httpd.server_address[0] if self._httpd is not None else self._host

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        registry: Any = self._metrics.registry
        if self._gate is not None:
            visible = self._gate(environ.get("HTTP_AUTHORIZATION"))
            if visible is None:
                start_response(
                    "401 Unauthorized",
                    [("WWW-Authenticate", 'Bearer realm="streamlog"'), ("Content-Type", "text/plain")],
                )
                return [b"unknown or malformed bearer token (Authorization: Bearer <token>)\n"]
            registry = ScrapeView(registry, visible)
        return prometheus_client.make_wsgi_app(registry)(environ, start_response)

    def start(self) -> None:
        # The address family of the host (HTTPServer assumes IPv4); its address is an IP string.
        family, _, _, _, address = socket.getaddrinfo(
            self._host, self._port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]

        class Server(prometheus_client.exposition.ThreadingWSGIServer):
            address_family = family

        self._httpd = wsgiref.simple_server.make_server(
            str(address[0]), self._port, self._app, Server, handler_class=_QuietHandler
        )
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="metrics", daemon=True)
        self._thread.start()
        log.info("metrics on http://%s:%d/metrics", self._host, self.port)

    def stop(self) -> None:
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        assert self._thread is not None
        self._thread.join(timeout=10)
        self._httpd = None
