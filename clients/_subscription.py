"""A Subscribe call's books, shared by the sync and the async Subscription.

The iteration itself differs (a thread blocks in `next()`, a task awaits `read()`)
and lives in clients/_streaming_sync.py and clients/_streaming_aio.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from streamlog.v1 import streamlog_pb2 as pb

from clients import _convert as convert
from clients._routing import Attempts
from clients.errors import StreamlogError
from clients.types import ReadResult

# Given where to resume (None: where it started) and how the call failed, a new call on the
# stream's new leader, or None when it is not to reopen (its client's, see clients/aio.py).
Reopen = Callable[[int | None, StreamlogError, Attempts], Any]


class SubscriptionBase:
    """An open Subscribe call: where it continues, and whether cancel() ended it."""

    def __init__(self, call: Any, reopen: Reopen | None = None) -> None:
        self._call = call
        self._reopen = reopen
        self._attempts: Attempts | None = None  # of reopening, since the last batch
        self._cancelled = False
        # Where the subscription continues: updated with every batch received.
        self.next_offset: int | None = None

    def _batch(self, reply: pb.SubscribeResponse) -> ReadResult:
        batch = convert.read_result(reply)
        self.next_offset = batch.next_offset
        self._attempts = None
        return batch

    def _reopener(self) -> Callable[[StreamlogError], Any] | None:
        """What reopens the call after it failed with an error (None: it does not reopen)."""
        reopen = self._reopen
        if reopen is None or self._cancelled:
            return None
        attempts = self._attempts = self._attempts or Attempts(None)
        return lambda error: reopen(self.next_offset, error, attempts)

    def _cancelled_here(self, error: grpc.RpcError) -> bool:
        """Whether the call ended because cancel() cancelled it (iteration then stops quietly)."""
        return self._cancelled and error.code() == grpc.StatusCode.CANCELLED

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()

    close = cancel
