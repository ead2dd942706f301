"""The web console's files: a page and a few scripts shipped inside the package, served
by every gateway at ``/ui`` with no build step and nothing fetched from elsewhere.

The scripts build every page in the browser from the JSON API (``/api/v1``, and the
figures under ``/api/v1/console``), with the credential the person pasted (kept in the
tab's session storage, sent as ``Authorization``). They put values on the page only as
text nodes, never as HTML, so a model named ``<img src=x onerror=...>`` shows as that
text; the strict Content-Security-Policy (:data:`SECURITY_HEADERS`) would stop a script
that got through anyway.

Files are read once, with an ETag (a hash of their bytes) and a gzip copy; browsers
revalidate them (``no-cache``), so a new version is picked up at once and an unchanged
file costs a 304.
"""

from __future__ import annotations

import gzip
import hashlib
import mimetypes
from dataclasses import dataclass
from importlib import resources

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self'; manifest-src 'self'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
    "cross-origin-opener-policy": "same-origin",
    "cross-origin-resource-policy": "same-origin",
}
_TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".html": "text/html; charset=utf-8",
    ".svg": "image/svg+xml",
    ".json": "application/json",
}


@dataclass(frozen=True, slots=True)
class Asset:
    body: bytes
    gzipped: bytes | None
    """None where gzip saves nothing worth it (small or compressed files)."""
    etag: str
    media_type: str


class Assets:
    """The console's files by their path under ``/ui/`` (``""``: the page)."""

    def __init__(self) -> None:
        self.files: dict[str, Asset] = {}
        root = resources.files(__package__) / "static"
        self._walk(root, "")

    def _walk(self, folder: resources.abc.Traversable, prefix: str) -> None:
        for entry in folder.iterdir():
            name = prefix + entry.name
            if entry.is_dir():
                self._walk(entry, name + "/")
            elif not entry.name.endswith((".md", "LICENSE")):
                self.files[name] = _asset(name, entry.read_bytes())
        if prefix == "" and "index.html" in self.files:
            self.files[""] = self.files["index.html"]

    def get(self, path: str) -> Asset | None:
        return self.files.get(path)


def _asset(name: str, body: bytes) -> Asset:
    suffix = "." + name.rsplit(".", 1)[-1] if "." in name else ""
    media_type = _TYPES.get(suffix) or mimetypes.guess_type(name)[0] or "application/octet-stream"
    packed = gzip.compress(body, 9, mtime=0) if len(body) > 512 else None
    if packed is not None and len(packed) > len(body) * 0.9:
        packed = None
    etag = '"' + hashlib.sha256(body).hexdigest()[:20] + '"'
    return Asset(body, packed, etag, media_type)


_ASSETS: Assets | None = None


def assets() -> Assets:
    """The files, read on first use (a gateway that never serves the console never
    reads them)."""
    global _ASSETS
    if _ASSETS is None:
        _ASSETS = Assets()
    return _ASSETS
