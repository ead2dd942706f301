"""Helpers for the web console's browser tests: Playwright driving Debian's Chromium.

Playwright for Python (the ``dev`` extra) drives ``/usr/bin/chromium`` (Debian's package,
installed by ``scripts/ensure-services.sh``, which ``make test`` runs); Playwright never
downloads a browser of its own here (do not run ``playwright install``).

Typical use, with the sync API::

    @pytest.fixture(scope="module")
    def browser() -> Iterator[Browser]:
        with browser_session() as b:
            yield b

    def test_page(browser: Browser, base_url: str) -> None:
        page = browser.new_page()
        errors = ConsoleErrors(page, base_url)
        page.goto(base_url + "/ui/")
        assert axe_violations(page) == []
        screenshot(page, "console-home")
        errors.assert_clean()

A missing browser or Playwright fails the test loudly (:func:`chromium_or_fail`) unless
``INFERD_SKIP_BROWSER=1`` is set, in which case the tests skip, saying so.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import pytest

if TYPE_CHECKING:
    from playwright.sync_api import (
        Browser,
        ConsoleMessage,
        Page,
        Playwright,
        Request,
        Response,
    )

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = Path("/usr/bin/chromium")
AXE_JS = Path(__file__).resolve().parent / "vendor" / "axe-core" / "axe.min.js"
SCREENSHOTS_ENV = "INFERD_SCREENSHOTS"
SKIP_ENV = "INFERD_SKIP_BROWSER"

# Headless, and none of Chromium's background connections: this machine's closed network
# refuses them (many at a time, and host look-ups at every start) otherwise.
CHROMIUM_ARGS: tuple[str, ...] = (
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
)

# Schemes that never reach the network (a data: favicon, a blob: download).
_LOCAL_SCHEMES = frozenset({"data", "blob", "about", "chrome-error"})


def _missing(what: str) -> str:
    return (
        f"{what}\n"
        "  The web console's browser tests need Debian's Chromium at /usr/bin/chromium and\n"
        "  Playwright for Python in the venv:\n"
        "    apt-get install chromium fonts-liberation   (make test does it, through\n"
        "                                                 scripts/ensure-services.sh)\n"
        "    .venv/bin/pip install -e '.[dev]'           (playwright; never `playwright install`)\n"
        f"  Set {SKIP_ENV}=1 to skip these tests instead."
    )


def chromium_or_fail() -> str:
    """The Chromium executable's path; ``pytest.fail`` (loudly) when it or Playwright is
    missing, or ``pytest.skip`` when ``INFERD_SKIP_BROWSER=1``."""
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1: the browser tests are skipped")
    if not (CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK)):
        pytest.fail(_missing(f"BROWSER MISSING: {CHROMIUM} is not installed."), pytrace=False)
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError as exc:
        pytest.fail(
            _missing(f"PLAYWRIGHT MISSING: cannot import playwright ({exc})."), pytrace=False
        )
    return str(CHROMIUM)


def launch(playwright: Playwright, **kwargs: Any) -> Browser:
    """Headless Debian Chromium, without background networking, in a fresh profile.

    Playwright's ``launch`` gives the browser a new temporary user data dir of its own
    and removes it on ``browser.close()`` (Playwright refuses ``--user-data-dir`` in args
    here; a persistent profile is ``launch_persistent_context``'s business). ``kwargs``
    go to ``chromium.launch`` (e.g. ``slow_mo``); extra ``args`` are appended.
    """
    args = [*CHROMIUM_ARGS, *kwargs.pop("args", ())]
    return playwright.chromium.launch(
        executable_path=chromium_or_fail(), headless=True, args=args, **kwargs
    )


@contextlib.contextmanager
def browser_session(**kwargs: Any) -> Iterator[Browser]:
    """Playwright started, :func:`launch`'s browser yielded, both closed after (for a
    fixture). Must not run inside a running asyncio loop (Playwright's sync API)."""
    chromium_or_fail()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = launch(pw, **kwargs)
        try:
            yield browser
        finally:
            browser.close()


def origin(url: str) -> str:
    """``scheme://host:port`` of ``url``."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


@dataclass(frozen=True)
class BrowserProblem:
    kind: str  # console.error, pageerror, requestfailed, http-error, foreign-request
    text: str
    url: str = ""

    def __str__(self) -> str:
        return f"[{self.kind}] {self.text}" + (f" ({self.url})" if self.url else "")


class ConsoleErrors:
    """What went wrong in a page, collected from the moment it is attached:

    - console messages of type ``error`` (CSP violations among them),
    - uncaught exceptions (``pageerror``),
    - requests that failed (``requestfailed``) or got an HTTP status >= 400,
    - any request to an origin other than ``base_url``'s (and ``allowed_origins``):
      proof that the page fetches no CDN, font or analytics host.

    ``/favicon.ico`` 404s (the browser's own, unasked for) are ignored when
    ``ignore_favicon`` (the default).
    """

    def __init__(
        self,
        page: Page,
        base_url: str,
        *,
        allowed_origins: Iterable[str] = (),
        ignore_favicon: bool = True,
    ) -> None:
        self.page = page
        self.allowed = {origin(base_url), *(origin(o) for o in allowed_origins)}
        self.ignore_favicon = ignore_favicon
        self.problems: list[BrowserProblem] = []
        page.on("console", self._on_console)
        page.on("pageerror", self._on_pageerror)
        page.on("requestfailed", self._on_requestfailed)
        page.on("request", self._on_request)
        page.on("response", self._on_response)

    def _favicon(self, url: str) -> bool:
        return self.ignore_favicon and urlsplit(url).path == "/favicon.ico"

    def _on_console(self, msg: ConsoleMessage) -> None:
        if msg.type != "error":
            return
        url = str(msg.location.get("url") or "")
        if not self._favicon(url):
            self.problems.append(BrowserProblem("console.error", msg.text, url))

    def _on_pageerror(self, exc: Exception) -> None:
        stack = getattr(exc, "stack", None)
        self.problems.append(BrowserProblem("pageerror", str(stack or exc)))

    def _on_requestfailed(self, request: Request) -> None:
        if not self._favicon(request.url):
            self.problems.append(
                BrowserProblem("requestfailed", request.failure or "failed", request.url)
            )

    def _on_request(self, request: Request) -> None:
        scheme = urlsplit(request.url).scheme
        if scheme not in _LOCAL_SCHEMES and origin(request.url) not in self.allowed:
            self.problems.append(
                BrowserProblem(
                    "foreign-request", f"{request.method} to a foreign host", request.url
                )
            )

    def _on_response(self, response: Response) -> None:
        if response.status >= 400 and not self._favicon(response.url):
            self.problems.append(
                BrowserProblem("http-error", f"HTTP {response.status}", response.url)
            )

    def assert_clean(self) -> None:
        """Fails listing every problem seen so far."""
        if self.problems:
            listed = "\n".join(f"  {p}" for p in self.problems)
            pytest.fail(f"{len(self.problems)} browser problem(s) on {self.page.url}:\n{listed}")


def inject_axe(page: Page) -> None:
    """Loads the vendored axe-core into ``page`` (once per document).

    ``page.evaluate`` runs the source through the DevTools protocol (Runtime evaluation),
    which a page's Content-Security-Policy does not govern: it works under
    ``script-src 'self'`` where ``page.add_script_tag(content=...)`` (an inline script)
    is refused, and it leaves no CSP violation in the console.
    """
    if not page.evaluate("() => typeof window.axe === 'object'"):
        page.evaluate(_axe_source())
        if not page.evaluate("() => typeof window.axe === 'object'"):
            pytest.fail(f"axe-core did not load from {AXE_JS}")


@functools.cache
def _axe_source() -> str:
    return AXE_JS.read_text(encoding="utf-8")


_AXE_RUN = """async ([context, options]) => {
  const results = await window.axe.run(context || document, options);
  return results.violations.map((v) => ({
    id: v.id,
    impact: v.impact,
    help: v.help,
    help_url: v.helpUrl,
    targets: v.nodes.map((n) => n.target.map((t) => [].concat(t).join(" >>> ")).join(" | ")),
  }));
}"""


def axe_violations(
    page: Page,
    impacts: Iterable[str] = ("serious", "critical"),
    *,
    context: str | None = None,
    options: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """axe-core's violations in ``page`` (or the ``context`` selector) whose impact is in
    ``impacts``, as plain dicts: ``id``, ``impact``, ``help``, ``help_url``, ``targets``
    (a CSS selector per offending node). ``options`` go to ``axe.run``."""
    inject_axe(page)
    opts: dict[str, Any] = {"resultTypes": ["violations"], **(options or {})}
    found: list[dict[str, Any]] = page.evaluate(_AXE_RUN, [context, opts])
    wanted = set(impacts)
    return [v for v in found if v["impact"] in wanted]


def format_violations(violations: Iterable[dict[str, Any]]) -> str:
    """One line per violation, for an assertion message."""
    return "\n".join(
        f"  {v['impact']}: {v['id']}: {v['help']} -> {', '.join(v['targets'])}" for v in violations
    )


def assert_accessible(page: Page, impacts: Iterable[str] = ("serious", "critical")) -> None:
    """Fails listing axe-core's violations of those impacts in ``page``."""
    found = axe_violations(page, impacts)
    if found:
        pytest.fail(
            f"axe-core: {len(found)} violation(s) on {page.url}:\n{format_violations(found)}"
        )


def screenshots_dir() -> Path:
    """``$INFERD_SCREENSHOTS``, else ``.cache/screenshots/`` in the repo (git-ignored);
    created."""
    path = Path(os.environ.get(SCREENSHOTS_ENV) or ROOT / ".cache" / "screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


def screenshot(page: Page, name: str) -> Path:
    """A full-page PNG of ``page`` saved as ``<screenshots_dir>/<name>.png``; its path."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", name.removesuffix(".png")).strip("-.") or "page"
    path = screenshots_dir() / f"{stem}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
