"""What a stream reports about itself: its figures (`StreamInfo`, for `info` and the
metrics) and the summary the catalog keeps of it while it is closed."""

from __future__ import annotations

from typing import TYPE_CHECKING

from storage.catalog import StreamSummary
from storage.packed import compression_ratio
from storage.reader import count_entries
from storage.results import StreamInfo

if TYPE_CHECKING:
    from storage.stream import Stream


def stream_info(stream: Stream) -> StreamInfo:
    with stream.lock:
        packed = (ref.header for s in stream.segments if s.packed for ref in s.nodes)
        return StreamInfo(
            name=stream.name,
            first_offset=stream.first_offset,
            end_offset=stream.visible_end,
            entries_added=stream.visible_end,
            entries=count_entries(stream, stream.first_offset, stream.visible_end),
            bytes_on_disk=sum(s.file.size for s in stream.segments),
            used_bytes=sum(s.file.size if s.packed else s.end_pos for s in stream.segments),
            segments=len(stream.segments),
            packed_segments=sum(1 for s in stream.segments if s.packed),
            nodes=len(stream.index),
            compression_ratio=compression_ratio(packed),
            last_timestamp_ms=stream.last_ts,
            config=stream.config,
            damaged=tuple(stream.damaged),
        )


def stream_summary(stream: Stream) -> StreamSummary:
    """What the catalog keeps of the stream while it is closed (storage/catalog.py): its
    figures, and when maintenance should visit it (`_upkeep_ms`). Every cache eviction asks:
    only the catalog's figures are computed, not `stream_info`."""
    with stream.lock:
        segments = stream.segments
        entries = count_entries(stream, stream.first_offset, stream.visible_end)
        cfg = stream.config
        # Nothing to visit it for without a retention or compaction rule or a segment to pack
        # (most streams: the default config).
        ruled = cfg.max_entries is not None or cfg.max_bytes is not None or cfg.max_age_ms is not None
        due = _upkeep_ms(stream, entries) if ruled or cfg.compaction or stream.pack_queue else 0
        return StreamSummary(
            entries,
            segments[0].file.size if len(segments) == 1 else sum(s.file.size for s in segments),
            len(segments),
            len(stream.index.nodes),
            due,
            stream.has_epochs,  # known without a stat: every close asks
        )


def _upkeep_ms(stream: Stream, entries: int) -> int:
    """When maintenance should visit the closed stream (wall-clock ms; 0: never): at once if
    packing is pending or an entry or byte limit was not applied since its last write; when its
    oldest node passes max_age_ms, or its next compaction is due, but at most once per
    compaction interval (call with the stream's lock held)."""
    cfg = stream.config
    compaction_interval_ms = stream.ctx.config.compaction_interval_ms
    due = []
    limited = cfg.max_entries is not None or cfg.max_bytes is not None
    if stream.pack_queue or (limited and stream.write_seq != stream.upkept_seq):
        due.append(1)
    floor = stream.upkept_ms + compaction_interval_ms
    if cfg.max_age_ms is not None and entries and len(stream.index):
        due.append(max(stream.index.max_ts[0] + cfg.max_age_ms, floor))
    if cfg.compaction and len(stream.segments) > 1:
        due.append(max(stream.cleaner.last_compaction_ms + compaction_interval_ms, floor))
    return min(due) if due else 0
