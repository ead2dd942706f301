"""README and the docs site state defaults in prose ("`request_timeout_s`, 30 s", "`jobs.max_items`
(1,000,000)"): every such statement about a setting must be what the code does."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from inferd.config import Settings
from inferd.registry.deployments import CANARY_DEFAULTS
from tests import docs

STATEMENT = re.compile(
    r"`(?P<name>(?:INFERD_)?[A-Za-z_][A-Za-z0-9_.]*)`"
    r"(?:\s*(?P<sep>\(|,|=|:|is|\|)?\s*(?:default(?::| is)?\s*)?)"
    r"(?P<number>-?\d[\d,]*(?:\.\d+)?|none\b)"
    r"(?:\s*(?P<unit>ms|s|MiB|GiB|KiB|days?|min|h)(?![A-Za-z]))?"
)
UNIT_SECONDS = {"ms": 0.001, "s": 1, "min": 60, "h": 3600, "day": 86400, "days": 86400}
UNIT_BYTES = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def _defaults(model: BaseModel, prefix: str = "") -> dict[str, Any]:
    """Every setting's default, by dotted path (nested settings flattened)."""
    out: dict[str, Any] = {}
    for name in type(model).model_fields:
        value = getattr(model, name)
        path = f"{prefix}{name}"
        if isinstance(value, BaseModel):
            out |= _defaults(value, f"{path}.")
        else:
            out[path] = value
    return out


DEFAULTS = _defaults(Settings(_env_file=None))  # type: ignore[call-arg]
LEAVES: dict[str, list[str]] = {}
for path in DEFAULTS:
    LEAVES.setdefault(path.rsplit(".", 1)[-1], []).append(path)


def resolve(name: str) -> tuple[str, Any] | None:
    """The setting a README name stands for (``batching.max_wait_ms``,
    ``INFERD_LLM__MAX_TOKENS_LIMIT``, a leaf name that is unique: ``max_wait_ms``), or
    a canary analysis default; None when the name is no setting."""
    if name.startswith("INFERD_"):
        name = name.removeprefix("INFERD_").lower().replace("__", ".")
    if name in DEFAULTS:
        return name, DEFAULTS[name]
    if len(LEAVES.get(name, [])) == 1:
        path = LEAVES[name][0]
        return path, DEFAULTS[path]
    if name in CANARY_DEFAULTS:
        return f"rollout.{name}", CANARY_DEFAULTS[name]
    return None


def in_field_units(path: str, number: float, unit: str | None) -> float:
    """A README figure in the unit the setting's name says (``_s``, ``_ms``, bytes)."""
    if unit is None or unit == "%":
        return number
    if unit in UNIT_BYTES:
        return number * UNIT_BYTES[unit]
    seconds = number * UNIT_SECONDS[unit]
    return seconds * 1000 if path.endswith("_ms") else seconds


def statements() -> list[tuple[str, str, str, float, Any]]:
    found = []
    for page, lineno, line in _lines():
        for match in STATEMENT.finditer(line):
            resolved = resolve(match["name"])
            if resolved is None:
                continue
            if match["sep"] == "|" and not line.startswith(f"| `{match['name']}` |"):
                continue  # a table cell after the name is a default only in a settings table
            path, default = resolved
            if match["number"] == "none":
                found.append((f"{docs.name(page)}:{lineno}", match.group(0), path, None, default))
                continue
            number = float(match["number"].replace(",", ""))
            stated = in_field_units(path, number, match["unit"])
            found.append((f"{docs.name(page)}:{lineno}", match.group(0), path, stated, default))
    return found


def _lines() -> list[tuple[Path, int, str]]:
    return [
        (page, lineno, line)
        for page in docs.pages()
        for lineno, line in enumerate(page.read_text().splitlines(), 1)
    ]


STATEMENTS = statements()


def test_readme_states_defaults():
    """The scan finds what it is meant to (a regression guard for the regex itself)."""
    paths = {path for _, _, path, _, _ in STATEMENTS}
    assert {"request_timeout_s", "max_request_timeout_s", "max_rows_per_request"} <= paths
    assert {"jobs.max_items", "llm.max_tokens_limit", "batching.max_wait_ms"} <= paths
    assert {"batching.queue_timeout_ms", "llm.max_prompt_tokens", "max_body_bytes"} <= paths
    assert len(STATEMENTS) >= 25


@pytest.mark.parametrize(
    ("where", "text", "path", "stated", "default"),
    STATEMENTS,
    ids=[f"{s[0]}:{s[2]}" for s in STATEMENTS],
)
def test_readme_default_is_the_code_default(where, text, path, stated, default):
    if stated is None:  # "none": the setting has no default value
        assert default is None, f"{where} says {text!r}; {path} is {default!r}"
        return
    assert default is not None, f"{where} ({text!r}): {path} has no default"
    assert float(default) == pytest.approx(stated), (
        f"{where} says {text!r}; {path} defaults to {default!r}"
    )
