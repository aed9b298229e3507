"""Server settings: defaults < TOML file < environment variables < command-line flags.

Every setting has one name, used everywhere: as a key in the TOML file (flat, no
tables), as `STREAMLOG_<NAME>` in the environment (e.g. `STREAMLOG_PORT=7071`),
and as `--set NAME=VALUE` on the command line (a few common ones also have their
own flags: --data, --host, --port, --fsync, --log-level, --log-format). The TOML
file comes from `--config FILE` or `STREAMLOG_CONFIG`.

No setting holds a secret itself: TLS keys and bearer tokens live in files named by
`tls_key_file` and `tokens_file`, so the settings can be printed at start-up
(`describe`, `describe_changes`); a value whose name says it is secret is masked all the same.

Values are checked once, here, so the server never starts half-configured: a bad
value stops start-up with a `ConfigError` naming the setting, where the value came
from, and what is allowed.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from cluster.addresses import check_name, parse_endpoints, parse_host_port, parse_peer_addresses
from storage import EngineConfig, FsyncPolicy, InvalidArgumentError
from storage.config import SMALL_STREAMS, min_segment_bytes

ENV_PREFIX = "STREAMLOG_"
ENV_CONFIG_FILE = "STREAMLOG_CONFIG"
FSYNC_POLICIES = tuple(policy.value for policy in FsyncPolicy)  # "always", "everysec", "no"
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
ACK_LEVELS = ("leader", "quorum")

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
    max_open_streams: int = 1024
    # "slots" (the default): new small streams live in 4 KiB slots of shared pack files, no
    # directory each (docs/design/small-streams.md); "off": a directory per new stream.
    small_streams: str = "slots"

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
    # Batches a Consume session may have asked for and not yet received.
    max_consume_batches: int = 1000
    # Messages and bytes of one Publish session held unanswered; past either, the server stops
    # reading the session's messages until answers go out (flow control pushes back).
    max_publish_messages: int = 1000
    max_publish_bytes: int = 8 << 20
    # Batches, and their serialized bytes, one AppendMany request may carry (past either the call
    # is refused whole); each batch also meets the limits of an Append.
    max_append_many_batches: int = 10_000
    max_append_many_bytes: int = 16 << 20
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

    # Logging: one line per event, as text or as one JSON object (service/logs.py).
    log_format: str = "text"

    # TLS (service/auth.py): PEM files; with tls_client_ca_file, clients must present a
    # certificate it signed (mutual TLS). Changed files are picked up without a restart.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""
    # Authentication and authorization: bearer tokens (TOML file) and per-stream rules
    # (TOML file). With acl_file set, every call but health and reflection needs an
    # identity (a token, or a client certificate under mutual TLS) and a rule allowing it.
    tokens_file: str = ""
    acl_file: str = ""
    # How often the TLS, token and ACL files are checked for changes; 0: only on SIGHUP.
    reload_interval_ms: int = 10_000
    # A second, plaintext port serving only the health service (0: none), for probes that
    # cannot do TLS or present client certificates (Kubernetes gRPC probes cannot).
    health_port: int = 0
    # Prometheus metrics over HTTP (service/metrics.py); 0: no metrics endpoint. It names
    # every stream and group, so it listens on the loopback unless told otherwise (with
    # authorization on, it shows names only to scrapers presenting a bearer token).
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    # Streams whose call counters get series of their own; those past it share `stream=""`.
    metrics_stream_series: int = 1000
    # The HTTP/JSON API and web console (service/http/); 0: off. Same TLS, tokens and rules
    # as gRPC; it shows what a caller may read, so it listens on the loopback unless told otherwise.
    http_port: int = 0
    http_host: str = "127.0.0.1"
    # The longest silence on a Server-Sent Events response before a comment line keeps it
    # open through proxies that close idle connections (often after 60 s); 0: none.
    http_keepalive_ms: int = 15_000

    # Limits on what clients can make the server hold (service/limits.py). Each refusal
    # is RESOURCE_EXHAUSTED naming the limit and its value.
    max_streams: int = 100_000
    max_groups_per_stream: int = 1_000
    max_consumers_per_group: int = 10_000
    # Groups get at most this many pending entries (their max_pending; 0: no server cap, as
    # in Redis). Set, a group created or reconfigured without max_pending gets this value.
    max_pending_per_group: int = 0
    max_subscriptions_per_connection: int = 1_000
    max_blocked_reads: int = 10_000
    # A subscriber that takes no reply for this long (its client stopped reading) is cut off.
    subscriber_send_timeout_ms: int = 30_000
    # Bytes of replies built and not yet taken by their clients, in total and per client
    # connection (service/replybudget.py); each such byte costs about two of memory (the
    # reply and gRPC's copy). A read that finds no room waits this long, then gets
    # RESOURCE_EXHAUSTED. The defaults keep replies under ~0.5 GiB, within the 2 GiB the
    # Kubernetes manifests give a server.
    max_queued_reply_bytes: int = 256 << 20
    max_connection_queued_reply_bytes: int = 64 << 20
    queued_reply_wait_ms: int = 5_000
    # gRPC connection management: concurrent calls per connection, keepalive pings that
    # find dead peers, the most often a client may ping, closing idle connections (0: never).
    max_concurrent_calls_per_connection: int = 2_000
    max_metadata_bytes: int = 16 << 10
    keepalive_time_ms: int = 60_000
    keepalive_timeout_ms: int = 20_000
    min_client_ping_interval_ms: int = 10_000
    max_connection_idle_ms: int = 0

    # Cluster (docs/CLUSTER.md). `cluster` empty: a single server and no etcd (the embedded
    # default); otherwise the etcd endpoints (HOST:PORT,...), and this node needs an id and
    # the address peers dial it at. `cluster_name` prefixes every etcd key (/<name>/...).
    cluster: str = ""
    node_id: str = ""
    advertise: str = ""
    cluster_name: str = "streamlog"
    # The node's etcd lease (whole seconds, etcd's unit): it leads streams only while it holds it.
    lease_ttl_ms: int = 5_000
    # A follower not caught up within this leaves the in-sync replicas.
    replica_lag_ms: int = 2_000
    # For streams that set none; the factor is capped by the live nodes.
    default_replication_factor: int = 3
    default_acks: str = "quorum"
    # ID=HOST:PORT,...: dial these peers here instead of at their advertised address.
    peer_addresses: str = ""
    # With TLS on, the CA certificates (PEM) that signed the other nodes' certificates;
    # empty: tls_client_ca_file, else the system's trust store.
    peer_ca_file: str = ""
    # A file holding the cluster's shared secret: nodes send it with every internal
    # (replication) call and refuse internal calls without it. Empty: internal calls are not
    # authenticated (keep the nodes' port private, or use mutual TLS).
    cluster_secret_file: str = ""
    # About how many record bytes a follower fetches in one round.
    replica_fetch_bytes: int = 1 << 20
    # A node gone this long has its replicas re-created on live nodes; 0: never.
    replica_replace_after_ms: int = 600_000
    # Streams copying to new replicas at once, for moves (rebalance, drain, replacement).
    max_concurrent_moves: int = 4
    # The most bytes per second this node's new replicas (moves) fetch, together, while they
    # catch up; in-sync followers are not throttled. 0: no throttle.
    move_bytes_per_s: int = 0


# name -> (lowest, highest) for integer settings; None means no bound on that side.
_INT_RANGES: dict[str, tuple[int | None, int | None]] = {
    "port": (0, 65_535),
    "segment_bytes": (1 << 20, 1 << 40),
    "node_entries": (1, 1 << 20),
    "compression_level": (1, 22),
    "cache_nodes": (1, None),
    "max_open_streams": (1, None),
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
    "max_consume_batches": (1, 2**31 - 1),
    "max_publish_messages": (1, None),
    "max_publish_bytes": (1, None),
    "max_append_many_batches": (1, None),
    "max_append_many_bytes": (1, None),
    "default_page_size": (1, None),
    "max_page_size": (1, 2**31 - 1),
    "max_block_ms": (0, 2**31 - 1),
    "max_subscriptions": (1, None),
    "append_threads": (1, 256),
    "shutdown_grace_ms": (0, 3_600_000),
    "reload_interval_ms": (0, 86_400_000),
    "health_port": (0, 65_535),
    "metrics_port": (0, 65_535),
    "metrics_stream_series": (0, None),
    "http_port": (0, 65_535),
    "http_keepalive_ms": (0, 3_600_000),
    "max_streams": (1, None),
    "max_groups_per_stream": (1, None),
    "max_consumers_per_group": (1, None),
    "max_pending_per_group": (0, None),
    "max_subscriptions_per_connection": (1, None),
    "max_blocked_reads": (1, None),
    "subscriber_send_timeout_ms": (100, 3_600_000),
    "max_queued_reply_bytes": (1 << 20, None),
    "max_connection_queued_reply_bytes": (1 << 20, None),
    "queued_reply_wait_ms": (0, 3_600_000),
    "max_concurrent_calls_per_connection": (1, 2**31 - 1),
    "max_metadata_bytes": (1 << 10, 1 << 24),
    "keepalive_time_ms": (1_000, 2**31 - 1),
    "keepalive_timeout_ms": (1_000, 2**31 - 1),
    "min_client_ping_interval_ms": (0, 2**31 - 1),
    "max_connection_idle_ms": (0, 2**31 - 1),
    "lease_ttl_ms": (1_000, 300_000),
    "replica_lag_ms": (100, 600_000),
    "replica_fetch_bytes": (1 << 10, 4 << 20),
    "default_replication_factor": (1, 64),
    "replica_replace_after_ms": (0, 2**31 - 1),
    "max_concurrent_moves": (1, 1_000),
    "move_bytes_per_s": (0, 1 << 40),
}

_CHOICES: dict[str, tuple[str, ...]] = {
    "fsync": FSYNC_POLICIES,
    "log_level": LOG_LEVELS,
    "log_format": LOG_FORMATS,
    "default_acks": ACK_LEVELS,
    "small_streams": SMALL_STREAMS,
}
# Settings naming a file the server reads at start-up (and again when it changes).
FILE_SETTINGS = (
    "tls_cert_file",
    "tls_key_file",
    "tls_client_ca_file",
    "tokens_file",
    "acl_file",
    "peer_ca_file",
    "cluster_secret_file",
)
# Parts of a setting's name that mark its value as secret: masked when settings are printed.
_SECRET_MARKERS = ("password", "secret", "token")

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
    for name in ("host", "metrics_host", "http_host"):
        if not getattr(settings, name).strip():
            raise ConfigError(f"{name}: must not be empty (from {where(name)})")
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
        # A read reserves its max_bytes: one of the largest must fit in a connection's budget.
        ("max_read_bytes", "max_connection_queued_reply_bytes"),
        ("max_connection_queued_reply_bytes", "max_queued_reply_bytes"),
    ]
    for small, large in ordered:
        if getattr(settings, small) > getattr(settings, large):
            raise ConfigError(
                f"{small} ({getattr(settings, small)}, from {where(small)}) must not be larger than "
                f"{large} ({getattr(settings, large)}, from {where(large)})"
            )
    _validate_security(settings, where)
    _validate_cluster(settings, where)
    taken = {settings.port: "port"}
    for name in ("health_port", "metrics_port", "http_port"):
        port = getattr(settings, name)
        if port and port in taken:
            raise ConfigError(f"{name} ({port}, from {where(name)}) must differ from {taken[port]}")
        taken[port] = name
    if settings.max_subscriptions_per_connection > settings.max_concurrent_calls_per_connection:
        raise ConfigError(
            "max_subscriptions_per_connection must not be larger than max_concurrent_calls_per_connection "
            f"({settings.max_subscriptions_per_connection} > {settings.max_concurrent_calls_per_connection})"
        )
    _validate_segment_size(settings, where)
    # The engine checks its own settings too (any left here are caught above, with sources).
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


def _validate_segment_size(settings: Settings, where: Callable[[str], str]) -> None:
    """A segment must hold one full batch: say so, and what to change, before the engine refuses it."""
    needed = min_segment_bytes(settings.node_entries, settings.max_batch_entries, settings.max_batch_bytes)
    if settings.segment_bytes >= needed:
        return
    batch_fits = settings.segment_bytes - (needed - settings.max_batch_bytes)
    if batch_fits >= 1024:
        lower = f"lower max_batch_bytes to at most {batch_fits} (e.g. {batch_fits >> 10}KiB)"
        if settings.max_entry_bytes > batch_fits:
            lower += " and max_entry_bytes to no more than that"
    else:
        lower = "lower max_batch_entries and max_batch_bytes"
    raise ConfigError(
        f"segment_bytes ({settings.segment_bytes}, from {where('segment_bytes')}) is too small for one full "
        f"batch, and a batch is never split across segments: it takes {needed} bytes with max_batch_bytes="
        f"{settings.max_batch_bytes} (from {where('max_batch_bytes')}) and max_batch_entries="
        f"{settings.max_batch_entries} (from {where('max_batch_entries')}). Raise segment_bytes to at "
        f"least {needed}, or {lower}"
    )


def _validate_security(settings: Settings, where: Callable[[str], str]) -> None:
    """TLS files come as a set, and authorization needs a way to tell who is calling."""
    for name in FILE_SETTINGS:
        path = getattr(settings, name)
        if path and not Path(path).is_file():
            raise ConfigError(f"{name}: {path} is not a readable file (from {where(name)})")
    if bool(settings.tls_cert_file) != bool(settings.tls_key_file):
        raise ConfigError("tls_cert_file and tls_key_file: set both (TLS) or neither (plaintext)")
    if settings.tls_client_ca_file and not settings.tls_cert_file:
        raise ConfigError("tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file")
    if settings.tokens_file and not settings.acl_file:
        raise ConfigError(
            "tokens_file needs acl_file: once callers are identified, every call is denied unless a rule "
            'allows it (to allow every known caller everything: a rule with principals = ["*"], '
            'streams = ["*"], permissions = ["admin"])'
        )
    if settings.acl_file and not (settings.tokens_file or settings.tls_client_ca_file):
        raise ConfigError(
            "acl_file needs a way to identify callers: tokens_file (bearer tokens), "
            "tls_client_ca_file (client certificates), or both"
        )


def _validate_cluster(settings: Settings, where: Callable[[str], str]) -> None:
    """The cluster settings parse, and a clustered node says who it is and where it listens."""
    if settings.lease_ttl_ms % 1000:
        raise ConfigError(
            f"lease_ttl_ms: etcd leases count whole seconds, so a multiple of 1000, got "
            f"{settings.lease_ttl_ms} (from {where('lease_ttl_ms')})"
        )
    if not settings.cluster.strip():
        for name in ("node_id", "advertise", "peer_addresses", "peer_ca_file", "cluster_secret_file"):
            if getattr(settings, name):
                raise ConfigError(
                    f"{name} is set (from {where(name)}) but cluster is not: set the etcd endpoints"
                )
        return
    for name in ("node_id", "advertise"):
        if not getattr(settings, name):
            raise ConfigError(
                f"{name}: a node in a cluster needs one (cluster is set, from {where('cluster')})"
            )
    checks: list[tuple[str, Callable[[str], object]]] = [
        ("cluster", parse_endpoints),
        ("node_id", lambda text: check_name("a node id", text)),
        ("advertise", parse_host_port),
        ("cluster_name", lambda text: check_name("the cluster name", text)),
        ("peer_addresses", parse_peer_addresses),
    ]
    for name, check in checks:
        try:
            check(getattr(settings, name))
        except ValueError as exc:
            raise ConfigError(f"{name}: {exc} (from {where(name)})") from None


def is_secret(name: str) -> bool:
    """Whether a setting's value must not be printed (file settings hold paths, not secrets)."""
    return name not in FILE_SETTINGS and any(marker in name for marker in _SECRET_MARKERS)


def describe(settings: Settings) -> dict[str, Any]:
    """Every setting and its value, for the start-up log; secret values masked."""
    values: dict[str, Any] = {}
    for name in _FIELDS:
        value = getattr(settings, name)
        if is_secret(name) and value:
            value = "********"
        values[name] = str(value) if isinstance(value, Path) else value
    return values


def describe_changes(settings: Settings) -> str:
    """The settings not at their built-in defaults, one per line, for people (text logs)."""
    defaults = describe(Settings())
    changed = [(name, value) for name, value in describe(settings).items() if value != defaults[name]]
    if not changed:
        return "settings: all at their defaults (every setting: streamlog serve --help)"
    lines = ["settings not at their defaults (every setting: streamlog serve --help):"]
    lines += [f"  {name} = {_show_value(name, value)}" for name, value in changed]
    return "\n".join(lines)


def _show_value(name: str, value: Any) -> str:
    """A size in the largest binary unit that states it exactly (as a setting accepts it back)."""
    if name.endswith("_bytes") and isinstance(value, int) and value:
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if value % size == 0:
                return f"{value // size} {unit}"
    return str(value)


def engine_config(settings: Settings, *, background: bool = True) -> EngineConfig:
    """The storage engine's configuration for these settings."""
    return EngineConfig(
        segment_bytes=settings.segment_bytes,
        node_entries=settings.node_entries,
        max_entry_bytes=settings.max_entry_bytes,
        max_batch_entries=settings.max_batch_entries,
        max_batch_bytes=settings.max_batch_bytes,
        max_tag_bytes=settings.max_tag_bytes,
        fsync=FsyncPolicy(settings.fsync),
        compression=settings.compression,
        compression_level=settings.compression_level,
        cache_nodes=settings.cache_nodes,
        max_open_streams=settings.max_open_streams,
        small_streams=settings.small_streams,
        background=background,
        groups_passive=bool(settings.cluster),
        retention_passive=bool(settings.cluster),
    )
