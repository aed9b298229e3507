"""A replica's copy of a stream: its settings from placement, and its role (leading or following).

**Settings.** A stream's own settings (SetStreamConfig: retention limits, compaction, fsync) are in
its placement record, so that every replica's copy has the same ones and a new leader enforces them.

They live in the record's `config` under `stream` (etcd): every node watches placement, so a
follower that was down gets them when it returns, whatever its copy holds, and a config change
is a compare-and-swap on the record that carries the leader epoch (a deposed leader's fails). The
leader writes them (service/routing.py), then every replica applies them to its copy
(cluster/replication/manager.py), the leader included.

**Role.** Only the leader's copy acts on its own: its consumer groups serve and act, and
maintenance applies its retention and compaction. A follower's copy changes only as its leader's
log does: group ops, the first offset (KIP-107) and the holes compaction left, all fetched.
"""

from __future__ import annotations

import dataclasses
import logging

from cluster.placement import StreamPlacement
from storage import Engine, InvalidArgumentError, StreamConfig

log = logging.getLogger("streamlog.cluster.replication")

KEY = "stream"


def placed(record: StreamPlacement) -> StreamConfig | None:
    """The stream's settings the record holds (None: none set, or unreadable: logged)."""
    settings = record.config.get(KEY)
    if settings is None:
        return None
    try:
        return StreamConfig.from_dict(dict(settings))
    except (InvalidArgumentError, TypeError, ValueError) as exc:
        log.error(
            "stream %r: its placement record's stream config is unusable (%s): %r", record.name, exc, settings
        )
        return None


def with_settings(record: StreamPlacement, config: StreamConfig) -> StreamPlacement:
    """The record with `config` as the stream's settings."""
    return dataclasses.replace(record, config={**record.config, KEY: config.to_dict()})


def differs(engine: Engine, record: StreamPlacement) -> bool:
    """Whether this node's copy has other settings than the record's (a cheap check, no disk)."""
    config = placed(record)
    return config is not None and engine.exists(record.name) and engine.stream_config(record.name) != config


def apply_settings(engine: Engine, record: StreamPlacement) -> None:
    """Give this node's copy the record's settings, durably (its meta file), if they differ."""
    config = placed(record)
    if config is not None and engine.stream_config(record.name) != config:
        log.info("stream %r: settings from placement: %s", record.name, config)
        engine.set_stream_config(record.name, config)


def set_leading(engine: Engine, name: str, leading: bool) -> None:
    """Make the copy act as its leader's, or follow (see the module docstring)."""
    engine.set_groups_active(name, leading)
    engine.set_retention_active(name, leading)
