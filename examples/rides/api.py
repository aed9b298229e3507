"""The Rocket Rides API simulator: creates rides and emits them into the unified log.

As in the seed article's API and streamer, every ride is first recorded in the
API's own database (here SQLite: the ground truth), then sent to the log in
batches with plain appends, at least once: about 10% of the batches are sent
twice, as a streamer does when it cannot tell whether its first attempt went
through. Consumers must cope with the copies; the ride ids let them. An append
that fails with the outcome unknown (the stream's leader died: a cluster failing
over) is sent again, for the same reason.
"""

from __future__ import annotations

import json
import random
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

from clients import Client, Record, TransientError

STREAM = "rocket-rides-log"
SEND_ATTEMPTS = 30  # with pauses doubling to 2 s: about 50 s, well past a failover (seconds)


@dataclass(frozen=True)
class Sent:
    rides: int
    batches: int
    double_sent: int
    entries: int  # acknowledged; the log may hold more: appends sent again after an unknown outcome
    resent: int = 0  # appends sent again after an unknown outcome (a failover)


def open_db(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE IF NOT EXISTS rides (id INTEGER PRIMARY KEY, distance TEXT NOT NULL)")
    return db


def ground_truth(path: Path) -> tuple[int, Decimal]:
    """(number of rides, total distance) as the API recorded them."""
    db = open_db(path)
    try:
        distances = [Decimal(d) for (d,) in db.execute("SELECT distance FROM rides")]
    finally:
        db.close()
    return len(distances), sum(distances, Decimal(0))


def simulate(
    client: Client,
    db_path: Path,
    rides: int,
    batch_size: int = 20,
    double_send_rate: float = 0.1,
    seed: int = 0,
    stream: str = STREAM,
    sent_so_far: Callable[[int], None] | None = None,
) -> Sent:
    """Create `rides` rides (ids 1..rides) and stream them, double-sending some batches.

    `sent_so_far`, when given, is called after each batch with the number of rides sent.
    """
    rng = random.Random(seed)
    db = open_db(db_path)
    batches = double = entries = resent = 0
    try:
        for first in range(1, rides + 1, batch_size):
            batch = []
            with db:  # the ride and its log record are created together (the staged-record idea)
                for ride_id in range(first, min(first + batch_size, rides + 1)):
                    # One decimal place, as the article rounds it: sums stay exact as Decimals.
                    distance = Decimal(rng.randrange(1, 100_000)) / 10
                    db.execute("INSERT INTO rides (id, distance) VALUES (?, ?)", (ride_id, str(distance)))
                    payload = json.dumps({"id": ride_id, "distance": float(distance)}).encode()
                    batch.append(Record(payload, tag=str(ride_id)))
            sends = 2 if rng.random() < double_send_rate else 1
            for _ in range(sends):
                resent += _send(client, stream, batch)
                entries += len(batch)
            batches += 1
            double += sends - 1
            if sent_so_far is not None:
                sent_so_far(min(first + batch_size - 1, rides))
    finally:
        db.close()
    return Sent(rides, batches, double, entries, resent)


def _send(client: Client, stream: str, batch: list[Record]) -> int:
    """Append `batch` with a plain append (at-least-once on purpose) until acknowledged; how many
    times it was sent again after an unknown outcome."""
    for attempt in range(SEND_ATTEMPTS):
        try:
            client.append(stream, batch)
            return attempt
        except TransientError as exc:
            if attempt + 1 == SEND_ATTEMPTS:
                raise
            client.route(stream, exc)  # the leader may be gone: look the stream up again
            time.sleep(min(0.1 * 2**attempt, 2.0))
    raise AssertionError("unreachable: the last attempt returns or raises")
