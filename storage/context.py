"""What every stream shares with its engine: file system, settings, clock, node cache, retention floor."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from storage.cache import NodeCache
from storage.config import EngineConfig
from storage.durability import DirSync
from storage.fs import FileSystem


@dataclass
class EngineContext:
    fs: FileSystem
    config: EngineConfig
    clock: Callable[[], int]
    cache: NodeCache
    retention_floor: Callable[[str], int | None]  # consumer groups': retention never evicts at or above it
    streams_dir: DirSync  # new streams' directory entries, made durable in batches (storage/creation.py)
