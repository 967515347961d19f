"""Headless Debian Chromium driven by Playwright, for dashboard tests.

`open_browser()` yields a `BrowserSession` whose pages record every request
they make, so a test can assert the dashboard never reaches outside the
server it was loaded from. Reusable by the live-demo browser test.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"


def chromium_or_skip() -> str:
    """Path of Chromium; in CI its absence is a failure, elsewhere a clear skip."""
    if os.path.exists(CHROMIUM):
        return CHROMIUM
    found = shutil.which("chromium")
    if found:
        return found
    msg = f"{CHROMIUM} is missing: apt-get install -y chromium"
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


@dataclass
class BrowserSession:
    context: object  # playwright BrowserContext
    browser: object  # playwright Browser
    requests: list[str] = field(default_factory=list)
    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)

    def new_page(self, *, javascript: bool = True) -> object:
        """A page that records its requests; `javascript=False` gets its own context."""
        if javascript:
            page = self.context.new_page()  # type: ignore[attr-defined]
        else:
            ctx = self.browser.new_context(java_script_enabled=False)  # type: ignore[attr-defined]
            page = ctx.new_page()
        page.on("request", lambda req: self.requests.append(req.url))
        page.on(
            "console",
            lambda msg: self.console_errors.append(msg.text) if msg.type == "error" else None,
        )
        page.on("pageerror", lambda exc: self.page_errors.append(str(exc)))
        return page

    def foreign_requests(self, base_url: str) -> list[str]:
        """Requests to anywhere but the origin under test (data: URLs are local)."""
        origin = urlsplit(base_url)
        out = []
        for url in self.requests:
            u = urlsplit(url)
            if u.scheme in ("data", "blob", "about"):
                continue
            if (u.scheme, u.hostname, u.port) != (origin.scheme, origin.hostname, origin.port):
                out.append(url)
        return out


@contextlib.contextmanager
def open_browser(
    *, viewport: tuple[int, int] = (1400, 1000), extra_headers: dict[str, str] | None = None
) -> Iterator[BrowserSession]:
    executable = chromium_or_skip()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(
                viewport={"width": viewport[0], "height": viewport[1]},
                extra_http_headers=extra_headers or {},
            )
            try:
                yield BrowserSession(context=context, browser=browser)
            finally:
                context.close()
        finally:
            browser.close()


def screenshot(page: object, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path), full_page=True)  # type: ignore[attr-defined]
    return path
