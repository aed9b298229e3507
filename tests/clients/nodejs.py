"""Running the Node.js client's tests (clients/node/test) from pytest: npm install, then `node --test`.

npm installs into clients/node/node_modules (git-ignored; the versions are pinned by
package-lock.json), which later runs reuse.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

NODE_DIR = Path(__file__).resolve().parents[2] / "clients" / "node"
NODE = shutil.which("node")
NPM = shutil.which("npm")

needs_node = pytest.mark.skipif(NODE is None or NPM is None, reason="needs Node.js 20 and npm")


_installed = False


def npm_install() -> None:
    """`npm install` in clients/node, once per run (its README's first step)."""
    global _installed
    if not _installed:
        assert NPM is not None
        install = subprocess.run(
            [NPM, "install", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=NODE_DIR,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert install.returncode == 0, install.stderr
        _installed = True


def run_node_tests(test_file: str, env: dict[str, str], timeout_s: float = 120) -> str:
    """Run clients/node/`test_file` with `env` added; assert that every test passed (node --test
    reports its counts) and return its report."""
    assert NODE is not None
    npm_install()
    result = subprocess.run(
        [NODE, "--test", test_file],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, **env},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "# fail 0" in result.stdout, result.stdout
    return result.stdout
