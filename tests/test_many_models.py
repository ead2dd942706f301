"""200 versions on one server, in shared replica processes under a memory budget that fits
about 30 of them (#38's test): random requests over all of them are all answered,
versions are loaded and evicted as they come, pinned versions stay, and the server ends
back under its budget."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import InferdServer, push_source

pytestmark = pytest.mark.slow

VERSIONS = 200
MB = 1 << 20
# Each version holds 2 MiB (its load adds about that to its shared process): a 64 MiB
# budget fits about 30 of them.
MODEL = """
import numpy as np


class Small:
    signature = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    }

    def load(self, artifact_dir):
        self.ballast = np.ones(2 * 2**20 // 8)

    def predict(self, batch):
        return {"y": batch["x"] * FACTOR}
"""


def name(i: int) -> str:
    return f"m{i:03d}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferdServer]:
    data = tmp_path_factory.mktemp("many")
    for i in range(VERSIONS):
        pin = ["--meta", "pinned=true"] if i < 2 else []
        push_source(data, name(i), MODEL.replace("FACTOR", str(i)), *pin)
    env = {
        "INFERD_MODELS__VERSIONS_PER_PROCESS": "50",
        "INFERD_MODELS__MEMORY_BUDGET_MB": "64",
        "INFERD_AUTOSCALE_INTERVAL_S": "1",
        "INFERD_BATCHING__WARMUP_REQUESTS": "1",
    }
    server = InferdServer(data, workers=2, env=env)
    try:
        server.wait_ready(timeout_s=180)
        yield server
    finally:
        assert server.stop(timeout_s=60) == 0, server.log()[-3000:]


def metric(text: str, prefix: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))


def test_random_requests_over_200_versions_under_a_budget_for_30(server: InferdServer) -> None:
    client = server.client
    assert client.get("/api/v1/models").json()["versions"] == {"registered": 200, "loaded": 2}
    pinned = {i: _pid(client, name(i)) for i in (0, 1)}
    rng = random.Random(0)
    work = [rng.randrange(VERSIONS) for _ in range(400)]

    def call(i: int) -> tuple[int, float | str]:
        reply = client.post(
            f"/api/v1/models/{name(i)}/predict", json={"inputs": [{"x": 2}]}, timeout=60
        )
        if not reply.is_success:
            return reply.status_code, reply.text  # named in the failure
        return reply.status_code, reply.json()["outputs"][0]["y"]

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(call, work))
    failed = [(name(i), a) for i, a in zip(work, answers, strict=True) if a[0] != 200]
    assert not failed, failed
    assert answers == [(200, 2.0 * i) for i in work]  # every request answered, by its version

    text = client.get("/metrics").text
    assert metric(text, "inferd_on_demand_loads_total") >= 100
    assert metric(text, "inferd_on_demand_evictions_total") >= 50
    assert {i: _pid(client, name(i)) for i in (0, 1)} == pinned  # pinned: never left
    server.wait_for(
        lambda: metric(client.get("/metrics").text, "inferd_on_demand_resident_bytes") <= 64 * MB,
        timeout_s=30,
        what="back under the budget",
    )
    loaded = client.get("/api/v1/models").json()["versions"]["loaded"]
    assert 2 < loaded < 60, loaded


def _pid(client: httpx.Client, model: str) -> int:
    (replica,) = client.get(f"/api/v1/models/{model}/versions/v1").json()["replicas"]
    return replica["pid"]
