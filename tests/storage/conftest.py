from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine

from storage import Engine, EngineConfig
from storage.cleanmark import SyncedEnd, marker_in
from storage.format import SEGMENT_HEADER_SIZE, SYNCED_SLOT_SIZE
from storage.fs import FileSystem
from storage.layout import SEGMENT_SUFFIX


class FakeClock:
    """Milliseconds that move only when a test says so."""

    def __init__(self, now_ms: int = 1_700_000_000_000) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms

    def advance(self, ms: int) -> None:
        self.now_ms += ms


def last_segment(fs: FileSystem, directory: Path) -> Path:
    return directory / [f for f in fs.listdir(directory) if f.endswith(SEGMENT_SUFFIX)][-1]


def synced_marker(directory: Path, fs: FileSystem | None = None) -> SyncedEnd | None:
    """The SYNCED marker a stream's clean close left in its last segment's slot (None: none)."""
    fs = fs or FileSystem()
    return marker_in(fs, last_segment(fs, directory))


def erase_slot(segment: Path) -> None:
    """Zero a segment file's SYNCED slot, as if no clean close had marked it."""
    with segment.open("r+b") as f:
        f.seek(SEGMENT_HEADER_SIZE)
        f.write(bytes(SYNCED_SLOT_SIZE))


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


def model_test_cases(
    machine: type[RuleBasedStateMachine], *, parts: int, examples: int, steps: int
) -> list[type]:
    """A hypothesis state machine's run as `parts` TestCases of `examples` examples of up to
    `steps` steps each: a pytest item each, so each stays a fraction of its timeout on a loaded
    machine while together they run as many examples as one long run. Each is a subclass of its
    own name: the CI profile (derandomize) seeds a machine from its name, so the parts explore
    different examples there too."""
    cases = []
    for part in range(1, parts + 1):
        case = type(f"{machine.__name__}Part{part}", (machine,), {}).TestCase
        case.settings = settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        )
        cases.append(case)
    return cases
