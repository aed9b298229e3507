"""bench.streams compares streamlog's disk with Redis's memory: both in the same unit."""

from __future__ import annotations

import os
from pathlib import Path

from bench.streams import _disk_mb


def test_disk_is_in_mb_of_a_million_bytes_as_redis_memory_is(tmp_path: Path) -> None:
    """Redis's `used_memory` is reported divided by 10^6; `du`'s KiB must be too, not by 1024."""
    (tmp_path / "data").write_bytes(os.urandom(500 * 4096))  # 2,048,000 bytes, every block allocated
    assert 2.048 <= _disk_mb(tmp_path) < 2.048 + 0.1  # the file, the directory's block or two
