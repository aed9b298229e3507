"""This node's replicas: its copy and its role (leader, follower, none) in each stream, from placement.

The manager listens to the placement table (cluster/placement.py, in etcd's revision
order) and reconciles each stream this node replicates with its latest record, one
stream at a time and in order (a task per stream while it has changes to apply):

- **Copies.** A stream this node replicates gets a local copy created with the
  stream's incarnation; a copy of an older incarnation (the name was deleted and
  taken again) is wiped first. A copy missing or damaged (unreadable at start-up)
  for a stream this node did not see created was lost: the node first leaves the
  in-sync set (cluster/replication/handover.py), then rebuilds it from the leader.
  The copy of a stream this node no
  longer replicates goes (a deleted stream's copy is the service's to delete, as it
  ends the calls waiting on it).
- **Leader** (the record names this node): the follower role stops first (its disk
  work finished), then `begin_epoch`, the commit cap set to the last HW this node
  knew (never serve past what was committed), the stream's consumer groups made
  active (from the state it holds), and only then does `ready()` let the service
  accept writes. A new record at the same epoch (the in-sync set, the config) just
  updates the leader.
- **Follower**: fetches from the leader the record names at its epoch, its copy capped at
  the last HW this node knew (its first offset after a restart); a new epoch or
  leader restarts it. Once it has heard the HW from that leader it `serves_reads`
  (reads from in-sync replicas, service/routing.py). No leader (offline): no role, the
  copy stays. Either way its consumer groups are passive (the engine starts them so in a cluster): they follow
  the leader's ops and act on nothing themselves.

Every replicated copy carries a commit cap, so its readers never see past the HW.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from cluster.placement import PlacementTable, StreamPlacement
from cluster.replication import copies
from cluster.replication.follower import Connect, FollowerContext, StreamFollower
from cluster.replication.handover import AskState, hand_over
from cluster.replication.leader import LeaderContext, NotLeadingError, StreamLeader
from cluster.replication.pace import Pace
from storage import Engine

log = logging.getLogger("streamlog.cluster.replication")

# Runs on the loop with the streams it is told of: name -> the value told.
Receiver = Callable[[dict[str, Any]], None]
# `to_loop(receive, name, value)` has `receive({name: value, ...})` run on the loop: the service's
# `LoopHops.tell` (service/loophops.py), which gathers a thread's batch of appends into one hop.
ToLoop = Callable[[Receiver, str, Any], None]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicationConfig:
    replica_lag_ms: int = 2000
    max_fetch_bytes: int = 1 << 20
    move_bytes_per_s: int = 0  # the throttle on copies for moves (0: none)
    # A higher HW alone is sent to a follower this long after it moved, unless entries come first.
    hw_linger_ms: int = 10


class ReplicaManager:
    """Applies placement to this node's engine and runs its replication roles. Event loop only."""

    def __init__(
        self,
        node_id: str,
        engine: Engine,
        placement: PlacementTable,
        *,
        lease_valid_until: Callable[[], float],
        connect: Connect,
        metadata: Sequence[tuple[str, str]] = (),
        config: ReplicationConfig = ReplicationConfig(),
        forget: Callable[[str], None] = lambda _name: None,
        live: Callable[[], Iterable[str]] = lambda: (),
        ask_state: AskState | None = None,
        to_loop: ToLoop | None = None,
    ) -> None:
        """`forget(name)` (on the loop) ends the waits on a copy wiped here (an older incarnation);
        `live()`: the live nodes; `ask_state`: a peer's ReplicaState (cluster/replication/handover.py);
        `to_loop`: how the engine's listeners reach the loop (else one hop per call)."""
        self.node_id = node_id
        self._to_loop = to_loop or self._hop
        # The engine's listeners' receivers on the loop (one object each: a batch gathers per receiver).
        self._logs_grew: Receiver = functools.partial(self._told, StreamLeader.on_log)
        self._group_batches_made: Receiver = functools.partial(self._told, StreamLeader.on_group_batch)
        self._forget = forget
        self._live_nodes = live
        self._ask_state = ask_state
        self._engine = engine
        self._placement = placement
        lag_s = config.replica_lag_ms / 1000
        self._leader_ctx = LeaderContext(
            node_id=node_id,
            engine=engine,
            placement=placement,
            lease_valid_until=lease_valid_until,
            replica_lag_s=lag_s,
            heartbeat_s=min(0.5, lag_s / 4),
            hw_linger_s=config.hw_linger_ms / 1000,
        )
        self._follower_ctx = FollowerContext(
            node_id=node_id,
            engine=engine,
            connect=connect,
            metadata=tuple(metadata),
            max_bytes=config.max_fetch_bytes,
            committed=self._committed,
            move_pace=Pace(config.move_bytes_per_s) if config.move_bytes_per_s else None,
        )
        self.leaders: dict[str, StreamLeader] = {}
        self.followers: dict[str, StreamFollower] = {}
        self._hw: dict[str, int] = {}  # the last HW this node knew, per stream
        self._apply_locks: dict[str, threading.Lock] = {}
        self._wanted: dict[str, StreamPlacement | None] = {}
        self._reconciling: dict[str, asyncio.Task[None]] = {}
        self._ready_waiters: dict[str, list[asyncio.Future[None]]] = {}
        self._live = False  # False while the records that exist at start load
        self._born: set[str] = set()  # streams seen created since then: a missing copy is just new
        self._lost: set[str] = set()  # copies lost here, until this node is out of the ISR
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = False
        engine.add_log_listener(self._on_log)
        engine.add_group_batch_listener(self._on_group_batch)

    # -- what the service asks

    def leader(self, name: str) -> StreamLeader | None:
        """The stream's leader role here, if this node leads it and is ready to accept writes."""
        leader = self.leaders.get(name)
        return leader if leader is not None and leader.leading else None

    def ready(self, name: str) -> bool:
        return self.leader(name) is not None

    async def wait_ready(self, name: str, timeout_s: float) -> bool:
        """Wait (bounded) until this node leads the stream and accepts writes: a stream just
        created or elected here is ready once its copy and epoch are (a few milliseconds)."""
        if self.ready(name):
            return True
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._ready_waiters.setdefault(name, []).append(future)
        try:
            await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            return False
        finally:
            waiters = self._ready_waiters.get(name)
            if waiters is not None and future in waiters:
                waiters.remove(future)
        return self.ready(name)

    def serves_reads(self, name: str, epoch: int) -> bool:
        """Whether this node follows the stream's leader at `epoch` and has learned the high
        watermark from it: its copy then shows committed entries only (reads from in-sync
        replicas)."""
        follower = self.followers.get(name)
        return follower is not None and follower.record.epoch == epoch and follower.learned

    def check_quorum(self, name: str, *, quorum: bool) -> None:
        """Raise unless this node leads the stream with enough in-sync replicas for the level."""
        leader = self.leader(name)
        if leader is None:
            raise NotLeadingError(f"stream {name!r}: this node does not lead it now")
        leader.check_quorum(quorum)

    async def barrier(self, name: str, end: int, *, quorum: bool, group_seq: int | None = None) -> None:
        """Wait until `end` is committed and the group op batches up to `group_seq` are applied
        by the in-sync replicas (acks=quorum); see StreamLeader.barrier."""
        leader = self.leader(name)
        if leader is None:
            raise NotLeadingError(f"stream {name!r}: this node does not lead it now; the outcome is unknown")
        await leader.barrier(end, quorum=quorum, group_seq=group_seq)

    # -- lifecycle

    def start(self) -> None:
        """Before the placement's records load (the listener hears them all)."""
        self._loop = asyncio.get_running_loop()

    async def stop(self) -> None:
        self._stopped = True
        tasks = list(self._reconciling.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for leader in self.leaders.values():
            leader.stop("the server is stopping")
        self.leaders.clear()
        await asyncio.gather(*(follower.stop() for follower in self.followers.values()))
        self.followers.clear()

    def go_live(self) -> None:
        """The records that existed at start have loaded: a copy missing from now on for a stream
        created meanwhile is a new stream's, not a lost one."""
        self._live = True

    def state(self, name: str, incarnation: int) -> tuple[int, int] | None:
        """(last epoch, log end) of this node's copy of that incarnation, unless it has none or lost it."""
        engine = self._engine
        if name in self._lost or not engine.exists(name) or engine.incarnation(name) != incarnation:
            return None
        epochs = engine.epochs(name)
        return (epochs[-1][0] if epochs else -1), engine.log_end(name)

    def on_placement(self, name: str, old: StreamPlacement | None, new: StreamPlacement | None) -> None:
        """The placement listener."""
        if self._stopped:
            return
        if new is None:
            self._born.discard(name)
        elif old is None and self._live:
            self._born.add(name)
        self._wanted[name] = new
        leader = self.leaders.get(name)
        if leader is not None and (new is None or new.epoch != leader.epoch or new.leader != self.node_id):
            leader.stop("placement moved the stream on")  # at once: no more acknowledgements
        if name not in self._reconciling:
            task = asyncio.get_running_loop().create_task(self._reconcile(name), name=f"replicas {name}")
            self._reconciling[name] = task

    async def _reconcile(self, name: str) -> None:
        try:
            while True:
                record = self._wanted[name]
                try:
                    await self._apply(name, record)
                except Exception:
                    log.exception("stream %r: could not apply its placement", name)
                if self._wanted.get(name) is record:
                    break
        finally:
            del self._reconciling[name]
            if self._wanted.get(name) is None:
                self._wanted.pop(name, None)

    async def _apply(self, name: str, record: StreamPlacement | None) -> None:
        mine = record is not None and self.node_id in record.replicas
        leading = mine and record is not None and record.leader == self.node_id
        lock = self._apply_locks.setdefault(name, threading.Lock())
        leader = self.leaders.get(name)
        if leader is not None and leading and record is not None and leader.epoch == record.epoch:
            leader.update(record)
            await self._follow_settings(record, lock)
            return
        if leader is not None:
            leader.stop("placement moved the stream on")
            self._hw[name] = max(self._hw.get(name, 0), leader.hw)
            del self.leaders[name]
            if self._engine.exists(name):  # it acts no more: the next leader's ops and log rule it
                await asyncio.to_thread(copies.set_leading, self._engine, name, False)
        follower = self.followers.get(name)
        if follower is not None:
            same = record is not None and (follower.record.epoch, follower.record.leader) == (
                record.epoch,
                record.leader,
            )
            if same and mine and not leading:
                follower.record = record  # type: ignore[assignment]
                await self._follow_settings(record, lock)  # type: ignore[arg-type]
                return
            await follower.stop()
            del self.followers[name]
        if record is None:  # deleted: the service deletes the copy (and ends its waiting readers)
            self._hw.pop(name, None)
            self._apply_locks.pop(name, None)
            return
        if not mine:
            await asyncio.to_thread(self._locked, lock, self._drop_copy, name)
            self._hw.pop(name, None)
            return
        await asyncio.to_thread(self._locked, lock, self._ensure_copy, record)
        if name in self._lost:
            if self._ask_state is None:
                self._lost.discard(name)
            else:
                await hand_over(self._placement, self.node_id, name, self._live_nodes, self._ask_state)
                self._lost.discard(name)
                if self._placement.locate(name) is not record:
                    return  # the record it changed comes next: its role is that one's
        if self._wanted.get(name) is not record:
            return  # a newer record came meanwhile: apply that one
        hw = self._hw.setdefault(name, self._engine.bounds(name).first_offset)
        if leading:
            await asyncio.to_thread(self._locked, lock, self._begin_epoch, record, hw)
            if self._wanted.get(name) is not record:
                return
            self.leaders[name] = StreamLeader(self._leader_ctx, record, hw)
            for future in self._ready_waiters.pop(name, ()):
                if not future.done():
                    future.set_result(None)
            log.info(
                "stream %r: leading epoch %d from offset %d (committed %d)",
                name,
                record.epoch,
                self._engine.log_end(name),
                hw,
            )
        elif record.leader:
            # The copy's readers see what is known committed (a copy opened at start-up has no
            # cap yet: in memory, no disk work); the follower raises it as the leader's HW comes.
            self._engine.set_commit(name, hw)
            self.followers[name] = StreamFollower(self._follower_ctx, record, hw, lock)

    async def _follow_settings(self, record: StreamPlacement, lock: threading.Lock) -> None:
        """Give this node's copy the stream settings placement holds, when they changed."""
        if copies.differs(self._engine, record):
            await asyncio.to_thread(self._locked, lock, copies.apply_settings, self._engine, record)

    @staticmethod
    def _locked(lock: threading.Lock, work: Callable[..., None], *args: object) -> None:
        with lock:
            work(*args)

    # -- in a thread, under the stream's apply lock

    def _ensure_copy(self, record: StreamPlacement) -> None:
        engine, name = self._engine, record.name
        if engine.exists(name) and engine.incarnation(name) != record.incarnation:
            log.warning(
                "stream %r: wiping this node's copy of incarnation %d (placement holds %d)",
                name,
                engine.incarnation(name),
                record.incarnation,
            )
            engine.delete_stream(name)
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._forget, name)
        if not engine.exists(name):
            if engine.wipe_damaged(name):  # lost like a missing one: rebuilt from the leader
                log.warning("stream %r: this node's copy is damaged: rebuilding it from the leader", name)
            if self.node_id in record.target and self.node_id not in record.isr:
                log.info("stream %r: a move adds a replica here: it copies the stream from the leader", name)
            elif name not in self._born:  # not a new stream: its data here was lost, or it never got any
                self._lost.add(name)
                log.warning(
                    "stream %r: this node holds no copy of it; it starts empty%s",
                    name,
                    "" if record.leader == self.node_id else " and fetches from the leader",
                )
            engine.create_stream(name, incarnation=record.incarnation)
            engine.set_commit(name, engine.bounds(name).first_offset)
        copies.apply_settings(engine, record)
        if record.leader != self.node_id:
            copies.set_leading(engine, name, False)  # (a node that led it before: no longer)

    def _drop_copy(self, name: str) -> None:
        if self._engine.exists(name):
            self._engine.delete_stream(name)

    def _begin_epoch(self, record: StreamPlacement, hw: int) -> None:
        engine, name = self._engine, record.name
        engine.set_commit(name, hw)
        engine.begin_epoch(name, record.epoch)
        copies.set_leading(engine, name, True)

    # -- engine and follower callbacks

    def _on_log(self, name: str, end: int) -> None:
        # On the engine's calling thread: to the loop (the listener may not call the engine back).
        if self._loop is not None and name in self.leaders:
            self._to_loop(self._logs_grew, name, end)

    def _on_group_batch(self, name: str, seq: int) -> None:
        if self._loop is not None and name in self.leaders:
            self._to_loop(self._group_batches_made, name, seq)

    def _hop(self, receive: Receiver, name: str, value: Any) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(receive, {name: value})

    def _told(self, news: Callable[[StreamLeader], None], names: dict[str, Any]) -> None:
        for name in names.keys() & self.leaders.keys():
            news(self.leaders[name])

    def _committed(self, name: str, hw: int) -> None:
        # From a follower's thread: a plain dict write of an int.
        self._hw[name] = hw
