"""The helper that installs the Debian packages the benchmarks and browser tests need."""

from __future__ import annotations

import subprocess

import pytest

from bench import debian


def test_a_present_program_is_found_without_apt(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(debian.subprocess, "run", lambda *a, **k: pytest.fail("must not run apt-get"))
    assert debian.ensure_package("coreutils", "ls").endswith("/ls")


def test_as_root_it_installs_then_finds_the_program(monkeypatch: pytest.MonkeyPatch) -> None:
    installed: list[list[str]] = []

    def run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        installed.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "ok", None)

    found = iter([None, "/usr/bin/chromium"])
    monkeypatch.setattr(debian, "find_executable", lambda name: next(found))
    monkeypatch.setattr(debian.os, "geteuid", lambda: 0)
    monkeypatch.setattr(debian.subprocess, "run", run)
    assert debian.ensure_package("chromium", "chromium") == "/usr/bin/chromium"
    assert [cmd[-1] for cmd in installed] == ["update", "chromium"]
    assert installed[1][-3:-1] == ["install", "-y"]


def test_it_says_why_when_it_cannot_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(debian, "find_executable", lambda name: None)
    monkeypatch.setattr(debian.os, "geteuid", lambda: 0)
    monkeypatch.setattr(
        debian.subprocess,
        "run",
        lambda cmd, **k: subprocess.CompletedProcess(cmd, 100, "E: Unable to locate package nope", None),
    )
    with pytest.raises(debian.PackageUnavailable, match="exited 100:\nE: Unable to locate package nope"):
        debian.ensure_package("nope", "nope")
    monkeypatch.setattr(debian.os, "geteuid", lambda: 1000)
    with pytest.raises(debian.PackageUnavailable, match="sudo apt-get install -y nope"):
        debian.ensure_package("nope", "nope")
