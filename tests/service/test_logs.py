"""Structured logs: one JSON object per line with the call's stream, group and peer; text for people."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from service import logs


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


def test_json_lines_carry_the_event_fields(restore_logging: None) -> None:
    out = io.StringIO()
    logs.configure("info", "json", out)
    log = logging.getLogger("service.test")
    log.info(
        "limit reached: %s",
        "max_streams",
        extra={"stream": "rides/ü", "group": "g", "peer": "ipv4:127.0.0.1:5"},
    )
    log.debug("not shown at info")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed", extra={"message_count": 2, "raw": b"\xff"})
    lines = out.getvalue().splitlines()
    assert len(lines) == 2  # one line per event, the traceback inside its line
    first, second = map(json.loads, lines)
    assert first["message"] == "limit reached: max_streams"
    assert (first["level"], first["logger"]) == ("info", "service.test")
    assert (first["stream"], first["group"], first["peer"]) == ("rides/ü", "g", "ipv4:127.0.0.1:5")
    assert first["time"].endswith("+00:00")
    assert second["level"] == "error" and "ValueError: boom" in second["exception"]
    assert second["message_count"] == 2 and second["raw"] == "\\xff"


def test_an_extra_cannot_overwrite_the_fixed_keys(restore_logging: None) -> None:
    out = io.StringIO()
    logs.configure("info", "json", out)
    logging.getLogger("x").info("m", extra={"time": "forged", "level": "forged"})
    line = json.loads(out.getvalue())
    assert line["level"] == "info" and line["extra_level"] == "forged" and line["extra_time"] == "forged"


def test_text_lines_append_the_fields(restore_logging: None) -> None:
    out = io.StringIO()
    logs.configure("warning", "text", out)
    logging.getLogger("service.test").warning(
        "subscriber cut off",
        extra={"stream": "a b", "limit": "subscriber_send_timeout_ms", "settings": {"x": 1}},
    )
    logging.getLogger("service.test").info("hidden")
    (line,) = out.getvalue().splitlines()
    assert " WARNING service.test: subscriber cut off " in line
    assert 'stream="a b"' in line and "limit=subscriber_send_timeout_ms" in line
    assert line.endswith('settings="{\\"x\\": 1}"')  # quoted: it holds spaces and quotes
