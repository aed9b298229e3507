"""Fixtures for the client tests: real servers on loopback (stopped at teardown) and clients."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from clients import Client
from tests.service.helpers import ServerThread, serve_for_test


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., ServerThread]]:
    """Start servers with overrides; every one is stopped at teardown."""
    yield from serve_for_test(tmp_path)


@pytest.fixture
def server(start_server: Callable[..., ServerThread]) -> ServerThread:
    return start_server()


@pytest.fixture
def client(server: ServerThread) -> Iterator[Client]:
    with Client(server.target, timeout=10) as c:
        yield c


class SignalRaised(BaseException):
    """What a signal handler raises, as KeyboardInterrupt is (not an Exception)."""


@pytest.fixture
def interrupt_inside_grpc(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], None]]:
    """Arm: the main thread's next lock taken by gRPC's code raises SignalRaised just after it is
    taken. That is where Ctrl-C can land: Python runs a signal handler between two bytecodes,
    here after threading.Condition.__enter__ took the lock and before the `with` that called it
    is set to release it, so the lock stays held by the interrupted thread (its own calls still
    go through; every other thread that needs it waits for ever). Released at teardown: else the
    thread that collects the channel would wait for it (the next test's server did)."""
    armed = threading.Event()
    kept: list[threading.Condition] = []
    enter = threading.Condition.__enter__

    def enter_then_interrupt(condition: threading.Condition) -> bool:
        taken = enter(condition)
        caller = sys._getframe(1).f_code.co_filename  # the Python frame under gRPC's Cython code
        if (
            armed.is_set()
            and threading.current_thread() is threading.main_thread()
            and f"{os.sep}grpc{os.sep}" in caller
        ):
            armed.clear()
            kept.append(condition)
            raise SignalRaised
        return taken

    monkeypatch.setattr(threading.Condition, "__enter__", enter_then_interrupt)
    yield armed.set
    for condition in kept:
        condition.release()
