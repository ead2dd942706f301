"""Small versions packed into shared replica processes (``models.versions_per_process``),
against the real server: they share one process yet answer as separate replicas; one
version raising on every call fails only its own requests; one whose predict hangs is
cut off by its time budget (``models.predict_budget_s``) without stalling its neighbours,
and comes back in a process of its own."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import InferdServer, push_source

pytestmark = pytest.mark.slow

MODEL = """
import time


class Model:
    signature = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    }

    def predict(self, batch):
        x = batch["x"]
        if KIND == "raise" and (x != 0).any():  # its warm-up (zeros) passes
            raise ValueError("this model refuses everything")
        if KIND == "hang" and (x == 7).any():
            time.sleep(600)
        return {"y": x * 2}
"""
KINDS = {"a": "ok", "b": "ok", "c": "ok", "d": "ok", "raiser": "raise", "hanger": "hang"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferdServer]:
    data = tmp_path_factory.mktemp("shared")
    for name, kind in KINDS.items():
        push_source(data, name, MODEL.replace("KIND", repr(kind)))
    env = {"INFERD_MODELS__VERSIONS_PER_PROCESS": "8", "INFERD_MODELS__PREDICT_BUDGET_S": "2"}
    server = InferdServer(data, workers=2, env=env)
    try:
        server.wait_ready()
        yield server
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def pids(client: httpx.Client, name: str) -> list[int]:
    replicas = client.get(f"/api/v1/models/{name}/versions/v1").json()["replicas"]
    return [r["pid"] for r in replicas if r["state"] == "ready"]


def timed(client: httpx.Client, name: str, x: float) -> tuple[int, float]:
    began = time.perf_counter()
    reply = client.post(f"/api/v1/models/{name}/predict", json={"inputs": [{"x": x}]})
    return reply.status_code, time.perf_counter() - began


def test_small_versions_share_a_process_and_answer_as_their_own(server: InferdServer) -> None:
    client = server.client
    shared = {name: pids(client, name) for name in KINDS}
    assert all(len(p) == 1 for p in shared.values()), shared
    assert len({p[0] for p in shared.values()}) == 1  # six versions, one process
    for name in "abcd":
        reply = client.post(f"/api/v1/models/{name}/predict", json={"inputs": [{"x": 3}]})
        assert reply.status_code == 200 and reply.json()["version"] == "v1"
        assert reply.json()["outputs"][0]["y"] == 6
    text = client.get("/metrics").text
    for name in KINDS:  # each its own replica in the figures
        assert f'inferd_replica_load_seconds{{model="{name}"' in text


def test_a_failing_neighbour_fails_only_its_own_requests(server: InferdServer) -> None:
    client = server.client
    with ThreadPoolExecutor(8) as pool:
        bad = [pool.submit(timed, client, "raiser", 1.0) for _ in range(20)]
        good = [pool.submit(timed, client, name, 1.0) for name in "abcd" * 10]
    assert all(f.result()[0] >= 400 for f in bad)
    assert all(f.result()[0] == 200 for f in good)
    refused = client.post("/api/v1/models/raiser/predict", json={"inputs": [{"x": 1}]})
    assert "refuses everything" in refused.text


def test_a_hanging_neighbour_is_cut_off_and_moves_to_a_process_of_its_own(
    server: InferdServer,
) -> None:
    client = server.client
    (host,) = set(pids(client, "a"))
    with ThreadPoolExecutor(2) as pool:
        stuck = pool.submit(
            client.post,
            "/api/v1/models/hanger/predict",
            json={"inputs": [{"x": 7}]},
            headers={"X-Request-Timeout": "6"},
        )
        time.sleep(0.3)
        while_stuck = [timed(client, name, 2.0) for name in "abcd" * 10]  # ~1 s of calls
        assert all(code == 200 for code, _ in while_stuck)
        assert statistics.median(t for _, t in while_stuck) < 0.1  # not stalled
        answer = stuck.result()
    # its request fails at once, naming why (not retried elsewhere: it would hang there)
    assert answer.status_code == 500, answer.text
    assert "ran past its time budget of 2s" in answer.json()["error"]["message"]
    # cut off after its budget, it comes back in a process of its own; the others stay
    server.wait_for(
        lambda: (p := pids(client, "hanger")) and p[0] != host, what="hanger in its own process"
    )
    assert all(pids(client, name) == [host] for name in "abcd")
    assert timed(client, "hanger", 1.0)[0] == 200
    assert "hanger:v1 gets a process of its own from now on" in server.log()


SPIN = """
import time


class Spin:
    signature = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    }

    def predict(self, batch):
        began = time.perf_counter()
        while SPIN and time.perf_counter() - began < 0.03:  # a core's worth of compute
            pass
        return {"y": batch["x"]}
"""


def test_a_shared_process_busy_computing_takes_no_new_replica(tmp_path) -> None:
    """Loaded on demand one after another: a version goes beside the others until their
    process computes most of a core; the next one then gets another process."""
    data = tmp_path / "data"
    for name, spin in (("first", False), ("hot", True), ("calm", False)):
        # one request a batch: the queued ones do not merge into one 30 ms batch, which
        # left gaps of round trips between batches (under 0.8 of a core on a loaded CI)
        push_source(data, name, SPIN.replace("SPIN", str(spin)), "--batching",
                    json.dumps({"max_batch_size": 1}))  # fmt: skip
    env = {"INFERD_MODELS__VERSIONS_PER_PROCESS": "8", "INFERD_MODELS__MEMORY_BUDGET_MB": "4096"}
    server = InferdServer(data, workers=1, env=env)
    try:
        server.wait_ready()
        client = server.client
        assert timed(client, "first", 1.0)[0] == 200
        assert timed(client, "hot", 1.0)[0] == 200
        assert pids(client, "hot") == pids(client, "first")  # room: beside it
        deadline = time.monotonic() + 6.0
        # keep "hot" computing all the time: 4 clients, so that one is always queued
        # behind the batch computing even when a loaded machine slows the round trips
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda _: [timed(client, "hot", 1.0) for _ in iter(
                lambda: time.monotonic() < deadline, False)], range(4)))  # fmt: skip
        assert timed(client, "calm", 1.0)[0] == 200
        assert pids(client, "calm") != pids(client, "hot")  # that process is busy
    finally:
        assert server.stop() == 0, server.log()[-3000:]
