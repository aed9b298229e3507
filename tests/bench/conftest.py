"""Fixtures shared by the bench harness tests."""

from __future__ import annotations

import pytest

from bench import redis_baseline as rb


@pytest.fixture(scope="module")
def redis_exe() -> str:
    """Debian's redis-server (installed when missing and we are root); skips the test otherwise."""
    try:
        return rb.ensure_redis_server()
    except rb.RedisUnavailable as exc:
        pytest.skip(f"redis-server not installed and not installable here: {exc}")
