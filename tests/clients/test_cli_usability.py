"""What a new user of the `streamlog` command meets first: --version, help on every argument,
the server's settings from `serve --help`, and shell completion."""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest

from clients import Client
from clients.cli import build_parser, main
from service.cli import build_parser as build_server_parser
from service.config import setting_names
from tests.service.helpers import ServerThread

STREAMLOG = shutil.which("streamlog", path=str(Path(sys.executable).parent))


def streamlog(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    assert STREAMLOG is not None, "the streamlog console script is not installed (pip install -e .)"
    return subprocess.run(
        [STREAMLOG, *args], capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})}
    )


def parsers(parser: argparse.ArgumentParser, path: str) -> list[tuple[str, argparse.ArgumentParser]]:
    """The parser and every subcommand's parser below it, with their command lines."""
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += parsers(sub, f"{path} {name}")
    return found


def test_version() -> None:
    result = streamlog("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"streamlog {version('streamlog')}\n"


@pytest.mark.parametrize("build", [build_parser, build_server_parser], ids=["client", "server"])
def test_every_positional_argument_has_help(build) -> None:
    missing = [
        f"{path} {action.metavar or action.dest}"
        for path, parser in parsers(build(), "streamlog")
        for action in parser._actions
        if not (action.option_strings or isinstance(action, argparse._SubParsersAction) or action.help)
    ]
    assert missing == []


def test_serve_help_points_to_the_settings_table_and_names_every_setting() -> None:
    result = streamlog("serve", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "the settings table in README.md (Running the server) and docs/OPERATIONS.md (Configure)" in text
    assert "--set NAME=VALUE" in text and "STREAMLOG_<NAME>" in text
    listed = text.split("Settings: ", 1)[1]
    assert all(name in listed for name in setting_names())


def complete(line: str) -> list[str]:
    """What the shell's completion would offer after `line` (argcomplete's protocol)."""
    env = {
        "_ARGCOMPLETE": "1",
        "_ARGCOMPLETE_SHELL": "bash",
        "_ARGCOMPLETE_IFS": "\n",
        "COMP_LINE": line,
        "COMP_POINT": str(len(line)),
        "COMP_TYPE": "9",
    }
    # argcomplete writes the completions to file descriptor 8, as the shell's hook sets it up.
    command = ["bash", "-c", '"$0" 8>&1', str(STREAMLOG)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    assert result.returncode == 0, result.stderr
    return sorted(result.stdout.split())


def test_shell_completion_of_commands_actions_and_options() -> None:
    assert complete("streamlog gro") == ["groups"]
    assert complete("streamlog groups c") == ["claim", "consume", "create"]
    assert complete("streamlog tail orders --f") == ["--follow", "--from"]
    assert "serve" in complete("streamlog ")


def test_the_completion_script_for_bash() -> None:
    """What the README tells users to put in their shell's start-up file."""
    register = Path(sys.executable).with_name("register-python-argcomplete")
    result = subprocess.run([str(register), "streamlog"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "complete" in result.stdout and "streamlog" in result.stdout


def info(server: ServerThread, *argv: str) -> str:
    out = io.StringIO()
    assert main(["info", *argv, "--address", server.target], out=out) == 0
    return out.getvalue()


def test_info_shows_sizes_in_human_units_and_what_the_entries_hold(server: ServerThread) -> None:
    """A new small stream's segment is the 3.5 KiB of its slot in a pack file (small_streams slots,
    the default): 10 entries of 100 bytes use about 1.4 KiB of it. A bigger one grows in steps as it
    fills (the test server's reach 1 MiB)."""
    with Client(server.target) as client:
        client.append("fresh", [b"x" * 100] * 10)
        ride = b'{"ride": %05d, "city": "Lisbon", "note": "' + b"on time " * 70 + b'"}'
        for batch in range(25):  # 1.4 MiB of compressible entries: the first segment fills up and is packed
            client.append("full", [ride % (batch * 100 + i) for i in range(100)])
        deadline = time.monotonic() + 60
        while client.info("full").packed_segments == 0 and time.monotonic() < deadline:
            time.sleep(0.1)  # the server's maintenance packs full segments about every second
        used = client.info("fresh").used_bytes
    assert 10 * 100 < used < 3584
    used_shown = f"{used / 1024:.1f} KiB"
    shown = info(server, "fresh")
    on_disk = f"3.5 KiB in 1 segment \\(1 node\\); the entries use {used_shown} of it"
    assert re.search(f"\non disk +{on_disk}\n", shown), shown
    assert re.search("\ncompression +none yet: a segment's nodes are compressed once it is full\n", shown)
    shown = info(server, "full")
    assert re.search(r"\ncompression +\d+\.\d\dx in 1 full segment\n", shown), shown
    assert re.search(r"\non disk +\d\.\d MiB in 2 segments \(\d+ nodes\); the entries use \d", shown), shown
    rows = [line.split() for line in info(server).splitlines()]
    assert rows[0] == ["STREAM", "ENTRIES", "FIRST", "NEXT", "USED", "DISK", "LAST", "APPEND"]
    assert rows[1][:8] == ["fresh", "10", "0", "10", *used_shown.split(), "3.5", "KiB"], rows
