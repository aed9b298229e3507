"""The Spark side of Rocket Rides: the same running totals, as a Structured Streaming query.

It reads the rides stream with the streamlog source, drops the producer's
double sends by ride id (Spark keeps the ids seen in its checkpointed state),
and keeps one row of totals (total distance, rides, last ride id) that every
micro-batch writes over the `ride_totals` table, a Parquet directory. The
checkpoint makes restarts exactly-once: stop the job, start it again, and it
goes on from the offsets and state it had committed.

Distances are decimal(12,1), as the API rounds them, so sums are exact and
comparable with the workers' and the API's own.
"""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery

RIDE_SCHEMA = "id long, distance decimal(12,1)"


def totals_query(
    spark: SparkSession,
    endpoint: str,
    stream: str,
    table: Path,
    checkpoint: Path,
    max_entries_per_trigger: int = 500,
    available_now: bool = False,
) -> StreamingQuery:
    rides = (
        spark.readStream.format("streamlog")
        .option("endpoint", endpoint)
        .option("streams", stream)
        .option("startingOffsets", "earliest")
        .option("maxEntriesPerTrigger", max_entries_per_trigger)
        .option("includeHeaders", "false")
        .option("payloadAs", "string")
        .load()
        .select(F.from_json("payload", RIDE_SCHEMA).alias("ride"))
        .select("ride.*")
        .dropDuplicates(["id"])
    )
    totals = rides.agg(
        F.sum("distance").alias("total_distance"),
        F.count("*").alias("rides"),
        F.max("id").alias("last_ride_id"),
    )

    def publish(batch: DataFrame, batch_id: int) -> None:
        # A complete-mode result is the whole table: overwriting it makes a replayed batch harmless.
        batch.coalesce(1).write.mode("overwrite").parquet(str(table))

    writer = (
        totals.writeStream.outputMode("complete")
        .foreachBatch(publish)
        .option("checkpointLocation", str(checkpoint))
        .queryName("ride_totals")
    )
    writer = writer.trigger(availableNow=True) if available_now else writer.trigger(processingTime="1 second")
    return writer.start()


def read_totals(spark: SparkSession, table: Path) -> dict[str, Any]:
    """The totals row: {"total_distance": Decimal, "rides": int, "last_ride_id": int}."""
    if not table.exists():
        return {"total_distance": Decimal(0), "rides": 0, "last_ride_id": 0}
    row = spark.read.parquet(str(table)).collect()[0]
    return {"total_distance": row.total_distance, "rides": row.rides, "last_ride_id": row.last_ride_id}


def session(app: str = "rocket-rides") -> SparkSession:
    """A local[2] session with the streamlog source registered (for the one-command run)."""
    import pyspark_streamlog

    spark = (
        SparkSession.builder.master("local[2]")
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    pyspark_streamlog.register(spark)
    return spark
