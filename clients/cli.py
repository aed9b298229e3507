# PYTHON_ARGCOMPLETE_OK  (argcomplete's marker: shell completion may run this module)
"""The `streamlog` command: everyday work against a server, and `serve` to run one.

    streamlog append orders '{"total": 42}'         streamlog tail -f orders
    streamlog read orders --from 0 --count 10       streamlog groups list orders
    streamlog export orders -o orders.jsonl         streamlog inspect ./data
    streamlog cluster                               streamlog cluster rebalance --dry-run
    streamlog cluster drain n3

Tables for people by default (control characters in names, tags and header keys
shown escaped), `--json` for scripts (one JSON document, or JSON Lines for
entries). Connection: `--address` (or STREAMLOG_ADDRESS, default localhost:7070),
`--token` (or STREAMLOG_TOKEN), `--tls`/`--tls-ca`/`--tls-cert`/`--tls-key`;
in a cluster, `--read-from replica` reads (read, tail, export) from in-sync replicas.
`serve` replaces this process with `python -m service.cli serve ...`,
so the client package never imports the server.

Exit codes: 0 success; 1 the call failed on the server (internal error, data
loss, a limit, ...); 2 bad command line or arguments (including INVALID_ARGUMENT);
3 stream or group not found; 4 conflict (a conditional append lost the race,
ALREADY_EXISTS, OUT_OF_RANGE); 5 server unreachable or the call timed out;
6 not allowed (UNAUTHENTICATED, PERMISSION_DENIED); 130 interrupted.
`inspect --verify` exits 1 when it finds damage.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import contextlib
import json
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clients.client import Client
    from clients.types import Entry, Gap, GroupInfo, Record, Start, StreamConfig

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_CONFLICT = 4
EXIT_UNAVAILABLE = 5
EXIT_DENIED = 6
EXIT_INTERRUPTED = 130

DEFAULT_ADDRESS = "localhost:7070"
_END = 2**63 - 1  # an offset past any stream's end
_PAGE = 1000  # entries per Read when the CLI pages through a stream
_MOVE_POLL_S = 0.5  # how often rebalance and drain look at the moves' progress


class UsageError(Exception):
    """A command line that parses but makes no sense; exits 2 with the message."""


# ------------------------------------------------------------------ output helpers


def _time(ms: int) -> str:
    if not ms:
        return "-"
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _size(count: int) -> str:
    """A number of bytes for people: B below 1 KiB, else KiB, MiB, GiB or TiB with one decimal."""
    if count < 1024:
        return f"{count} B"
    value = float(count)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024:
            return f"{value:.1f} {unit}"
    return f"{value / 1024:.1f} TiB"


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _show_bytes(value: bytes, width: int = 60) -> str:
    """Payloads for people: text when it is printable UTF-8, else base64, cut to `width`."""
    try:
        text = value.decode()
        shown = text if text.isprintable() else "b64:" + base64.b64encode(value).decode()
    except UnicodeDecodeError:
        shown = "b64:" + base64.b64encode(value).decode()
    return shown if len(shown) <= width else shown[: width - 1] + "…"


def _printable(text: str) -> str:
    """Text from the server (names, tags, header keys) for a terminal: control characters
    escaped as Python does (ESC as \\x1b), so a name cannot move the cursor, retitle the
    window or hide what follows it."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _table(rows: Sequence[Sequence[Any]], headers: Sequence[str], out: IO[str]) -> None:
    cells = [
        [str(h) for h in headers],
        *[["-" if c is None else _printable(str(c)) for c in row] for row in rows],
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        out.write("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() + "\n")


def _pairs(pairs: Sequence[tuple[str, Any]], out: IO[str]) -> None:
    width = max(len(k) for k, _ in pairs)
    for key, value in pairs:
        out.write(f"{key.ljust(width)}  {'-' if value is None else _printable(str(value))}\n")


def _json(value: Any, out: IO[str]) -> None:
    out.write(json.dumps(value, default=_json_default, sort_keys=False) + "\n")


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes):
        return _encode_bytes(value)[1]
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def _encode_bytes(value: bytes) -> tuple[bool, str]:
    """(is_text, value): UTF-8 text as is, anything else in base64."""
    try:
        return True, value.decode()
    except UnicodeDecodeError:
        return False, base64.b64encode(value).decode()


def entry_to_json(entry: Entry) -> dict[str, Any]:
    """An entry as a JSON object: `payload` when it is UTF-8 text, else `payload_base64`; same for headers."""
    record: dict[str, Any] = {"offset": entry.offset, "timestamp_ms": entry.timestamp_ms}
    if entry.tag:
        record["tag"] = entry.tag
    is_text, payload = _encode_bytes(entry.payload)
    record["payload" if is_text else "payload_base64"] = payload
    if entry.headers:
        text: dict[str, str] = {}
        binary: dict[str, str] = {}
        for key, value in entry.headers.items():
            is_text, shown = _encode_bytes(value)
            (text if is_text else binary)[key] = shown
        if text:
            record["headers"] = text
        if binary:
            record["headers_base64"] = binary
    if entry.deliver_at_ms:
        record["deliver_at_ms"] = entry.deliver_at_ms
    if entry.delivery_count:
        record["delivery_count"] = entry.delivery_count
    return record


def record_from_json(line: str, where: str) -> tuple[str | None, Record]:
    """The stream a JSON Lines line names (its "stream" field; None without one) and its Record (the
    format `export` writes; offsets and times are ignored)."""
    from clients.types import Record

    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{where}: not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{where}: expected a JSON object, got {type(data).__name__}")
    stream = data.get("stream")
    if stream is not None and not isinstance(stream, str):
        raise UsageError(f'{where}: "stream" must be a string, got {type(stream).__name__}')
    try:
        if "payload_base64" in data:
            payload = base64.b64decode(data["payload_base64"], validate=True)
        else:
            payload = str(data.get("payload", "")).encode()
        headers = {str(k): str(v).encode() for k, v in (data.get("headers") or {}).items()}
        for key, value in (data.get("headers_base64") or {}).items():
            headers[str(key)] = base64.b64decode(value, validate=True)
        return stream, Record(
            payload,
            tag=str(data.get("tag", "")),
            headers=headers or None,
            deliver_at_ms=int(data.get("deliver_at_ms", 0)),
        )
    except (binascii.Error, ValueError, TypeError, AttributeError) as exc:
        raise UsageError(f"{where}: {exc}") from None


class Progress:
    """A progress line on stderr for long work: done (of total), rate; redrawn at most 5 times a second.

    On a terminal it redraws one line; elsewhere (when forced on) it prints a line a second.
    """

    def __init__(self, label: str, enabled: bool, total: int | None = None, unit: str = "entries") -> None:
        self.label = label
        self.enabled = enabled
        self.total = total
        self.unit = unit
        self._tty = sys.stderr.isatty()
        self._started = time.monotonic()
        self._shown = 0.0
        self.done = 0

    def update(self, done: int, force: bool = False) -> None:
        self.done = done
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._shown < (0.2 if self._tty else 1.0):
            return
        self._shown = now
        rate = done / max(now - self._started, 1e-6)
        text = f"{self.label}: {done:,} {self.unit}"
        if self.total:
            text += f" of {self.total:,} ({min(done / self.total, 1.0):.0%})"
        text += f", {rate:,.0f}/s"
        sys.stderr.write(f"\r{text}\x1b[K" if self._tty else text + "\n")
        sys.stderr.flush()

    def finish(self) -> None:
        self.update(self.done, force=True)
        if self.enabled and self._tty:
            sys.stderr.write("\n")


def _warn_gap(gap: Gap) -> None:
    sys.stderr.write(
        f"warning: offsets {gap.start_offset}..{gap.end_offset - 1} are missing ({gap.reason})\n"
    )


# ------------------------------------------------------------------ connection


def _client(args: argparse.Namespace) -> Client:
    from clients.client import Client

    address = args.address or os.environ.get("STREAMLOG_ADDRESS") or DEFAULT_ADDRESS
    token = args.token or os.environ.get("STREAMLOG_TOKEN") or None
    try:
        return Client(
            address,
            token=token,
            tls=args.tls,
            root_certificates=args.tls_ca,
            certificate_chain=args.tls_cert,
            private_key=args.tls_key,
            server_name=args.tls_server_name,
            timeout=args.timeout,
            read_from=args.read_from,
        )
    except (ValueError, OSError) as exc:
        raise UsageError(str(exc)) from None


def _offset(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an offset (an integer >= 0), got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an offset >= 0, got {value}")
    return value


def _start(text: str) -> Start:
    if text in ("oldest", "latest"):
        return "oldest" if text == "oldest" else "latest"
    try:
        return _offset(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected oldest, latest or an offset, got {text!r}") from None


def _header(text: str) -> tuple[str, bytes]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value.encode()


def _limit(text: str) -> int | None:
    """A positive number, or none/off to remove the limit."""
    if text.lower() in ("none", "off", "unset"):
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or none, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer or none, got {value}")
    return value


def _range(text: str) -> tuple[int, int]:
    start, sep, end = text.partition("-")
    try:
        span = (int(start), int(end))
    except ValueError:
        span = (-1, -1)
    if not sep or span[0] < 0 or span[1] < span[0]:
        raise argparse.ArgumentTypeError(f"expected START-END (half-open, START <= END), got {text!r}")
    return span


# ------------------------------------------------------------------ data commands


def _cmd_append(args: argparse.Namespace, out: IO[str]) -> int:
    from clients.producer import Producer
    from clients.types import Record

    headers = dict(args.header) or None
    with _client(args) as client:
        if args.payloads:
            if args.jsonl:
                raise UsageError("--jsonl reads standard input; give no payload arguments with it")
            items = [Record(p.encode(), tag=args.tag, headers=headers) for p in args.payloads]
            batch = [i.payload for i in items] if not (args.tag or headers) else items
            result = client.append(args.stream, batch, expected_next_offset=args.expect_offset)
            first, last, count = result.first_offset, result.last_offset, result.count
        else:
            if args.expect_offset is not None:
                raise UsageError("--expect-offset needs the payloads as arguments (one atomic batch)")
            futures = []
            with Producer(client, args.stream, max_batch_entries=args.batch, linger_ms=50) as producer:
                for number, line in enumerate(sys.stdin, start=1):
                    line = line.rstrip("\n")
                    if args.jsonl:
                        if not line.strip():
                            continue
                        _, record = record_from_json(line, f"stdin line {number}")
                        if args.tag and not record.tag:
                            record = Record(record.payload, args.tag, record.headers, record.deliver_at_ms)
                    else:
                        record = Record(line.encode(), tag=args.tag, headers=headers)
                    futures.append(producer.send(record))
            if not futures:
                raise UsageError("nothing to append: give payloads as arguments or lines on stdin")
            offsets = [f.result() for f in futures]
            first, last, count = offsets[0], offsets[-1], len(offsets)
    if args.json:
        _json({"stream": args.stream, "first_offset": first, "last_offset": last, "count": count}, out)
    else:
        out.write(f"appended {count} entries to {args.stream!r}: offsets {first}..{last}\n")
    return EXIT_OK


def _print_entries(entries: Iterable[Entry], args: argparse.Namespace, out: IO[str]) -> int:
    """Print entries (JSON Lines with --json, else one line each); return how many."""
    count = 0
    for entry in entries:
        count += 1
        if args.json:
            _json(entry_to_json(entry), out)
            continue
        line = f"{entry.offset:>8}  {_time(entry.timestamp_ms)}"
        if entry.tag:
            line += f"  [{_printable(entry.tag)}]"
        line += f"  {_show_bytes(entry.payload, args.width)}"
        if entry.headers:
            line += "  " + " ".join(f"{_printable(k)}={_show_bytes(v, 20)}" for k, v in entry.headers.items())
        if entry.delivery_count:
            line += f"  (delivery {entry.delivery_count})"
        out.write(line + "\n")
    out.flush()
    return count


def _read_pages(client: Client, stream: str, offset: int, limit: int, block_ms: int) -> Iterator[Entry]:
    """Entries from `offset` on, `limit` at most (0: to the end), one Read per page; gaps go to stderr."""
    remaining = limit or _END
    while remaining > 0:
        result = client.read(stream, offset, count=min(remaining, _PAGE), block_ms=block_ms)
        if result.gap is not None:
            _warn_gap(result.gap)
        yield from result.entries
        remaining -= len(result.entries)
        if result.next_offset <= offset or (not result.entries and result.next_offset >= result.end_offset):
            return  # at the end (a page ends when the stream does; each page moves forward)
        offset = result.next_offset


def _cmd_read(args: argparse.Namespace, out: IO[str]) -> int:
    with _client(args) as client:
        if args.last is not None:
            newest = client.read(args.stream, _END, count=args.last, reverse=True)
            _print_entries(reversed(newest.entries), args, out)
            return EXIT_OK
        _print_entries(_read_pages(client, args.stream, args.start, args.count, args.block_ms), args, out)
    return EXIT_OK


def _cmd_tail(args: argparse.Namespace, out: IO[str]) -> int:
    from clients.errors import NotFoundError

    with _client(args) as client:
        if args.start is not None:
            start: Start = args.start
        else:
            try:
                info = client.info(args.stream)
                start = max(info.next_offset - args.lines, info.first_offset)
            except NotFoundError:
                if not args.follow:
                    raise
                start = 0  # follow a stream that does not exist yet from its first entry
        if not args.follow:
            first = start if isinstance(start, int) else client.info(args.stream).first_offset
            _print_entries(_read_pages(client, args.stream, first, args.lines, 0), args, out)
            return EXIT_OK
        printed = 0
        with client.subscribe(args.stream, start) as subscription:
            for batch in subscription:
                if batch.gap is not None:
                    _warn_gap(batch.gap)
                entries = batch.entries
                if args.limit:
                    entries = entries[: args.limit - printed]
                printed += _print_entries(entries, args, out)
                if args.limit and printed >= args.limit:
                    break
    return EXIT_OK


# ------------------------------------------------------------------ groups


def _group_row(group: GroupInfo) -> list[Any]:
    return [
        group.name,
        group.next_offset,
        group.lag,
        group.pending,
        len(group.consumers),
        _time(group.active_ms),
    ]


def _group_config_args(args: argparse.Namespace) -> Any:
    from clients.types import GroupConfig

    return GroupConfig(
        retry_ms=args.retry_ms,
        expire_ms=args.expire_ms,
        max_deliveries=args.max_deliveries,
        max_pending=args.max_pending,
        dead_letter_stream=args.dead_letter or "",
        delay_ms=args.delay_ms or 0,
        retention_hold=args.retention_hold,
    )


def _show_group(group: GroupInfo, args: argparse.Namespace, out: IO[str]) -> None:
    if args.json:
        _json(asdict(group), out)
        return
    config = group.config
    _pairs(
        [
            ("group", f"{group.name} (stream {group.stream})"),
            ("next offset", group.next_offset),
            ("entries read", group.entries_read),
            ("lag", group.lag if group.lag is not None else "unknown"),
            ("pending", group.pending),
            ("scheduled", group.scheduled),
            ("created", _time(group.created_ms)),
            ("active", _time(group.active_ms)),
            ("retry ms", config.retry_ms),
            ("expire ms", config.expire_ms),
            ("max deliveries", config.max_deliveries),
            ("max pending", config.max_pending),
            ("dead letters to", config.dead_letter_stream or None),
            ("holds retention", "yes" if group.holds_retention else "no"),
            (
                "counters",
                " ".join(f"{k}={v}" for k, v in asdict(group.counters).items()),
            ),
        ],
        out,
    )
    if group.consumers:
        out.write("\n")
        _table(
            [[c.name, c.pending, _time(c.seen_ms), _time(c.active_ms or 0)] for c in group.consumers],
            ["CONSUMER", "PENDING", "SEEN", "ACTIVE"],
            out,
        )


def _cmd_groups(args: argparse.Namespace, out: IO[str]) -> int:
    with _client(args) as client:
        action = args.action
        if action == "create":
            group = client.create_group(
                args.stream,
                args.group,
                args.start,
                timestamp_ms=args.at_time,
                config=_group_config_args(args),
                create_stream=args.create_stream,
            )
            if args.json:
                _json(asdict(group), out)
            else:
                out.write(f"created group {group.name!r} on {group.stream!r} at offset {group.next_offset}\n")
        elif action == "list":
            groups = client.list_groups(args.stream)
            if args.json:
                _json([asdict(g) for g in groups], out)
            else:
                _table(
                    [_group_row(g) for g in groups],
                    ["GROUP", "NEXT", "LAG", "PENDING", "CONSUMERS", "ACTIVE"],
                    out,
                )
        elif action == "info":
            _show_group(client.group_info(args.stream, args.group), args, out)
        elif action == "pending":
            pending = client.pending(
                args.stream,
                args.group,
                consumer=args.consumer or "",
                min_idle_ms=args.min_idle_ms,
                count=args.count,
            )
            if args.json:
                _json(asdict(pending), out)
            else:
                low, high = pending.lowest_offset, pending.highest_offset
                span = f", offsets {low}..{high}" if low is not None else ""
                out.write(f"{pending.count} pending{span}; {pending.released} released for redelivery\n")
                for consumer, count in pending.consumers.items():
                    out.write(f"  {_printable(consumer)}: {count}\n")
                if pending.entries:
                    out.write("\n")
                    _table(
                        [
                            [p.offset, p.consumer or "(released)", p.idle_ms, p.delivery_count]
                            for p in pending.entries
                        ],
                        ["OFFSET", "CONSUMER", "IDLE_MS", "DELIVERIES"],
                        out,
                    )
        elif action == "read":
            result = client.read_group(
                args.stream, args.group, args.consumer, count=args.count, block_ms=args.block_ms
            )
            _print_entries(result.entries, args, out)
            if args.ack and result.entries:
                client.ack(args.stream, args.group, [e.offset for e in result.entries])
        elif action == "consume":
            return _consume_group(client, args, out)
        elif action == "ack":
            if not args.offsets and not args.range:
                raise UsageError("give offsets and/or --range START-END to acknowledge")
            acked = client.ack(args.stream, args.group, args.offsets, ranges=args.range)
            if args.json:
                _json(asdict(acked), out)
            else:
                out.write(f"acknowledged {acked.acknowledged}; {acked.unknown} were not pending\n")
        elif action == "claim":
            claimed = client.claim(
                args.stream, args.group, args.consumer, args.offsets, min_idle_ms=args.min_idle_ms
            )
            if args.json:
                _json(asdict(claimed), out)
            else:
                out.write(f"claimed {len(claimed.entries)} entries for {args.consumer!r}\n")
                _print_entries(claimed.entries, args, out)
                if claimed.deleted_offsets:
                    out.write(f"no longer in the stream: {claimed.deleted_offsets}\n")
        elif action == "delete":
            if args.consumer:
                released = client.delete_consumer(args.stream, args.group, args.consumer)
                message = f"deleted consumer {args.consumer!r}; {released} entries released to the group"
            else:
                client.delete_group(args.stream, args.group)
                message = f"deleted group {args.group!r} of {args.stream!r}"
            if args.json:
                _json({"deleted": True}, out)
            else:
                out.write(message + "\n")
    return EXIT_OK


def _consume_group(client: Client, args: argparse.Namespace, out: IO[str]) -> int:
    """Print the batches of a Consume session until --max-batches of them (0: until Ctrl-C).

    --ack acknowledges each batch once printed (sent with the request for the next
    one, or when the session ends). Ctrl-C ends the session in order: the batches
    already on their way are printed (and acknowledged) too, then the command exits
    130; a second Ctrl-C interrupts at once. Entries that arrived after the end were
    never printed: they are nacked, so the group hands them out again at once.
    """
    import signal

    if args.max_batches < 0:
        raise UsageError("--max-batches must not be negative")
    session = client.consume(args.stream, args.group, args.consumer, count=args.count, ahead=args.ahead)
    interrupted = False

    def on_interrupt(signum: int, frame: Any) -> None:
        nonlocal interrupted
        interrupted = True
        signal.signal(signal.SIGINT, previous)
        session.stop()

    try:
        previous = signal.signal(signal.SIGINT, on_interrupt)
    except ValueError:
        previous = None  # not the main thread: Ctrl-C is not ours to handle
    try:
        with session:
            for taken, batch in enumerate(session, start=1):
                if batch.gap is not None:
                    _warn_gap(batch.gap)
                _print_entries(batch.entries, args, out)
                if args.ack:
                    session.ack(e.offset for e in batch.entries)
                if taken == args.max_batches:
                    break
    finally:
        if previous is not None and signal.getsignal(signal.SIGINT) is on_interrupt:
            signal.signal(signal.SIGINT, previous)
        if session.unconsumed_offsets:
            client.nack(args.stream, args.group, session.unconsumed_offsets)
    return EXIT_INTERRUPTED if interrupted else EXIT_OK


# ------------------------------------------------------------------ admin


def _config_pairs(config: StreamConfig) -> list[tuple[str, Any]]:
    return [
        ("max entries", config.max_entries),
        ("max age ms", config.max_age_ms),
        ("max bytes", config.max_bytes),
        ("compaction", "on" if config.compaction else "off"),
        ("tombstone retention ms", config.tombstone_retention_ms),
        ("fsync", config.fsync or "server's"),
    ]


def _cmd_info(args: argparse.Namespace, out: IO[str]) -> int:
    with _client(args) as client:
        if args.stream is None:
            names = client.list_streams(args.prefix, limit=args.limit + 1 if args.limit else 0)
            more = bool(args.limit) and len(names) > args.limit
            infos = [client.info(name) for name in names[: args.limit or None]]
            if args.json:
                _json([asdict(i) for i in infos], out)
            else:
                rows = [
                    [
                        i.name,
                        i.entries,
                        i.first_offset,
                        i.next_offset,
                        _size(i.used_bytes),
                        _size(i.bytes_on_disk),
                        _time(i.last_timestamp_ms),
                    ]
                    for i in infos
                ]
                _table(rows, ["STREAM", "ENTRIES", "FIRST", "NEXT", "USED", "DISK", "LAST APPEND"], out)
                if more:
                    out.write(f"(the first {args.limit} streams: --prefix or --limit for others)\n")
            return EXIT_OK
        info = client.info(args.stream)
        groups = client.list_groups(args.stream) if info.groups else []
    if args.json:
        _json({**asdict(info), "group_details": [asdict(g) for g in groups]}, out)
        return EXIT_OK
    pairs: list[tuple[str, Any]] = [
        ("stream", info.name),
        ("offsets", f"{info.first_offset}..{info.next_offset - 1}" if info.entries else "none"),
        ("next offset", info.next_offset),
        ("entries", f"{info.entries} retained, {info.entries_added} ever added"),
        (
            "on disk",
            f"{_size(info.bytes_on_disk)} in {_plural(info.segments, 'segment')} "
            f"({_plural(info.nodes, 'node')}); the entries use {_size(info.used_bytes)} of it",
        ),
        (
            "compression",
            f"{info.compression_ratio:.2f}x in {_plural(info.packed_segments, 'full segment')}"
            if info.packed_segments
            else "none yet: a segment's nodes are compressed once it is full",
        ),
        ("last append", _time(info.last_timestamp_ms)),
        ("fsync in force", info.effective_fsync),
        *_config_pairs(info.config),
    ]
    if info.damaged:
        pairs.append(("damaged", ", ".join(f"{g.start_offset}..{g.end_offset - 1}" for g in info.damaged)))
    if info.retention_holder is not None:
        holder = info.retention_holder
        pairs.append(("retention held by", f"group {holder.group!r} at offset {holder.offset}"))
    _pairs(pairs, out)
    if groups:
        out.write("\n")
        _table(
            [_group_row(g) for g in groups], ["GROUP", "NEXT", "LAG", "PENDING", "CONSUMERS", "ACTIVE"], out
        )
    return EXIT_OK


def _cmd_cluster(args: argparse.Namespace, out: IO[str]) -> int:
    with _client(args) as client:
        cluster = client.describe_cluster(args.prefix)
    if args.json:
        _json(asdict(cluster), out)
        return EXIT_OK
    if not cluster.cluster_name:
        out.write(f"a single server (no cluster), streamlog {cluster.nodes[0].version}\n")
        return EXIT_OK
    out.write(
        f"cluster {_printable(cluster.cluster_name)}, as node {_printable(cluster.node_id)} sees it\n\n"
    )
    _table(
        [
            [
                n.id,
                n.address,
                "alive" if n.alive else "down",
                "yes" if n.controller else "",
                n.version,
                _time(n.started_ms),
            ]
            for n in cluster.nodes
        ],
        ["NODE", "ADDRESS", "STATE", "CONTROLLER", "VERSION", "STARTED"],
        out,
    )
    if cluster.streams:
        out.write("\n")
        _table(
            [
                [
                    s.name,
                    s.leader or "(none)",
                    s.leader_epoch,
                    ",".join(s.replicas),
                    ",".join(s.in_sync_replicas),
                    s.replication_factor,
                    s.acks,
                ]
                for s in cluster.streams
            ],
            ["STREAM", "LEADER", "EPOCH", "REPLICAS", "IN SYNC", "FACTOR", "ACKS"],
            out,
        )
    return EXIT_OK


def _cmd_rebalance(args: argparse.Namespace, out: IO[str]) -> int:
    from clients import _rebalance

    with _client(args) as client:
        cluster, sizes = _layout(client, args.prefix)
        live = [n.id for n in cluster.nodes if n.alive]
        moves = _rebalance.rebalance(cluster.streams, live, sizes)
        return _carry_out(client, moves, [], args, out)


def _cmd_drain(args: argparse.Namespace, out: IO[str]) -> int:
    from clients import _rebalance

    with _client(args) as client:
        cluster, sizes = _layout(client, "")
        if args.node not in {n.id for n in cluster.nodes}:
            raise UsageError(f"no node {args.node!r} in the cluster")
        live = [n.id for n in cluster.nodes if n.alive]
        moves, stuck = _rebalance.drain(cluster.streams, live, sizes, args.node)
        return _carry_out(client, moves, stuck, args, out)


def _cmd_cancel_moves(args: argparse.Namespace, out: IO[str]) -> int:
    with _client(args) as client:
        cluster = client.describe_cluster()
        if not cluster.cluster_name:
            raise UsageError("the server is not in a cluster: there are no moves to cancel")
        targets = {s.name: s.target_replicas for s in cluster.streams if s.target_replicas}
        results: dict[str, dict[str, Any]] = {}
        for name in args.streams or sorted(targets):
            placement = client.cancel_move(name)
            # A move that finished meanwhile is not undone: the stream is then on its target.
            cancelled = name in targets and placement.replicas != targets[name]
            results[name] = {
                "cancelled": cancelled,
                "replicas": placement.replicas,
                "leader": placement.leader,
            }
    if args.json:
        _json(results, out)
        return EXIT_OK
    for name, result in results.items():
        state = "move cancelled, back on" if result["cancelled"] else "no move in progress, on"
        out.write(f"{_printable(name)}: {state} {','.join(result['replicas'])} (leader {result['leader']})\n")
    out.write(f"{sum(r['cancelled'] for r in results.values())} move(s) cancelled\n")
    return EXIT_OK


def _layout(client: Client, prefix: str) -> tuple[Any, dict[str, int]]:
    """The cluster's layout and each led stream's bytes (asked of its leader)."""
    from clients.errors import NotFoundError

    cluster = client.describe_cluster(prefix)
    if not cluster.cluster_name:
        raise UsageError("the server is not in a cluster: there are no replicas to move")
    sizes = {}
    for stream in cluster.streams:
        if stream.leader and not stream.target_replicas:
            with contextlib.suppress(NotFoundError):  # deleted meanwhile
                sizes[stream.name] = client.info(stream.name).bytes_on_disk
    return cluster, sizes


def _carry_out(
    client: Client, moves: Sequence[Any], stuck: Sequence[str], args: argparse.Namespace, out: IO[str]
) -> int:
    """Print the plan; unless --dry-run, write each move (the cluster carries them out, a few
    streams at a time) and report progress until all are done."""
    if args.json:
        _json({"moves": [asdict(m) for m in moves], "cannot_move": list(stuck)}, out)
    else:
        for move in moves:
            out.write(
                f"{_printable(move.stream)}: {','.join(move.replicas)} (leader {move.leader}) -> "
                f"{','.join(move.target)} (leader {move.target[0]})\n"
            )
        for name in stuck:
            out.write(
                f"{_printable(name)}: cannot move now (no leader, already moving, or no node to take it)\n"
            )
        out.write(f"{len(moves)} stream(s) to move\n")
    if args.dry_run or not moves:
        return EXIT_OK if not stuck else EXIT_FAILURE
    started = time.monotonic()
    for move in moves:
        client.reassign_replicas(move.stream, move.target)
    if args.no_wait:
        return EXIT_OK
    waiting = {move.stream for move in moves}
    while waiting:
        if args.max_wait is not None and time.monotonic() - started > args.max_wait:
            out.write(f"still moving after {args.max_wait:g} s: {', '.join(sorted(waiting))}\n")
            return EXIT_UNAVAILABLE
        time.sleep(_MOVE_POLL_S)
        placement = {s.name: s for s in client.describe_cluster().streams}
        for name in sorted(waiting):
            record = placement.get(name)
            if record is None or not record.target_replicas:
                waiting.discard(name)
                if not args.json:
                    where = (
                        "deleted"
                        if record is None
                        else f"{','.join(record.replicas)} (leader {record.leader})"
                    )
                    out.write(f"[{len(moves) - len(waiting)}/{len(moves)}] {_printable(name)}: {where}\n")
    if not args.json:
        out.write(f"done in {time.monotonic() - started:.1f} s\n")
    return EXIT_OK if not stuck else EXIT_FAILURE


def _cmd_trim(args: argparse.Namespace, out: IO[str]) -> int:
    with _client(args) as client:
        first = client.trim(
            args.stream, to_offset=args.to, keep_last=args.keep_last, evict_up_to=args.evict_up_to
        )
    if args.json:
        _json({"stream": args.stream, "first_offset": first}, out)
    else:
        out.write(f"{args.stream!r} now starts at offset {first}\n")
    return EXIT_OK


_UNCHANGED = object()


def _cmd_config(args: argparse.Namespace, out: IO[str]) -> int:
    from dataclasses import replace

    changes: dict[str, Any] = {}
    for name in ("max_entries", "max_age_ms", "max_bytes", "tombstone_retention_ms"):
        value = getattr(args, name)
        if value is not _UNCHANGED:
            changes[name] = value
    if args.compaction is not None:
        changes["compaction"] = args.compaction == "on"
    if args.fsync is not None:
        changes["fsync"] = None if args.fsync == "server" else args.fsync
    with _client(args) as client:
        config = client.get_config(args.stream)
        if changes:
            # SetStreamConfig replaces the whole configuration: start from the current one.
            config = client.set_config(args.stream, replace(config, **changes))
    if args.json:
        _json(asdict(config), out)
    else:
        _pairs(_config_pairs(config), out)
    return EXIT_OK


def _cmd_delete(args: argparse.Namespace, out: IO[str]) -> int:
    if not args.yes:
        raise UsageError(f"deleting {args.stream!r} removes all its entries: add --yes to confirm")
    with _client(args) as client:
        client.delete_stream(args.stream)
    if not args.json:
        out.write(f"deleted {args.stream!r}\n")
    else:
        _json({"deleted": args.stream}, out)
    return EXIT_OK


def _progress_enabled(args: argparse.Namespace) -> bool:
    return args.progress if args.progress is not None else sys.stderr.isatty()


def _cmd_export(args: argparse.Namespace, out: IO[str]) -> int:
    with _client(args) as client:
        info = client.info(args.stream)
        start = max(args.start, info.first_offset) if args.start is not None else info.first_offset
        end = min(args.end, info.next_offset) if args.end is not None else info.next_offset
        total = client.count(args.stream, start, end) if end > start else 0
        progress = Progress(f"export {args.stream}", _progress_enabled(args), total)
        target = open(args.output, "w", encoding="utf-8") if args.output else out  # noqa: SIM115
        try:
            offset = start
            written = 0
            while offset < end:
                result = client.read(args.stream, offset, count=_PAGE)
                if result.gap is not None:
                    _warn_gap(result.gap)
                for entry in result.entries:
                    if entry.offset >= end:
                        break
                    target.write(json.dumps(entry_to_json(entry)) + "\n")
                    written += 1
                progress.update(written)
                if result.next_offset <= offset:
                    break  # nothing further (the stream ended early, e.g. trimmed meanwhile)
                offset = result.next_offset
        finally:
            if target is not out:
                target.close()
        progress.finish()
    if args.output:
        message = {"stream": args.stream, "exported": written, "file": str(args.output)}
        _json(message, out) if args.json else out.write(f"exported {written} entries to {args.output}\n")
    return EXIT_OK


def _cmd_import(args: argparse.Namespace, out: IO[str]) -> int:
    from clients.producer import Producer

    source = open(args.input, encoding="utf-8") if args.input else sys.stdin  # noqa: SIM115
    total_bytes = os.fstat(source.fileno()).st_size if args.input else None
    progress = Progress(
        f"import {args.stream or 'streams'}", _progress_enabled(args), total_bytes, unit="bytes"
    )
    futures = []
    streams: set[str] = set()
    consumed = 0
    try:
        # Lines for several streams at once go out as one AppendMany per batch (the Producer's).
        with _client(args) as client, Producer(client, args.stream, max_batch_entries=args.batch) as producer:
            for number, line in enumerate(source, start=1):
                consumed += len(line.encode())
                if not line.strip():
                    continue
                stream, record = record_from_json(line, f"line {number}")
                stream = stream or args.stream
                if not stream:
                    raise UsageError(f'line {number}: no "stream" field, and no stream given to import into')
                streams.add(stream)
                futures.append(producer.send(record, stream=stream))
                progress.update(consumed)
            offsets = [f.result() for f in futures]
    finally:
        if source is not sys.stdin:
            source.close()
    progress.finish()
    if len(streams) > 1:
        _json({"streams": len(streams), "imported": len(offsets)}, out) if args.json else out.write(
            f"imported {len(offsets)} entries into {len(streams)} streams\n"
        )
        return EXIT_OK
    stream = next(iter(streams), args.stream)
    summary = {"stream": stream, "imported": len(offsets)}
    if offsets:
        summary.update(first_offset=offsets[0], last_offset=offsets[-1])
    if args.json:
        _json(summary, out)
    else:
        span = f" at offsets {offsets[0]}..{offsets[-1]}" if offsets else ""
        out.write(f"imported {len(offsets)} entries into {stream!r}{span}\n")
    return EXIT_OK


def _cmd_inspect(args: argparse.Namespace, out: IO[str]) -> int:
    # The one place a client reads the storage engine's files: offline, read-only.
    from storage.inspect import main as inspect_main

    argv = [*(["verify"] if args.verify else []), *map(str, args.paths)]
    if args.verify and len(args.paths) != 1:
        raise UsageError("inspect --verify takes one data directory")
    if args.json:
        argv.append("--json")
    if args.segment_bytes is not None:
        argv += ["--segment-bytes", args.segment_bytes]
    return inspect_main(argv)


def _cmd_bench(args: argparse.Namespace, out: IO[str]) -> int:
    stream = args.stream or f"bench-{uuid.uuid4().hex[:8]}"
    payload = os.urandom(args.size // 2).hex().encode()[: args.size].ljust(args.size, b"0")
    batch = [payload] * args.batch
    batches, rest = divmod(args.entries, args.batch)
    with _client(args) as client:
        started = time.perf_counter()
        for _ in range(batches):
            client.append(stream, batch)
        if rest:
            client.append(stream, batch[:rest])
        append_s = time.perf_counter() - started
        started = time.perf_counter()
        info = client.info(stream)
        offset, read = info.next_offset - args.entries, 0
        while read < args.entries:
            result = client.read(stream, offset, count=min(args.batch, args.entries - read))
            if not result.entries:
                break
            read += len(result.entries)
            offset = result.next_offset
        read_s = time.perf_counter() - started
        if not args.keep:
            client.delete_stream(stream)
    mib = args.entries * args.size / (1 << 20)
    figures = {
        "stream": stream,
        "entries": args.entries,
        "payload_bytes": args.size,
        "batch": args.batch,
        "append_entries_per_s": round(args.entries / append_s),
        "append_mib_per_s": round(mib / append_s, 1),
        "read_entries_per_s": round(read / read_s),
        "read_mib_per_s": round(read * args.size / (1 << 20) / read_s, 1),
    }
    if args.json:
        _json(figures, out)
    else:
        _table(
            [
                [
                    "append",
                    f"{figures['append_entries_per_s']:,}",
                    figures["append_mib_per_s"],
                    f"{append_s:.2f}",
                ],
                ["read", f"{figures['read_entries_per_s']:,}", figures["read_mib_per_s"], f"{read_s:.2f}"],
            ],
            ["OPERATION", "ENTRIES/S", "MIB/S", "SECONDS"],
            out,
        )
        out.write(
            f"{args.entries:,} entries of {args.size} bytes in batches of {args.batch}, stream {stream!r}\n"
        )
    return EXIT_OK


# ------------------------------------------------------------------ parser


def _connection_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("connection")
    group.add_argument(
        "--address",
        metavar="HOST:PORT[,HOST:PORT...]",
        help="server address, or a cluster's nodes comma-separated "
        f"(default: $STREAMLOG_ADDRESS or {DEFAULT_ADDRESS})",
    )
    group.add_argument(
        "--read-from",
        choices=("leader", "replica"),
        default="leader",
        help="in a cluster, read (read, tail, export) from the stream's leader, or from one of its "
        "in-sync replicas, which serve committed entries only (default: leader)",
    )
    group.add_argument("--token", help="bearer token (default: $STREAMLOG_TOKEN)")
    group.add_argument("--tls", action="store_true", help="use TLS with the system's root certificates")
    group.add_argument("--tls-ca", type=Path, metavar="PEM", help="use TLS, trusting these root certificates")
    group.add_argument("--tls-cert", type=Path, metavar="PEM", help="client certificate (with --tls-key)")
    group.add_argument("--tls-key", type=Path, metavar="PEM", help="client certificate's private key")
    group.add_argument(
        "--tls-server-name", metavar="NAME", help="name to check the server's certificate against"
    )
    group.add_argument(
        "--timeout", type=float, default=30.0, metavar="S", help="per-call timeout (default: 30)"
    )
    common.add_argument("--json", action="store_true", help="machine-readable output")
    return common


def _entry_display(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--width", type=int, default=60, help="cut payloads to this many characters (default: 60)"
    )


def _add_group_config(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("group configuration")
    group.add_argument("--retry-ms", type=int, help="redeliver entries not acknowledged within this time")
    group.add_argument("--expire-ms", type=int, help="drop (or dead-letter) entries pending this long")
    group.add_argument("--max-deliveries", type=int, help="drop (or dead-letter) after this many deliveries")
    group.add_argument("--max-pending", type=int, help="bound the pending list")
    group.add_argument("--dead-letter", metavar="STREAM", help="where dropped entries go")
    group.add_argument("--delay-ms", type=int, help="deliver entries this long after their append")
    group.add_argument("--retention-hold", action="store_true", help="never evict what the group still needs")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamlog",
        description="streamlog: a persistent, append-only stream service. Run `streamlog COMMAND --help`.",
        epilog="Exit codes: 0 ok, 1 failed on the server, 2 bad usage, 3 not found, 4 conflict, "
        "5 unavailable or timed out, 6 not allowed, 130 interrupted. Shell completion (bash, zsh): "
        'eval "$(register-python-argcomplete streamlog)".',
    )
    parser.add_argument("--version", action="version", version=f"streamlog {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = _connection_options()

    def command(
        name: str, help_text: str, handler: Callable[..., int], **kwargs: Any
    ) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text, parents=[common], **kwargs)
        sub.set_defaults(handler=handler)
        return sub

    # `serve` is handled before parsing (its flags belong to the server's parser); listed for --help.
    commands.add_parser("serve", help="run a server (see `streamlog serve --help`)", add_help=False)

    p = command("append", "append entries: payload arguments (one atomic batch), or stdin lines", _cmd_append)
    p.add_argument("stream", help="the stream to append to (created by its first append)")
    p.add_argument("payloads", nargs="*", metavar="PAYLOAD", help="payloads (UTF-8); none: read stdin")
    p.add_argument("--tag", default="", help="tag (key) for every entry")
    p.add_argument("--header", type=_header, action="append", default=[], metavar="NAME=VALUE")
    p.add_argument(
        "--jsonl", action="store_true", help="stdin is JSON Lines: {tag, payload|payload_base64, headers}"
    )
    p.add_argument(
        "--expect-offset", type=_offset, metavar="N", help="append only if the stream's next offset is N"
    )
    p.add_argument("--batch", type=int, default=500, help="entries per append from stdin (default: 500)")

    p = command("read", "read entries from an offset", _cmd_read)
    p.add_argument("stream", help="the stream to read")
    p.add_argument(
        "--from", dest="start", type=_offset, default=0, metavar="OFFSET", help="first offset (default: 0)"
    )
    p.add_argument(
        "--count", type=int, default=100, help="at most this many entries; 0: to the end (default: 100)"
    )
    p.add_argument("--last", type=int, metavar="N", help="the newest N entries instead")
    p.add_argument(
        "--block-ms", type=int, default=0, help="wait this long for entries when there are none yet"
    )
    _entry_display(p)

    p = command("tail", "print the newest entries; with -f, keep following the stream", _cmd_tail)
    p.add_argument("stream", help="the stream to print (and follow)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing entries as they are appended")
    p.add_argument(
        "-n", "--lines", type=int, default=10, help="start this many entries before the end (default: 10)"
    )
    p.add_argument(
        "--from", dest="start", type=_start, metavar="oldest|latest|OFFSET", help="start here instead"
    )
    p.add_argument("--limit", type=int, default=0, help="with -f: stop after this many entries")
    _entry_display(p)

    p = command(
        "groups",
        "consumer groups: create, list, info, pending, read, consume, ack, claim, delete",
        _cmd_groups,
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    a = actions.add_parser("create", help="create a group", parents=[common])
    a.add_argument("stream", help="the stream the group reads")
    a.add_argument("group", help="the new group's name")
    a.add_argument(
        "--start", type=_start, default="oldest", metavar="oldest|latest|OFFSET", help="(default: oldest)"
    )
    a.add_argument(
        "--at-time", type=int, metavar="MS", help="start at the first entry appended at or after this time"
    )
    a.add_argument("--create-stream", action="store_true", help="create the stream if it does not exist")
    _add_group_config(a)
    a = actions.add_parser(
        "list", help="the groups of a stream, with lag and pending counts", parents=[common]
    )
    a.add_argument("stream", help="the stream whose groups to list")
    a = actions.add_parser("info", help="one group, with its consumers", parents=[common])
    a.add_argument("stream", help="the group's stream")
    a.add_argument("group", help="the consumer group")
    a = actions.add_parser("pending", help="the group's pending entries", parents=[common])
    a.add_argument("stream", help="the group's stream")
    a.add_argument("group", help="the consumer group")
    a.add_argument("--consumer", help="only this consumer's entries")
    a.add_argument("--min-idle-ms", type=int, default=0, help="only entries idle this long")
    a.add_argument("--count", type=int, default=20, help="detail rows (default: 20)")
    a = actions.add_parser("read", help="read as a consumer of the group", parents=[common])
    a.add_argument("stream", help="the group's stream")
    a.add_argument("group", help="the consumer group")
    a.add_argument("consumer", help="the consumer reading (created by its first read)")
    a.add_argument("--count", type=int, default=10, help="(default: 10)")
    a.add_argument("--block-ms", type=int, default=0, help="wait this long for entries")
    a.add_argument("--ack", action="store_true", help="acknowledge what was printed")
    _entry_display(a)
    a = actions.add_parser(
        "consume",
        help="consume batches as a consumer of the group, on one session (until Ctrl-C or --max-batches)",
        parents=[common],
    )
    a.add_argument("stream", help="the group's stream")
    a.add_argument("group", help="the consumer group")
    a.add_argument("consumer", help="the consumer reading (created by its first read)")
    a.add_argument("--count", type=int, default=10, help="entries per batch (default: 10)")
    a.add_argument(
        "--max-batches", type=int, default=0, metavar="N", help="stop after N batches (default: 0, no limit)"
    )
    a.add_argument(
        "--ahead", type=int, default=1, metavar="N", help="batches asked for at a time (default: 1)"
    )
    a.add_argument("--ack", action="store_true", help="acknowledge each batch once printed")
    _entry_display(a)
    a = actions.add_parser("ack", help="acknowledge entries", parents=[common])
    a.add_argument("stream", help="the group's stream")
    a.add_argument("group", help="the consumer group")
    a.add_argument("offsets", nargs="*", type=_offset, metavar="OFFSET", help="offsets to acknowledge")
    a.add_argument(
        "--range", type=_range, action="append", default=[], metavar="START-END", help="half-open range"
    )
    a = actions.add_parser("claim", help="take over pending entries for a consumer", parents=[common])
    a.add_argument("stream", help="the group's stream")
    a.add_argument("group", help="the consumer group")
    a.add_argument("consumer", help="the consumer taking the entries over")
    a.add_argument("offsets", nargs="+", type=_offset, metavar="OFFSET", help="pending offsets to take over")
    a.add_argument("--min-idle-ms", type=int, default=0, help="only entries idle this long")
    _entry_display(a)
    a = actions.add_parser("delete", help="delete a group, or one consumer with --consumer", parents=[common])
    a.add_argument("stream", help="the group's stream")
    a.add_argument("group", help="the consumer group")
    a.add_argument("--consumer", help="delete only this consumer (its pending entries return to the group)")

    p = command("info", "describe a stream (its config and groups), or list streams", _cmd_info)
    p.add_argument("stream", nargs="?", help="no stream: list streams (--limit)")
    p.add_argument("--prefix", default="", help="when listing: only streams starting with this")
    p.add_argument(
        "--limit", type=int, default=100, help="when listing: at most this many (default: 100; 0: all)"
    )

    p = command("trim", "remove old entries from the start of a stream", _cmd_trim)
    p.add_argument("stream", help="the stream to trim")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--to", type=_offset, metavar="OFFSET", help="make OFFSET exactly the oldest entry")
    mode.add_argument(
        "--keep-last", type=_offset, metavar="N", help="evict whole nodes while N entries remain"
    )
    mode.add_argument("--evict-up-to", type=_offset, metavar="OFFSET", help="evict whole nodes up to OFFSET")

    p = command("config", "show a stream's configuration, or change parts of it", _cmd_config)
    p.add_argument("stream", help="the stream to show or change")
    for flag in ("--max-entries", "--max-age-ms", "--max-bytes", "--tombstone-retention-ms"):
        p.add_argument(flag, type=_limit, default=_UNCHANGED, metavar="N|none")
    p.add_argument("--compaction", choices=("on", "off"))
    p.add_argument("--fsync", choices=("always", "everysec", "no", "server"))

    p = command("delete", "delete a stream and all its entries", _cmd_delete)
    p.add_argument("stream", help="the stream to delete")
    p.add_argument("--yes", action="store_true", help="really delete")

    p = command("export", "write a stream's entries as JSON Lines", _cmd_export)
    p.add_argument("stream", help="the stream to export")
    p.add_argument("-o", "--output", type=Path, metavar="FILE", help="(default: stdout)")
    p.add_argument("--from", dest="start", type=_offset, metavar="OFFSET", help="(default: the oldest entry)")
    p.add_argument("--to", dest="end", type=_offset, metavar="OFFSET", help="stop before this offset")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, help="(default: on a terminal)")

    p = command("import", "append JSON Lines (as export writes them) to a stream, or to many", _cmd_import)
    p.add_argument(
        "stream",
        nargs="?",
        help='the stream to append to (created by its first append); a line with a "stream" field goes '
        "to that stream instead (needed on every line without this argument)",
    )
    p.add_argument("-i", "--input", type=Path, metavar="FILE", help="(default: stdin)")
    p.add_argument("--batch", type=int, default=500, help="entries per append (default: 500)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, help="(default: on a terminal)")

    p = command(
        "cluster", "the cluster's nodes and where each stream lives (its leader, replicas)", _cmd_cluster
    )
    p.add_argument("--prefix", default="", help="only streams whose name starts with this")
    actions = p.add_subparsers(dest="action", required=False, metavar="ACTION")
    moving = argparse.ArgumentParser(add_help=False)
    moving.add_argument("--dry-run", action="store_true", help="print the plan and move nothing")
    moving.add_argument(
        "--no-wait", action="store_true", help="write the moves and exit (the cluster carries them out)"
    )
    moving.add_argument(
        "--max-wait", type=float, metavar="SECONDS", help="give up waiting after this (exit 5)"
    )
    a = actions.add_parser(
        "rebalance",
        help="move replicas to even out replicas, bytes and leaders per live node",
        parents=[common, moving],
    )
    a.add_argument(
        "--prefix",
        default="",
        help="even out only the streams whose name starts with this (among themselves)",
    )
    a.set_defaults(handler=_cmd_rebalance)
    a = actions.add_parser("drain", help="move every replica off a node", parents=[common, moving])
    a.add_argument("node", help="the node's id")
    a.set_defaults(handler=_cmd_drain)
    a = actions.add_parser(
        "cancel-moves",
        help="undo moves in progress (kafka-reassign-partitions --cancel): the replicas they added "
        "are dropped, the replicas and leader each stream had kept; a finished move is not undone",
        parents=[common],
    )
    a.add_argument("streams", nargs="*", metavar="STREAM", help="(default: every stream moving now)")
    a.set_defaults(handler=_cmd_cancel_moves)

    p = command("inspect", "list the segments and nodes of a data directory, offline", _cmd_inspect)
    p.add_argument(
        "paths", nargs="+", type=Path, metavar="PATH", help="data directory, stream directory or .seg"
    )
    p.add_argument("--verify", action="store_true", help="check a data directory; exit 1 if damaged")
    p.add_argument(
        "--segment-bytes",
        metavar="SIZE",
        help="inspect unpack DATA: the server's segment_bytes, which the moved streams' segments grow to",
    )

    p = command("bench", "measure append and read throughput against a server", _cmd_bench)
    p.add_argument("stream", nargs="?", help="(default: a new bench-* stream, deleted afterwards)")
    p.add_argument("--entries", type=int, default=100_000, help="(default: 100000)")
    p.add_argument("--size", type=int, default=100, help="payload bytes (default: 100)")
    p.add_argument("--batch", type=int, default=1000, help="entries per append and per read (default: 1000)")
    p.add_argument("--keep", action="store_true", help="keep the stream")
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("streamlog")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def _complete(parser: argparse.ArgumentParser) -> None:
    """Answer the shell's completion request, if this run is one (argcomplete exits after it)."""
    if "_ARGCOMPLETE" in os.environ:
        import argcomplete

        argcomplete.autocomplete(parser)


def _exit_code(error: Exception) -> int:
    import grpc

    from clients.errors import OffsetMismatchError, StreamlogError, TransientError

    if isinstance(error, ValueError):
        return EXIT_USAGE  # arguments the client library refused before calling
    if not isinstance(error, StreamlogError):
        return EXIT_FAILURE
    if isinstance(error, TransientError):
        return EXIT_UNAVAILABLE
    if isinstance(error, OffsetMismatchError):
        return EXIT_CONFLICT
    if error.code is None:
        return EXIT_FAILURE  # refused by the client library
    return {
        grpc.StatusCode.INVALID_ARGUMENT: EXIT_USAGE,
        grpc.StatusCode.NOT_FOUND: EXIT_NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION: EXIT_CONFLICT,
        grpc.StatusCode.ALREADY_EXISTS: EXIT_CONFLICT,
        grpc.StatusCode.OUT_OF_RANGE: EXIT_CONFLICT,
        grpc.StatusCode.UNAUTHENTICATED: EXIT_DENIED,
        grpc.StatusCode.PERMISSION_DENIED: EXIT_DENIED,
    }.get(error.code, EXIT_FAILURE)


def _serve(argv: Sequence[str]) -> int:
    """Become the server process: same pid, so signals reach the server directly."""
    command = [sys.executable, "-m", "service.cli", "serve", *argv]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, command)
    return EXIT_FAILURE  # not reached: execv returns only by raising


def main(argv: Sequence[str] | None = None, out: IO[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        return _serve(argv[1:])
    out = out or sys.stdout
    parser = build_parser()
    _complete(parser)
    args = parser.parse_args(argv)
    try:
        return args.handler(args, out)
    except UsageError as exc:
        print(f"streamlog {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`streamlog read s | head`): stop quietly, as cat does.
        # Point stdout at /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except Exception as exc:
        from clients.errors import StreamlogError

        if not isinstance(exc, StreamlogError | OSError | ValueError):
            raise
        print(f"streamlog {args.command}: {exc}", file=sys.stderr)
        return _exit_code(exc)


if __name__ == "__main__":
    sys.exit(main())
