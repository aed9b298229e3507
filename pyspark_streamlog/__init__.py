"""Apache Spark connector for streamlog: `format("streamlog")` for read, readStream, write, writeStream.

    import pyspark_streamlog
    pyspark_streamlog.register(spark)          # once per SparkSession
    df = (spark.read.format("streamlog")
          .option("endpoint", "localhost:7070")
          .option("streams", "rides")
          .load())

Spark also finds the source without `register` when this package is installed
(it looks for modules named `pyspark_*` that define `DefaultSource`). See
docs/SPARK.md for every option.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyspark_streamlog.errors import (
    DataLossError,
    EndpointError,
    OptionError,
    ServerError,
    StreamlogSparkError,
    StreamNotFoundError,
)
from pyspark_streamlog.source import StreamlogDataSource

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = [
    "DataLossError",
    "DefaultSource",
    "EndpointError",
    "OptionError",
    "ServerError",
    "StreamNotFoundError",
    "StreamlogDataSource",
    "StreamlogSparkError",
    "register",
]

# The name Spark's data source lookup asks a pyspark_* module for.
DefaultSource = StreamlogDataSource


def register(spark: SparkSession) -> None:
    """Make `format("streamlog")` available in this SparkSession."""
    spark.dataSource.register(StreamlogDataSource)
