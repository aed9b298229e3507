"""Logging: one line per event, as text for people or as JSON for log pipelines.

Events about a call carry who and what it concerned as `extra` fields (`stream`,
`group`, `consumer`, `peer`, `principal`, `method`, `code`, `limit`, ...). The JSON
format writes each of them as a key of the line's object, so a log pipeline can
filter on them; the text format appends them as `key=value`. Any `extra` field a
call site adds is written the same way: nothing is lost to a fixed schema.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import Any, TextIO

# Attributes every LogRecord has; anything else on a record came from `extra`.
_STANDARD_ATTRS = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {key: value for key, value in record.__dict__.items() if key not in _STANDARD_ATTRS}


def _plain(value: Any) -> Any:
    """A value JSON can hold: bytes and other objects become text."""
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(v) for v in value]
    return str(value)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601, ms), level, logger, message, extras."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in _extras(record).items():
            # An extra may not overwrite the fixed keys; keep it under its own name with a prefix.
            line[key if key not in line else f"extra_{key}"] = _plain(value)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        # ensure_ascii=False: stream names are UTF-8 and stay readable; one line per event.
        return json.dumps(line, ensure_ascii=False, separators=(",", ":"))


class TextFormatter(logging.Formatter):
    """`time level logger: message key=value ...`."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        extras = _extras(record)
        if extras:
            pairs = " ".join(f"{key}={_text_value(value)}" for key, value in extras.items())
            # The exception's traceback (if any) follows the first line; keep the pairs on it.
            first, sep, rest = text.partition("\n")
            text = f"{first} {pairs}{sep}{rest}"
        return text


def _text_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(_plain(value), ensure_ascii=False)
    # Quote values that would break `key=value` splitting.
    return json.dumps(text, ensure_ascii=False) if not text or any(c in text for c in ' ="\n') else text


def configure(level: str, fmt: str, stream: TextIO | None = None) -> None:
    """Send every log record at `level` or above to `stream` (stderr) in format `fmt` (text|json)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # grpc logs through the `grpc` logger too; its debug chatter is not ours to show at debug.
    logging.getLogger("grpc").setLevel(max(root.level, logging.INFO))
