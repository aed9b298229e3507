"""The `streamlog` command: main() against a real server, and the console script as a process."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.common import free_port
from clients import Client, Record
from clients.cli import (
    EXIT_CONFLICT,
    EXIT_INTERRUPTED,
    EXIT_NOT_FOUND,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    main,
)
from tests.service.helpers import ServerThread
from tests.service.test_metrics import scrape, value

STREAMLOG = shutil.which("streamlog", path=str(Path(sys.executable).parent))


def run(server: ServerThread | str, *argv: str, stdin: str | None = None) -> tuple[int, str]:
    """main(argv) with --address; returns (exit code, stdout)."""
    target = server if isinstance(server, str) else server.target
    out = io.StringIO()
    saved = sys.stdin
    if stdin is not None:
        sys.stdin = io.StringIO(stdin)
    try:
        code = main([*argv, "--address", target], out=out)
    finally:
        sys.stdin = saved
    return code, out.getvalue()


def lines_json(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def test_append_arguments_then_read_them(server: ServerThread) -> None:
    code, out = run(server, "append", "orders", "one", "two", "--tag", "k", "--header", "src=cli")
    assert code == 0 and "offsets 0..1" in out
    code, out = run(server, "append", "orders", "three", "--json")
    assert json.loads(out) == {"stream": "orders", "first_offset": 2, "last_offset": 2, "count": 1}
    code, out = run(server, "read", "orders", "--json")
    assert code == 0
    records = lines_json(out)
    assert [(r["offset"], r["payload"], r.get("tag"), r.get("headers")) for r in records] == [
        (0, "one", "k", {"src": "cli"}),
        (1, "two", "k", {"src": "cli"}),
        (2, "three", None, None),
    ]
    code, out = run(server, "read", "orders", "--from", "1", "--count", "1")
    assert code == 0
    (line,) = out.splitlines()
    assert line.split()[0] == "1" and "[k]" in line and "two" in line and "src=cli" in line
    code, out = run(server, "read", "orders", "--last", "2", "--json")
    assert [r["offset"] for r in lines_json(out)] == [1, 2]


def test_append_from_stdin_lines_and_json_lines(server: ServerThread) -> None:
    code, out = run(server, "append", "s", "--json", stdin="alpha\nbeta\n")
    assert code == 0 and json.loads(out)["count"] == 2
    jsonl = "\n".join(
        [
            json.dumps({"payload": "text", "tag": "t1", "headers": {"h": "v"}}),
            "",
            json.dumps({"payload_base64": "AP8=", "headers_base64": {"bin": "AQI="}}),
        ]
    )
    code, _ = run(server, "append", "s", "--jsonl", stdin=jsonl)
    assert code == 0
    with Client(server.target) as client:
        entries = client.read("s", 0).entries
    assert [(e.payload, e.tag, e.headers) for e in entries] == [
        (b"alpha", "", {}),
        (b"beta", "", {}),
        (b"text", "t1", {"h": b"v"}),
        (b"\x00\xff", "", {"bin": b"\x01\x02"}),
    ]
    code, _ = run(server, "append", "s", "--jsonl", stdin="not json\n")
    assert code == EXIT_USAGE


def test_conditional_append_and_exit_codes(server: ServerThread, capsys: pytest.CaptureFixture) -> None:
    assert run(server, "append", "e", "created", "--expect-offset", "0")[0] == 0
    assert run(server, "append", "e", "again", "--expect-offset", "0")[0] == EXIT_CONFLICT
    assert "FAILED_PRECONDITION" in capsys.readouterr().err
    assert run(server, "info", "missing")[0] == EXIT_NOT_FOUND
    assert run(server, "append", "bad\x00name", "x")[0] == EXIT_USAGE
    assert run(server, "delete", "e")[0] == EXIT_USAGE  # needs --yes
    assert run(server, "delete", "e", "--yes")[0] == 0
    assert run(server, "info", "e")[0] == EXIT_NOT_FOUND
    with pytest.raises(SystemExit) as caught:
        main(["read"])
    assert caught.value.code == 2


def test_an_unreachable_server_exits_5(start_server) -> None:
    server = start_server()
    target = server.target
    server.stop()
    assert run(target, "info", "--timeout", "2")[0] == EXIT_UNAVAILABLE


def test_address_from_the_environment(server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMLOG_ADDRESS", server.target)
    out = io.StringIO()
    assert main(["append", "env", "x"], out=out) == 0
    assert "offsets 0..0" in out.getvalue()


def test_tail_prints_the_newest_and_follows(server: ServerThread) -> None:
    with Client(server.target) as client:
        client.append("t", [b"%d" % i for i in range(20)])
        code, out = run(server, "tail", "t", "-n", "3", "--json")
        assert [r["payload"] for r in lines_json(out)] == ["17", "18", "19"]

        def append_later() -> None:
            # Once tail follows (its Subscribe is open, from offset 19), not after a fixed delay:
            # appended before tail looked for the newest entry, new-2 would be it.
            deadline = time.monotonic() + 60
            while server.call(lambda: len(server.server.ops.open_calls)) == 0:
                assert time.monotonic() < deadline, "tail did not subscribe"
                time.sleep(0.01)
            client.append("t", [b"new-1", b"new-2"])

        writer = threading.Thread(target=append_later)
        writer.start()
        code, out = run(server, "tail", "t", "-f", "-n", "1", "--limit", "3", "--json")
        writer.join()
    assert code == 0
    assert [r["payload"] for r in lines_json(out)] == ["19", "new-1", "new-2"]


def test_info_trim_and_config(server: ServerThread) -> None:
    with Client(server.target) as client:
        client.append("a", [b"%d" % i for i in range(40)])
        client.append("b", b"x")
    code, out = run(server, "info")
    assert code == 0
    rows = [line.split() for line in out.splitlines()]
    assert rows[0][:4] == ["STREAM", "ENTRIES", "FIRST", "NEXT"]
    assert [r[:4] for r in rows[1:]] == [["a", "40", "0", "40"], ["b", "1", "0", "1"]]
    code, out = run(server, "info", "--limit", "1")  # a server may hold a million: one page
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["a", "(the"]
    assert run(server, "info", "--limit", "2")[1].count("(the first") == 0
    code, out = run(server, "trim", "a", "--to", "30", "--json")
    assert json.loads(out) == {"stream": "a", "first_offset": 30}
    code, out = run(server, "info", "a")
    assert "30..39" in out and "10 retained, 40 ever added" in out
    code, out = run(server, "config", "a", "--max-entries", "1000", "--fsync", "always", "--json")
    config = json.loads(out)
    assert (config["max_entries"], config["fsync"]) == (1000, "always")
    code, out = run(server, "config", "a", "--max-entries", "none", "--compaction", "on", "--json")
    config = json.loads(out)
    # Only the options given change; the rest of the configuration is kept.
    assert (config["max_entries"], config["compaction"], config["fsync"]) == (None, True, "always")
    code, out = run(server, "config", "a")
    assert "compaction" in out and "on" in out


def test_export_then_import_round_trips_binary_payloads(
    server: ServerThread, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    with Client(server.target) as client:
        client.append("src", [b"text", b"\x00\xff\xfe"])
        from clients import Record

        client.append("src", [Record(b"tagged", tag="k", headers={"h": b"\x80"})])
    target = tmp_path / "src.jsonl"
    code, out = run(server, "export", "src", "-o", str(target), "--progress")
    assert code == 0 and "exported 3 entries" in out
    assert "export src: 3 entries of 3 (100%)" in capsys.readouterr().err
    code, out = run(server, "import", "copy", "-i", str(target), "--json")
    assert json.loads(out) == {"stream": "copy", "imported": 3, "first_offset": 0, "last_offset": 2}
    with Client(server.target) as client:
        original = client.read("src", 0).entries
        copied = client.read("copy", 0).entries
    assert [(e.payload, e.tag, e.headers) for e in copied] == [
        (e.payload, e.tag, e.headers) for e in original
    ]
    code, out = run(server, "export", "src", "--from", "1", "--to", "2")
    assert [r["offset"] for r in lines_json(out)] == [1]


def test_import_of_lines_naming_many_streams_uses_append_many(start_server, tmp_path: Path) -> None:
    server = start_server(metrics_port=free_port())
    lines = [json.dumps({"stream": f"device-{i % 4}", "payload": f"r{i}"}) for i in range(40)]
    lines.append(json.dumps({"payload": "to the default stream"}))
    target = tmp_path / "many.jsonl"
    target.write_text("\n".join(lines) + "\n")
    code, out = run(server, "import", "fallback", "-i", str(target), "--json")
    assert code == 0 and json.loads(out) == {"streams": 5, "imported": 41}
    with Client(server.target) as client:
        assert [e.payload for e in client.read("device-2", 0).entries] == [
            b"r%d" % i for i in range(2, 40, 4)
        ]
        assert [e.payload for e in client.read("fallback", 0).entries] == [b"to the default stream"]
    assert value(scrape(server), "streamlog_rpc_duration_seconds_count", method="AppendMany", code="OK") >= 1
    # Without a stream argument every line must name one.
    code, _ = run(server, "import", "-i", str(target))
    assert code == EXIT_USAGE


def test_inspect_a_data_directory(server: ServerThread, capsys: pytest.CaptureFixture) -> None:
    with Client(server.target) as client:
        client.append("x", [b"payload"] * 40)
    data = str(server.settings.data_dir)
    assert main(["inspect", data]) == 0
    listing = capsys.readouterr().out
    assert "base=0" in listing and "nodes" in listing
    assert main(["inspect", "--verify", data]) == 0
    assert "ok: no damage found" in capsys.readouterr().out
    assert main(["inspect", "--verify", data, data]) == EXIT_USAGE


def test_inspect_unpack_passes_the_servers_segment_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from storage import AppendBatch, Engine, EngineConfig
    from storage.format import SEGMENT_HEADER_SIZE, SegmentHeader
    from storage.layout import stream_directory

    data = tmp_path / "data"
    with Engine(data, EngineConfig(background=False)) as engine:
        engine.append("s", AppendBatch([b"x"]))  # in a slot of a pack file
    with pytest.raises(SystemExit) as exited:  # the inspector's usage error, as the command line's
        main(["inspect", "unpack", str(data), "--segment-bytes", "1000"])
    assert exited.value.code == EXIT_USAGE
    assert "segment_bytes is 1 MiB to 1 TiB" in capsys.readouterr().err
    assert main(["inspect", "unpack", str(data), "--segment-bytes", "2MiB"]) == 0
    assert "their segments grow to 2 MiB" in capsys.readouterr().out
    (segment,) = stream_directory(data, "s").glob("*.seg")
    assert SegmentHeader.decode(segment.read_bytes()[:SEGMENT_HEADER_SIZE]).capacity == 2 << 20


def test_bench_measures_and_cleans_up(server: ServerThread) -> None:
    code, out = run(server, "bench", "--entries", "1000", "--batch", "100", "--size", "50", "--json")
    assert code == 0
    figures = json.loads(out)
    assert (
        figures["entries"] == 1000
        and figures["append_entries_per_s"] > 0
        and figures["read_entries_per_s"] > 0
    )
    with Client(server.target) as client:
        assert client.list_streams() == []  # the bench stream was deleted


# Two fresh interpreters, each importing the client or the server: under a CPU hog `serve` alone
# took more than 30 s to refuse its settings.
@pytest.mark.timeout(300)
def test_the_console_script_help_and_serve_exec(tmp_path: Path) -> None:
    assert STREAMLOG is not None, "the streamlog console script is not installed (pip install -e .)"
    helped = subprocess.run([STREAMLOG, "--help"], capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0
    for command in ("serve", "append", "tail", "groups", "export", "inspect", "bench"):
        assert command in helped.stdout
    # `serve` execs the server's own command line: its flags, its exit code for bad settings.
    env = {**os.environ, "STREAMLOG_FSYNC": "sometimes"}
    served = subprocess.run(
        [STREAMLOG, "serve", "--data", str(tmp_path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert served.returncode == 2
    assert "fsync: must be one of" in served.stderr


def test_groups_commands(server: ServerThread) -> None:
    with Client(server.target) as client:
        client.append("jobs", [b"j0", b"j1", b"j2", b"j3"])
    code, out = run(server, "groups", "create", "jobs", "workers", "--max-deliveries", "5")
    assert code == 0 and "at offset 0" in out
    assert run(server, "groups", "create", "jobs", "workers")[0] == EXIT_CONFLICT
    code, out = run(server, "groups", "read", "jobs", "workers", "w1", "--count", "3", "--json")
    assert [(r["offset"], r["delivery_count"]) for r in lines_json(out)] == [(0, 1), (1, 1), (2, 1)]
    code, out = run(server, "groups", "list", "jobs")
    header, row = out.splitlines()
    assert header.split()[:4] == ["GROUP", "NEXT", "LAG", "PENDING"]
    assert row.split()[:5] == ["workers", "3", "1", "3", "1"]
    code, out = run(server, "groups", "pending", "jobs", "workers", "--json")
    pending = json.loads(out)
    assert (pending["count"], pending["consumers"]) == (3, {"w1": 3})
    code, out = run(server, "groups", "ack", "jobs", "workers", "0", "--range", "1-2")
    assert code == 0 and "acknowledged 2" in out
    code, out = run(server, "groups", "claim", "jobs", "workers", "w2", "2", "--json")
    assert [e["offset"] for e in json.loads(out)["entries"]] == [2]
    code, out = run(server, "groups", "info", "jobs", "workers")
    assert re.search(r"max deliveries\s+5\n", out) and re.search(r"^w2\s+1\s", out, re.M)
    code, out = run(server, "groups", "read", "jobs", "workers", "w1", "--ack", "--json")
    assert [r["offset"] for r in lines_json(out)] == [3]
    code, out = run(server, "info", "jobs")
    assert "workers" in out  # the stream's groups are listed with it
    code, out = run(server, "groups", "delete", "jobs", "workers", "--consumer", "w2")
    assert code == 0 and "1 entries released" in out
    assert run(server, "groups", "delete", "jobs", "workers")[0] == 0
    assert run(server, "groups", "info", "jobs", "workers")[0] == EXIT_NOT_FOUND


def test_terminal_control_characters_in_names_tags_and_header_keys_are_escaped(server: ServerThread) -> None:
    # Escape sequences that would retitle the terminal, clear it, or colour what follows.
    stream, group, consumer = "s\x1b]0;owned\x07", "g\x1b[2J", "c\x1b[31m"
    with Client(server.target) as client:
        client.append(stream, [Record(b"p", tag="t\x1b[8m", headers={"k\r\x1b[1A": b"v"})])
        client.create_group(stream, group, "oldest")
        client.read_group(stream, group, consumer)
    shown = {
        "info": run(server, "info"),
        "info stream": run(server, "info", stream),
        "read": run(server, "read", stream),
        "groups list": run(server, "groups", "list", stream),
        "groups info": run(server, "groups", "info", stream, group),
        "groups pending": run(server, "groups", "pending", stream, group),
    }
    for command, (code, out) in shown.items():
        assert code == 0, command
        assert "\x1b" not in out and "\r" not in out and "\x07" not in out, command
    assert "s\\x1b]0;owned\\x07" in shown["info"][1]
    assert "[t\\x1b[8m]" in shown["read"][1] and "k\\r\\x1b[1A=v" in shown["read"][1]
    assert "g\\x1b[2J" in shown["groups list"][1] and "c\\x1b[31m" in shown["groups pending"][1]
    # JSON carries the names as they are (JSON's own escapes keep them off the terminal).
    code, out = run(server, "read", stream, "--json")
    (record,) = lines_json(out)
    assert (record["tag"], record["headers"]) == ("t\x1b[8m", {"k\r\x1b[1A": "v"})


CONSUME = ("groups", "consume", "jobs", "workers")


def test_groups_consume_prints_batches_and_acknowledges_them(server: ServerThread) -> None:
    with Client(server.target) as client:
        client.append("jobs", [b"j%d" % i for i in range(7)])
        client.create_group("jobs", "workers")
        code, out = run(server, *CONSUME, "w1", "--count", "2", "--max-batches", "2", "--json")
        assert code == 0
        assert [(r["offset"], r["delivery_count"]) for r in lines_json(out)] == [(i, 1) for i in range(4)]
        assert client.pending("jobs", "workers").consumers == {"w1": 4}  # printed, not acknowledged
        code, out = run(server, *CONSUME, "w2", "--count", "2", "--ahead", "3", "--max-batches", "1", "--ack")
        assert code == 0
        assert [line.split()[0] for line in out.splitlines()] == ["4", "5"]
        # 4 and 5 acknowledged; 6, if its batch was already on its way, given back for redelivery.
        pending = client.pending("jobs", "workers")
        assert pending.consumers == {"w1": 4} and pending.released in (0, 1)
        assert [e.offset for e in client.read_group("jobs", "workers", "w3", count=5)] == [6]
        unknown_group = ("groups", "consume", "jobs", "nope", "w1")
        assert run(server, *unknown_group, "--max-batches", "1")[0] == EXIT_NOT_FOUND
        assert run(server, *CONSUME, "w1", "--ahead", "0")[0] == EXIT_USAGE


@pytest.fixture
def ctrl_c_as_in_a_terminal() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt, as in a terminal: a run a script started in its background
    inherits SIGINT ignored, and Python then leaves it so."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("ctrl_c_as_in_a_terminal")
def test_groups_consume_ends_in_order_on_ctrl_c(server: ServerThread) -> None:
    with Client(server.target) as client:
        client.create_group("jobs", "workers", create_stream=True)

        def append_then_interrupt() -> None:
            # Only once the command handles Ctrl-C (it waits for entries by then): never hit pytest.
            deadline = time.monotonic() + 10
            while signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.01)
            client.append("jobs", [b"a", b"b", b"c"])
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGINT)

        helper = threading.Thread(target=append_then_interrupt)
        helper.start()
        started = time.monotonic()
        code, out = run(server, *CONSUME, "w1", "--count", "2", "--ack", "--json")
        helper.join()
        assert code == EXIT_INTERRUPTED and time.monotonic() - started < 8
        assert [r["offset"] for r in lines_json(out)] == [0, 1, 2]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
        assert client.group_info("jobs", "workers").pending == 0


def test_cluster_on_a_single_server(server: ServerThread) -> None:
    code, out = run(server, "cluster")
    assert code == 0 and out.startswith("a single server (no cluster), streamlog ")
    code, out = run(server, "cluster", "--json")
    described = json.loads(out)
    assert code == 0 and described["cluster_name"] == "" and described["streams"] == []
    assert [(n["id"], n["alive"]) for n in described["nodes"]] == [("", True)]
