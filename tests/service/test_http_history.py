"""The console's history (service/http/history.py) on a data directory of closed streams."""

from __future__ import annotations

import asyncio
from pathlib import Path

from service.http.history import History
from storage import AppendBatch, Engine, EngineConfig


def test_start_opens_no_stream_and_counts_from_each_streams_end(tmp_path: Path) -> None:
    config = EngineConfig(background=False)
    with Engine(tmp_path, config) as engine:
        for name in ("a", "b", "c"):
            engine.append(name, AppendBatch([b"x"] * 5))
    with Engine(tmp_path, config) as engine:
        history = History()

        async def run() -> None:
            await history.start(engine)
            await history.stop()

        asyncio.run(run())
        assert engine.open_streams() == 0  # start-up's work is per stream used, not per stream
        engine.append("a", AppendBatch([b"y"] * 2))  # opened here: counted from its end, 5
        engine.append("d", AppendBatch([b"z"] * 3))  # created since: counted from 0
        history.sample()
        engine.append("a", AppendBatch([b"y"]))
        history.sample()
    assert [n for _, n in history.appended("a")] == [2, 1]
    assert [n for _, n in history.appended("d")] == [3, 0]
    assert [n for _, n in history.appended("b")] == [0, 0]
