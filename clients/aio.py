"""The asyncio streamlog client (grpc.aio).

    from clients import AsyncClient

    async with AsyncClient("localhost:7070") as client:
        await client.append("orders", [b"one", b"two"])
        for entry in await client.read("orders", 0):
            print(entry.offset, entry.payload)

Every method takes a `timeout` in seconds (default: the client's `timeout`, to
which a blocking call adds the time it may block; None means no deadline), maps
replies to the typed values of `clients.types`, and raises the exceptions of
`clients.errors` (the grpc.RpcError is their `__cause__`).

clients/client.py is generated from clients/aio.py by clients/_generate_sync.py
when the build runs (`make gen`, and every make target that needs it); it is not
in the repository: change the clients in clients/aio.py. The streaming calls, which
differ between threads and asyncio, are written for each: clients/_streaming_sync.py
and clients/_streaming_aio.py.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from streamlog.v1 import streamlog_pb2 as pb
from streamlog.v1 import streamlog_pb2_grpc as pb_grpc

from clients import _convert as convert
from clients._connection import (
    DEFAULT_ADDRESS,
    DEFAULT_TIMEOUT_S,
    Pem,
    auth_metadata,
    call_timeout,
    open_channel,
)
from clients._routing import (
    LOOKUP_TIMEOUT_S,
    READ_FROM,
    READ_FROM_METADATA,
    ROUTE_METADATA,
    Attempts,
    Routes,
    retryable,
    seed_addresses,
    stream_of,
)
from clients._streaming_aio import AsyncConsumeSession, AsyncPublishSession, AsyncSubscription, sleep
from clients.errors import StreamlogError, TransientError, from_rpc_error
from clients.types import (
    AckResult,
    AppendData,
    AppendResult,
    Batch,
    ClaimResult,
    ClusterDescription,
    GroupConfig,
    GroupInfo,
    NackResult,
    PendingInfo,
    Ranges,
    ReadResult,
    Start,
    StreamConfig,
    StreamInfo,
    StreamPlacement,
)

_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["StreamLogService"].full_name


class AsyncClient:
    """A grpc.aio connection to one streamlog server; the same API as Client, with `await`.

    Create it inside a running event loop (grpc.aio channels belong to one loop).

    address: host:port, or several (a list, or comma-separated): seeds, of which the first that
    answers is used. In a cluster the client learns the layout (DescribeCluster) and sends each
    call on a stream to the stream's leader, following leader changes (see clients/_routing.py
    for what is retried). read_from: "leader" (the default), or "replica" to send plain reads
    and subscriptions (not a group's) to one of the stream's in-sync replicas, which serves
    committed entries only: each stream's reads go to one replica, chosen in turn among them
    (the leader when none other is known); against a single server it changes nothing.
    token: sent as `authorization: Bearer <token>` on every call.
    TLS: `tls=True` (system roots), or `root_certificates` (PEM bytes or a file path),
    plus `certificate_chain` and `private_key` for a client certificate; `server_name`
    overrides the name checked in the server's certificate. `channel`: use this channel
    (e.g. an intercepted one) instead of opening one; the client then does not close it, and
    sends every call there (no routing).
    """

    def __init__(
        self,
        address: str | Sequence[str] = DEFAULT_ADDRESS,
        *,
        token: str | None = None,
        tls: bool = False,
        root_certificates: Pem | None = None,
        certificate_chain: Pem | None = None,
        private_key: Pem | None = None,
        server_name: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        options: Sequence[tuple[str, Any]] = (),
        channel: grpc.aio.Channel | None = None,
        read_from: str = "leader",
    ) -> None:
        if read_from not in READ_FROM:
            raise ValueError(f"read_from must be one of {', '.join(READ_FROM)}, not {read_from!r}")
        seeds = seed_addresses(address)
        self.address = ",".join(seeds)
        self.timeout = timeout
        self.read_from = read_from
        self._metadata = auth_metadata(token)
        self._routed_metadata = (*self._metadata, ROUTE_METADATA)
        self._replica_metadata = (*self._routed_metadata, READ_FROM_METADATA)
        self._owns_channel = channel is None
        opener = functools.partial(
            open_channel,
            grpc.aio,
            tls=tls,
            root_certificates=root_certificates,
            certificate_chain=certificate_chain,
            private_key=private_key,
            server_name=server_name,
            options=options,
        )
        self._routes = Routes(seeds, opener, channel)

    @property
    def _channel(self) -> grpc.aio.Channel:
        """The channel to the seed that answered (the first, until one did not)."""
        return self._routes.channel(self._routes.default)

    @property
    def _stub(self) -> pb_grpc.StreamLogServiceStub:
        return self._routes.stub(self._routes.default)

    async def close(self) -> None:
        if self._owns_channel:
            for channel in self._routes.opened():
                await channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def _replica_reads(self) -> bool:
        return self.read_from == "replica"

    async def _unary(
        self,
        method: Any,
        request: Any,
        timeout: float | None,
        block_ms: int = 0,
        replica: bool = False,
        prefer: str | None = None,
    ) -> Any:
        deadline = call_timeout(self.timeout, timeout, block_ms)
        stream = stream_of(request)
        if stream is None or self._routes.cluster is False:
            try:
                return await method(request, timeout=deadline, metadata=self._metadata)
            except grpc.RpcError as exc:
                raise from_rpc_error(exc) from exc
        name = self._routes.method_name(method)
        return await self._routed(name, stream, request, Attempts(deadline), replica, prefer)

    async def _routed(
        self,
        name: str,
        stream: str,
        request: Any,
        attempts: Attempts,
        replica: bool = False,
        prefer: str | None = None,
    ) -> Any:
        """A call on `stream`, sent to its leader (`replica`: to an in-sync replica, node `prefer`
        if it is one), and again (after a redirect or where retrying is safe) until it is answered
        or its time is up."""
        routes = self._routes
        while True:
            # After a failure: where failed() or failed_replica() below pointed.
            address = await (self.replica_route(stream, replica=prefer) if replica else self.route(stream))
            routed = routes.cluster is True
            call = getattr(routes.stub(address), name)
            metadata = self._metadata
            if routed:
                metadata = self._replica_metadata if replica else self._routed_metadata
            try:
                return await call(request, timeout=attempts.remaining(), metadata=metadata)
            except grpc.RpcError as exc:
                failure = from_rpc_error(exc)
                if not routed:
                    raise failure from exc
                failed = routes.failed
                if replica:
                    failed = functools.partial(routes.failed_replica, address=address)
                if not retryable(name, request, exc):
                    if isinstance(failure, TransientError):
                        failed(stream, failure)  # the next call looks the leader up again
                    raise failure from exc
                pause = attempts.pause(redirected=failed(stream, failure))
                if pause is None:
                    raise failure from exc
            await sleep(pause)

    async def route(self, stream: str, failure: BaseException | None = None) -> str:
        """The address calls on `stream` go to: its leader's in a cluster (looked up with
        DescribeCluster once, then cached), the server's otherwise (one DescribeCluster, ever).

        `failure`: the error a call or session on `stream` just failed with (UNAVAILABLE: a
        redirect, or a node down), to look again; the Producer and the Consumer pass theirs when
        they reopen a session. When no node can say, the first seed that answered.
        """
        routes = self._routes
        if isinstance(failure, TransientError):
            routes.failed(stream, failure)
        address = routes.leader(stream)
        if address is None:
            await self._look_up(stream)
            address = routes.leader(stream)
        return address or routes.default

    async def replica_route(
        self,
        stream: str,
        failure: BaseException | None = None,
        *,
        failed_at: str | None = None,
        replica: str | None = None,
    ) -> str:
        """The address a read of `stream` from an in-sync replica goes to (as with
        read_from="replica"): node `replica` (an id) while it is a live in-sync replica of the
        stream, else the replica chosen for the stream (the layout looked up when none is known),
        else its leader's; the server's against a single server.

        `failure`: the error a read of `stream` sent to `failed_at` (default: the chosen replica)
        just failed with; that replica is then passed over for a while and the layout looked up
        again. For callers that send the read themselves (the Spark connector's Arrow reads).
        """
        routes = self._routes
        if isinstance(failure, TransientError):
            routes.failed_replica(stream, failure, failed_at)
        address = routes.replica(stream, replica)
        if address is None:
            await self._look_up(stream)
            address = routes.replica(stream, replica)
        return address or await self.route(stream)

    async def in_sync_replicas(self, stream: str) -> list[str]:
        """The node ids of `stream`'s live in-sync replicas (its leader among them), in node id
        order, as a node describes them now (the client's layout is updated too; as last known
        when no node answers): where read(..., replica=...) may go. [] against a single server
        and while the stream has no leader."""
        if self._routes.cluster is not False:
            await self._look_up(stream)
        return self._routes.in_sync_nodes(stream)

    async def _look_up(self, stream: str) -> None:
        """Learn where `stream` lives (DescribeCluster of its name as prefix) from the first node
        that answers; the layout stays as it was when none can say."""
        routes = self._routes
        for candidate in routes.describers():
            try:
                description = await self._describe(routes.stub(candidate), stream, 0, LOOKUP_TIMEOUT_S)
            except TransientError:
                continue  # down or not ready: ask another
            except StreamlogError:
                routes.cluster = routes.cluster or False  # DescribeCluster refused: not routable
                return
            routes.learn(candidate, description)
            return

    def _session_route(
        self, stream: str | None, replica: bool = False
    ) -> tuple[pb_grpc.StreamLogServiceStub, tuple[tuple[str, str], ...]]:
        """The stub and metadata to open a session on `stream` with: its leader's (`replica`: its
        chosen in-sync replica's), with a redirect asked for, when the layout knows it (route()
        looks it up; sessions open without waiting); else the default node's, which serves or
        forwards it."""
        routes = self._routes
        if stream is None or routes.cluster is not True:
            return self._stub, self._metadata
        address = routes.replica(stream) if replica else routes.leader(stream)
        if address is None:
            return self._stub, (*self._metadata, READ_FROM_METADATA) if replica else self._metadata
        return routes.stub(address), self._replica_metadata if replica else self._routed_metadata

    # ------------------------------------------------------------------ data

    async def append(
        self,
        stream: str,
        data: AppendData,
        *,
        producer_id: str | None = None,
        producer_sequence: int | None = None,
        expected_next_offset: int | None = None,
        timeout: float | None = None,
    ) -> AppendResult:
        """Append one batch (atomic): bytes, a list of bytes, or Records for tags/headers/delays.

        producer_id + producer_sequence make it idempotent (a retry returns the first
        attempt's offsets with `duplicate` set); expected_next_offset makes it
        conditional (OffsetMismatchError, with the stream's `next_offset`, otherwise).
        """
        request = convert.append_request(stream, data, producer_id, producer_sequence, expected_next_offset)
        return convert.append_result(await self._unary(self._stub.Append, request, timeout))

    async def append_many(
        self, batches: Iterable[Batch | tuple[str, AppendData]], *, timeout: float | None = None
    ) -> list[AppendResult | StreamlogError]:
        """Append batches to many streams in one call: Batch values, or (stream, data) pairs.

        Each batch is atomic on its own (as append()'s, with its own producer id, sequence
        and expected_next_offset in a Batch); the result lists, in order, each batch's
        AppendResult or the StreamlogError it was refused with (one bad batch does not fail
        the others). The call itself raises only for what fails it as a whole (no batches,
        past max_append_many_batches or max_append_many_bytes, credentials, unavailable).
        """
        request = convert.append_many_request(batches)
        return convert.append_many_results(await self._unary(self._stub.AppendMany, request, timeout))

    def publisher(
        self, *, stream: str | None = None, max_in_flight: int = 1000, timeout: float | None = None
    ) -> AsyncPublishSession:
        """Open a Publish session: appends sent as messages without waiting for each answer.

        Each message is an append of its own (any stream, idempotent with a producer
        id and sequence), answered in order; one small entry per message goes several
        times faster than one per append() call. `max_in_flight`: messages sent and
        not yet answered before publish() waits. No deadline unless `timeout` is
        given: a session lives until closed. See AsyncPublishSession. In a cluster, a
        session carries one stream: name it as `stream` to open the session on its
        leader (where route() last found it; else a node forwards the session there).
        """
        stub, metadata = self._session_route(stream)
        return AsyncPublishSession(
            functools.partial(stub.Publish, timeout=timeout, metadata=metadata), max_in_flight
        )

    async def read(
        self,
        stream: str,
        offset: int = 0,
        *,
        count: int = 0,
        block_ms: int = 0,
        reverse: bool = False,
        max_bytes: int = 0,
        replica: str | None = None,
        timeout: float | None = None,
    ) -> ReadResult:
        """Up to `count` entries from `offset` (0: the server's default count).

        block_ms: wait that long for an entry at or after `offset` when there is none
        yet. reverse: newest first, from `offset` down (a huge offset starts at the end).
        replica: in a cluster, a node id: read from that in-sync replica of the stream (whatever
        `read_from` says); when it is not one now, or a read there fails, from another in-sync
        replica or the leader, as with read_from="replica". Committed entries only, as ever.
        """
        request = convert.read_request(stream, offset, count, block_ms, reverse, max_bytes)
        from_replica = self._replica_reads or replica is not None
        reply = await self._unary(self._stub.Read, request, timeout, block_ms, from_replica, replica)
        return convert.read_result(reply)

    def subscribe(
        self,
        stream: str,
        start: Start = "oldest",
        *,
        timestamp_ms: int | None = None,
        count: int = 0,
        max_bytes: int = 0,
        timeout: float | None = None,
    ) -> AsyncSubscription:
        """Follow a stream from `start` (an offset, "oldest" or "latest"; or a `timestamp_ms`).

        No deadline unless `timeout` is given: a subscription lives until cancelled.
        """
        request = convert.subscribe_request(stream, start, timestamp_ms, count, max_bytes)
        return self._subscription(request, timeout)

    # ------------------------------------------------------------------ consumer groups

    async def read_group(
        self,
        stream: str,
        group: str,
        consumer: str,
        *,
        count: int = 0,
        block_ms: int = 0,
        max_bytes: int = 0,
        ack: Iterable[int] = (),
        ack_ranges: Ranges = (),
        retry_ms: int | None = None,
        expire_ms: int | None = None,
        noack: bool = False,
        claim_idle_ms: int | None = None,
        timeout: float | None = None,
    ) -> ReadResult:
        """Read as `consumer` of `group`: due redeliveries first, then new entries.

        `ack`/`ack_ranges` acknowledge earlier entries in the same round trip. Entries'
        `delivery_count` says how often the group has delivered each.
        """
        request = convert.group_read_request(
            stream,
            group,
            consumer,
            count=count,
            block_ms=block_ms,
            max_bytes=max_bytes,
            ack=ack,
            ack_ranges=ack_ranges,
            retry_ms=retry_ms,
            expire_ms=expire_ms,
            noack=noack,
            claim_idle_ms=claim_idle_ms,
        )
        return convert.read_result(await self._unary(self._stub.Read, request, timeout, block_ms))

    def subscribe_group(
        self,
        stream: str,
        group: str,
        consumer: str,
        *,
        count: int = 0,
        max_bytes: int = 0,
        retry_ms: int | None = None,
        expire_ms: int | None = None,
        noack: bool = False,
        claim_idle_ms: int | None = None,
        timeout: float | None = None,
    ) -> AsyncSubscription:
        """Receive the entries `group` assigns to `consumer`, as they come; acknowledge with ack()."""
        request = convert.group_session_request(
            pb.SubscribeRequest,
            stream,
            group,
            consumer,
            count=count,
            max_bytes=max_bytes,
            retry_ms=retry_ms,
            expire_ms=expire_ms,
            noack=noack,
            claim_idle_ms=claim_idle_ms,
        )
        return self._subscription(request, timeout)

    def _subscription(self, request: pb.SubscribeRequest, timeout: float | None) -> AsyncSubscription:
        stub, metadata = self._session_route(request.stream, self._replica_reads and not request.group)
        call = stub.Subscribe(request, timeout=timeout, metadata=metadata)
        return AsyncSubscription(call, functools.partial(self._resubscribe, request, timeout))

    async def _resubscribe(
        self,
        request: pb.SubscribeRequest,
        timeout: float | None,
        next_offset: int | None,
        failure: StreamlogError,
        attempts: Attempts,
    ) -> Any:
        """A subscription's call again, on its stream's new leader after a leader change (a plain
        one from `next_offset`, where it was; a group's as before: the group keeps its place);
        None against a single server, after other errors, or when retrying has lasted too long."""
        routes = self._routes
        if not isinstance(failure, TransientError):
            return None
        if routes.cluster is None:  # opened before any lookup: is it a cluster?
            await self.route(request.stream)
        if routes.cluster is not True:
            return None
        replica = self._replica_reads and not request.group
        failed = routes.failed_replica if replica else routes.failed
        pause = attempts.pause(redirected=failed(request.stream, failure))
        if pause is None:
            return None
        await sleep(pause)
        await (self.replica_route(request.stream) if replica else self.route(request.stream))
        if next_offset is not None and not request.group:
            request = convert.subscribe_request(
                request.stream, next_offset, None, request.count, request.max_bytes
            )
        stub, metadata = self._session_route(request.stream, replica)
        return stub.Subscribe(request, timeout=timeout, metadata=metadata)

    def consume(
        self,
        stream: str,
        group: str,
        consumer: str,
        *,
        count: int = 0,
        ahead: int = 1,
        max_bytes: int = 0,
        retry_ms: int | None = None,
        expire_ms: int | None = None,
        noack: bool = False,
        claim_idle_ms: int | None = None,
        timeout: float | None = None,
    ) -> AsyncConsumeSession:
        """Open a Consume session as `consumer` of `group`: batches and acknowledgements on one call.

        Batches of up to `count` entries (0: the server's default), due redeliveries
        first, as read_group's. `ahead`: batches asked for at a time; taking a batch
        tops the credit up to `ahead` again, so 1 means one round trip per batch
        (carrying the previous batch's acknowledgements) and no entry assigned before
        you ask, and more keeps batches on their way while you work. The read options
        hold for the whole session. No deadline unless `timeout` is given: a session
        lives until closed. See AsyncConsumeSession.
        """
        opening = convert.group_session_request(
            pb.ConsumeRequest,
            stream,
            group,
            consumer,
            count=count,
            max_bytes=max_bytes,
            retry_ms=retry_ms,
            expire_ms=expire_ms,
            noack=noack,
            claim_idle_ms=claim_idle_ms,
        )
        stub, metadata = self._session_route(stream)
        return AsyncConsumeSession(
            functools.partial(stub.Consume, timeout=timeout, metadata=metadata),
            opening,
            ahead,
            lambda request: self._unary(self._stub.Ack, request, None),
            self.timeout,
        )

    async def ack(
        self,
        stream: str,
        group: str,
        offsets: Iterable[int] = (),
        *,
        ranges: Ranges = (),
        timeout: float | None = None,
    ) -> AckResult:
        """Acknowledge entries by offset and by half-open (start, end) ranges."""
        request = convert.ack_request(stream, group, offsets, ranges)
        reply = await self._unary(self._stub.Ack, request, timeout)
        return AckResult(reply.acknowledged, reply.unknown)

    async def nack(
        self,
        stream: str,
        group: str,
        offsets: Iterable[int],
        *,
        delay_ms: int = 0,
        timeout: float | None = None,
    ) -> NackResult:
        """Give pending entries back for redelivery to the group's next reader after `delay_ms`."""
        request = pb.NackRequest(stream=stream, group=group, offsets=list(offsets), delay_ms=delay_ms)
        reply = await self._unary(self._stub.Nack, request, timeout)
        return NackResult(reply.released, reply.unknown)

    async def claim(
        self,
        stream: str,
        group: str,
        consumer: str,
        offsets: Iterable[int],
        *,
        min_idle_ms: int = 0,
        timeout: float | None = None,
    ) -> ClaimResult:
        """Take over pending entries idle for at least `min_idle_ms` (Redis XCLAIM)."""
        request = pb.ClaimRequest(
            stream=stream, group=group, consumer=consumer, min_idle_ms=min_idle_ms, offsets=list(offsets)
        )
        return convert.claim_result(await self._unary(self._stub.Claim, request, timeout))

    async def auto_claim(
        self,
        stream: str,
        group: str,
        consumer: str,
        *,
        min_idle_ms: int = 0,
        cursor: int = 0,
        count: int = 0,
        timeout: float | None = None,
    ) -> ClaimResult:
        """Scan the pending list from `cursor` and claim idle entries (Redis XAUTOCLAIM)."""
        request = pb.AutoClaimRequest(
            stream=stream, group=group, consumer=consumer, min_idle_ms=min_idle_ms, cursor=cursor, count=count
        )
        return convert.claim_result(await self._unary(self._stub.AutoClaim, request, timeout))

    async def pending(
        self,
        stream: str,
        group: str,
        *,
        consumer: str = "",
        min_idle_ms: int = 0,
        start_offset: int = 0,
        end_offset: int | None = None,
        count: int = 0,
        timeout: float | None = None,
    ) -> PendingInfo:
        """The group's pending list: summary, and detail rows filtered as asked (Redis XPENDING)."""
        request = convert.pending_request(
            stream,
            group,
            consumer=consumer,
            min_idle_ms=min_idle_ms,
            start_offset=start_offset,
            end_offset=end_offset,
            count=count,
        )
        return convert.pending_info(await self._unary(self._stub.GetPending, request, timeout))

    async def create_group(
        self,
        stream: str,
        group: str,
        start: Start = "oldest",
        *,
        timestamp_ms: int | None = None,
        entries_read: int | None = None,
        config: GroupConfig | None = None,
        create_stream: bool = False,
        timeout: float | None = None,
    ) -> GroupInfo:
        """Create a consumer group reading from `start` ("oldest", "latest", an offset, or a time)."""
        request = convert.create_group_request(
            stream,
            group,
            start,
            timestamp_ms=timestamp_ms,
            entries_read=entries_read,
            config=config,
            create_stream=create_stream,
        )
        return convert.group_info((await self._unary(self._stub.CreateGroup, request, timeout)).group)

    async def delete_group(self, stream: str, group: str, *, timeout: float | None = None) -> None:
        await self._unary(self._stub.DeleteGroup, pb.DeleteGroupRequest(stream=stream, group=group), timeout)

    async def list_groups(self, stream: str, *, timeout: float | None = None) -> list[GroupInfo]:
        reply = await self._unary(self._stub.ListGroups, pb.ListGroupsRequest(stream=stream), timeout)
        return [convert.group_info(g) for g in reply.groups]

    async def group_info(self, stream: str, group: str, *, timeout: float | None = None) -> GroupInfo:
        request = pb.GetGroupInfoRequest(stream=stream, group=group)
        return convert.group_info((await self._unary(self._stub.GetGroupInfo, request, timeout)).group)

    async def set_group_offset(
        self,
        stream: str,
        group: str,
        start: Start,
        *,
        timestamp_ms: int | None = None,
        entries_read: int | None = None,
        timeout: float | None = None,
    ) -> GroupInfo:
        request = convert.set_group_offset_request(
            stream, group, start, timestamp_ms=timestamp_ms, entries_read=entries_read
        )
        return convert.group_info((await self._unary(self._stub.SetGroupOffset, request, timeout)).group)

    async def set_group_config(
        self, stream: str, group: str, config: GroupConfig, *, timeout: float | None = None
    ) -> GroupInfo:
        """Replace the group's whole configuration (unset fields take their defaults)."""
        request = pb.SetGroupConfigRequest(
            stream=stream, group=group, config=convert.group_config_to_pb(config)
        )
        return convert.group_info((await self._unary(self._stub.SetGroupConfig, request, timeout)).group)

    async def delete_consumer(
        self, stream: str, group: str, consumer: str, *, timeout: float | None = None
    ) -> int:
        """Remove a consumer; its pending entries go back to the group. Returns how many."""
        request = pb.DeleteConsumerRequest(stream=stream, group=group, consumer=consumer)
        return (await self._unary(self._stub.DeleteConsumer, request, timeout)).released

    # ------------------------------------------------------------------ admin

    async def list_streams(
        self, prefix: str = "", *, page_size: int = 0, limit: int = 0, timeout: float | None = None
    ) -> list[str]:
        """Every stream name starting with `prefix`, in byte order (all pages), or the first
        `limit` of them (a server may hold a million)."""
        names: list[str] = []
        token = ""
        while True:
            size = min(page_size or limit, limit - len(names)) if limit else page_size
            request = pb.ListStreamsRequest(prefix=prefix, page_size=size, page_token=token)
            reply = await self._unary(self._stub.ListStreams, request, timeout)
            names.extend(reply.streams)
            token = reply.next_page_token
            if not token or (limit and len(names) >= limit):
                return names[:limit] if limit else names

    async def describe_cluster(
        self, prefix: str = "", *, page_size: int = 0, timeout: float | None = None
    ) -> ClusterDescription:
        """The cluster's nodes and where its streams starting with `prefix` live (all pages), as
        the server called sees it. A single server answers as one node, with no cluster name."""
        return await self._describe(self._stub, prefix, page_size, timeout)

    async def _describe(
        self, stub: pb_grpc.StreamLogServiceStub, prefix: str, page_size: int, timeout: float | None
    ) -> ClusterDescription:
        streams: list[StreamPlacement] = []
        token = ""
        while True:
            request = pb.DescribeClusterRequest(prefix=prefix, page_size=page_size, page_token=token)
            reply = await self._unary(stub.DescribeCluster, request, timeout)
            streams += map(convert.stream_placement, reply.streams)
            token = reply.next_page_token
            if not token:
                nodes = list(map(convert.cluster_node, reply.nodes))
                return ClusterDescription(reply.cluster_name, reply.node_id, nodes, streams)

    async def reassign_replicas(
        self, stream: str, replicas: Sequence[str], *, timeout: float | None = None
    ) -> StreamPlacement:
        """Move the stream's replicas to these nodes (the first preferred as leader); returns its
        placement once the move is written. The cluster carries the move out: the stream's
        `target_replicas` (describe_cluster) stay set until it is done."""
        request = pb.ReassignReplicasRequest(stream=stream, replicas=replicas)
        reply = await self._unary(self._stub.ReassignReplicas, request, timeout)
        return convert.stream_placement(reply.placement)

    async def cancel_move(self, stream: str, *, timeout: float | None = None) -> StreamPlacement:
        """Undo the stream's move in progress (`kafka-reassign-partitions --cancel`): the replicas
        it added are dropped (they delete their copies), the replicas and leader it had kept;
        returns its placement then. A finished move is not undone: with none in progress, the
        placement is returned as it is."""
        request = pb.ReassignReplicasRequest(stream=stream, cancel=True)
        reply = await self._unary(self._stub.ReassignReplicas, request, timeout)
        return convert.stream_placement(reply.placement)

    async def info(self, stream: str, *, timeout: float | None = None) -> StreamInfo:
        reply = await self._unary(self._stub.GetStreamInfo, pb.GetStreamInfoRequest(stream=stream), timeout)
        return convert.stream_info(reply.info)

    async def delete_stream(self, stream: str, *, timeout: float | None = None) -> None:
        await self._unary(self._stub.DeleteStream, pb.DeleteStreamRequest(stream=stream), timeout)

    async def trim(
        self,
        stream: str,
        *,
        to_offset: int | None = None,
        keep_last: int | None = None,
        evict_up_to: int | None = None,
        timeout: float | None = None,
    ) -> int:
        """Remove old entries (exactly one mode); returns the stream's new first offset.

        to_offset: exact. keep_last / evict_up_to: whole macro nodes (RCP 11's TEVICT).
        """
        request = convert.trim_request(
            stream, to_offset=to_offset, keep_last=keep_last, evict_up_to=evict_up_to
        )
        return (await self._unary(self._stub.Trim, request, timeout)).first_offset

    async def get_config(self, stream: str, *, timeout: float | None = None) -> StreamConfig:
        return (await self.info(stream, timeout=timeout)).config

    async def set_config(
        self, stream: str, config: StreamConfig, *, timeout: float | None = None
    ) -> StreamConfig:
        """Replace the stream's whole configuration; returns the one now in force."""
        request = pb.SetStreamConfigRequest(stream=stream, config=convert.stream_config_to_pb(config))
        return convert.stream_config((await self._unary(self._stub.SetStreamConfig, request, timeout)).config)

    async def seek(self, stream: str, timestamp_ms: int, *, timeout: float | None = None) -> int:
        """The first offset appended at or after `timestamp_ms` (the end when all are older)."""
        request = pb.SeekTimeRequest(stream=stream, timestamp_ms=timestamp_ms)
        return (await self._unary(self._stub.SeekTime, request, timeout)).offset

    async def count(
        self, stream: str, start: int = 0, end: int | None = None, *, timeout: float | None = None
    ) -> int:
        """Entries retained in [start, end) (end None: to the end), counted without reading them."""
        request = pb.CountRangeRequest(
            stream=stream, start_offset=start, **convert.optional_fields(end_offset=end)
        )
        return (await self._unary(self._stub.CountRange, request, timeout)).count

    async def health(self, *, timeout: float | None = None) -> str:
        """The server's health status: "SERVING", "NOT_SERVING", ... (grpc.health.v1)."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        reply = await self._unary(stub.Check, health_pb2.HealthCheckRequest(service=_SERVICE_NAME), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
