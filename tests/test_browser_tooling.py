"""The browser test tooling end to end (tests/browser.py): Debian's Chromium driven by
Playwright, a page under the console's strict CSP drawing a chart with the vendored uPlot,
the console-error collector, axe-core injected despite the CSP, and a screenshot."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests import browser as bt
from tests.conftest import ROOT, free_port

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

UPLOT = ROOT / "inferd" / "console" / "static" / "vendor" / "uplot"
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:"
)
# 1x1 transparent PNG.
PIXEL = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360000002000001e221bc330000000049454e44ae426082"
)

HEAD = (
    '<!doctype html><html lang="en"><head><meta charset="utf-8">'
    '<link rel="icon" href="data:,"><title>{title}</title>{extra}</head>'
)
CHART_PAGE = (
    HEAD.format(
        title="Latency",
        extra='<link rel="stylesheet" href="/vendor/uplot/uPlot.min.css">'
        '<script defer src="/vendor/uplot/uPlot.iife.min.js"></script>'
        '<script defer src="/chart.js"></script>',
    )
    + '<body><main><h1>Latency</h1><div id="chart" role="img" aria-label="p50 latency in ms">'
    "</div></main></body></html>"
)
CHART_JS = """\
const el = document.getElementById("chart");
new uPlot(
  {
    width: 480,
    height: 240,
    series: [{}, { label: "p50 ms", stroke: "#1f5fbf", width: 2 }],
  },
  [[1, 2, 3, 4, 5], [12, 18, 9, 22, 15]],
  el,
);
document.body.dataset.ready = "1";
"""
BAD_PAGE = (
    HEAD.format(title="Unlabelled", extra="")
    + '<body><main><h1>Bad</h1><img src="/pixel.png"><button type="button"></button>'
    "</main></body></html>"
)


def _routes(foreign: str) -> dict[str, tuple[bytes, str, bool]]:
    """path -> (body, content type, with the CSP header)."""
    leaky = (
        HEAD.format(
            title="Leaky",
            extra=f'<link rel="stylesheet" href="{foreign}/fonts.css">'
            '<script src="/throws.js"></script>',
        )
        + "<body><main><h1>Leaky</h1></main></body></html>"
    )
    html = "text/html; charset=utf-8"
    return {
        "/index.html": (CHART_PAGE.encode(), html, True),
        "/chart.js": (CHART_JS.encode(), "text/javascript", True),
        "/bad.html": (BAD_PAGE.encode(), html, True),
        "/pixel.png": (PIXEL, "image/png", True),
        "/leaky.html": (leaky.encode(), html, False),
        "/throws.js": (b'throw new Error("boom from throws.js");', "text/javascript", False),
        "/vendor/uplot/uPlot.iife.min.js": (
            (UPLOT / "uPlot.iife.min.js").read_bytes(),
            "text/javascript",
            True,
        ),
        "/vendor/uplot/uPlot.min.css": ((UPLOT / "uPlot.min.css").read_bytes(), "text/css", True),
    }


@pytest.fixture(scope="module")
def site() -> Iterator[str]:
    """The test pages on 127.0.0.1 (a free port), in a thread; the base URL."""
    routes = _routes(foreign=f"http://127.0.0.1:{free_port()}")  # a closed loopback port

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            found = routes.get(self.path.split("?")[0])
            if found is None:
                self.send_error(404)
                return
            body, ctype, csp = found
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            if csp:
                self.send_header("Content-Security-Policy", CSP)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with bt.browser_session() as b:
        yield b


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 800, "height": 600})
    try:
        yield context.new_page()
    finally:
        context.close()


def test_chart_page_under_strict_csp_is_clean_and_accessible(site: str, page: Page) -> None:
    errors = bt.ConsoleErrors(page, site)
    page.goto(f"{site}/index.html")
    page.wait_for_selector("body[data-ready='1']", timeout=5000)
    canvas = page.locator("#chart canvas")
    assert canvas.count() == 1
    box = canvas.bounding_box()
    assert box is not None and box["width"] > 100 and box["height"] > 50

    violations = bt.axe_violations(page)  # serious or critical ones
    assert violations == [], bt.format_violations(violations)
    shot = bt.screenshot(page, "browser-tooling chart")
    assert shot.name == "browser-tooling-chart.png"
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # axe's injection through the DevTools protocol left no CSP violation behind.
    errors.assert_clean()


def test_axe_finds_unlabelled_image_and_button(site: str, page: Page) -> None:
    errors = bt.ConsoleErrors(page, site)
    page.goto(f"{site}/bad.html")
    found = {v["id"]: v for v in bt.axe_violations(page)}
    assert {"image-alt", "button-name"} <= found.keys(), found
    assert found["image-alt"]["impact"] == "critical"
    assert found["image-alt"]["targets"] == ["img"]
    assert found["button-name"]["help"]
    with pytest.raises(pytest.fail.Exception, match="image-alt"):
        bt.assert_accessible(page)
    errors.assert_clean()


def test_console_errors_catch_exceptions_and_foreign_requests(site: str, page: Page) -> None:
    errors = bt.ConsoleErrors(page, site)
    page.goto(f"{site}/leaky.html")
    page.wait_for_load_state("load")
    kinds = {p.kind for p in errors.problems}
    assert {"pageerror", "foreign-request", "requestfailed"} <= kinds, errors.problems
    with pytest.raises(pytest.fail.Exception, match=r"boom from throws\.js"):
        errors.assert_clean()


def test_missing_browser_fails_loudly(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(bt.SKIP_ENV, raising=False)
    monkeypatch.setattr(bt, "CHROMIUM", tmp_path / "chromium")
    with pytest.raises(pytest.fail.Exception, match="apt-get install chromium"):
        bt.chromium_or_fail()
    monkeypatch.setenv(bt.SKIP_ENV, "1")
    with pytest.raises(pytest.skip.Exception, match=bt.SKIP_ENV):
        bt.chromium_or_fail()


def test_screenshots_dir_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(bt.SCREENSHOTS_ENV, str(tmp_path / "shots"))
    assert bt.screenshots_dir() == tmp_path / "shots"
    assert (tmp_path / "shots").is_dir()
    monkeypatch.delenv(bt.SCREENSHOTS_ENV)
    assert bt.screenshots_dir() == ROOT / ".cache" / "screenshots"
