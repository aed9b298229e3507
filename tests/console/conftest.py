"""Fixtures for the console's tests in a real browser (tests/browsers.py)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.common import free_port
from tests import browsers
from tests.service.helpers import ServerThread, serve_for_test

_visits = itertools.count()
browser_context = browsers.browser_context  # the fixture (tests/browsers.py)


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., ServerThread]]:
    """Servers with the HTTP API and console on; every one is stopped at teardown."""
    starting = serve_for_test(tmp_path)
    start = next(starting)
    yield lambda **overrides: start(**{"http_port": free_port(), **overrides})
    next(starting, None)


class Console:
    """One browser tab on a server's console, recording what the page logs as errors."""

    def __init__(self, context: Any, server: ServerThread) -> None:
        assert server.server.http is not None
        self.base = f"http://127.0.0.1:{server.server.http.port}"
        self.page = context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def visit(self, route: str = "#/") -> Any:
        """Load the console afresh at `route` and wait until the page has drawn its data."""
        self.page.goto(f"{self.base}/?visit={next(_visits)}{route}")
        self.page.wait_for_selector("main[aria-busy=false]", timeout=15_000)
        return self.page

    def close(self) -> None:
        self.page.close()


@pytest.fixture
def open_console(browser_context: Any) -> Iterator[Callable[[ServerThread], Console]]:
    tabs: list[Console] = []

    def open_tab(server: ServerThread) -> Console:
        tab = Console(browser_context, server)
        tabs.append(tab)
        return tab

    yield open_tab
    for tab in tabs:
        tab.close()
