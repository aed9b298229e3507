"""The gauge streamlog_streams_uncounted: after a kill -9, the slot streams whose figures the
totals (streamlog_entries, ...) miss until maintenance reads them from their slots; 0 after."""

from __future__ import annotations

from service.metrics import EngineCollector
from storage import Engine
from storage.maintenance import RECOUNT_BATCH
from tests.storage.test_recount import crashed


def gauges(engine: Engine) -> dict[str, float]:
    collector = EngineCollector(lambda: engine, lambda: 0, lambda: 0)
    return {family.name: family.samples[0].value for family in collector.collect() if family.samples}


def test_the_gauge_counts_the_streams_the_totals_miss_down_to_0():
    streams = RECOUNT_BATCH + 10
    engine = crashed(streams)
    found = gauges(engine)
    assert found["streamlog_streams_uncounted"] == streams and found["streamlog_entries"] == 0
    engine.maintain()
    found = gauges(engine)
    assert found["streamlog_streams_uncounted"] == 10 and found["streamlog_entries"] == 3 * RECOUNT_BATCH
    engine.maintain()
    found = gauges(engine)
    assert found["streamlog_streams_uncounted"] == 0 and found["streamlog_entries"] == 3 * streams
    engine.close()
