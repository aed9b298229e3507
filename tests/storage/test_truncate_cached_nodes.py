"""A truncation and the node cache: appends go on in a node that reads may have cached while it was
sealed (storage/truncation.py), and new nodes go where cut ones were; reads must see them all."""

from __future__ import annotations

import pytest

from storage import AppendBatch, Engine


def read_all(engine: Engine) -> list[tuple[int, bytes]]:
    got: list[tuple[int, bytes]] = []
    offset = 0
    while True:
        result = engine.read("s", offset, 1000)
        assert result.gap is None
        if not result.count:
            return got
        got += [(e.offset, e.payload) for e in result.entries()]
        offset = result.next_offset


# 60 entries of 3 KB, one a batch, lay the stream out as segments from 0, 21 and 42; the first
# segment's last node holds 17..20 (4 of its 8 slots), the second's nodes start at 21, 29, 37.
CUTS = {
    "segment boundary": 21,  # the first segment's last node is resumed; later appends fill it
    "node boundary": 29,  # node 21 (full) stays last: the next node goes where node 29 was
    "inside a node": 33,  # node 29 shortened to 4 entries and resumed
}


@pytest.mark.parametrize("cut", CUTS.values(), ids=CUTS.keys())
def test_entries_appended_after_a_truncation_read_back_once_their_node_is_sealed(open_engine, cut):
    engine = open_engine()
    old = [b"old-%04d" % i + b"x" * 3000 for i in range(60)]
    for payload in old:
        engine.append("s", AppendBatch([payload]))
    assert [s.base_offset for s in engine._open.glance("s").segments] == [0, 21, 42]
    assert read_all(engine) == list(enumerate(old))  # every sealed node cached
    engine.truncate("s", cut)
    new = [b"new-%04d" % i + b"y" * 500 for i in range(40)]
    for payload in new:
        engine.append("s", AppendBatch([payload]))
    assert read_all(engine) == list(enumerate(old[:cut] + new))
    chunk = engine.read_replica("s", cut - 1, 1 << 20)  # what a follower would copy: no hole either
    assert chunk.dense and (chunk.first_offset, chunk.end_offset) == (cut - 1, cut + len(new))
