"""The Node.js client (clients/node) against a real server: npm install, then `node --test`.

npm installs into clients/node/node_modules (git-ignored; the versions are pinned by
package-lock.json), which later runs reuse.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.service.helpers import ServerThread

NODE_DIR = Path(__file__).resolve().parents[2] / "clients" / "node"
NODE = shutil.which("node")
NPM = shutil.which("npm")


@pytest.mark.skipif(NODE is None or NPM is None, reason="needs Node.js 20 and npm")
def test_node_client_appends_reads_subscribes_and_acks(server: ServerThread) -> None:
    install = subprocess.run(
        [NPM, "install", "--no-audit", "--no-fund", "--loglevel=error"],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr
    env = {**os.environ, "STREAMLOG_ADDRESS": server.target}
    result = subprocess.run(
        [NODE, "--test", "test/"], cwd=NODE_DIR, capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # node --test reports its counts: every test ran and passed.
    assert "# fail 0" in result.stdout and "# pass 8" in result.stdout, result.stdout
