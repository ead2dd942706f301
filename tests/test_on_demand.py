"""Versions loaded on demand under a memory budget (``models.memory_budget_mb``), against
the real server and real replica processes: nothing but pinned versions runs until a
request asks; a load unloads the least recently used versions with nothing in flight,
never a busy one nor a pinned one; every request is answered; loads, evictions and
counts show in the API and ``/metrics``. The policy's arithmetic has unit tests below."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from inferd.control.on_demand import SETTLE_S, Resident, evictions
from tests.conftest import InferdServer, push_source

pytestmark = pytest.mark.slow

MB = 1 << 20
# Each replica holds 200 MB on top of the interpreter and numpy (~50 MB): with a budget of
# 800 MB the pinned version and two more fit, a fourth does not.
BIG = """
import time

import numpy as np


class Big:
    signature = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    }

    def load(self, artifact_dir):
        self.ballast = np.ones(200 * 2**20 // 8)  # touched: resident

    def predict(self, batch):
        x = batch["x"]
        if (x < 0).any():
            time.sleep(8)  # a long request, to be in flight while others load
        return {"y": x * FACTOR}
"""
NAMES = ["slow", *(f"m{i}" for i in range(2, 10))]


def factor(name: str) -> int:
    return 1 if name == "slow" else int(name[1:])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferdServer]:
    data = tmp_path_factory.mktemp("on-demand")
    for name in ["pinned", *NAMES]:
        source = BIG.replace("FACTOR", str(factor(name) if name != "pinned" else 1))
        push_source(data, name, source, *(["--meta", "pinned=true"] if name == "pinned" else []))
    env = {"INFERD_MODELS__MEMORY_BUDGET_MB": "800", "INFERD_AUTOSCALE_INTERVAL_S": "1"}
    server = InferdServer(data, workers=2, env=env)
    try:
        server.wait_ready()
        yield server
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def predict(client: httpx.Client, name: str, x: float) -> float:
    reply = client.post(f"/api/v1/models/{name}/predict", json={"inputs": [{"x": x}]}, timeout=60)
    assert reply.status_code == 200, (name, reply.text)
    return reply.json()["outputs"][0]["y"]


def loaded(client: httpx.Client, name: str) -> bool:
    return client.get(f"/api/v1/models/{name}/versions/v1").json()["loaded"]


def pid(client: httpx.Client, name: str) -> int:
    (replica,) = client.get(f"/api/v1/models/{name}/versions/v1").json()["replicas"]
    return replica["pid"]


def metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_versions_load_on_demand_and_the_least_recently_used_idle_ones_leave(
    server: InferdServer,
) -> None:
    client = server.client
    counts = client.get("/api/v1/models").json()["versions"]
    assert counts == {"registered": 10, "loaded": 1}  # only the pinned one runs
    pinned_pid = pid(client, "pinned")

    assert predict(client, "slow", 1.0) == 1.0  # a request loads its version
    assert predict(client, "m2", 1.0) == 2.0
    assert loaded(client, "slow") and loaded(client, "m2")

    # ``slow`` is the least recently used, but busy: ``m2`` goes instead (each load waits
    # until the one before settled: a version just loaded is not evicted at once)
    long = ThreadPoolExecutor(1).submit(predict, client, "slow", -1.0)
    time.sleep(SETTLE_S + 0.3)  # the long request is in the replica meanwhile
    assert predict(client, "m3", 1.0) == 3.0
    assert loaded(client, "slow") and not loaded(client, "m2")
    time.sleep(SETTLE_S + 0.3)
    assert predict(client, "m4", 1.0) == 4.0
    assert loaded(client, "slow") and not loaded(client, "m3")
    assert long.result() == -1.0  # answered by the replica it started on
    time.sleep(SETTLE_S + 0.3)

    # idle now, it goes like any other
    for name in ("m5", "m6", "m7"):
        assert predict(client, name, 2.0) == 2.0 * factor(name)
        time.sleep(SETTLE_S + 0.3)
    assert not loaded(client, "slow")

    # many requests over every version, several at once: all answered
    rng = random.Random(0)
    work = [(name, float(rng.randint(1, 9))) for name in NAMES * 3]
    rng.shuffle(work)
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda w: predict(client, *w), work))
    assert answers == [x * factor(name) for name, x in work]

    assert pid(client, "pinned") == pinned_pid  # never evicted, never restarted
    # loads that found everything busy went over the budget: once idle, back under it
    server.wait_for(
        lambda: metric(client.get("/metrics").text, "inferd_on_demand_resident_bytes") <= 800 * MB,
        timeout_s=30,
        what="back under the budget",
    )
    counts = client.get("/api/v1/models").json()["versions"]
    assert counts["registered"] == 10 and counts["loaded"] <= 4
    text = client.get("/metrics").text
    assert metric(text, "inferd_on_demand_loads_total") >= 12
    assert metric(text, "inferd_on_demand_evictions_total") >= 9
    assert metric(text, 'inferd_on_demand_versions{state="loaded"}') < 9
    assert metric(text, "inferd_on_demand_budget_bytes") == 800 * MB
    events = client.get("/api/v1/deployments/slow").json()["scaling_events"]
    assert {e["reason"] for e in events} >= {"load", "evict"}


def resident(key: str, mb: int, used: float, pinned: bool = False, busy: bool = False) -> Resident:
    return Resident((key, "v1"), mb * MB, used, pinned, busy)


def test_evictions_take_the_least_recently_used_idle_unpinned_versions_until_it_fits() -> None:
    residents = [
        resident("a", 100, used=1.0),
        resident("b", 100, used=2.0, busy=True),
        resident("c", 100, used=3.0, pinned=True),
        resident("d", 100, used=4.0),
        resident("e", 100, used=5.0),
    ]
    assert evictions(100, residents, 600 * MB) == []  # it fits
    assert evictions(100, residents, 500 * MB) == [("a", "v1")]
    # b is busy and c pinned: passed over, the next least recently used go
    assert evictions(100, residents, 300 * MB) == [("a", "v1"), ("d", "v1"), ("e", "v1")]
    # even all it may unload is not enough: it unloads those, the load goes over
    assert evictions(100, residents, 100 * MB) == [("a", "v1"), ("d", "v1"), ("e", "v1")]
