"""A stream this node leads: its followers' progress, the high watermark, the in-sync set, the barrier.

One `StreamLeader` per led stream and epoch (Kafka's partition leader):

- **Fetches.** Each follower holds one Replicate call open (cluster/replication/service.py
  hands it to `serve`). Its first request is the divergence check (KIP-101/279): the
  leader answers where the follower's last epoch ends in its own history, until the
  follower's log is a prefix of its own. Then each request acknowledges the follower's
  `log_end` and is answered, as soon as there is something new (entries past it, a
  higher watermark: `hw_linger_s` after it moved, unless entries come first to go with it)
  or after `heartbeat_s`, with the records from there and the holes
  compaction left between them, stopping where the next epoch starts so that the
  follower records the epoch first, and this log's first offset, which the follower's
  copy follows (KIP-107: trims and retention happen here only). The wait is woken
  by the engine's log listener (an append under the commit cap), never by polling.
- **High watermark.** HW = min(the leader's log end, the acknowledged log end of every
  other in-sync replica); it only grows. When it moves, `set_commit` lets readers see
  up to it and barriers at or below it complete.
- **In-sync set** (changed by compare-and-swap on the placement record that carries the
  epoch): a follower not caught up for `replica_lag_s` leaves it; one whose log end
  reached the HW (and this epoch's start) joins it again. A CAS that finds another epoch
  or leader means this node was deposed: it stops at once.
- **Group state.** Each session's first group data is a snapshot of the stream's
  consumer groups (a follower's op seq names a batch of one leader's history only),
  then the op batches after the follower's `group_seq` (a snapshot again if they are
  no longer retained). Group data goes only in a response that brings the follower's
  log to the HW, so the entries the ops name are there first. A follower's `group_seq`
  acknowledges the batches it applied, once it took this session's snapshot.
- **Barrier.** A mutating call's reply waits until the HW covers the call's end and
  every other in-sync replica applied the call's group ops, and only while this node's
  lease is valid; it fails (outcome unknown) when the node stops leading or its lease
  lapses, and is refused up front when the in-sync set is smaller than a majority of
  the replicas (acks=quorum).
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable

from streamlog.internal.v1 import replication_pb2 as rpb

from cluster.placement import PlacementTable, StreamPlacement
from cluster.replication.wire import to_data
from storage import Engine, StreamNotFoundError

log = logging.getLogger("streamlog.cluster.replication")

# A barrier stops trusting the lease this long before it runs out (clock drift, scheduling).
LEASE_MARGIN_S = 0.2


class NotLeadingError(Exception):
    """This node does not (or no longer) lead the stream at the epoch asked; `epoch` is the
    stream's current epoch as far as this node knows."""

    def __init__(self, message: str, epoch: int = 0) -> None:
        super().__init__(message)
        self.epoch = epoch


class NotEnoughReplicasError(Exception):
    """acks=quorum, but the in-sync set is smaller than a majority of the replicas."""


class FetchRefusedError(Exception):
    """A follower's request that this leader cannot serve (wrong stream, incarnation, epoch or
    follower); `epoch` is the leader's."""

    def __init__(self, message: str, epoch: int) -> None:
        super().__init__(message)
        self.epoch = epoch


@dataclasses.dataclass
class _Progress:
    """What the leader knows of one follower in this epoch."""

    log_end: int  # acknowledged (-1: not yet, in this epoch)
    caught_up_at: float  # monotonic time it was last known caught up
    group_seq: int = -1  # group op batches applied, acknowledged in a session after its snapshot
    shown_end: int = -1  # the leader's log end when it last answered this follower
    answered_at: float = 0.0
    sent_hw: int = -1  # the HW it was last told


def majority(replicas: int) -> int:
    return replicas // 2 + 1


@dataclasses.dataclass
class _Session:
    """One fetch session's group replication: whether its snapshot went out, and the op seq of the
    last group data sent."""

    snapshot_sent: bool = False
    sent_seq: int = -1


@dataclasses.dataclass(frozen=True, kw_only=True)
class LeaderContext:
    """What a leader needs from this node besides its engine and the placement table."""

    node_id: str
    engine: Engine
    placement: PlacementTable
    lease_valid_until: Callable[[], float]  # monotonic time; membership's reckoning
    replica_lag_s: float
    heartbeat_s: float
    # How long news of a higher HW alone waits for entries to travel with (see `_answer`).
    hw_linger_s: float


class StreamLeader:
    """This node leading one stream at one epoch. Event loop only."""

    def __init__(self, ctx: LeaderContext, record: StreamPlacement, hw: int) -> None:
        self._ctx = ctx
        self.name = record.name
        self.record = record
        self.leading = True
        self.hw = hw
        self._hw_moved_at = 0.0
        self._engine = ctx.engine
        self._epoch_start = self._engine.log_end(self.name)
        now = time.monotonic()
        self._started_at = now
        self._progress: dict[str, _Progress] = {}
        self._wake: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []  # heap of (end, n, future)
        # The op seq of group batches every other in-sync replica applied, and its waiters.
        self.group_hw = -1
        self._group_waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._count = itertools.count()
        self._isr_task: asyncio.Task[None] | None = None
        self._lag_task = asyncio.get_running_loop().create_task(self._watch_lag())
        self.advance()  # alone in the in-sync set, everything it holds is committed at once

    @property
    def epoch(self) -> int:
        return self.record.epoch

    # -- lifecycle

    def update(self, record: StreamPlacement) -> None:
        """The placement record changed at this epoch (the in-sync set, the config)."""
        self.record = record
        self.advance()

    def stop(self, reason: str) -> None:
        """Stop leading: waiting barriers fail (outcome unknown), fetches end."""
        if not self.leading:
            return
        self.leading = False
        log.info("stream %r: no longer leading epoch %d: %s", self.name, self.epoch, reason)
        for _, _, future in self._waiters + self._group_waiters:
            if not future.done():
                future.set_exception(NotLeadingError(f"{reason}; the outcome is unknown", self.epoch))
        self._waiters.clear()
        self._group_waiters.clear()
        self._lag_task.cancel()
        if self._isr_task is not None:
            self._isr_task.cancel()
        self._notify()

    # -- the high watermark and barriers

    def on_log(self) -> None:
        """The engine's log grew (an append under the commit cap)."""
        if self.leading:
            self.advance()
            self._notify()

    def advance(self) -> None:
        """Move the HW as far as every in-sync replica has acknowledged, and the group HW as far
        as every other in-sync replica has applied group ops."""
        if not self.leading:
            return
        self._advance_groups()
        hw = self._engine.log_end(self.name)
        for node in self.record.isr:
            if node != self._ctx.node_id:
                progress = self._progress.get(node)
                hw = min(hw, progress.log_end if progress is not None else -1)
        if hw <= self.hw:
            return
        self.hw = hw
        self._hw_moved_at = time.monotonic()
        self._engine.set_commit(self.name, hw)
        _release(self._waiters, hw)
        self._notify()

    def _advance_groups(self) -> None:
        try:
            group_hw = self._engine.group_seq(self.name)
        except StreamNotFoundError:  # deleted: this leader is about to stop
            return
        for node in self.record.isr:
            if node != self._ctx.node_id:
                progress = self._progress.get(node)
                group_hw = min(group_hw, progress.group_seq if progress is not None else -1)
        if group_hw > self.group_hw:
            self.group_hw = group_hw
            _release(self._group_waiters, group_hw)

    async def barrier(self, end: int, *, quorum: bool, group_seq: int | None = None) -> None:
        """Return once the HW covers `end` and every other in-sync replica applied the group op
        batches up to `group_seq` (acks=quorum), while the lease is valid; NotLeadingError when
        this node stops leading or its lease lapses first, NotEnoughReplicasError at once when the
        in-sync set is below a majority of the replicas."""
        self.check_quorum(quorum)
        if quorum:
            self.advance()
            if self.hw < end:
                await self._wait(self._waiters, end)
            if group_seq is not None and self.group_hw < group_seq:
                await self._wait(self._group_waiters, group_seq)
            self.check_quorum(quorum)  # the in-sync set may have shrunk while it waited
        if not self.leading:
            raise NotLeadingError(f"stream {self.name!r}: this node stopped leading; the outcome is unknown")
        if time.monotonic() >= self._ctx.lease_valid_until() - LEASE_MARGIN_S:
            raise NotLeadingError(
                f"stream {self.name!r}: this node cannot confirm its cluster lease; the outcome is unknown",
                self.epoch,
            )

    async def _wait(self, waiters: list[tuple[int, int, asyncio.Future[None]]], target: int) -> None:
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(waiters, (target, next(self._count), future))
        while not future.done():
            remaining = self._ctx.lease_valid_until() - LEASE_MARGIN_S - time.monotonic()
            if remaining <= 0:
                future.cancel()
                raise NotLeadingError(
                    f"stream {self.name!r}: this node's cluster lease lapsed while waiting for "
                    "replication; the outcome is unknown",
                    self.epoch,
                )
            await asyncio.wait([future], timeout=remaining)
        future.result()

    def check_quorum(self, quorum: bool) -> None:
        if not self.leading:
            raise NotLeadingError(f"stream {self.name!r}: this node does not lead it now", self.epoch)
        count = self.record.replica_count  # a move's copying replicas do not raise the bar
        if quorum and len(self.record.isr) < majority(count):
            raise NotEnoughReplicasError(
                f"stream {self.name!r}: not enough in-sync replicas ({len(self.record.isr)} of "
                f"{count}, {majority(count)} needed for acks=quorum)"
            )

    def _notify(self) -> None:
        wake, self._wake = self._wake, asyncio.get_running_loop().create_future()
        wake.set_result(None)

    def progress(self) -> tuple[int, list[tuple[str, int, int]]]:
        """(the HW, each replica's (node, log end, ms since it was last caught up)), for operators."""
        now, me, end = time.monotonic(), self._ctx.node_id, self._engine.log_end(self.name)
        replicas = [(me, end, 0)]
        for node in self.record.replicas:
            known = self._progress.get(node)
            if node != me and known is not None:
                since = now - known.caught_up_at
                # At the end and heard from lately: no lag. A silent one (down) lags however full.
                caught_up = known.log_end >= end and since <= self._ctx.replica_lag_s
                lag = 0 if caught_up else since
                replicas.append((node, known.log_end, int(min(lag, 1e12) * 1000)))
        return self.hw, replicas

    # -- serving a follower's fetch session

    def check(self, request: rpb.FetchRequest) -> None:
        """FetchRefusedError unless the request is for this stream, incarnation and epoch, from one
        of its other replicas."""
        record = self.record
        problem = None
        if not self.leading:
            problem = f"this node no longer leads stream {self.name!r} at epoch {record.epoch}"
        elif request.incarnation != record.incarnation:
            problem = f"stream {self.name!r} is incarnation {record.incarnation}, not {request.incarnation}"
        elif request.leader_epoch != record.epoch:
            problem = f"stream {self.name!r} is at leader epoch {record.epoch}, not {request.leader_epoch}"
        elif request.follower_id == self._ctx.node_id or request.follower_id not in record.replicas:
            problem = f"node {request.follower_id!r} is not a follower of stream {self.name!r}"
        if problem is not None:
            raise FetchRefusedError(problem, record.epoch)

    async def serve(self, requests: AsyncIterator[rpb.FetchRequest]) -> AsyncIterator[rpb.FetchResponse]:
        """Answer one follower's fetch session (its requests already validated for shape)."""
        checked = False
        session = _Session()
        async for request in requests:
            self.check(request)
            if not checked:
                answer = self._divergence(request)
                if answer is not None:
                    yield answer
                    continue
                checked = True
            yield await self._answer(request, session)

    def _divergence(self, request: rpb.FetchRequest) -> rpb.FetchResponse | None:
        """KIP-279: None when the follower's log is a prefix of this one; else where to cut it, or
        (its end is before this log's first offset) a reset."""
        engine, name = self._engine, self.name
        if request.log_end < self._first_offset():
            return self._reset()
        epoch, end = engine.epoch_end(name, request.last_epoch)
        if epoch == request.last_epoch and request.log_end <= end:
            return None
        return rpb.FetchResponse(diverging=rpb.Diverging(end_offset=end, epoch=epoch))

    def _reset(self) -> rpb.FetchResponse:
        """Tell a follower whose end is before this log's first offset to rebuild from there."""
        first = self._first_offset()
        return rpb.FetchResponse(reset=rpb.Reset(log_start=first, epoch=self._epoch_at(first)))

    def _first_offset(self) -> int:
        return self._engine.bounds(self.name).first_offset

    def _epoch_at(self, offset: int) -> int:
        """The epoch in force at `offset` in this log (-1: none recorded there)."""
        found = -1
        for epoch, start in self._engine.epochs(self.name):
            if start > offset:
                break
            found = epoch
        return found

    async def _answer(self, request: rpb.FetchRequest, session: _Session) -> rpb.FetchResponse:
        follower, log_end = request.follower_id, request.log_end
        if log_end > self._engine.log_end(self.name):
            raise FetchRefusedError(f"log_end {log_end} is past the leader's end", self.epoch)
        if session.snapshot_sent and request.group_seq != session.sent_seq:
            raise FetchRefusedError(
                f"group_seq {request.group_seq} is not the group data last sent ({session.sent_seq})",
                self.epoch,
            )
        self._acknowledged(follower, log_end, request.group_seq if session.snapshot_sent else -1)
        progress = self._progress[follower]
        sent_hw = progress.sent_hw
        deadline = time.monotonic() + self._ctx.heartbeat_s
        while (
            self.leading
            and self._engine.log_end(self.name) <= log_end
            and not self._group_news(session, log_end)
        ):
            # A higher HW alone waits a moment for entries to go with it: under a stream of quorum
            # appends the next batch comes soon after the HW covered the last one, and one answer
            # then carries both (a round per batch, not two).
            due = min(deadline, self._hw_moved_at + self._ctx.hw_linger_s) if self.hw > sent_hw else deadline
            remaining = due - time.monotonic()
            if remaining <= 0:
                break
            await asyncio.wait([self._wake], timeout=remaining)
        if not self.leading:
            raise FetchRefusedError(f"this node no longer leads stream {self.name!r}", self.epoch)
        first = self._first_offset()
        if log_end < first:  # retention or a trim moved past it meanwhile
            return self._reset()
        response = self._data(log_end, request.max_bytes, first)
        data = response.data
        if data.end_offset >= self.hw:  # the follower will hold every entry the group ops name
            await self._add_group_data(data, session, request.max_bytes)
        progress.shown_end = data.log_end
        progress.answered_at = time.monotonic()
        progress.sent_hw = data.high_watermark
        return response

    def _group_news(self, session: _Session, log_end: int) -> bool:
        """Whether there is group data to send a follower whose log ends at `log_end` now."""
        if log_end < self.hw:
            return False
        return not session.snapshot_sent or self._engine.group_seq(self.name) > session.sent_seq

    async def _add_group_data(self, data: rpb.ReplicaData, session: _Session, max_bytes: int) -> None:
        """The session's snapshot first, then the batches after what was last sent (a snapshot
        again when they are no longer retained)."""
        engine, name = self._engine, self.name
        batches = engine.group_ops_since(name, session.sent_seq, max_bytes) if session.snapshot_sent else None
        if batches is None:
            seq, body = await asyncio.to_thread(engine.group_snapshot, name)  # it may encode a big state
            data.group_snapshot.seq, data.group_snapshot.ops = seq, body
            session.snapshot_sent, session.sent_seq = True, seq
            return
        for seq, body in batches:
            data.group_ops.add(seq=seq, ops=body)
        if batches:
            session.sent_seq = batches[-1][0]

    def on_group_batch(self) -> None:
        """This stream's groups made an op batch: wake the fetches waiting to send it."""
        if self.leading:
            self._notify()

    def _data(self, offset: int, max_bytes: int, first: int) -> rpb.FetchResponse:
        """The records from `offset` with the holes between them, up to where the next epoch starts
        and no further than this log vouches for (synced, under fsync "always"), with the bounds
        (`first`: this log's first offset, which the follower's copy follows)."""
        engine, name = self._engine, self.name
        epoch_start = None
        stop = engine.log_end(name)
        for epoch, start in engine.epochs(name):
            if start == offset:
                epoch_start = rpb.EpochStart(epoch=epoch, start_offset=start)
            elif start > offset:
                stop = min(stop, start)
                break
        chunk = engine.read_replica(name, offset, max_bytes, stop)
        if chunk.end_offset == offset < stop:
            log.error(
                "stream %r: a follower's end %d falls in a range of this log lost to damage: it cannot "
                "be replicated past it",
                name,
                offset,
            )
        data = to_data(chunk, high_watermark=self.hw, log_start=first)
        if epoch_start is not None:
            data.epoch_start.CopyFrom(epoch_start)
        return rpb.FetchResponse(data=data)

    # -- follower progress and the in-sync set

    def _acknowledged(self, follower: str, log_end: int, group_seq: int) -> None:
        now = time.monotonic()
        progress = self._progress.get(follower)
        if progress is None:
            progress = self._progress[follower] = _Progress(log_end, self._started_at)
        progress.group_seq = group_seq
        if log_end < progress.log_end or (follower in self.record.isr and log_end < self.hw):
            # It lost entries it had acknowledged (a wiped disk, unsynced writes lost in a power
            # cut): it may lack committed ones, so it leaves the in-sync set now, not after a lag.
            log.warning(
                "stream %r: follower %s went back to %d (HW %d)", self.name, follower, log_end, self.hw
            )
            progress.caught_up_at = float("-inf")
            self._change_isr()
        progress.log_end = log_end
        # Caught up: it has everything the leader had when it last answered (Kafka's rule), or
        # everything the leader has now, and it applied the group data this session sent it (a
        # follower that cannot apply group ops keeps losing its session, and leaves the set).
        synced = group_seq >= 0
        if synced and log_end >= self._engine.log_end(self.name):
            progress.caught_up_at = now
        elif synced and progress.shown_end >= 0 and log_end >= progress.shown_end:
            progress.caught_up_at = progress.answered_at
        self.advance()
        if follower not in self.record.isr and self._may_join(progress):
            self._change_isr()

    def _may_join(self, progress: _Progress) -> bool:
        """A follower joins the in-sync set once it holds everything committed: entries up to the
        HW (and this epoch's start), and the group ops every in-sync replica applied, and only
        while it keeps fetching: a follower that went silent (down) after catching up does not
        come back with the next change of the set, which would hold the HW until it lags out."""
        return (
            progress.log_end >= max(self.hw, self._epoch_start)
            and progress.group_seq >= self.group_hw
            and time.monotonic() - progress.caught_up_at <= self._ctx.replica_lag_s
        )

    async def _watch_lag(self) -> None:
        """Take followers that stopped keeping up out of the in-sync set (a timer, not a poll of
        data: lag is a matter of time)."""
        period = max(0.05, self._ctx.replica_lag_s / 4)
        while self.leading:
            await asyncio.sleep(period)
            if self._lagging():
                self._change_isr()

    def _lagging(self) -> set[str]:
        now, lag = time.monotonic(), self._ctx.replica_lag_s
        out = set()
        for node in self.record.isr:
            progress = self._progress.get(node)
            last = progress.caught_up_at if progress is not None else self._started_at
            if node != self._ctx.node_id and now - last > lag:
                out.add(node)
        return out

    def _wanted_isr(self) -> tuple[str, ...]:
        lagging = self._lagging()
        joining = {
            node
            for node, progress in self._progress.items()
            if node not in self.record.isr and self._may_join(progress)
        }
        isr = (set(self.record.isr) - lagging) | joining | {self._ctx.node_id}
        return tuple(node for node in self.record.replicas if node in isr)

    def _change_isr(self) -> None:
        if self._isr_task is None or self._isr_task.done():
            self._isr_task = asyncio.get_running_loop().create_task(self._write_isr())

    async def _write_isr(self) -> None:
        placement = self._ctx.placement
        while self.leading:
            wanted = self._wanted_isr()
            if set(wanted) == set(self.record.isr):
                return
            record = self.record
            updated = dataclasses.replace(record, isr=wanted)
            try:
                outcome = await placement.cas(record, updated)
            except Exception as exc:  # etcd unreachable: try again at the next change or lag check
                log.warning("stream %r: could not change the in-sync set to %s: %s", self.name, wanted, exc)
                return
            current = outcome.record
            if current is None or current.epoch != record.epoch or current.leader != self._ctx.node_id:
                self.stop("deposed: the placement record moved to another epoch or leader")
                return
            if outcome.applied:
                log.info("stream %r: in-sync replicas %s -> %s", self.name, list(record.isr), list(wanted))
            self.update(current)


def _release(waiters: list[tuple[int, int, asyncio.Future[None]]], reached: int) -> None:
    """Complete the waiters (a heap of (target, n, future)) whose target is reached."""
    while waiters and waiters[0][0] <= reached:
        future = heapq.heappop(waiters)[2]
        if not future.done():
            future.set_result(None)
