"""The parts of a stream made on first use: its syncs' gate and the condition its syncs and
"always" appends wait on, its idempotent producers' table (and its saving), its epoch history,
and its maintenance helpers (cleaner, retention, truncation).

Most streams among a million never use them (no producer id, not replicated, never
compacted, trimmed or truncated): a creation, an append and an eviction make none, which
saves their making and the garbage collector's walks over them while the stream is open.
An open sets the producers and the epochs it loads (assignment replaces the lazy value).
The helpers reach their stream through a weak proxy: no reference cycle, so a stream the
cache lets go is freed when its last user drops it, not left to the collector's full passes,
which traverse every live object (one closed stream per call to a closed stream, issue 17).
"""

from __future__ import annotations

import threading
import weakref
from functools import cached_property
from typing import TYPE_CHECKING, cast

from storage.cleaner import Cleaner
from storage.context import EngineContext
from storage.dedup import ProducerTable
from storage.durability import SyncGate
from storage.epochs import EpochHistory
from storage.errors import DurabilityError
from storage.layout import PRODUCERS_FILE
from storage.loader import new_producer_table
from storage.retention import Retention
from storage.truncation import Truncation

if TYPE_CHECKING:
    from storage.home import DirectoryHome
    from storage.slothome import SlotHome
    from storage.stream import Stream


class StreamParts:
    ctx: EngineContext  # these set by Stream
    home: DirectoryHome | SlotHome
    lock: threading.RLock
    end_offset: int
    # Its gate once made (`gate`): the class's None till then, read as a plain attribute so that
    # a stream's instance dict is never built for it (most streams never sync on their own).
    _gate: SyncGate | None = None

    def made(self, part: str) -> bool:
        """Whether the part named `part` was made (or set) so far."""
        return part in self.__dict__

    @property
    def gate(self) -> SyncGate:
        """Its syncs' group commit (storage/durability.py), made at its first sync: one, whichever
        threads ask at once (setdefault is atomic)."""
        gate = self._gate
        return gate if gate is not None else self.__dict__.setdefault("_gate", SyncGate())

    @property
    def sync_error(self) -> DurabilityError | None:
        """The failure its gate remembers (appends are refused after it), None with no gate yet.
        Every append and close asks: `self.__dict__` here built each stream's instance dict (an
        object the collector walks while the stream is open, and slower attribute reads)."""
        gate = self._gate
        return None if gate is None else gate.error

    @cached_property
    def sync_ended(self) -> threading.Condition:
        """Under "always" an append waits for the sync in flight (`_check_writable`): notified when
        a sync ends, and when the appends that waited have written (the next sync waits for them).
        Made at the first sync or wait, both with `lock` held (so one, even where cached_property
        takes no lock): a new stream that the cache closes before either, as most of a load of new
        streams, never makes one."""
        return threading.Condition(self.lock)

    @cached_property
    def producers(self) -> ProducerTable:
        return new_producer_table(self.ctx)

    def save_producers(self, now_ms: int) -> None:
        """Expire idle producers and snapshot the table if it changed (maintenance, close)."""
        with self.lock:
            if not self.made("producers"):  # nothing recorded since the open
                return
            raw = self.producers.snapshot(now_ms, self.end_offset)
        if raw is not None:
            self.home.save_file(PRODUCERS_FILE, raw)

    @cached_property
    def epochs(self) -> EpochHistory:
        return EpochHistory()  # a replicated stream's is set by its open or save_epochs

    @cached_property
    def cleaner(self) -> Cleaner:
        return Cleaner(cast("Stream", weakref.proxy(self)))

    @cached_property
    def retention(self) -> Retention:
        return Retention(cast("Stream", weakref.proxy(self)))

    @cached_property
    def truncation(self) -> Truncation:
        return Truncation(cast("Stream", weakref.proxy(self)))
