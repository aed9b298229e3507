"""Benchmarks for streamlog: scripts that print their figures as JSON lines.

They are not tests: run them with ``python -m bench.<name>``. Shared helpers
live in :mod:`bench.common`; the Redis Streams baseline that every comparison
runs against on the same machine lives in :mod:`bench.redis_baseline`.
"""
