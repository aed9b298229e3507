"""The Rocket Rides API simulator: creates rides and emits them into the unified log.

As in the seed article's API and streamer, every ride is first recorded in the
API's own database (here SQLite: the ground truth), then sent to the log in
batches with plain appends, at least once: about 10% of the batches are sent
twice, as a streamer does when it cannot tell whether its first attempt went
through. Consumers must cope with the copies; the ride ids let them.
"""

from __future__ import annotations

import json
import random
import sqlite3
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

from clients import Client, Record

STREAM = "rocket-rides-log"


@dataclass(frozen=True)
class Sent:
    rides: int
    batches: int
    double_sent: int
    entries: int


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
) -> Sent:
    """Create `rides` rides (ids 1..rides) and stream them, double-sending some batches."""
    rng = random.Random(seed)
    db = open_db(db_path)
    batches = double = entries = 0
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
                client.append(stream, batch)  # plain appends: at-least-once on purpose
                entries += len(batch)
            batches += 1
            double += sends - 1
    finally:
        db.close()
    return Sent(rides, batches, double, entries)
