"""An AppendMany call split into parts and its results put back in order, for the layers around it.

A layer that checks requests (auth, limits) checks each batch of an AppendMany on its
own and answers one it refuses in that batch's result, the others going on; routing
(service/routing.py) serves some batches here and forwards the others, by leader.
Each does it the same way: the request's batch indices split into the refused ones
(with their status) and parts, each part served as an AppendMany request of its own
batches, and the parts' results put back into the slots of their batches.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from streamlog.v1 import streamlog_pb2 as pb

from service.appendmany import check_request, error_result
from service.callcontext import CallContext, UnaryBehavior
from service.config import Settings

BATCH_CALLS = frozenset({"AppendMany"})

Refusal = tuple[grpc.StatusCode, str]
# Serves a part: its AppendMany request to its reply, one result per batch in order.
Serve = Callable[[pb.AppendManyRequest], Awaitable[pb.AppendManyResponse]]


def part_of(request: pb.AppendManyRequest, indices: Sequence[int]) -> pb.AppendManyRequest:
    """The AppendMany request of the batches at `indices`, in that order."""
    batches = request.batches
    return pb.AppendManyRequest(batches=[batches[i] for i in indices])


def checked(
    request: pb.AppendManyRequest, settings: Settings, check: Callable[[pb.AppendRequest], Refusal | None]
) -> tuple[dict[int, Refusal], list[int]]:
    """The batches `check` refuses (index -> status) and the indices of those it lets pass; a
    ServiceError for a request wrong as a whole (checked first, on all its batches)."""
    check_request(request, settings)
    refused: dict[int, Refusal] = {}
    passed: list[int] = []
    for i, batch in enumerate(request.batches):
        refusal = check(batch)
        if refusal is None:
            passed.append(i)
        else:
            refused[i] = refusal
    return refused, passed


async def answered(
    request: pb.AppendManyRequest,
    refused: dict[int, Refusal],
    parts: Sequence[tuple[Sequence[int], Serve]],
) -> pb.AppendManyResponse:
    """The reply to `request`: its refused batches answered with their status, each part's batches
    with the results of that part's own call (the parts served at once)."""
    count = len(request.batches)
    results: list[Any] = [None] * count  # each slot filled below
    for i, (code, message) in refused.items():
        results[i] = error_result(code, message)
    replies = await asyncio.gather(*(serve(part_of(request, indices)) for indices, serve in parts))
    for (indices, _), reply in zip(parts, replies, strict=True):
        for i, result in zip(indices, reply.results, strict=True):
            results[i] = result
    return pb.AppendManyResponse(results=results)


async def passed_on(
    request: pb.AppendManyRequest,
    refused: dict[int, Refusal],
    passed: Sequence[int],
    behavior: UnaryBehavior,
    context: CallContext,
) -> pb.AppendManyResponse:
    """The reply to `request` when a layer refused some batches: the others served by the next
    layer's `behavior`, as one call."""
    if not refused:
        return await behavior(request, context)
    parts = [(passed, lambda part: behavior(part, context))] if passed else []
    return await answered(request, refused, parts)
