"""What a new user of the `streamlog` command meets first: --version, help on every argument,
the server's settings from `serve --help`, and shell completion."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from clients.cli import build_parser
from service.cli import build_parser as build_server_parser
from service.config import setting_names

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
