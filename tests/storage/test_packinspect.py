"""The offline inspector's view of the slot streams (storage/packinspect.py's `catalog_places`) is
the one a start-up takes without a scan: the catalog file and its journals read by
storage/catalogfiles.py's `read_journaled` (start-up's own) and the places moved by its
`replay_places`."""

from __future__ import annotations

import random
from pathlib import Path

from storage import AppendBatch, Engine, EngineConfig
from storage.packinspect import catalog_places
from tests.storage.conftest import SMALL
from tests.storage.faultfs import FaultFS

ROOT = Path("/faultfs/data")
CONFIG = EngineConfig(**SMALL, max_open_streams=2)


def test_the_inspector_places_slot_streams_as_a_start_up_does_after_a_clean_stop_and_a_kill_9():
    fs = FaultFS()
    fs.prepare_dir(ROOT)
    engine = Engine(ROOT, CONFIG, fs=fs)
    for i in range(6):
        engine.append(f"s{i}", AppendBatch([b"x"]))
    engine.close()  # the catalog file, complete
    places = catalog_places(fs, ROOT)
    assert places is not None and sorted(places) == [f"s{i}" for i in range(6)]
    engine = Engine(ROOT, CONFIG, fs=fs)
    assert engine._catalog.placed() == places
    engine.append("new", AppendBatch([b"n"]))  # in a slot since the file
    engine.append("directory", AppendBatch([b"d" * 3000] * 3))  # too big for a slot: a directory
    engine.append("s1", AppendBatch([b"y" * 3500]))  # outgrows its slot: promoted
    engine.delete_stream("s2")  # the file set aside: its journals go on from it
    engine.delete_stream("s3")
    engine.append("s3", AppendBatch([b"again"]))  # made again, in a slot
    killed = fs.crashed_copy(random.Random(5), "process")
    places = catalog_places(killed, ROOT)
    assert places is not None and sorted(places) == ["new", "s0", "s3", "s4", "s5"]
    restarted = Engine(ROOT, CONFIG, fs=killed)
    assert restarted._catalog.placed() == places
    restarted.close()
    engine.close()
