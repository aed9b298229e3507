"""Headless Chromium for the console's tests, screenshots and render timings.

Playwright for Python drives Debian's `chromium` (installed by bench.debian when
missing and we are root): Playwright's own browser downloads are not used. Each
launch gets a fresh profile directory and the flags that keep a headless browser
from reaching anywhere but the server under test.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from typing import Any

from bench.debian import ensure_package

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def chromium_path(install: bool = True) -> str:
    """Debian's chromium; PackageUnavailable when it is missing and cannot be installed."""
    return ensure_package("chromium", "chromium", install)


@contextlib.contextmanager
def browser(install: bool = True, width: int = 1280, height: int = 800) -> Iterator[Any]:
    """A Playwright BrowserContext on Debian's chromium with a fresh profile, closed on exit."""
    from playwright.sync_api import sync_playwright  # a dev dependency: imported when used

    executable = chromium_path(install)
    profiles = tempfile.TemporaryDirectory(prefix="streamlog-chromium-")
    with profiles as profile, sync_playwright() as playwright:
        # (Playwright passes the profile as --user-data-dir itself.)
        context = playwright.chromium.launch_persistent_context(
            profile,
            executable_path=executable,
            args=list(FLAGS),
            headless=True,
            viewport={"width": width, "height": height},
        )
        try:
            yield context
        finally:
            context.close()
