"""AppendMany: batches for many streams in one call, each atomic on its own, one result per batch.

Each batch is checked as an Append is (streamwire.checked_append); one that fails gets
its error in its result and the others go on. Those that pass are grouped by stream, in
request order, and each stream's are written by one `Engine.append_many` (the write of
Publish's coalesced messages: one lock, one sync under "always", one wake-up), or by one
`Engine.append` each, in order, when one of them is conditional (expected_next_offset,
which append_many does not take). The streams whose sync blocks are written together by
`Engine.append_many_streams`: all written, then made durable, so that one sync of the packs
and the journal covers all the slot streams of a thread's part (a result is still handed out
only once its stream's writes are durable).

Where a stream is written is what it costs the loop (measured, CPU time, an everysec engine
and the server's two append listeners): an open stream's batch costs about 45 µs there, so open
streams whose fsync policy does not block are written on the loop, ON_LOOP_SLICE at a time with
a turn of the loop between slices (1,000 of them held it 45 ms in one go). A stream to create
costs 300 to 900 µs of CPU and a mkdir's wait, one to reopen a file open and a mapping: those,
and the streams whose sync blocks, are written after them in a thread, one after another, so
that a disk's slowness never holds the loop (10,000 new streams held it for tens of seconds,
and every other call of the server waited). Each thread hop writes its streams in one batch of
the listeners' hops (service/loophops.py): the readers to wake hear of all its streams in one
wake-up of the loop, not one per stream.

The thread work is of two kinds, run at once. Streams to create or reopen under a policy
that does not block are CPU-bound (a creation is mostly Python): two calls writing them in two
threads at once only fought over the GIL and the engine's creation lock, so they pass through
the servicer's lane, one call at a time (two calls in flight of 2,000 new streams each: see
docs/PERFORMANCE.md, "Two AppendMany calls at once"). Streams whose sync blocks mostly wait for
the disk: they are written outside the lane, spread over all the thread pool's threads but one,
so that the syncs of directory streams (each its own segment's) overlap, within a call and
across calls (1,000 new slot streams under "always": 1,336 fdatasyncs when each stream waited
for its own in turn, 10 since the parts' are shared; docs/PERFORMANCE.md, "One sync for an
AppendMany call's streams"). A stream the cache closed is taken to have the server's fsync
policy (its own is known once it is open again): one with a policy of its own that blocks,
under a server's that does not, holds the lane for its sync.

The request as a whole is checked first (`check_request`): at least one batch, at most
max_append_many_batches of them and max_append_many_bytes. In a cluster the routing layer
checks it too, before it splits the batches by leader (service/routing.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from streamlog.v1 import streamlog_pb2 as pb

from service import streamwire, validation
from service.callcontext import CallContext
from service.config import Settings
from service.errors import ServiceError, invalid_argument, limit_exceeded, status_for, translate_errors
from service.loophops import LoopHops
from service.serving import Serving
from service.streamwire import Producer
from storage import AppendBatch, AppendResult, Engine, StorageError

# What a batch gets: its result, or the error that refused it.
Outcome = AppendResult | BaseException
# A stream's checked batches, in request order: (index in the request, batch, producer, expected end).
_Writes = list[tuple[int, AppendBatch, Producer, int | None]]

# Open streams written on the loop between two turns of it: about 3 ms of CPU.
ON_LOOP_SLICE = 64


def check_request(request: pb.AppendManyRequest, settings: Settings) -> None:
    """Refuse a request that is wrong as a whole: no batches, or past a bound on the whole.

    Its size is measured only under a max_append_many_bytes below max_message_bytes: the gRPC
    server's and the HTTP API's receive limit, which every request has passed before it gets here
    (a part that routing serves or forwards is a part of one), and a request's ByteSize encodes
    it whole (a quarter of the loop's CPU in an AppendMany load of new streams, measured twice)."""
    count = len(request.batches)
    if not count:
        raise invalid_argument("batches: at least one batch is required")
    limit = settings.max_append_many_batches
    if count > limit:
        raise limit_exceeded("max_append_many_batches", limit, f"batches: the request has {count} batches")
    limit = settings.max_append_many_bytes
    if limit >= settings.max_message_bytes:
        return
    size = request.ByteSize()
    if size > limit:
        raise limit_exceeded("max_append_many_bytes", limit, f"batches: the request has {size} bytes")


def error_result(code: grpc.StatusCode, message: str) -> pb.AppendManyResult:
    """The result of a batch that was not appended: the status an Append of it would end with."""
    return pb.AppendManyResult(error=pb.PublishError(code=code.value[0], message=message))


def _response(outcomes: list[Outcome]) -> pb.AppendManyResponse:
    """The reply: one result per outcome, in order. Each is added in place: a result made apart
    and copied into the list cost three times as much."""
    response = pb.AppendManyResponse()
    results = response.results
    add = results.add
    for outcome in outcomes:
        if isinstance(outcome, AppendResult):
            add(**streamwire.appended(outcome))
        else:
            results.append(error_result(*status_for(outcome)))
    return response


def _unconditional(writes: _Writes) -> bool:
    return all(expected is None for *_, expected in writes)


def _appends(writes: _Writes) -> list[tuple[AppendBatch, Producer]]:
    return [(batch, producer) for _, batch, producer, _ in writes]


def _place(writes: _Writes, written: list[AppendResult | StorageError], outcomes: list[Any]) -> None:
    for (i, *_), outcome in zip(writes, written, strict=True):
        outcomes[i] = outcome


def _write(engine: Engine, stream: str, writes: _Writes, outcomes: list[Any]) -> None:
    """Write one stream's batches, each outcome into its slot."""
    try:
        if _unconditional(writes):
            _place(writes, engine.append_many(stream, _appends(writes)), outcomes)
            return
        for i, batch, producer, expected in writes:
            try:
                outcomes[i] = engine.append(stream, batch, producer=producer, expected_end=expected)
            except StorageError as exc:
                outcomes[i] = exc
    except StorageError as exc:  # the stream as a whole refused the write (deleted, failed sync)
        for i, *_ in writes:
            outcomes[i] = exc


def _write_all(
    engine: Engine, streams: list[tuple[str, _Writes]], outcomes: list[Any], hops: LoopHops
) -> None:
    """Write streams one after another, in a thread: their listeners' news reaches the loop in one hop."""
    with hops.batch():
        for stream, writes in streams:
            _write(engine, stream, writes, outcomes)


def _write_durable_together(
    engine: Engine, streams: list[tuple[str, _Writes]], outcomes: list[Any], hops: LoopHops
) -> None:
    """Write streams whose sync blocks, in a thread: those without a conditional batch by one
    `Engine.append_many_streams` (all written, then made durable by as few syncs as the storage
    needs), the others one by one. Their listeners' news reaches the loop in one hop."""
    together = [(stream, writes) for stream, writes in streams if _unconditional(writes)]
    with hops.batch():
        written = engine.append_many_streams([(stream, _appends(writes)) for stream, writes in together])
        for (_, writes), outcome in zip(together, written, strict=True):
            if isinstance(outcome, StorageError):  # the stream as a whole refused the write
                outcome = [outcome] * len(writes)
            _place(writes, outcome, outcomes)
        for stream, writes in streams:
            if not _unconditional(writes):
                _write(engine, stream, writes, outcomes)


class AppendManyCalls:
    """The AppendMany RPC."""

    def __init__(self, serving: Serving) -> None:
        self._serving = serving
        # Held by the call whose streams to create or reopen are being written (event loop only).
        self._lane = asyncio.Lock()

    async def _write_in_lane(
        self, engine: Engine, streams: list[tuple[str, _Writes]], outcomes: list[Any]
    ) -> None:
        """Write streams in a thread once no other call's lane part is being written."""
        lane = self._lane
        await lane.acquire()
        try:
            written = asyncio.ensure_future(
                self._serving.in_thread(_write_all, engine, streams, outcomes, self._serving.waiters.hops)
            )
        except BaseException:
            lane.release()
            raise
        # Held until the thread is done, even if this call is cancelled meanwhile.
        written.add_done_callback(lambda _: lane.release())
        await asyncio.shield(written)

    @translate_errors
    async def AppendMany(self, request: pb.AppendManyRequest, context: CallContext) -> pb.AppendManyResponse:
        serving = self._serving
        engine = serving.ready()
        settings = serving.settings
        check_request(request, settings)
        outcomes: list[Any] = [None] * len(request.batches)
        by_stream: dict[str, _Writes] = {}
        for i, batch_request in enumerate(request.batches):
            try:
                stream, batch, producer = streamwire.checked_append(
                    batch_request, settings.max_batch_entries, "batch"
                )
                expected = None
                if batch_request.HasField("expected_next_offset"):
                    expected = validation.non_negative(
                        "expected_next_offset", batch_request.expected_next_offset
                    )
            except (ServiceError, StorageError) as exc:
                outcomes[i] = exc
                continue
            by_stream.setdefault(stream, []).append((i, batch, producer, expected))
        lane: list[tuple[str, _Writes]] = []  # to create or reopen, under a policy that does not block
        blocking: list[tuple[str, _Writes]] = []  # whose sync blocks
        default_blocks = engine.config.fsync.blocks  # a stream not open: see the module docstring
        on_loop = 0
        for stream, writes in by_stream.items():
            if not engine.is_open(stream):
                (blocking if default_blocks else lane).append((stream, writes))
                continue
            if engine.fsync_policy(stream).blocks:
                blocking.append((stream, writes))
                continue
            _write(engine, stream, writes, outcomes)
            on_loop += 1
            if on_loop % ON_LOOP_SLICE == 0:
                await asyncio.sleep(0)  # the other calls' turn
        hops = []
        if lane:
            hops.append(self._write_in_lane(engine, lane, outcomes))
        # Blocking streams are spread over the pool's threads but one (left to the other calls):
        # a directory stream's sync is its own, and those of the parts overlap.
        spread = min(len(blocking), max(1, settings.append_threads - 1))
        for part in range(spread):
            hops.append(
                serving.in_thread(
                    _write_durable_together, engine, blocking[part::spread], outcomes, serving.waiters.hops
                )
            )
        if hops:
            await asyncio.gather(*hops)
        return _response(outcomes)
