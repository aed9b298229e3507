"""Consumer-group delivery: group reads (Read naming a group, and the reads of group Subscribe and
Consume), Ack, Nack, Claim and AutoClaim.

A group call journals its change and, on a stream whose fsync policy blocks, waits
for the journal's sync: such calls run in the thread pool there, and on the loop
otherwise (`Serving.may_block`). A group read that finds nothing waits in its
group's queue: blocked group readers are served in arrival order
(service/groupwaits.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from streamlog.v1 import streamlog_pb2 as pb

from service import groupwire, validation
from service.callcontext import CallContext
from service.errors import invalid_argument, not_found, translate_errors
from service.groupwaits import GroupWaits, WaitResult, has_news
from service.replybudget import ReplyCharge
from service.serving import Serving
from service.waiters import Wake
from storage import AckResult, Engine, GroupReadOptions, GroupReadResult

# Group-mode fields of ReadRequest/SubscribeRequest/ConsumeRequest that are unset (None) when not given.
_GROUP_OPTIONAL_MS = ("retry_ms", "expire_ms", "claim_idle_ms")


def group_options(
    request: pb.ReadRequest | pb.SubscribeRequest | pb.ConsumeRequest, count: int, max_bytes: int
) -> GroupReadOptions:
    """A group read's options from the request that asks for it (count and max_bytes checked)."""
    consumer = validation.name("consumer", request.consumer)
    optional = {
        name: validation.duration_ms(name, getattr(request, name)) if request.HasField(name) else None
        for name in _GROUP_OPTIONAL_MS
    }
    return GroupReadOptions(consumer, count, max_bytes, noack=request.noack, **optional)


def has_group_fields(request: pb.ReadRequest | pb.SubscribeRequest) -> bool:
    """Whether a plain (non-group) read or subscription sets a field that needs `group`."""
    return bool(
        request.consumer
        or request.noack
        or request.HasField("retry_ms")
        or request.HasField("expire_ms")
        or request.HasField("claim_idle_ms")
    )


class GroupDelivery:
    """Hands a group's entries to its consumers, and takes back their acknowledgements."""

    def __init__(self, serving: Serving) -> None:
        self._serving = serving
        # Blocked group readers, served in arrival order; the dispatcher reads through `_dispatch`.
        self.waits = GroupWaits(self._dispatch, hops=serving.waiters.hops)

    def listen_to(self, engine: Engine) -> None:
        """Register the wake-ups of blocked group readers with the engine (once per engine)."""
        engine.add_append_listener(self.waits.on_append)
        engine.add_group_listener(self.waits.on_group_change)

    # ------------------------------------------------------------------ reads

    async def read(
        self, engine: Engine, stream: str, group: str, options: GroupReadOptions, charge: ReplyCharge
    ) -> GroupReadResult:
        """A group read, with room reserved in `charge` for the reply it may fill (kept only if it
        found something: the caller then settles it to the reply's size)."""
        await charge.reserve(options.max_bytes)
        result = await self._serving.may_block(engine, stream, engine.read_group, stream, group, options)
        if not has_news(result):
            charge.settle(0)
        return result

    async def _dispatch(
        self, stream: str, group: str, options: GroupReadOptions, charge: ReplyCharge
    ) -> GroupReadResult:
        return await self.read(self._serving.ready(), stream, group, options, charge)

    async def read_or_wait(
        self,
        engine: Engine,
        stream: str,
        group: str,
        options: GroupReadOptions,
        wait_s: float | None,
        charge: ReplyCharge,
        until: asyncio.Event | None = None,
    ) -> WaitResult:
        """A group read that waits (wait_s seconds, None: forever; `until` set: no longer) while it
        finds nothing.

        Returns the read's result (with entries, or empty at once when wait_s is 0), or
        why the wait ended without one (TIMEOUT, DELETED, CLOSED).
        """
        waits = self.waits
        if not waits.busy(stream, group):
            # Nobody queued ahead: read now.
            in_thread = engine.fsync_policy(stream).blocks
            result = await self.read(engine, stream, group, options, charge)
            if has_news(result) or wait_s == 0:
                return result
            if not in_thread:
                # Read on the loop with no await since, so no append or ack went unseen: queue up
                # without reading again, and be woken when the read said something falls due.
                return await waits.wait(
                    stream,
                    group,
                    options,
                    wait_s,
                    charge,
                    due_ms=result.next_due_ms,
                    read_first=False,
                    until=until,
                )
        # Readers are queued ahead (they are served first), or the read above ran in a thread:
        # queue up, and the group's dispatcher reads for the queue in arrival order.
        return await waits.wait(stream, group, options, wait_s, charge, until=until)

    async def read_request(
        self,
        engine: Engine,
        stream: str,
        request: pb.ReadRequest,
        limits: tuple[int, int],
        block_ms: int,
        context: CallContext,
        charge: ReplyCharge,
    ) -> bytes:
        """A Read in group mode: acknowledge what the request carries, then read (and wait) as a
        consumer. `limits`: the read's count and max_bytes."""
        group = validation.name("group", request.group)
        options = group_options(request, *limits)
        if request.reverse:
            raise invalid_argument("reverse: group reads go forward only")
        offsets, ranges = self.ack_items(
            request.ack_offsets, request.ack_ranges, ("ack_offsets", "ack_ranges")
        )
        acks: dict[str, int] = {}
        if offsets or ranges:
            # First, so that the room it makes in a bounded pending list serves this very read.
            done = await self.ack(engine, stream, group, offsets, ranges)
            acks = {"acknowledged": done.acknowledged, "ack_unknown": done.unknown}
        if block_ms:
            wait_s = self._serving.wait_limit_s(context, block_ms)
            waited = await self.read_or_wait(engine, stream, group, options, wait_s, charge)
            if waited is Wake.DELETED:
                raise not_found(f"stream {stream!r} was deleted")
            # TIMEOUT, or CLOSED (draining): an empty reply, as a plain blocking read's timeout.
            result = waited if isinstance(waited, GroupReadResult) else None
        else:
            result = await self.read(engine, stream, group, options, charge)
        return charge.hold(groupwire.read_reply(pb.ReadResponse, result, engine.bounds(stream), **acks))

    # ------------------------------------------------------------------ acknowledgements

    def ack_items(
        self, offsets: Sequence[int], ranges: Sequence[pb.OffsetRange], names: tuple[str, str]
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Offsets and ranges to acknowledge, checked (max_ack_offsets, signs)."""
        return validation.ack_items(offsets, ranges, names, self._serving.settings.max_ack_offsets)

    async def ack(
        self, engine: Engine, stream: str, group: str, offsets: list[int], ranges: list[tuple[int, int]]
    ) -> AckResult:
        return await self._serving.may_block(engine, stream, engine.ack, stream, group, offsets, ranges)

    @translate_errors
    async def Ack(self, request: pb.AckRequest, context: CallContext) -> pb.AckResponse:
        engine = self._serving.ready()
        stream = validation.stream(request.stream)
        group = validation.name("group", request.group)
        if not request.offsets and not request.ranges:
            raise invalid_argument("offsets, ranges: nothing to acknowledge")
        offsets, ranges = self.ack_items(request.offsets, request.ranges, ("offsets", "ranges"))
        result = await self.ack(engine, stream, group, offsets, ranges)
        return pb.AckResponse(acknowledged=result.acknowledged, unknown=result.unknown)

    @translate_errors
    async def Nack(self, request: pb.NackRequest, context: CallContext) -> pb.NackResponse:
        serving = self._serving
        engine = serving.ready()
        stream = validation.stream(request.stream)
        group = validation.name("group", request.group)
        offsets = validation.offsets(request.offsets, serving.settings.max_ack_offsets)
        delay_ms = validation.duration_ms("delay_ms", request.delay_ms)
        result = await serving.may_block(engine, stream, engine.nack, stream, group, offsets, delay_ms)
        return pb.NackResponse(released=result.released, unknown=result.unknown)

    # ------------------------------------------------------------------ claims

    @translate_errors
    async def Claim(self, request: pb.ClaimRequest, context: CallContext) -> bytes:
        serving = self._serving
        engine = serving.ready()
        stream = validation.stream(request.stream)
        group = validation.name("group", request.group)
        consumer = validation.name("consumer", request.consumer)
        min_idle_ms = validation.non_negative("min_idle_ms", request.min_idle_ms)
        offsets = validation.offsets(request.offsets, serving.settings.max_ack_offsets)
        # The claimed entries' size is known only once claimed: room for the largest read.
        charge = serving.replies.charge(context)
        await charge.reserve(serving.settings.max_read_bytes)
        result = await serving.may_block(
            engine, stream, engine.claim, stream, group, consumer, min_idle_ms, offsets
        )
        return charge.hold(groupwire.claim_reply(pb.ClaimResponse, result))

    @translate_errors
    async def AutoClaim(self, request: pb.AutoClaimRequest, context: CallContext) -> bytes:
        serving = self._serving
        engine = serving.ready()
        settings = serving.settings
        stream = validation.stream(request.stream)
        group = validation.name("group", request.group)
        consumer = validation.name("consumer", request.consumer)
        min_idle_ms = validation.non_negative("min_idle_ms", request.min_idle_ms)
        cursor = validation.non_negative("cursor", request.cursor)
        count = validation.bounded(
            "count", request.count, settings.default_read_entries, settings.max_read_entries
        )
        charge = serving.replies.charge(context)  # as Claim
        await charge.reserve(settings.max_read_bytes)
        next_cursor, result = await serving.may_block(
            engine, stream, engine.autoclaim, stream, group, consumer, min_idle_ms, cursor, count
        )
        return charge.hold(groupwire.claim_reply(pb.AutoClaimResponse, result, next_cursor=next_cursor))
