"""Disk faults seen through the service: a failed fsync, a full disk.

The servicer runs over an engine whose file system is the fault-injecting one
(tests/storage/faultfs.py), so a sync can be made to fail and the disk to fill
at chosen moments, then the state after a restart is examined.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from streamlog.v1 import streamlog_pb2 as pb

from service.config import engine_config
from service.servicer import StreamLogServicer
from service.waiters import Waiters
from storage import Engine
from tests.service.helpers import Aborted, FakeContext, small_settings
from tests.storage.faultfs import FaultFS

ROOT = Path("/faultfs/data")


def _serve(fs: FaultFS, scenario) -> None:
    """Run `scenario(servicer)` on a fresh loop over an engine on `fs`, fsync=always."""

    async def main() -> None:
        settings = small_settings(ROOT, fsync="always")
        engine = Engine(ROOT, engine_config(settings, background=False), fs=fs)
        waiters = Waiters()
        engine.add_append_listener(waiters.on_append)
        with ThreadPoolExecutor(max_workers=2) as executor:
            servicer = StreamLogServicer(settings, waiters, executor)
            servicer.attach_engine(engine)
            try:
                await scenario(servicer)
            finally:
                engine.close()

    asyncio.run(main())


async def _append(servicer, stream: str, payloads: list[bytes]) -> pb.AppendResponse:
    return await servicer.Append(pb.AppendRequest(stream=stream, payloads=payloads), FakeContext())


async def _payloads(servicer, stream: str) -> list[bytes]:
    """Every payload of the stream, page by page."""
    payloads: list[bytes] = []
    offset = 0
    while True:
        raw = await servicer.Read(pb.ReadRequest(stream=stream, offset=offset, count=1000), FakeContext())
        reply = pb.ReadResponse.FromString(raw)
        if not reply.entries:
            return payloads
        payloads.extend(e.payload for e in reply.entries)
        offset = reply.next_offset


async def _status(coro) -> grpc.StatusCode:
    try:
        await coro
    except Aborted as exc:
        return exc.code
    return grpc.StatusCode.OK


def test_failed_fsync_stops_acknowledging_keeps_reads_and_restart_recovers_what_was_synced():
    fs = FaultFS()
    fs.prepare_dir(ROOT)

    async def before(servicer) -> None:
        await _append(servicer, "s", [b"synced-1", b"synced-2"])
        fs.fail_at_sync = fs.syncs + 1  # the next fsync fails: EIO
        assert await _status(_append(servicer, "s", [b"never-acked"])) == grpc.StatusCode.UNAVAILABLE
        fs.fail_at_sync = None
        # No retry that could lie: appends stay refused, with a clear status, until restart.
        code = await _status(_append(servicer, "s", [b"refused"]))
        assert code == grpc.StatusCode.UNAVAILABLE
        assert await _payloads(servicer, "s") == [b"synced-1", b"synced-2"]  # reads keep working

    _serve(fs, before)
    restarted = fs.crashed_copy(mode="lost")  # what is on disk: only what was synced

    async def after(servicer) -> None:
        assert await _payloads(servicer, "s") == [b"synced-1", b"synced-2"]
        assert (await _append(servicer, "s", [b"after-restart"])).first_offset == 2

    _serve(restarted, after)


def test_full_disk_refuses_appends_with_resource_exhausted_then_recovers():
    fs = FaultFS()
    fs.prepare_dir(ROOT)

    async def scenario(servicer) -> None:
        await _append(servicer, "s", [b"before"])
        await _append(servicer, "other", [b"x" * 1000])
        fs.disk_full = True
        acked: list[bytes] = []
        refused = None
        for i in range(200):  # enough appends to need a new segment, which cannot be created
            batch = [b"%d-%d" % (i, j) + b"x" * 500 for j in range(30)]
            code = await _status(_append(servicer, "s", batch))
            if code != grpc.StatusCode.OK:
                refused = code
                break
            acked.extend(batch)
        assert refused == grpc.StatusCode.RESOURCE_EXHAUSTED
        stored = await _payloads(servicer, "s")
        assert stored == [b"before", *acked]  # nothing half-written, nothing lost
        fs.disk_full = False
        after = await _append(servicer, "s", [b"space again"])
        assert (await _payloads(servicer, "s"))[-1] == b"space again"
        assert after.first_offset == len(stored)

    _serve(fs, scenario)
