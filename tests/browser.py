"""A real browser for tests: Debian's Chromium (`make chromium`) driven by Playwright, offline.

Playwright's own browser downloads are never used (`playwright install` cannot reach its servers
here); `executable_path` points it at the system Chromium. Every page records what it logged, so a
test can assert that the dashboard raised no error.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, sync_playwright

CHROMIUM = "/usr/bin/chromium"
TIMEOUT_MS = 20_000
"""Any single Playwright action or wait: the slowest the tests wait for is a model loading (~5-10 s
on 2 cores); each test bounds its own longer waits explicitly."""


@dataclass
class Console:
    """What a page said: console errors and warnings, and uncaught exceptions."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def on_message(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            self.errors.append(f"{message.text} ({message.location.get('url', '')})")
        elif message.type == "warning":
            self.warnings.append(message.text)

    def on_page_error(self, error: Exception) -> None:
        self.errors.append(f"uncaught: {error}")


@contextmanager
def chromium() -> Iterator[Browser]:
    """Headless Chromium, or the test is skipped with how to install it."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"{CHROMIUM} is missing: `make chromium` installs Debian's package")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


def open_page(browser: Browser, url: str, *, width: int = 1400, height: int = 900) -> tuple[Page, Console]:
    """A fresh page (its own storage) at `url`, with its console recorded."""
    context = browser.new_context(viewport={"width": width, "height": height})
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    console = Console()
    page.on("console", console.on_message)
    page.on("pageerror", console.on_page_error)
    page.goto(url)
    return page, console
