"""A stream this node follows: the fetch loop against the leader placement names for its epoch.

One `StreamFollower` per followed stream and epoch. It opens a Replicate call to the
leader (never to anyone else: the manager starts a new follower when placement names
another leader or epoch) and sends a request per round: its `log_end`, durable under
its fsync policy, acknowledges what it holds. The leader's answers:

- `diverging` (KIP-279): cut the log where the leader says this node's last epoch ends
  (or where this node's own copy of the leader's epoch ends, if sooner), then ask
  again; a cut below what this node knows to be committed is refused (it would mean
  the leader lost committed entries) and logged.
- `reset`: this node's end is before the leader's first offset (retention moved it):
  the copy is rebuilt empty from the leader's first offset.
- `data`: record the epoch that starts here, append the records at the offsets they
  carry with the holes between them (storage's append_replica, in a thread: it may
  sync), remove the prefix below the leader's first offset (KIP-107: its trims and
  retention), and follow the HW with the commit cap (what this node serves if it
  becomes leader); then the consumer
  groups: install the leader's group snapshot if one came, apply the op batches
  (storage's passive group store, journaled), and acknowledge them with `group_seq`.

A replica a move added, while it catches up, fetches no faster than `move_bytes_per_s` (all
such copies on this node together; cluster/replication/pace.py): the next request waits until
the bytes received fit the rate. In-sync followers are never throttled.

A broken call (leader gone, refused, malformed data) is retried with bounded
exponential backoff.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from streamlog.internal.v1 import replication_pb2 as rpb

from cluster.placement import StreamPlacement
from cluster.replication import copies
from cluster.replication.pace import Pace
from cluster.replication.wire import from_data
from storage import Engine

log = logging.getLogger("streamlog.cluster.replication")

_MIN_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 1.0


class CommittedTruncationError(Exception):
    """The leader asked this node to cut below what it knows to be committed."""


# (leader node id) -> the Replicate stream-stream multicallable on a channel to it
Connect = Callable[[str], Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FollowerContext:
    node_id: str
    engine: Engine
    connect: Connect
    metadata: Sequence[tuple[str, str]]  # sent with every call (the peer secret)
    max_bytes: int
    committed: Callable[[str, int], None]  # (stream, HW) as the leader last said it
    move_pace: Pace | None = None  # the cap on copies for moves (move_bytes_per_s); None: none


class StreamFollower:
    """This node following one stream's leader at one epoch. Event loop only; its disk work
    runs in threads under `apply_lock`, which whoever takes the stream over next must take."""

    def __init__(
        self, ctx: FollowerContext, record: StreamPlacement, hw: int, apply_lock: threading.Lock
    ) -> None:
        self._ctx = ctx
        self.name = record.name
        self.record = record
        self.hw = hw
        self.learned = False  # True once the leader of this epoch sent its HW (in `_apply`)
        self._apply_lock = apply_lock
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"follow {record.name}")

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.wait([self._task])

    async def _run(self) -> None:
        backoff = _MIN_BACKOFF_S
        while True:
            try:
                progressed = await self._session()
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                progressed = False
                log.debug("stream %r: fetch from %s ended: %s", self.name, self.record.leader, exc.details())
            except Exception as exc:
                progressed = False
                log.warning("stream %r: fetch from %s failed: %r", self.name, self.record.leader, exc)
            backoff = _MIN_BACKOFF_S if progressed else min(backoff * 2, _MAX_BACKOFF_S)
            await asyncio.sleep(backoff)

    def _last_epoch(self) -> int:
        epochs = self._ctx.engine.epochs(self.name)
        return epochs[-1][0] if epochs else -1

    def _request(self) -> rpb.FetchRequest:
        pace = self._move_pace()
        return rpb.FetchRequest(
            stream=self.name,
            incarnation=self.record.incarnation,
            leader_epoch=self.record.epoch,
            follower_id=self._ctx.node_id,
            log_end=self._ctx.engine.log_end(self.name),
            last_epoch=self._last_epoch(),
            group_seq=self._ctx.engine.group_seq(self.name),
            # Throttled: a second's worth at most per round, so that the copy paces evenly.
            max_bytes=self._ctx.max_bytes if pace is None else min(self._ctx.max_bytes, pace.bytes_per_s),
        )

    def _move_pace(self) -> Pace | None:
        """The throttle, while this node is a replica a move added that is still catching up (an
        in-sync follower is never throttled)."""
        node, record = self._ctx.node_id, self.record
        if self._ctx.move_pace is None or node not in record.added or node in record.isr:
            return None
        return self._ctx.move_pace

    async def _session(self) -> bool:
        """One Replicate call; True if it moved anything (the next one starts without backoff)."""
        call = self._ctx.connect(self.record.leader)(metadata=tuple(self._ctx.metadata))
        progressed = False
        try:
            await call.write(self._request())
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    return progressed
                body = response.WhichOneof("body")
                if body == "data":
                    data = response.data
                    if self._waits_on_disk(data):
                        await asyncio.to_thread(self._locked, self._apply, data)
                    else:  # no sync to wait for: a thread hop would cost more than the append
                        self._locked(self._apply, data)
                elif body == "diverging":
                    await asyncio.to_thread(self._locked, self._truncate, response.diverging)
                elif body == "reset":
                    await asyncio.to_thread(self._locked, self._rebuild, response.reset)
                else:
                    raise ValueError("an empty response from the leader")
                progressed = True
                if body == "data" and (pace := self._move_pace()) is not None:
                    await pace.took(response.data.ByteSize())
                await call.write(self._request())
        except asyncio.InvalidStateError:
            # The leader ended the call (refused, or stopped leading) as this node wrote: its status says why.
            log.debug(
                "stream %r: fetch from %s ended: %s", self.name, self.record.leader, await call.details()
            )
            return progressed
        finally:
            call.cancel()

    def _waits_on_disk(self, data: rpb.ReplicaData) -> bool:
        """Whether applying `data` may wait on the disk: a sync (the fsync policy), a group snapshot,
        a prefix removal (the meta file), or holes (a packed segment, written whole and synced)."""
        engine, name = self._ctx.engine, self.name
        count = len(data.positions) // 4 - 1
        return (
            engine.fsync_policy(name).blocks
            or data.HasField("group_snapshot")
            or data.end_offset != data.first_offset + count
            or (count > 0 and data.runs[0].first_offset != data.first_offset)
            or data.log_start > engine.bounds(name).first_offset
        )

    def _locked(self, work: Callable[[Any], None], message: Any) -> None:
        with self._apply_lock:
            work(message)

    # -- in a thread, under the apply lock

    def _apply(self, data: rpb.ReplicaData) -> None:
        engine, name = self._ctx.engine, self.name
        end = engine.log_end(name)
        moves = data.end_offset > data.first_offset  # records, or a hole the leader's compaction left
        if data.HasField("epoch_start") and moves:  # an epoch is recorded with its first offset
            start = data.epoch_start
            epochs = engine.epochs(name)
            if start.start_offset == end and (not epochs or start.epoch > epochs[-1][0]):
                engine.begin_epoch(name, start.epoch)
        if moves:
            end = engine.append_replica(name, from_data(data))
        if data.log_start > engine.bounds(name).first_offset:
            # The leader's first offset moved (a trim, its retention): this copy follows (KIP-107).
            engine.trim(name, min(data.log_start, end))
        hw = min(data.high_watermark, end)
        if hw > self.hw:
            self.hw = hw
            engine.set_commit(name, hw)
            self._ctx.committed(name, hw)
        self.learned = True
        if data.HasField("group_snapshot"):
            engine.install_group_snapshot(name, data.group_snapshot.seq, data.group_snapshot.ops)
        for batch in data.group_ops:
            engine.apply_group_ops(name, batch.seq, batch.ops)

    def _truncate(self, diverging: rpb.Diverging) -> None:
        engine, name = self._ctx.engine, self.name
        _, own_end = engine.epoch_end(name, diverging.epoch)
        first = engine.bounds(name).first_offset
        log_end = engine.log_end(name)
        cut = max(first, min(diverging.end_offset, own_end, log_end))
        if cut >= log_end and diverging.epoch == self._last_epoch():
            # Nothing to cut, yet the leader still says it diverges: asking again at once would spin.
            raise ValueError(f"stream {name!r}: the leader says this log diverges at {cut}, where it ends")
        if cut < self.hw:
            raise CommittedTruncationError(
                f"stream {name!r}: the leader ({self.record.leader}, epoch {self.record.epoch}) says this "
                f"log diverges at {cut}, below the committed offset {self.hw}: not truncated"
            )
        log.info(
            "stream %r: truncating at %d (diverged from the leader's epoch %d)", name, cut, diverging.epoch
        )
        engine.truncate(name, cut)

    def _rebuild(self, reset: rpb.Reset) -> None:
        engine, name = self._ctx.engine, self.name
        if reset.log_start < engine.log_end(name):
            raise ValueError(f"a reset to {reset.log_start} would move the copy back")
        log.warning(
            "stream %r: this copy ends before the leader's first offset %d: rebuilding it from there",
            name,
            reset.log_start,
        )
        engine.delete_stream(name)
        engine.create_stream(name, incarnation=self.record.incarnation)
        copies.apply_settings(engine, self.record)
        copies.set_leading(engine, name, False)
        engine.set_commit(name, reset.log_start)
        engine.reset(name, reset.log_start)
        if reset.epoch >= 0:
            engine.begin_epoch(name, reset.epoch)
        self.hw = reset.log_start
