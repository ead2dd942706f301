"""CPU-seconds of the suite by test: ``INFERD_TEST_CPU_LOG=path`` makes every pytest
process (each xdist worker) append one JSON line per test to ``path``: its node id, wall
seconds, and the CPU-seconds the process spent (``RUSAGE_SELF``) and its reaped children
spent (``RUSAGE_CHILDREN``: servers and replicas a test or a fixture started and stopped)
from setup to teardown. A fixture shared by several tests counts where it is set up and
torn down. ``python scripts/suite_cpu.py path`` sums them by file.
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Iterator

import pytest

LOG = os.environ.get("INFERD_TEST_CPU_LOG")


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if not LOG:
        yield
        return
    wall, own, children = (
        time.monotonic(), _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN),
    )  # fmt: skip
    yield
    row = {
        "test": item.nodeid,
        "wall_s": round(time.monotonic() - wall, 3),
        "self_s": round(_cpu(resource.RUSAGE_SELF) - own, 3),
        "children_s": round(_cpu(resource.RUSAGE_CHILDREN) - children, 3),
    }
    with open(LOG, "a") as out:
        out.write(json.dumps(row) + "\n")
