"""Rocket Rides on streamlog: the unified-log pipeline of the "Redis Streams and the Unified Log" article.

`api.py` emits rides, `worker.py` keeps running totals through consumer groups,
`spark_job.py` computes them with Spark, `pipeline.py` runs everything.
"""
