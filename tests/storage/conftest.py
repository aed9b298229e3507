from __future__ import annotations

import pytest

from storage import Engine, EngineConfig


class FakeClock:
    """Milliseconds that move only when a test says so."""

    def __init__(self, now_ms: int = 1_700_000_000_000) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms

    def advance(self, ms: int) -> None:
        self.now_ms += ms


# Small sizes so a few hundred entries seal nodes, roll segments and get packed.
SMALL = dict(
    segment_bytes=64 * 1024,
    node_entries=8,
    max_batch_entries=64,
    max_batch_bytes=16 * 1024,
    max_entry_bytes=4 * 1024,
    background=False,
)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def open_engine(tmp_path, clock):
    """Open (and later close) engines on one data directory: open_engine(**config overrides)."""
    engines: list[Engine] = []

    def _open(**overrides) -> Engine:
        engine = Engine(tmp_path / "data", EngineConfig(**{**SMALL, **overrides}), clock=clock)
        engines.append(engine)
        return engine

    yield _open
    for engine in engines:
        engine.close()
