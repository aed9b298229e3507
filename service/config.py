"""Server settings: defaults < TOML file < environment variables < command-line flags.

Every setting has one name, used everywhere: as a key in the TOML file (flat, no
tables), as `STREAMLOG_<NAME>` in the environment (e.g. `STREAMLOG_PORT=7071`),
and as `--set NAME=VALUE` on the command line (a few common ones also have their
own flags: --data, --host, --port, --fsync, --log-level). The TOML file comes from
`--config FILE` or `STREAMLOG_CONFIG`.

Values are checked once, here, so the server never starts half-configured: a bad
value stops start-up with a `ConfigError` naming the setting, where the value came
from, and what is allowed.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from storage import EngineConfig, InvalidArgumentError

ENV_PREFIX = "STREAMLOG_"
ENV_CONFIG_FILE = "STREAMLOG_CONFIG"
FSYNC_POLICIES = ("always", "everysec", "no")
LOG_LEVELS = ("debug", "info", "warning", "error")
MAX_STREAM_NAME_BYTES = 255

# Room for everything in a response besides the entries themselves (offsets, gap,
# field tags); checked against max_message_bytes so a full read always fits.
RESPONSE_OVERHEAD_BYTES = 64 << 10


class ConfigError(ValueError):
    """A setting is unknown, malformed or out of range. The message says which and why."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """Everything a server needs to run. Units are the last part of each name."""

    # Where and how to listen. Port 0 asks the OS for a free port (the server logs it).
    data_dir: Path = Path("data")
    host: str = "127.0.0.1"
    port: int = 7070
    log_level: str = "info"

    # Storage engine: durability policy for streams that set none, and layout.
    fsync: str = "everysec"
    segment_bytes: int = 64 << 20
    node_entries: int = 1000
    compression: bool = True
    compression_level: int = 3
    cache_nodes: int = 256

    # Limits on what one request may carry. Appends past them are refused whole.
    max_message_bytes: int = 16 << 20
    max_entry_bytes: int = 1 << 20
    max_batch_entries: int = 10_000
    max_batch_bytes: int = 8 << 20
    max_tag_bytes: int = 1024
    max_ack_offsets: int = 10_000

    # Limits on what one reply may carry. A request asking for more gets this much.
    default_read_entries: int = 100
    max_read_entries: int = 10_000
    # 1 MiB keeps a default reply under the 4 MiB receive limit of default gRPC clients.
    default_read_bytes: int = 1 << 20
    max_read_bytes: int = 8 << 20
    subscribe_batch_entries: int = 1000
    default_page_size: int = 100
    max_page_size: int = 1000

    # Waiting: the longest block_ms a Read may ask for, and how many subscriptions
    # (each an open call holding a little memory) one server keeps at once.
    max_block_ms: int = 300_000
    max_subscriptions: int = 10_000

    # Threads for appends to streams whose fsync policy is "always": each waits in
    # fdatasync with the GIL released, and concurrent ones share one sync (group commit).
    append_threads: int = 4
    # On SIGTERM: how long in-flight calls get to finish before they are cancelled.
    shutdown_grace_ms: int = 5_000


# name -> (lowest, highest) for integer settings; None means no bound on that side.
_INT_RANGES: dict[str, tuple[int | None, int | None]] = {
    "port": (0, 65_535),
    "segment_bytes": (1 << 20, 1 << 40),
    "node_entries": (1, 1 << 20),
    "compression_level": (1, 22),
    "cache_nodes": (1, None),
    "max_message_bytes": (1 << 20, 2**31 - 1),
    "max_entry_bytes": (1, None),
    "max_batch_entries": (1, None),
    "max_batch_bytes": (1, None),
    "max_tag_bytes": (1, None),
    "max_ack_offsets": (1, None),
    "default_read_entries": (1, None),
    "max_read_entries": (1, 2**31 - 1),
    "default_read_bytes": (1, None),
    "max_read_bytes": (1, None),
    "subscribe_batch_entries": (1, None),
    "default_page_size": (1, None),
    "max_page_size": (1, 2**31 - 1),
    "max_block_ms": (0, 2**31 - 1),
    "max_subscriptions": (1, None),
    "append_threads": (1, 256),
    "shutdown_grace_ms": (0, 3_600_000),
}

_CHOICES: dict[str, tuple[str, ...]] = {"fsync": FSYNC_POLICIES, "log_level": LOG_LEVELS}

_FIELDS = {f.name: f for f in dataclasses.fields(Settings)}
_TYPES: dict[str, type] = {
    name: type(f.default) if name != "data_dir" else Path for name, f in _FIELDS.items()
}

_SIZE_UNITS = {
    "": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
}
_SIZE_RE = re.compile(r"^\s*(\d[\d_]*)\s*([a-z]*)\s*$", re.IGNORECASE)
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def setting_names() -> list[str]:
    """All setting names, in declaration order."""
    return list(_FIELDS)


def env_name(name: str) -> str:
    """The environment variable that sets `name`."""
    return ENV_PREFIX + name.upper()


def _parse_text(name: str, text: str, source: str) -> Any:
    """Turn the text of an environment variable or --set into the setting's type."""
    kind = _TYPES[name]
    if kind is bool:
        lowered = text.strip().lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
        raise ConfigError(f"{name}: expected true or false, got {text!r} (from {source})")
    if kind is int:
        match = _SIZE_RE.match(text)
        # Byte sizes may carry a binary unit ("64MiB"); other integers may not.
        if match and (not match.group(2) or name.endswith("_bytes")):
            unit = _SIZE_UNITS.get(match.group(2).lower())
            if unit is not None:
                return int(match.group(1)) * unit
        allowed = "an integer" + (" with an optional unit KiB, MiB or GiB" if name.endswith("_bytes") else "")
        raise ConfigError(f"{name}: expected {allowed}, got {text!r} (from {source})")
    if kind is Path:
        return Path(text)
    return text


def _check_toml_value(name: str, value: Any, source: str) -> Any:
    """TOML values arrive typed: accept them only when the type is the setting's."""
    kind = _TYPES[name]
    ok = (
        isinstance(value, bool)
        if kind is bool
        else isinstance(value, int) and not isinstance(value, bool)
        if kind is int
        else isinstance(value, str)
    )
    if not ok:
        expected = {bool: "a boolean", int: "an integer"}.get(kind, "a string")
        raise ConfigError(f"{name}: expected {expected}, got {value!r} (from {source})")
    return Path(value) if kind is Path else value


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def load_settings(
    *,
    config_file: Path | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
    overrides: Mapping[str, str] | None = None,
) -> Settings:
    """Merge the sources in precedence order and validate the result.

    `env` is the process environment (only `STREAMLOG_*` names are looked at; unknown
    ones are ignored so that client tools can have their own). `flags` holds typed
    values from dedicated command-line flags (None = not given); `overrides` holds
    `--set NAME=VALUE` texts, which win over everything.
    """
    env = {} if env is None else env
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}

    if config_file is None and env.get(ENV_CONFIG_FILE):
        config_file = Path(env[ENV_CONFIG_FILE])
    if config_file is not None:
        source = f"config file {config_file}"
        for name, value in _read_toml(config_file).items():
            if name not in _FIELDS:
                raise ConfigError(f"unknown setting {name!r} in {source}; known: {', '.join(_FIELDS)}")
            values[name] = _check_toml_value(name, value, source)
            sources[name] = source

    for name in _FIELDS:
        variable = env_name(name)
        if variable in env:
            source = f"environment variable {variable}"
            values[name] = _parse_text(name, env[variable], source)
            sources[name] = source

    for name, value in (flags or {}).items():
        if name not in _FIELDS:
            raise ConfigError(f"unknown setting {name!r}")
        if value is not None:
            values[name] = value
            sources[name] = "the command line"

    for name, text in (overrides or {}).items():
        if name not in _FIELDS:
            raise ConfigError(f"unknown setting {name!r} in --set; known: {', '.join(_FIELDS)}")
        source = f"--set {name}"
        values[name] = _parse_text(name, text, source)
        sources[name] = source

    settings = Settings(**values)
    validate(settings, sources)
    return settings


def validate(settings: Settings, sources: Mapping[str, str] | None = None) -> None:
    """Raise ConfigError for the first value out of range or inconsistent with another."""
    sources = sources or {}

    def where(name: str) -> str:
        return sources.get(name, "the default")

    for name, (low, high) in _INT_RANGES.items():
        value = getattr(settings, name)
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = f"between {low} and {high}" if high is not None else f"at least {low}"
            raise ConfigError(f"{name}: must be {bounds}, got {value} (from {where(name)})")
    for name, choices in _CHOICES.items():
        value = getattr(settings, name)
        if value not in choices:
            raise ConfigError(
                f"{name}: must be one of {', '.join(choices)}, got {value!r} (from {where(name)})"
            )
    if not settings.host.strip():
        raise ConfigError(f"host: must not be empty (from {where('host')})")
    if not str(settings.data_dir).strip():
        raise ConfigError(f"data_dir: must not be empty (from {where('data_dir')})")

    # Pairs that must be ordered: (smaller, larger). A default above its maximum, or
    # a batch that could never fit in a message, is a configuration mistake.
    ordered = [
        ("max_entry_bytes", "max_batch_bytes"),
        ("default_read_entries", "max_read_entries"),
        ("subscribe_batch_entries", "max_read_entries"),
        ("default_read_bytes", "max_read_bytes"),
        ("default_page_size", "max_page_size"),
        ("max_batch_bytes", "max_message_bytes"),
    ]
    for small, large in ordered:
        if getattr(settings, small) > getattr(settings, large):
            raise ConfigError(
                f"{small} ({getattr(settings, small)}, from {where(small)}) must not be larger than "
                f"{large} ({getattr(settings, large)}, from {where(large)})"
            )
    # The engine checks its own settings (e.g. a segment must hold a full batch).
    try:
        engine_config(settings)
    except InvalidArgumentError as exc:
        raise ConfigError(f"storage engine settings: {exc}") from None
    # A read reply holds up to max_read_bytes plus one entry that may pass it.
    reply_bytes = settings.max_read_bytes + settings.max_entry_bytes + RESPONSE_OVERHEAD_BYTES
    if reply_bytes > settings.max_message_bytes:
        raise ConfigError(
            f"max_message_bytes ({settings.max_message_bytes}, from {where('max_message_bytes')}) must hold "
            f"a full read reply: max_read_bytes + max_entry_bytes + {RESPONSE_OVERHEAD_BYTES} = {reply_bytes}"
        )


def engine_config(settings: Settings, *, background: bool = True) -> EngineConfig:
    """The storage engine's configuration for these settings."""
    return EngineConfig(
        segment_bytes=settings.segment_bytes,
        node_entries=settings.node_entries,
        max_entry_bytes=settings.max_entry_bytes,
        max_batch_entries=settings.max_batch_entries,
        max_batch_bytes=settings.max_batch_bytes,
        max_tag_bytes=settings.max_tag_bytes,
        fsync=settings.fsync,
        compression=settings.compression,
        compression_level=settings.compression_level,
        cache_nodes=settings.cache_nodes,
        background=background,
    )
