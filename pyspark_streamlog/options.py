"""Parsing and checking the options of `format("streamlog")`, once, on the driver.

Option names follow Spark's Kafka connector where the idea is the same
(`startingOffsets`, `endingOffsets`, `startingTimestamp`, `minPartitions`,
`failOnDataLoss`, `includeHeaders`), so users can carry their habits over.
Everything is checked before a job starts: a typo in an option name is an
error listing the valid names, not an option silently ignored.

The connection options are `clients.Client`'s (`token`, `tls`, `tlsCa`, `tlsCert`,
`tlsKey`, `tlsServerName`, as the CLI's `--token`, `--tls`, `--tls-ca`, ...), and
the environment variables are the CLI's (STREAMLOG_ADDRESS, STREAMLOG_TOKEN).
Certificate files are read here, where the query is planned; their contents
travel to the tasks inside the pickled options, so executors need no copies.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

from pyspark_streamlog.errors import OptionError

ENV_ENDPOINT = "STREAMLOG_ADDRESS"
ENV_TOKEN = "STREAMLOG_TOKEN"
READ_FROM = ("replica", "leader")  # the readFrom option's values; the first is the default
EARLIEST = -2  # in startingOffsets JSON, as in Kafka's connector
LATEST = -1
MAX_STREAM_NAME_BYTES = 255
# The server refuses producer ids over 255 bytes; the connector adds ":<batch>:<partition>".
MAX_PRODUCER_ID_BYTES = 200

# Spark passes these to every source or sink of a query; they are not ours to check.
_SPARK_OPTIONS = {"checkpointlocation", "path", "queryname"}

_COMMON = {"endpoint", "timeoutms", "token", "tls", "tlsca", "tlscert", "tlskey", "tlsservername"}
_READ = _COMMON | {
    "streams",
    "startingoffsets",
    "endingoffsets",
    "startingtimestamp",
    "endingtimestamp",
    "entriesperpartition",
    "minpartitions",
    "failondataloss",
    "payloadas",
    "includeheaders",
    "maxentriespertrigger",
    "readfrom",
}
_STREAM_ONLY = {"maxentriespertrigger"}
_BATCH_ONLY = {"endingoffsets", "endingtimestamp"}
_WRITE = _COMMON | {"stream", "producerid", "entriesperappend", "bytesperappend"}

# Option names as users write them, for messages (Spark lower-cases the keys it passes on).
_DISPLAY = {
    name.lower(): name
    for name in (
        "endpoint",
        "timeoutMs",
        "token",
        "tls",
        "tlsCa",
        "tlsCert",
        "tlsKey",
        "tlsServerName",
        "streams",
        "startingOffsets",
        "endingOffsets",
        "startingTimestamp",
        "endingTimestamp",
        "entriesPerPartition",
        "minPartitions",
        "failOnDataLoss",
        "payloadAs",
        "includeHeaders",
        "maxEntriesPerTrigger",
        "readFrom",
        "stream",
        "producerId",
        "entriesPerAppend",
        "bytesPerAppend",
    )
}


@dataclass(frozen=True, slots=True)
class Position:
    """Where a range starts or ends: an offset (EARLIEST/LATEST allowed) or a time."""

    offset: int | None = None
    timestamp_ms: int | None = None


@dataclass(frozen=True, slots=True)
class Server:
    """A streamlog server (or a cluster's seed nodes) and how to connect to it: the connection
    arguments of `clients.Client`. `address`: one host:port, or several separated by commas.

    Hashable (tasks keep one channel per server and process) and picklable; the
    secrets stay out of its repr, which Spark may log.
    """

    address: str
    token: str | None = field(default=None, repr=False)
    tls: bool = False
    root_certificates: bytes | None = field(default=None, repr=False)
    certificate_chain: bytes | None = field(default=None, repr=False)
    private_key: bytes | None = field(default=None, repr=False)
    server_name: str | None = None

    def tls_arguments(self) -> dict[str, Any]:
        """The TLS keyword arguments of `clients.Client` (and of the channel it opens)."""
        return {
            "tls": self.tls,
            "root_certificates": self.root_certificates,
            "certificate_chain": self.certificate_chain,
            "private_key": self.private_key,
            "server_name": self.server_name,
        }


@dataclass(frozen=True, slots=True)
class ReadOptions:
    server: Server
    streams: tuple[str, ...]
    starting: dict[str, Position]
    ending: dict[str, Position]
    entries_per_partition: int
    min_partitions: int | None
    fail_on_data_loss: bool
    payload_as_string: bool
    include_headers: bool
    max_entries_per_trigger: int | None
    timeout_s: float
    read_from: str


@dataclass(frozen=True, slots=True)
class WriteOptions:
    server: Server
    stream: str | None
    producer_id: str | None
    entries_per_append: int
    bytes_per_append: int
    timeout_s: float


def _lower(options: Mapping[str, str]) -> dict[str, str]:
    # Spark hands data sources a case-insensitive dict; plain dicts (tests, direct use) too.
    return {str(k).lower(): str(v) for k, v in options.items()}


def _check_names(options: dict[str, str], allowed: set[str], what: str) -> None:
    unknown = sorted(set(options) - allowed - _SPARK_OPTIONS)
    if unknown:
        names = ", ".join(_DISPLAY.get(n, n) for n in unknown)
        valid = ", ".join(sorted(_DISPLAY[n] for n in allowed))
        raise OptionError(f"unknown option(s) for a streamlog {what}: {names}. Valid options: {valid}")


def endpoint(options: dict[str, str]) -> str:
    """The server's address, or a cluster's seed addresses: "host:port" or "a:7070,b:7070", normalized."""
    value = options.get("endpoint") or os.environ.get(ENV_ENDPOINT, "")
    seeds = [seed.strip() for seed in value.split(",") if seed.strip()]
    if not seeds:
        raise OptionError(
            f"no streamlog server given: set the endpoint option (e.g. .option('endpoint', "
            f"'localhost:7070'), or a cluster's nodes 'n1:7070,n2:7070') or the {ENV_ENDPOINT} "
            "environment variable"
        )
    return ",".join(dict.fromkeys(seeds))


def _pem_file(options: dict[str, str], name: str) -> bytes | None:
    raw = options.get(name, "").strip()
    if not raw:
        return None
    try:
        data = Path(raw).expanduser().read_bytes()
    except OSError as exc:
        raise OptionError(f"{_DISPLAY[name]}: cannot read {raw!r}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise OptionError(f"{_DISPLAY[name]}: {raw!r} is not a PEM file (it has no -----BEGIN line)")
    return data


def server(options: dict[str, str]) -> Server:
    """The server to call and how: endpoint, token and TLS options (or the environment)."""
    ca = _pem_file(options, "tlsca")
    certificate = _pem_file(options, "tlscert")
    key = _pem_file(options, "tlskey")
    if (certificate is None) != (key is None):
        raise OptionError("tlsCert and tlsKey go together: a client certificate needs its private key")
    files = ca is not None or certificate is not None
    tls = _bool(options, "tls", files)
    if files and not tls:
        raise OptionError("tls is false, but tlsCa or tlsCert is set: they are for TLS connections")
    server_name = options.get("tlsservername", "").strip() or None
    if server_name and not tls:
        raise OptionError("tlsServerName is for TLS connections: set tls to true (or tlsCa)")
    token = (options.get("token") or os.environ.get(ENV_TOKEN, "")).strip() or None
    return Server(endpoint(options), token, tls, ca, certificate, key, server_name)


def stream_name(name: str, option: str) -> str:
    size = len(name.encode())
    if not 1 <= size <= MAX_STREAM_NAME_BYTES or "\x00" in name:
        raise OptionError(f"{option}: {name!r} is not a valid stream name (1..255 bytes of UTF-8, no NUL)")
    return name


@overload
def _int(options: dict[str, str], name: str, default: int, low: int) -> int: ...
@overload
def _int(options: dict[str, str], name: str, default: None, low: int) -> int | None: ...
def _int(options: dict[str, str], name: str, default: int | None, low: int) -> int | None:
    raw = options.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise OptionError(f"{_DISPLAY[name]} must be an integer, got {raw!r}") from None
    if value < low:
        raise OptionError(f"{_DISPLAY[name]} must be at least {low}, got {value}")
    return value


def _bool(options: dict[str, str], name: str, default: bool) -> bool:
    raw = options.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value not in ("true", "false"):
        raise OptionError(f"{_DISPLAY[name]} must be true or false, got {raw!r}")
    return value == "true"


def _positions(
    options: dict[str, str], offsets_key: str, time_key: str, streams: tuple[str, ...], default: int
) -> dict[str, Position]:
    """Per-stream positions from `<x>Offsets` (earliest, latest or JSON) or `<x>Timestamp`."""
    raw_offsets = options.get(offsets_key)
    raw_time = options.get(time_key)
    if raw_offsets is not None and raw_time is not None:
        raise OptionError(f"set {_DISPLAY[offsets_key]} or {_DISPLAY[time_key]}, not both")
    if raw_time is not None:
        timestamp = _int(options, time_key, None, 0)
        return {s: Position(timestamp_ms=timestamp) for s in streams}
    if raw_offsets is None:
        return {s: Position(offset=default) for s in streams}
    text = raw_offsets.strip()
    if text.lower() == "earliest":
        return {s: Position(offset=EARLIEST) for s in streams}
    if text.lower() == "latest":
        return {s: Position(offset=LATEST) for s in streams}
    name = _DISPLAY[offsets_key]
    try:
        given: Any = json.loads(text)
    except json.JSONDecodeError:
        raise OptionError(
            f'{name} must be "earliest", "latest" or JSON like {{"stream": 42}}, got {raw_offsets!r}'
        ) from None
    if not isinstance(given, dict):
        raise OptionError(f'{name} JSON must be an object like {{"stream": 42}}, got {raw_offsets!r}')
    extra = sorted(set(given) - set(streams))
    if extra:
        raise OptionError(f"{name} names stream(s) not in the streams option: {', '.join(extra)}")
    missing = sorted(set(streams) - set(given))
    if missing:
        raise OptionError(f"{name} must give a position for every stream; missing: {', '.join(missing)}")
    positions = {}
    for stream, value in given.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < EARLIEST:
            raise OptionError(
                f"{name}: the position of {stream!r} must be an offset >= 0, -2 (earliest) or -1 (latest), "
                f"got {value!r}"
            )
        positions[stream] = Position(offset=value)
    return positions


def parse_read(raw: Mapping[str, str], streaming: bool) -> ReadOptions:
    options = _lower(raw)
    allowed = _READ - (_BATCH_ONLY if streaming else _STREAM_ONLY)
    _check_names(options, allowed, "streaming read" if streaming else "batch read")
    names = [s.strip() for s in options.get("streams", "").split(",") if s.strip()]
    if not names:
        raise OptionError("the streams option is required: one stream name, or several separated by commas")
    streams = tuple(dict.fromkeys(stream_name(s, "streams") for s in names))
    payload_as = options.get("payloadas", "binary").strip().lower()
    if payload_as not in ("binary", "string"):
        raise OptionError(f"payloadAs must be binary or string, got {options['payloadas']!r}")
    read_from = options.get("readfrom", READ_FROM[0]).strip().lower()
    if read_from not in READ_FROM:
        raise OptionError(f"readFrom must be {' or '.join(READ_FROM)}, got {options['readfrom']!r}")
    starting = _positions(
        options, "startingoffsets", "startingtimestamp", streams, LATEST if streaming else EARLIEST
    )
    ending = {s: Position(offset=LATEST) for s in streams}
    if not streaming:
        ending = _positions(options, "endingoffsets", "endingtimestamp", streams, LATEST)
        early = sorted(s for s, p in ending.items() if p.offset == EARLIEST)
        if early:
            raise OptionError(
                f"endingOffsets cannot be earliest (-2); it is for stream(s) {', '.join(early)}"
            )
    return ReadOptions(
        server=server(options),
        streams=streams,
        starting=starting,
        ending=ending,
        entries_per_partition=_int(options, "entriesperpartition", 250_000, 1),
        min_partitions=_int(options, "minpartitions", None, 1),
        fail_on_data_loss=_bool(options, "failondataloss", True),
        payload_as_string=payload_as == "string",
        include_headers=_bool(options, "includeheaders", True),
        max_entries_per_trigger=_int(options, "maxentriespertrigger", None, 1),
        timeout_s=_int(options, "timeoutms", 30_000, 1) / 1000,
        read_from=read_from,
    )


def parse_write(raw: Mapping[str, str]) -> WriteOptions:
    options = _lower(raw)
    _check_names(options, _WRITE, "write")
    stream = options.get("stream")
    producer_id = options.get("producerid")
    if producer_id is not None:
        producer_id = producer_id.strip()
        size = len(producer_id.encode())
        if not 1 <= size <= MAX_PRODUCER_ID_BYTES:
            raise OptionError(f"producerId must be 1..{MAX_PRODUCER_ID_BYTES} bytes, got {size}")
    return WriteOptions(
        server=server(options),
        stream=stream_name(stream.strip(), "stream") if stream is not None else None,
        producer_id=producer_id,
        entries_per_append=_int(options, "entriesperappend", 5_000, 1),
        bytes_per_append=_int(options, "bytesperappend", 4 << 20, 1),
        timeout_s=_int(options, "timeoutms", 30_000, 1) / 1000,
    )
