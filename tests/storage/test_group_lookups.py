"""A call that only reads consumer groups makes no group store (storage/groupstore.py's
`GroupStores.find`, issue 17): a metrics scrape lists the groups of every open stream, and each
empty store it made stayed in memory for good, one per stream ever seen.

What callers get is unchanged: each call on a stream without a store answers (or fails) exactly
as on one with the empty store these calls made before (`GroupStores.get`), on a leader and on a
follower.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from storage import (
    AppendBatch,
    Engine,
    EngineConfig,
    GroupConfig,
    GroupNotFoundError,
    GroupReadOptions,
    InvalidArgumentError,
    PreconditionError,
    StreamNotFoundError,
)

from .conftest import SMALL

# Every group call that needs no store to answer on a stream without groups, by name.
READS: dict[str, Callable[[Engine, str], Any]] = {
    "list_groups": lambda e, s: e.list_groups(s),
    "group_info": lambda e, s: e.group_info(s, "g"),
    "pending": lambda e, s: e.pending(s, "g"),
    "consumer_count": lambda e, s: e.consumer_count(s, "g", "c"),
    "group_seq": lambda e, s: e.group_seq(s),
    "group_ops_since 0": lambda e, s: e.group_ops_since(s, 0),
    "group_ops_since 3": lambda e, s: e.group_ops_since(s, 3),
    "dump": lambda e, s: e._groups.dump(s),
    # Calls that write a group, on a group that does not exist: they fail before writing.
    "read_group": lambda e, s: e.read_group(s, "g", GroupReadOptions("c", 1)),
    "ack": lambda e, s: e.ack(s, "g", [0]),
    "nack": lambda e, s: e.nack(s, "g", [0]),
    "claim": lambda e, s: e.claim(s, "g", "c", 0, [0]),
    "autoclaim": lambda e, s: e.autoclaim(s, "g", "c", 0),
    "delete_group": lambda e, s: e.delete_group(s, "g"),
    "set_group_offset": lambda e, s: e.set_group_offset(s, "g", 0),
    "set_group_config": lambda e, s: e.set_group_config(s, "g", GroupConfig()),
    "delete_consumer": lambda e, s: e.delete_consumer(s, "g", "c"),
}


def outcome(call: Callable[[Engine, str], Any], engine: Engine, stream: str) -> tuple[str, str]:
    """(what the call returned or the error's type, its text), the stream's name taken out."""
    try:
        result = call(engine, stream)
    except Exception as exc:
        return type(exc).__name__, str(exc).replace(repr(stream), "<stream>")
    return "returned", repr(result)


def stores(engine: Engine) -> list[str]:
    return sorted(store.name for store in engine._groups.stores.all())


@pytest.fixture
def engine(tmp_path, clock):
    engine = Engine(tmp_path / "data", EngineConfig(**SMALL), clock=clock)
    yield engine
    engine.close()


def test_listing_the_groups_of_many_streams_without_groups_makes_no_store(engine):
    names = [f"seen-{i}" for i in range(50)]
    for name in names:
        engine.append(name, AppendBatch([b"x"]))
    for _ in range(3):  # three scrapes
        assert [engine.list_groups(name) for name in names] == [[]] * len(names)
    assert stores(engine) == []
    engine.create_group("seen-7", "readers")  # a call that writes a group makes one
    assert stores(engine) == ["seen-7"]
    assert [i.name for i in engine.list_groups("seen-7")] == ["readers"]


@pytest.mark.parametrize("name", sorted(READS))
def test_each_call_answers_as_an_empty_store_would_and_makes_none(engine, name):
    for stream in ("bare", "made"):
        engine.append(stream, AppendBatch([b"x"] * 3))
    engine._groups.stores.get("made")  # the empty store these calls made before
    call = READS[name]
    assert outcome(call, engine, "bare") == outcome(call, engine, "made")
    assert stores(engine) == ["made"]


@pytest.mark.parametrize("name", sorted(READS))
def test_a_missing_stream_or_a_bad_name_is_refused_as_before(engine, name):
    call = READS[name]
    with pytest.raises(StreamNotFoundError, match="'missing' does not exist"):
        call(engine, "missing")
    with pytest.raises(InvalidArgumentError):
        call(engine, "")
    assert stores(engine) == []


@pytest.mark.parametrize("name", sorted(READS))
def test_a_follower_answers_as_its_passive_store_without_groups_would(tmp_path, clock, name):
    """A follower's groups serve nothing (PreconditionError: the service sends group calls to the
    leader), a store or none; consumer_count, which checks no mode, says the group is not there."""
    follower = Engine(tmp_path / "follower", EngineConfig(**SMALL, groups_passive=True), clock=clock)
    try:
        for stream in ("bare", "made"):
            follower.append(stream, AppendBatch([b"x"] * 3))
        follower._groups.stores.get("made")  # the empty (passive) store these calls made before
        call = READS[name]
        assert outcome(call, follower, "bare") == outcome(call, follower, "made")
        assert stores(follower) == ["made"]
        if name in ("list_groups", "group_info", "read_group"):
            with pytest.raises(PreconditionError, match="served by its leader"):
                call(follower, "bare")
        follower.set_groups_active("bare", True)  # this node leads it now
        assert follower.list_groups("bare") == []
        with pytest.raises(GroupNotFoundError):
            follower.group_info("bare", "g")
        assert stores(follower) == ["made"]
    finally:
        follower.close()
