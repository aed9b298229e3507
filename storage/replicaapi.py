"""The engine's replication primitives (no networking: cluster/ drives them). `Engine` takes them
from `ReplicaCalls`, so the engine's own file stays about streams.

- Leader side: `read_replica` hands out stored records from an offset, past the commit cap;
  `set_commit` caps what readers see at the high watermark, and wakes them when it moves up.
- Follower side: `append_replica` writes a chunk at the offsets it carries; `truncate` drops a
  diverged suffix (KIP-101).
- Follower side too: `set_retention_active(name, False)` keeps maintenance from applying the
  stream's own retention and compaction to a follower's copy (it follows its leader's first
  offset and holes instead).
- Both: the leader-epoch history (`epochs`, `begin_epoch`, `epoch_end`) and the stream's
  `incarnation` (storage/epochs.py), and `log_end`, the end a replica vouches for.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from storage.config import EngineConfig
from storage.errors import InvalidArgumentError, PreconditionError
from storage.fs import FileSystem
from storage.index import NodeIndex
from storage.layout import stream_directory
from storage.names import validate_name
from storage.replica import ReplicaChunk, append_chunk, read_chunk
from storage.stream import Stream


class ReplicaCalls:
    config: EngineConfig
    _retention_switched: set[str]
    _listeners: list[Callable[[str, int], None]]  # set by the engine
    _stream: Callable[[str], Stream]
    _fs: FileSystem
    data_dir: Path
    unreadable: list[str]

    def read_replica(self, name: str, offset: int, max_bytes: int, stop: int | None = None) -> ReplicaChunk:
        """Stored records from `offset` on, up to about `max_bytes` (at least one record if there
        is any past `offset`) and short of `stop` if given, whatever the commit cap; see
        storage/replica.py."""
        return read_chunk(self._stream(name), offset, max_bytes, stop)

    def append_replica(self, name: str, chunk: ReplicaChunk) -> int:
        """Append a chunk read from the leader at the offsets it carries, timestamps as recorded;
        its idempotent batches are noted for deduplication. OffsetMismatchError unless it starts at
        the stream's end. Returns the new end once as durable as the stream's fsync policy promises.
        Append listeners are not told: readers of a replica see what `set_commit` lets through."""
        return append_chunk(self._stream(name), chunk)

    def truncate(self, name: str, end_offset: int) -> None:
        """Drop every entry at and after `end_offset` (from the first offset to the end, else
        InvalidArgumentError), with the epochs that start there or later and the idempotent
        batches that end there or later; durable and crash-safe (storage/truncation.py)."""
        self._stream(name).truncation.truncate(end_offset)

    def reset(self, name: str, first_offset: int) -> None:
        """Make an empty copy (one that never held a record) start at `first_offset`: a follower
        rebuilding from a leader whose retention moved past its end. Durable (the meta file);
        PreconditionError if the copy holds records, InvalidArgumentError below its end. An empty
        slot stream moves to a directory first (a slot keeps no first offset)."""
        stream = self._stream(name)
        with stream.maintenance_lock, stream.lock:
            # A slot stream's one segment is there from its creation, records or not (and a trim
            # or a truncation would have moved it to a directory).
            if stream.end_offset if stream.in_slot else stream.segments:
                raise PreconditionError(f"stream {name!r} holds records: only an empty copy is reset")
            if not isinstance(first_offset, int) or first_offset < stream.end_offset:
                raise InvalidArgumentError(f"a reset offset must be an integer >= {stream.end_offset}")
            promoted = stream.in_slot
            stream.write_meta(first_offset, stream.config)  # (a slot stream moves to a directory first)
            if promoted:
                _drop_empty_segment(stream)
            stream.first_offset = stream.end_offset = first_offset
            stream.publish(first_offset)

    def set_retention_active(self, name: str, active: bool) -> None:
        """Active: maintenance applies the stream's retention limits and compaction (this node leads
        it, or there is no cluster). Passive: it does neither (a follower's copy removes a prefix and
        gets holes only as its leader's log did). Streams start as `EngineConfig.retention_passive`
        says; explicit trims and compactions are the caller's, either way."""
        validate_name(name)
        if active == self.config.retention_passive:  # not as streams start
            self._retention_switched.add(name)
        else:
            self._retention_switched.discard(name)

    def retention_active(self, name: str) -> bool:
        return (name in self._retention_switched) == self.config.retention_passive

    def wipe_damaged(self, name: str) -> bool:
        """Remove the stream's damaged copy (its directory failed its checks at start-up and is
        kept, unserved, as evidence), so that a follower can rebuild it from its leader. False
        when there is none."""
        validate_name(name)
        directory = stream_directory(self.data_dir, name)
        if directory.name not in self.unreadable:
            return False
        self._fs.remove_tree(directory)
        self.unreadable.remove(directory.name)
        return True

    def log_end(self, name: str) -> int:
        """The end this replica vouches for, whatever the commit cap: entries written, and synced
        under fsync "always" (a follower's acknowledgement, a leader's share of the watermark)."""
        return self._stream(name).local_end

    def set_commit(self, name: str, offset: int | None) -> None:
        """Cap what readers see (reads, group reads, subscriptions, count, seeks, bounds) at
        `offset`; None lifts the cap (the default: embedded mode). When readers can see further,
        the append listeners are told, so blocked reads wake on commit, not on append."""
        if offset is not None and (not isinstance(offset, int) or offset < 0):
            raise InvalidArgumentError("a commit offset must be a non-negative integer or None")
        stream = self._stream(name)
        if stream.set_commit(offset):
            for listener in self._listeners:
                listener(name, stream.visible_end)

    def epochs(self, name: str) -> list[tuple[int, int]]:
        """The leader-epoch history: (epoch, start offset) pairs, both increasing."""
        return list(self._stream(name).epochs.entries)

    def begin_epoch(self, name: str, epoch: int) -> None:
        """Record that `epoch` starts at the stream's end now, durably. The latest epoch again:
        nothing changes; a lower one: PreconditionError."""
        stream = self._stream(name)
        with stream.maintenance_lock, stream.lock:
            begun = stream.epochs.begun(epoch, stream.end_offset)
            if begun is not None:
                stream.save_epochs(begun)

    def epoch_end(self, name: str, epoch: int) -> tuple[int, int]:
        """KIP-279: (the largest recorded epoch <= `epoch`, where it ends: the next epoch's start,
        or the stream's end). No epoch at or below it: (-1, the first recorded epoch's start), or
        (-1, the first offset) when none is recorded."""
        stream = self._stream(name)
        with stream.lock:
            return stream.epochs.end_of(epoch, stream.first_offset, stream.end_offset)

    def incarnation(self, name: str) -> int:
        """The incarnation the stream was created with (0: none, a stream not created replicated)."""
        return self._stream(name).epochs.incarnation


def _drop_empty_segment(stream: Stream) -> None:
    """Remove, durably, the empty segment a promoted slot stream brought to its directory: named
    after offset 0, it would stay beside the reset copy's first segment, named after its first
    offset. After the meta file: the directory of a name with a default meta has none, and one
    with neither meta nor segment is a creation a crash cut short (start-up removes it). A crash
    before the removal leaves the segment, which the stream's open removes (a trailing segment
    with no node, storage/loader.py)."""
    (segment,) = stream.segments
    stream.segments = []
    stream.release(segment)
    stream.ctx.fs.remove(segment.path)
    stream.index = NodeIndex(())
    stream.active = None
