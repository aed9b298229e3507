"""Facts about a request's protobuf encoding, found without visiting each entry in Python.

Append's common case is a batch of entries that carry only a payload. Checking
each entry's tag, headers and deliver time costs a Python-level pass per field
(with upb, touching an element of a repeated field creates its Python wrapper).
Instead, compare the request's encoded size (computed in C) with the size it
would have if every entry held only its payload: any other field present (tag,
headers, deliver time, a client-sent offset or timestamp, an unknown field) adds
at least two bytes, so equal sizes prove the batch is payload-only.
"""

from __future__ import annotations

from collections.abc import Sequence

from google.protobuf.message import Message

# Where varint lengths step up: a number n takes k+1 bytes when n >= 128**k.
_VARINT_STEPS = tuple(128**k for k in range(1, 5))


def varint_size(value: int) -> int:
    """Bytes of the varint encoding of a non-negative int below 128**5."""
    return 1 + sum(value >= step for step in _VARINT_STEPS)


def _count_at_least(lengths: Sequence[int], threshold: int) -> int:
    # `threshold.__le__` runs in C for each length: no Python frame per entry.
    return sum(map(threshold.__le__, lengths))


def payload_only_size(stream_bytes: int, lengths: Sequence[int]) -> int:
    """Encoded size of an AppendRequest whose entries carry only non-empty payloads of `lengths`.

    One entry with a payload of L bytes encodes as: key 0x12 (field 2), varint of
    its size S, then S = 1 (key 0x22) + varint(L) + L. Summed over entries that is
    2n + sum(L) + sum(varint(L)) + sum(varint(S)), and the varint sums are n plus,
    for each step T, how many L (resp. S) reach T. Near a step T = 128**k, varint(L)
    is k, so S = L + 1 + k reaches T exactly when L >= T - 1 - k.
    """
    n = len(lengths)
    size = 4 * n + sum(lengths)
    longest = max(lengths, default=0)
    for k, step in enumerate(_VARINT_STEPS, start=1):
        if longest < step - 1 - k:
            break
        size += _count_at_least(lengths, step) + _count_at_least(lengths, step - 1 - k)
    if stream_bytes:
        size += 1 + varint_size(stream_bytes) + stream_bytes
    return size


def entries_hold_only_payloads(request: Message, stream: str, payloads: Sequence[bytes]) -> bool:
    """True when every entry of the AppendRequest `request` has a non-empty payload and nothing else."""
    lengths = list(map(len, payloads))
    if not lengths or min(lengths) == 0:
        # An empty payload is not encoded at all; such batches take the general path.
        return False
    return request.ByteSize() == payload_only_size(len(stream.encode()), lengths)
