"""A Rocket Rides consumer: a running total of ride distances, through a consumer group.

Run as a process (`python -m examples.rides.worker --name consumer0 ...`); it
may crash, and its supervisor starts it again. As in the seed article, the
worker's state (the total) and its checkpoint (the last offset and ride id it
consumed) live in its own database and change in one transaction per batch,
and about 10% of batches crash the process just before that commit.

The log side uses a consumer group (one group per worker, so every worker sees
every ride): a batch's entries stay pending in the group until the worker
acknowledges them, which it does only after its commit, in the next group read.
A crash leaves the batch pending; the restarted worker first removes the dead
process's consumer from the group (DeleteConsumer hands its pending entries
back for immediate redelivery), so the uncommitted batch comes back before any
newer entry. Rides come in id order except for the producer's double sends
and these redeliveries, so "skip ids at or below the checkpoint's last ride
id" removes every copy, as in the article. A call the cluster cannot answer
(its stream's leader died, and the client's retries ran out before a new one
was elected) ends the process too, like a crash: it starts again from its
checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import sqlite3
import sys
import uuid
from decimal import Decimal
from pathlib import Path

from clients import AlreadyExistsError, Client, GroupConfig, NotFoundError, TransientError

log = logging.getLogger("rides.worker")

CRASH_EXIT = 3  # the supervisor restarts a worker that exits with this code (an injected crash)
UNAVAILABLE_EXIT = 4  # and this one (the servers did not answer: a failover); not counted as a crash
BATCH = 50
MAX_BATCHES = 100_000  # a bound on one process's loop; far more than any run needs


def open_db(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None)  # transactions are explicit (BEGIN ... COMMIT)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute(
        "CREATE TABLE IF NOT EXISTS checkpoints ("
        " name TEXT PRIMARY KEY, last_offset INTEGER NOT NULL, last_ride_id INTEGER NOT NULL)"
    )
    db.execute(
        "CREATE TABLE IF NOT EXISTS consumer_states (name TEXT PRIMARY KEY, total_distance TEXT NOT NULL)"
    )
    return db


def state(db: sqlite3.Connection, name: str) -> tuple[int, int, Decimal]:
    """(last offset, last ride id, total distance) as last committed."""
    row = db.execute("SELECT last_offset, last_ride_id FROM checkpoints WHERE name = ?", (name,)).fetchone()
    total = db.execute("SELECT total_distance FROM consumer_states WHERE name = ?", (name,)).fetchone()
    last_offset, last_ride = row if row else (-1, 0)
    return last_offset, last_ride, Decimal(total[0]) if total else Decimal(0)


def join_group(client: Client, stream: str, group: str, me: str) -> None:
    """Create the group if needed, and hand back what earlier (crashed) processes held."""
    # retention_hold: the log keeps every ride this worker has not acknowledged yet.
    with contextlib.suppress(AlreadyExistsError):
        client.create_group(
            stream, group, "oldest", config=GroupConfig(retention_hold=True), create_stream=True
        )
    for consumer in client.group_info(stream, group).consumers:
        if consumer.name != me:
            released = client.delete_consumer(stream, group, consumer.name)
            log.info("%s: took back %d pending entries of %s", group, released, consumer.name)


def run(
    endpoint: str,
    stream: str,
    name: str,
    db_path: Path,
    crash_rate: float,
    until_ride: int | None,
    idle_exit_s: float | None,
    crash_seed: str | None = None,
) -> int:
    """Consume until ride `until_ride` is committed (or, with idle_exit_s, until the log stays quiet).

    crash_seed makes the injected crashes reproducible (the supervisor passes one per restart).
    """
    rng = random.Random(crash_seed)
    me = f"{name}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    db = open_db(db_path)
    with Client(endpoint, timeout=30) as client:
        join_group(client, stream, name, me)
        acks: list[int] = []
        idle_reads = 0
        for _ in range(MAX_BATCHES):
            last_offset, last_ride, total = state(db, name)
            if until_ride is not None and last_ride >= until_ride:
                if acks:
                    client.ack(stream, name, acks)
                return 0
            block_ms = 1000
            result = client.read_group(stream, name, me, count=BATCH, block_ms=block_ms, ack=acks)
            acks = []
            if not result.entries:
                idle_reads += 1
                if idle_exit_s is not None and idle_reads * block_ms / 1000 >= idle_exit_s:
                    return 0
                continue
            idle_reads = 0
            db.execute("BEGIN")
            for entry in sorted(result.entries, key=lambda e: e.offset):
                ride = json.loads(entry.payload, parse_float=Decimal)
                if ride["id"] <= last_ride:
                    log.debug(
                        "%s skipped ride %d at offset %d (already consumed)", name, ride["id"], entry.offset
                    )
                    continue
                total += Decimal(ride["distance"])
                last_offset, last_ride = entry.offset, ride["id"]
            db.execute(
                "INSERT INTO checkpoints (name, last_offset, last_ride_id) VALUES (?, ?, ?) "
                "ON CONFLICT(name) DO UPDATE SET last_offset = excluded.last_offset, "
                "last_ride_id = excluded.last_ride_id",
                (name, last_offset, last_ride),
            )
            db.execute(
                "INSERT INTO consumer_states (name, total_distance) VALUES (?, ?) "
                "ON CONFLICT(name) DO UPDATE SET total_distance = excluded.total_distance",
                (name, str(total)),
            )
            if rng.random() < crash_rate:
                # The article's injected failure: die after handling a batch, before committing.
                log.warning("%s: crashing before the commit (injected)", name)
                os._exit(CRASH_EXIT)
            db.execute("COMMIT")
            acks = [e.offset for e in result.entries]
            print(f"{name}: ride {last_ride} total_distance={total}", flush=True)
    raise RuntimeError(f"{name}: gave up after {MAX_BATCHES} batches")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A Rocket Rides consumer-group worker.")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--stream", default="rocket-rides-log")
    parser.add_argument("--name", required=True, help="worker (and consumer group) name")
    parser.add_argument("--db", type=Path, required=True, help="SQLite file for the state and checkpoint")
    parser.add_argument("--crash-rate", type=float, default=0.1)
    parser.add_argument("--until-ride", type=int, help="exit once this ride id is committed")
    parser.add_argument("--idle-exit-s", type=float, help="exit after this long with nothing to read")
    parser.add_argument("--crash-seed", help="seed of the injected crashes (default: random)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    try:
        return run(
            args.endpoint,
            args.stream,
            args.name,
            args.db,
            args.crash_rate,
            args.until_ride,
            args.idle_exit_s,
            crash_seed=args.crash_seed,
        )
    except NotFoundError as exc:
        print(f"{args.name}: {exc}", file=sys.stderr)
        return 1
    except TransientError as exc:
        print(f"{args.name}: the servers did not answer ({exc}); starting again", file=sys.stderr)
        return UNAVAILABLE_EXIT


if __name__ == "__main__":
    sys.exit(main())
