"""The browser fixture of the console tests: Debian's chromium driven by Playwright.

The browser is installed when missing (as root, with apt-get: bench.debian); the tests
are skipped, saying why, only when it cannot be. Import the fixture into a conftest or
a test module to use it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from bench.debian import PackageUnavailable


# Per module, not per session: while Playwright's sync API runs, the main thread has a running
# event loop, and the next modules' asyncio.run() would refuse to start.
@pytest.fixture(scope="module")
def browser_context() -> Iterator[Any]:
    try:
        from bench.browser import browser, chromium_path

        chromium_path()
    except (ImportError, PackageUnavailable) as exc:
        pytest.skip(f"no browser for the console tests: {exc}")
    with browser() as context:
        yield context
