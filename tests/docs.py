"""The project's written documentation: README and the docs site's pages (``docs/``),
for the tests that run their examples and check what they state. The reference pages
generated from the code (``scripts/gen_reference.py``) are checked by being regenerated
(tests/test_reference_docs.py), not here."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
GENERATED = frozenset(
    DOCS / "reference" / name
    for name in ("cli.md", "settings.md", "metrics.md", "errors.md", "http-api.md")
)


def pages() -> list[Path]:
    """README, then every written page of the site, in a stable order."""
    written = sorted(p for p in DOCS.rglob("*.md") if p not in GENERATED)
    return [README, *written]


def name(page: Path) -> str:
    return str(page.relative_to(ROOT))
