"""Truncation: dropping a stream's suffix from an offset on (a replica whose log diverged, KIP-101).

A cut takes several writes (segments removed, a packed segment rewritten, a
node header rewritten, bytes zeroed, the epoch history and producer table
replaced), so it is made atomic with an intent record: everything up to the
cut is synced, then a `TRUNCATING` file naming the cut is written durably,
then the cut is done and synced, then the file is removed. Recovery that
finds the file does the cut again (`finish_pending`): each step is
idempotent and leaves a log that still holds the cut offset, so a crash at any
point yields the old log (before the intent is durable) or the truncated one.

Within the segment holding the cut, the steps go in the order that keeps
every intermediate state a readable prefix of the old log: later segments
first (newest first), then the node that straddles the cut gets a header of
its shorter self (in its other header slot, synced), and only then are the
nodes and bytes after it zeroed.
"""

from __future__ import annotations

import json
import struct
from array import array
from bisect import bisect_left
from typing import TYPE_CHECKING

import zstandard
from crc32c import crc32c

from storage.cleaner import TagIndex
from storage.errors import CorruptionError, InvalidArgumentError
from storage.format import NODE_CARRIED_FLAGS, NODE_HEADER_SIZE, NODE_PREFIX_SIZE, NodeBody, NodeHeader
from storage.growing import GrowingNode
from storage.index import NodeIndex
from storage.layout import PRODUCERS_FILE, TRUNCATE_MARKER
from storage.packed import decompressor, encode_packed_node, write_packed_segment
from storage.records import record_offset_and_timestamp
from storage.results import Gap
from storage.segment import NodeRef, Segment

if TYPE_CHECKING:
    from storage.stream import Stream

_MAGIC = b"SLTR"


def encode_marker(end_offset: int) -> bytes:
    body = json.dumps({"end_offset": end_offset}).encode()
    return _MAGIC + struct.pack("<I", crc32c(body)) + body


def decode_marker(raw: bytes) -> int:
    if raw[:4] != _MAGIC or len(raw) < 8 or struct.unpack_from("<I", raw, 4)[0] != crc32c(raw[8:]):
        raise CorruptionError("truncation marker failed its checks")
    try:
        return int(json.loads(raw[8:])["end_offset"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptionError(f"truncation marker is malformed: {exc}") from exc


class Truncation:
    def __init__(self, stream: Stream) -> None:
        self._stream = stream

    def truncate(self, end_offset: int) -> None:
        """Drop every entry at and after `end_offset`, durably, before returning.

        `end_offset` must lie between the stream's first offset and its end. Epochs that start at or
        after it and idempotent batches that end at or after it are forgotten. For a replica: an
        append racing a truncation may be cut after it was acknowledged.
        """
        s = self._stream
        if not isinstance(end_offset, int) or end_offset < 0:
            raise InvalidArgumentError("a truncation offset must be a non-negative integer")
        with s.maintenance_lock, s.lock:
            if not s.first_offset <= end_offset <= s.end_offset:
                raise InvalidArgumentError(
                    f"cannot truncate stream {s.name!r} to {end_offset}: the cut must lie between its "
                    f"first offset {s.first_offset} and its end {s.end_offset}"
                )
            if end_offset == s.end_offset:  # no entry to drop; an epoch begun here that wrote none goes
                epochs = s.epochs.truncated(end_offset)
                if epochs is not None:
                    s.save_epochs(epochs)
                return
            s.directory_home().drop_markers(s.segments)
            # What stays must be durable before the intent is: recovery redoes the cut from there.
            for file in list(s.dirty):
                file.sync()
            s.dirty.clear()
            fs = s.ctx.fs
            fs.write_file_atomic(s.directory / TRUNCATE_MARKER, encode_marker(end_offset))
            self._cut(end_offset)
            fs.remove(s.directory / TRUNCATE_MARKER)

    def finish_pending(self) -> None:
        """At start-up: finish a truncation that a crash interrupted (its marker is still there)."""
        s = self._stream
        fs = s.ctx.fs
        path = s.directory / TRUNCATE_MARKER
        if not fs.exists(path):
            return
        end_offset = decode_marker(fs.read_file(path))
        with s.maintenance_lock, s.lock:
            # Even when the log is cut already: the epochs and producers may not be yet.
            s.directory_home().drop_markers(s.segments)
            if s.first_offset <= end_offset <= s.end_offset:
                self._cut(end_offset)
        fs.remove(path)

    # ------------------------------------------------------------------ the cut

    def _cut(self, cut: int) -> None:
        """Do the cut (both stream locks held): files first, then the stream's memory."""
        s = self._stream
        fs = s.ctx.fs
        while s.segments and s.segments[-1].base_offset >= cut:
            doomed = s.segments.pop()
            s.release(doomed)
            fs.remove(doomed.path)
        if s.segments and s.segments[-1].end_offset() > cut:
            holding = s.segments[-1]
            if holding.packed:
                s.segments[-1] = self._rewrite_packed(holding, cut)
            else:
                self._cut_growing(holding, cut)
        tail = s.segments[-1] if s.segments else None
        resumed = tail.nodes[-1] if tail is not None and not tail.packed and tail.nodes else None
        if resumed is not None:
            # Appends go on in a node the cache may hold from when it was sealed, and new nodes go
            # where cut ones were: cached bodies keyed by their position would hide them from reads.
            s.ctx.cache.drop_segment(resumed.segment.uid)
            s.active = GrowingNode.resume(resumed)
        else:
            s.active = None
        s.index = NodeIndex(
            r for seg in s.segments for r in seg.nodes if r.end_offset > s.first_offset or r is resumed
        )
        s.pack_queue = [seg for seg in s.pack_queue if seg in s.segments[:-1]]
        s.end_offset = cut
        s.cuts += 1
        if s.commit is not None:
            s.commit = min(s.commit, cut)
        s.publish(min(s.local_end, cut))
        s.last_ts = s.index.max_ts[-1] if len(s.index) else 0
        s.damaged = [
            Gap(g.start_offset, min(g.end_offset, cut), g.reason) for g in s.damaged if g.start_offset < cut
        ]
        s.cleaner.tags = TagIndex()  # it may name offsets past the cut; the next compaction rebuilds it
        s.producers.forget_from(cut)
        fs.write_file_atomic(s.directory / PRODUCERS_FILE, s.producers.encode())
        epochs = s.epochs.truncated(cut)
        if epochs is not None:
            s.save_epochs(epochs)

    def _cut_growing(self, segment: Segment, cut: int) -> None:
        """Cut a growing segment at `cut` (inside it): shorten the node holding it, zero what follows."""
        keep = [ref for ref in segment.nodes if ref.base_offset < cut]
        straddling = keep[-1]
        zero_from = segment.end_pos
        if straddling.end_offset > cut:
            self._shorten(straddling, cut - straddling.base_offset)
            segment.file.sync()  # the shorter header is durable before any byte after it goes
            zero_from = straddling.pos + NODE_PREFIX_SIZE + straddling.header.stored_len
        later = segment.nodes[len(keep) :]
        if later:
            zero_from = min(zero_from, later[0].pos)
        if zero_from < segment.end_pos:
            segment.file.write(zero_from, bytes(segment.end_pos - zero_from))
            segment.file.sync()
        segment.nodes = keep
        segment.end_pos = straddling.pos + straddling.disk_size

    def _shorten(self, ref: NodeRef, count: int) -> None:
        """Give a growing node a header of its first `count` entries, in its other header slot."""
        h = ref.header
        file = ref.segment.file
        start = ref.pos + NODE_PREFIX_SIZE
        table = file.read(start, 4 * count)
        positions = array("I")
        positions.frombytes(file.read(start, 4 * (count + 1)))  # count < h.count: entry `count` exists
        blob_len = positions[count]
        blob = file.read(start + 4 * h.slots, blob_len)
        _, last_ts = record_offset_and_timestamp(blob, positions[count - 1])
        header = NodeHeader(
            seq=h.seq + 1,
            count=count,
            base_offset=h.base_offset,
            slots=h.slots,
            blob_len=blob_len,
            stored_len=4 * h.slots + blob_len,
            body_crc=crc32c(table),
            blob_crc=crc32c(blob),
            min_ts=h.min_ts,
            max_ts=last_ts,
            flags=h.flags,
        )
        file.write(ref.pos + NODE_HEADER_SIZE * (header.seq % 2), header.encode())
        ref.header = header

    def _rewrite_packed(self, segment: Segment, cut: int) -> Segment:
        """A packed segment holding only the entries before `cut` in place of `segment`."""
        s = self._stream
        cfg = s.ctx.config
        compressor = zstandard.ZstdCompressor(level=cfg.compression_level) if cfg.compression else None
        nodes: list[bytes] = []
        for ref in segment.nodes:
            if ref.end_offset <= cut:
                nodes.append(segment.file.read(ref.pos, ref.disk_size))  # a packed node moves as it is
            elif ref.base_offset < cut:
                body = segment.read_body(ref, decompressor())
                below = cut - body.base_offset
                n = below if body.deltas is None else bisect_left(body.deltas, below)
                if n:
                    prefix = NodeBody(
                        body.base_offset,
                        body.positions[: n + 1],
                        body.blob[: body.positions[n]],
                        body.deltas[:n] if body.deltas is not None else None,
                    )
                    _, last_ts = record_offset_and_timestamp(prefix.blob, prefix.positions[n - 1])
                    flags = ref.header.flags & NODE_CARRIED_FLAGS
                    nodes.append(encode_packed_node(prefix, ref.header.min_ts, last_ts, flags, compressor))
        fs = s.ctx.fs
        write_packed_segment(fs, segment.path, segment.base_offset, cut, segment.header.created_ms, nodes)
        s.release(segment)
        fresh, problem = Segment.open(fs, segment.path, writable=False, verify=False)
        if problem:
            raise CorruptionError(f"rewritten segment {segment.path.name} does not read back: {problem}")
        return fresh
