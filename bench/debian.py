"""Debian packages the benchmarks and browser tests need, installed when missing.

`ensure_package("redis-server", "redis-server")` returns the path of the
executable, installing Debian's package first when it is missing and we are root
(``apt-get update`` then ``apt-get install -y``: nothing prompts, apt's output
goes to stderr so a bench's stdout stays pure JSON lines). When it cannot install
(not root, no apt-get, apt fails) it raises PackageUnavailable saying why and
what to run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

# Debian installs some servers in sbin; a sudo-less PATH may lack it.
_SEARCH_DIRS = ("/usr/bin", "/usr/sbin", "/usr/local/bin", "/usr/local/sbin")
_APT_TIMEOUTS = {"update": 300, "install": 900}  # seconds; a stuck mirror must not hang a run


class PackageUnavailable(RuntimeError):
    """A needed program is not installed and could not be installed here."""


def find_executable(name: str) -> str | None:
    """Path of an executable `name` on PATH or in the usual directories, or None."""
    path = shutil.which(name)
    if path:
        return path
    for directory in _SEARCH_DIRS:
        candidate = os.path.join(directory, name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def ensure_package(package: str, executable: str, install: bool = True) -> str:
    """The path of `executable`, installing Debian's `package` if it is missing."""
    path = find_executable(executable)
    if path:
        return path
    if not install:
        raise PackageUnavailable(f"{executable} not found on PATH (install Debian's {package} package)")
    if os.geteuid() != 0:
        raise PackageUnavailable(
            f"{executable} not found and not running as root, so not installing it: "
            f"run `sudo apt-get update && sudo apt-get install -y {package}`"
        )
    if shutil.which("apt-get") is None:
        raise PackageUnavailable(f"{executable} not found and apt-get is not available to install it")
    # noninteractive: no debconf prompts; the lock timeout lets two runs that install at once
    # wait for each other instead of failing.
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    lock = ["-o", "DPkg::Lock::Timeout=120"]
    steps = [
        ("update", ["apt-get", *lock, "update"]),
        ("install", ["apt-get", *lock, "install", "-y", package]),
    ]
    print(f"{executable} missing, installing Debian's {package} package", file=sys.stderr, flush=True)
    for name, cmd in steps:
        try:
            proc = subprocess.run(
                cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=_APT_TIMEOUTS[name],
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise PackageUnavailable(f"`{' '.join(cmd)}` timed out after {exc.timeout}s") from exc
        if proc.returncode != 0:
            tail = "\n".join(proc.stdout.splitlines()[-15:])
            raise PackageUnavailable(f"`{' '.join(cmd)}` exited {proc.returncode}:\n{tail}")
    path = find_executable(executable)
    if path is None:
        raise PackageUnavailable(f"apt-get installed {package} but no {executable} executable was found")
    return path
