"""Every code block of README.md, docs/*.md and clients/node/README.md runs as written.

Each document gets a fresh server, as `make run` gives a reader: default settings,
data in ./data of the directory the blocks run in. Its blocks run top to bottom,
each seeing what the blocks before it did, with the virtualenv's commands first
on PATH (the README asks the reader to activate it). The changes to the text:
`localhost:7070` (gRPC) and `localhost:7080` (HTTP) become the test server's
addresses (tests use ephemeral ports), STREAMLOG_ADDRESS names the first for the
streamlog command, and the examples' scratch directory /tmp/streamlog-examples
becomes one of the test's own.

How a block is run (and how one says it must not be) is in tests/docs/snippets.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.common import free_port
from service.config import Settings, load_settings
from tests.clients.nodejs import NODE, NPM, npm_install
from tests.docs.snippets import DOCUMENTS, REPO, Block, blocks, commands
from tests.service.helpers import ServerThread

# Where examples keep files that outlive a command (Spark's output and checkpoints): a directory
# of each document's own in the test, as Spark resolves paths from its own working directory.
EXAMPLES_DIR = "/tmp/streamlog-examples"
RUN_TIMEOUT_S = 120
# A block or command that runs until Ctrl-C is interrupted once it has printed its
# first line, or after this long: what it does before then must not fail.
FOLLOW_S = 15


class Reader:
    """A process's stdout, read line by line as it comes, on a thread."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self.text: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(process,), daemon=True)
        self._thread.start()

    def _read(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            self.lines.put(line)

    def wait_for_a_line(self, timeout_s: float) -> None:
        with contextlib.suppress(queue.Empty):
            self.text.append(self.lines.get(timeout=timeout_s))

    def rest(self) -> str:
        self._thread.join(timeout=10)
        while not self.lines.empty():
            self.text.append(self.lines.get())
        return "".join(self.text)


class Runner:
    """Runs one document's blocks against its server, in `workdir`."""

    def __init__(self, server: ServerThread, workdir: Path, request: pytest.FixtureRequest) -> None:
        self.server = server
        self.workdir = workdir
        self.request = request
        self.env = {
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "STREAMLOG_ADDRESS": server.target,
            "PYTHONPATH": str(REPO),
            "PYTHONFAULTHANDLER": "1",
        }
        self.not_run: list[str] = []

    def code(self, block: Block) -> str:
        code = block.code.replace(EXAMPLES_DIR, str(self.workdir / "examples"))
        http = f"127.0.0.1:{self.server.settings.http_port}"
        for host in ("localhost", "127.0.0.1"):
            code = code.replace(f"{host}:7070", self.server.target).replace(f"{host}:7080", http)
        return code

    def run(self, block: Block) -> None:
        getattr(self, f"run_{block.kind}")(block)

    def run_skip(self, block: Block) -> None:
        pass

    def run_text(self, block: Block) -> None:
        pass

    def run_settings(self, block: Block) -> None:
        """A streamlog.toml: the server accepts it (every value in range and consistent)."""
        path = self.workdir / "streamlog.toml"
        path.write_text(block.code)
        load_settings(config_file=path)

    def run_python(self, block: Block) -> None:
        command = [sys.executable, "-c", self.code(block)]
        if block.marker == "until interrupted":
            self.interrupt(block, command, expect="KeyboardInterrupt")
        else:
            self.check(block, command)

    def run_sh(self, block: Block) -> None:
        code = self.code(block)
        steps = commands(code)
        if not any(c.expected is not None or c.until_interrupted for c in steps):
            # A plain script: run as written, in one shell (variables carry from line to line).
            self.check(block, ["bash", "-e", "-o", "pipefail", "-c", code])
            return
        for step in steps:
            command = ["bash", "-o", "pipefail", "-c", step.text]
            started = time.monotonic()
            if step.until_interrupted:
                self.interrupt(block, command)
                print(f"  {time.monotonic() - started:.1f}s (interrupted) {step.text[:70]}")
                continue
            output = self.check(block, command)
            print(f"  {time.monotonic() - started:.1f}s {step.text[:70]}")
            if step.expected:
                assert normalized(output) == normalized(step.expected), (
                    f"{block.where}: `{step.text}` printed\n{output}\nbut the document shows\n{step.expected}"
                )

    def run_js(self, block: Block) -> None:
        if NODE is None or NPM is None:
            self.not_run.append(f"{block.where} (needs Node.js 20 and npm)")
            return
        npm_install()
        # From the repository's root, as the block says (require('./clients/node')).
        self.check(block, [NODE, "-e", self.code(block)], cwd=REPO)

    def run_spark(self, block: Block) -> None:
        """In this process, with the suite's SparkSession as `spark`; queries it starts are run
        over what there is to read, then stopped."""
        spark = self.request.getfixturevalue("spark")
        previous = Path.cwd()
        os.chdir(self.workdir)
        try:
            exec(compile(self.code(block), block.where, "exec"), {"spark": spark, "__name__": "__snippet__"})
            for query in spark.streams.active:
                query.processAllAvailable()
                query.stop()
        finally:
            for query in spark.streams.active:
                query.stop()
            os.chdir(previous)

    def check(self, block: Block, command: list[str], cwd: Path | None = None) -> str:
        result = subprocess.run(
            command,
            cwd=cwd or self.workdir,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
        assert result.returncode == 0, (
            f"{block.where}: exit {result.returncode}\n--- ran:\n{command[-1]}\n--- stdout:\n{result.stdout}"
            f"\n--- stderr:\n{result.stderr}"
        )
        return result.stdout

    def interrupt(self, block: Block, command: list[str], expect: str = "") -> None:
        """Run a command that goes on until Ctrl-C: once it is going, send it SIGINT. It must not
        have failed before then; `expect` is the last line it then writes to stderr."""
        process = subprocess.Popen(
            command,
            cwd=self.workdir,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # Ctrl-C reaches the whole process group, as in a terminal
            # SIGINT handled by default, as in a terminal, even if this test runs in a background job
            # (which ignores it, and children inherit that).
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        reader = Reader(process)
        reader.wait_for_a_line(FOLLOW_S)
        ended_alone = process.poll() is not None
        if not ended_alone:
            os.killpg(process.pid, signal.SIGINT)
        hung = False
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            # Still running a minute after Ctrl-C: SIGABRT makes Python's fault handler
            # (PYTHONFAULTHANDLER) print where every thread is, for the failure below.
            hung = True
            os.killpg(process.pid, signal.SIGABRT)
            process.wait(timeout=30)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
        stdout, stderr = reader.rest(), process.stderr.read() if process.stderr else ""
        shown = f"{block.where}: `{command[-1]}`\n--- stdout:\n{stdout}\n--- stderr:\n{stderr}"
        assert not hung, "still running a minute after Ctrl-C: " + shown
        if ended_alone:
            assert process.returncode == 0, shown
        elif expect:
            assert stderr.strip().splitlines()[-1:] == [expect], shown


def normalized(text: str) -> str:
    """Output as a document shows it: times differ from run to run, and the end of a stream
    depends on what the blocks before appended."""
    text = re.sub(r'"(timestamp_ms|end_offset)": "\d+"', r'"\1": "…"', text)
    with contextlib.suppress(json.JSONDecodeError):
        return json.dumps(json.loads(text), indent=2, sort_keys=True)
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


@pytest.fixture
def document_server(tmp_path: Path) -> Iterator[tuple[ServerThread, Path]]:
    """A server as `make run` starts it (default settings, data in ./data, the HTTP API on), on
    ephemeral ports."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / ".venv").symlink_to(Path(sys.executable).parents[1])  # `source .venv/bin/activate` works
    settings = Settings(data_dir=workdir / "data", port=0, http_port=free_port(), log_level="warning")
    server = ServerThread(settings)
    server.start()
    try:
        yield server, workdir
    finally:
        server.stop()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_block_runs_as_written(
    document: str, document_server: tuple[ServerThread, Path], request: pytest.FixtureRequest
) -> None:
    server, workdir = document_server
    runner = Runner(server, workdir, request)
    found = blocks(document)
    # Before anything runs: every block says how it is run (one that cannot, unmarked, fails here).
    assert all(block.kind for block in found)
    for block in found:
        started = time.monotonic()
        runner.run(block)
        print(f"{block.where} {block.kind}: {time.monotonic() - started:.1f}s")
    if runner.not_run:
        pytest.skip("not run: " + ", ".join(runner.not_run))
