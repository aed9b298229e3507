"""A Subscribe call's books, shared by the sync and the async Subscription.

The iteration itself differs (a thread blocks in `next()`, a task awaits `read()`)
and lives in clients/_streaming_sync.py and clients/_streaming_aio.py.
"""

from __future__ import annotations

from typing import Any

import grpc
from streamlog.v1 import streamlog_pb2 as pb

from clients import _convert as convert
from clients.types import ReadResult


class SubscriptionBase:
    """An open Subscribe call: where it continues, and whether cancel() ended it."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._cancelled = False
        # Where the subscription continues: updated with every batch received.
        self.next_offset: int | None = None

    def _batch(self, reply: pb.SubscribeResponse) -> ReadResult:
        batch = convert.read_result(reply)
        self.next_offset = batch.next_offset
        return batch

    def _cancelled_here(self, error: grpc.RpcError) -> bool:
        """Whether the call ended because cancel() cancelled it (iteration then stops quietly)."""
        return self._cancelled and error.code() == grpc.StatusCode.CANCELLED

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()

    close = cancel
