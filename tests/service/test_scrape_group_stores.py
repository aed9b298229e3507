"""A metrics scrape lists the groups of every open stream (service/metrics.py) and makes no
consumer-group store for those without groups (storage/groupstore.py's `GroupStores.find`,
issue 17: one empty store per stream a scrape ever saw, kept for good)."""

from __future__ import annotations

from pathlib import Path

from service.metrics import EngineCollector
from storage import AppendBatch, Engine, EngineConfig


def test_a_scrape_of_many_streams_makes_no_group_store(tmp_path: Path) -> None:
    engine = Engine(tmp_path / "data", EngineConfig(background=False))
    try:
        for i in range(200):
            engine.append(f"s-{i}", AppendBatch([b"x"]))
        engine.create_group("s-3", "readers", start=0)
        collector = EngineCollector(lambda: engine, lambda: 0, lambda: 0)
        for _ in range(2):
            families = {family.name: family for family in collector.collect()}
        lag = families["streamlog_group_lag"].samples
        assert [(s.labels, s.value) for s in lag] == [({"stream": "s-3", "group": "readers"}, 1)]
        assert [store.name for store in engine._groups.stores.all()] == ["s-3"]
    finally:
        engine.close()
