"""The curl examples of README's tour and of the errors reference page run against a
real demo server and answer as shown."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.conftest import InferdServer
from tests.docs import DOCS, README

pytestmark = pytest.mark.slow


PAGES = {README: 3, DOCS / "reference" / "errors-and-limits.md": None}
"""The pages whose curl examples are run, and how many (None: all); the others change
the server's state (repository unload, deployments, jobs) or need the LLM."""


def _examples() -> list[tuple[str, dict]]:
    found = []
    for page, count in PAGES.items():
        section = page.read_text()
        blocks = re.findall(r"\$ (curl .*?)\n(\{.*?\})\n", section, flags=re.S)
        found += [(cmd.replace("\\\n", " "), json.loads(out)) for cmd, out in blocks[:count]]
    return found


def test_readme_has_examples():
    assert len(_examples()) == 5


@pytest.mark.parametrize("index", range(5))
def test_readme_curl_example(demo_server: InferdServer, index: int):
    command, shown = _examples()[index]
    command = command.replace("localhost:8000", f"127.0.0.1:{demo_server.port}")
    result = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=30)
    got = json.loads(result.stdout)
    volatile = {"latency_ms", "request_id", "confidence", "probabilities"}

    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in volatile}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    assert strip(got) == strip(shown)
