"""`streamlog serve` on a disk that keeps only what was synced: power loss and a full disk in a real process.

    python -m tests.cluster.powernode [--power-mode lost|power] [--seed N] serve --data DIR [serve's flags]

Runs the server exactly as `streamlog serve` does, but its engine's file system is
a FaultFS (tests/storage/faultfs.py) loaded from DIR at start: every write lands in
memory and reaches FaultFS's "platter" image only when synced, as the page cache
and the disk do. Signals drive the faults:

- SIGUSR1, power loss: DIR is replaced by what the platter holds (`--power-mode`
  "lost": nothing unsynced survives; "power": each unsynced write is kept,
  dropped, garbled or torn at random, seeded by `--seed`), and the process exits
  at once with POWER_LOSS_EXIT;
- SIGUSR2, process crash (kill -9): DIR is replaced by everything written (the
  page cache survives), exit with PROCESS_CRASH_EXIT;
- SIGRTMIN: the disk is full from now on (creating a segment or writing a file
  fails, as on a real full disk); SIGRTMIN+1: there is space again. Each switch
  is confirmed by a line on stderr (`DISK_FULL_LINE`), for a test to wait on;
- SIGTERM / SIGINT: the server's own clean shutdown, then DIR is replaced by the
  final state (everything synced by then), exit 0.

While a crash image is taken and written out, every file operation of the server
waits (FaultFS.frozen), so nothing is acknowledged after the image: what a client
saw acknowledged before the signal is all that the image can be judged by.

A test tool, not a production mode: it keeps the whole data directory in memory.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import random
import shutil
import signal
import sys
import threading
from pathlib import Path

from service import cli, logs
from service.config import ConfigError
from storage import StorageError
from tests.storage.faultfs import FaultFS

POWER_LOSS_EXIT = 98
PROCESS_CRASH_EXIT = 99
DISK_FULL_ON = signal.SIGRTMIN
DISK_FULL_OFF = signal.SIGRTMIN + 1
DISK_FULL_LINE = "powernode: disk full {}"  # "on" or "off"
_FAULT_SIGNALS = {signal.SIGUSR1, signal.SIGUSR2, DISK_FULL_ON, DISK_FULL_OFF}

log = logging.getLogger("streamlog.powernode")


def replace_dir(image: FaultFS, data_dir: Path) -> None:
    """Make the real `data_dir` hold exactly what `image` holds there (written aside, then swapped in)."""
    fresh = data_dir.with_name(data_dir.name + ".image")
    stale = data_dir.with_name(data_dir.name + ".stale")
    for leftover in (fresh, stale):
        shutil.rmtree(leftover, ignore_errors=True)
    image.export(data_dir, fresh)
    if data_dir.exists():
        data_dir.rename(stale)
    fresh.rename(data_dir)
    shutil.rmtree(stale, ignore_errors=True)


class FaultSwitch:
    """The thread that waits for the fault signals and acts on them (see the module doc)."""

    def __init__(self, fs: FaultFS, data_dir: Path, power_mode: str, seed: int) -> None:
        self.fs = fs
        self.data_dir = data_dir
        self.power_mode = power_mode
        self.rng = random.Random(seed)
        self.thread = threading.Thread(target=self._run, name="powernode-faults", daemon=True)

    def _run(self) -> None:
        while True:
            signum = signal.sigwait(_FAULT_SIGNALS)
            if signum == signal.SIGUSR1:
                self.crash(self.power_mode, POWER_LOSS_EXIT)
            elif signum == signal.SIGUSR2:
                self.crash("process", PROCESS_CRASH_EXIT)
            else:
                self.fs.disk_full = signum == DISK_FULL_ON
                print(
                    DISK_FULL_LINE.format("on" if self.fs.disk_full else "off"), file=sys.stderr, flush=True
                )

    def crash(self, mode: str, code: int) -> None:
        with self.fs.frozen():
            pending = self.fs.pending_writes()
            replace_dir(self.fs.crashed_copy(self.rng, mode), self.data_dir)
            print(
                f"powernode: {mode} crash, {pending} unsynced writes at the time", file=sys.stderr, flush=True
            )
            os._exit(code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.cluster.powernode", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--power-mode", choices=("lost", "power"), default="lost")
    parser.add_argument("--seed", type=int, default=0)
    ours, serve_argv = parser.parse_known_args(argv)
    args = cli.build_parser().parse_args(serve_argv)
    if args.command != "serve":
        parser.error("expected `serve` and its flags")
    try:
        settings = cli.serve_settings(args, os.environ)
    except ConfigError as exc:
        print(f"powernode: {exc}", file=sys.stderr)
        return cli.EXIT_USAGE
    logs.configure(settings.log_level, settings.log_format)
    data_dir = Path(settings.data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    fs = FaultFS()
    fs.load(data_dir, data_dir)
    # Blocked here, before any thread starts, so that only the switch's sigwait takes them.
    signal.pthread_sigmask(signal.SIG_BLOCK, _FAULT_SIGNALS)
    switch = FaultSwitch(fs, data_dir, ours.power_mode, ours.seed)
    switch.thread.start()
    from service.server import serve  # after the mask: the server's threads inherit it

    code = 0
    try:
        asyncio.run(serve(dataclasses.replace(settings, data_dir=data_dir), fs=fs))
    except (ConfigError, StorageError, OSError, RuntimeError) as exc:
        log.error("cannot run the server: %s", exc)
        code = cli.EXIT_FAILURE
    with fs.frozen():
        replace_dir(fs.crashed_copy(mode="process"), data_dir)
    return code


if __name__ == "__main__":
    sys.exit(main())
