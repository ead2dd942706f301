"""Canary rollouts and shadow traffic on the real server: a canary as good as the stable
version is promoted step by step; one 20 % slower, or one that fails, is rolled back
with the reason recorded; a failing webhook check stops it; a shadow's answers are
compared with the live ones without slowing them."""

from __future__ import annotations

import json
import re
import statistics
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from inferd.registry import Registry
from tests.conftest import InferdServer, push_folder, served
from tests.test_traffic import Load

pytestmark = pytest.mark.slow

MODEL = """
import time

import numpy as np


class Sleepy:
    signature = {
        "inputs": [{"name": "features", "datatype": "FP32", "shape": [-1, 4]}],
        "outputs": [{"name": "prediction", "datatype": "FP32", "shape": [-1]}],
    }

    def predict(self, batch):
        x = batch["features"]
        if FAIL and (x != 0).any():  # the warm-up (zeros) passes
            raise ValueError("this version is broken")
        time.sleep(DELAY)
        return {"prediction": x.sum(axis=1).astype(np.float32) + OFFSET}
"""
BODY = {"inputs": [{"features": [1, 2, 3, 4]}]}
ONE_AT_A_TIME = {"max_batch_size": 1}
"""Each request is its own batch: compute time is the model's time for one request."""
VERSIONS = {
    # name: (delay s, fail, offset)
    "base": (0.020, False, 0.0),
    "same": (0.020, False, 0.0),
    "slower": (0.024, False, 0.0),  # the practice problem: 20 % slower
    "broken": (0.001, True, 0.0),
    "differs": (0.200, False, 1.0),  # slow, and answers differently
}


def _source(folder: Path, delay: float, fail: bool, offset: float) -> Path:
    folder.mkdir()
    code = MODEL.replace("DELAY", repr(delay)).replace("FAIL", repr(fail))
    (folder / "model.py").write_text(code.replace("OFFSET", repr(offset)))
    return folder


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = tmp_path_factory.mktemp("canary")
    sources = {
        name: _source(data / name, delay, fail, offset)
        for name, (delay, fail, offset) in VERSIONS.items()
    }
    # base last: the newest version is what serves before the first deployment.
    pushes = {
        "promo": ["same", "base"],
        "slowdown": ["slower", "base"],
        "faulty": ["broken", "base"],
        "hooked": ["same", "base"],
        "mirrored": ["same", "differs", "base"],
    }
    for model, versions in pushes.items():
        for version in versions:
            push_folder(data, model, sources[version], version, deploy=True)
    return data


@pytest.fixture(scope="module")
def server(data: Path) -> Iterator[InferdServer]:
    with served(data) as srv:
        yield srv


@pytest.fixture(scope="module")
def registry(data: Path) -> Iterator[Registry]:
    with Registry(f"sqlite:///{data / 'inferd.db'}", data / "artifacts", migrate=False) as reg:
        yield reg


def _stable(registry: Registry, model: str) -> None:
    """``base`` serves all the traffic of ``model``, one request per batch."""
    registry.deployments.deploy(
        model, "base", traffic_pct=100, batching=ONE_AT_A_TIME, actor="test"
    )


def _deployment(
    server: InferdServer, model: str, version: str, client: httpx.Client | None = None
) -> dict[str, Any]:
    """``model:version`` as ``GET /api/v1/deployments/{model}`` shows it (its live fields
    from the routing table of the gateway process that answers ``client``)."""
    view = (client or server.client).get(f"/api/v1/deployments/{model}").json()
    return next(v for v in view["versions"] if v["version"] == version)


def _wait_shadow_ready(server: InferdServer, model: str, version: str) -> None:
    """Until every gateway process's routing table has a ready replica of the shadow
    ``model:version`` (from then on each one mirrors to it)."""
    server.wait_all_gateways(
        lambda client: bool(_deployment(server, model, version, client)["replicas_ready"]),
        timeout_s=60,
        what=f"the shadow {model}:{version} ready",
    )


def _in_flight(server: InferdServer, model: str, version: str) -> float | None:
    """Requests in ``model:version``'s replicas, queued or computing, as ``/metrics``
    has them (it asks the replicas when it is scraped); None when none reported."""
    labels = (f'model="{model}"', f'version="{version}"')
    found = [
        float(line.split()[-1])
        for line in server.client.get("/metrics").text.splitlines()
        if line.startswith("inferd_inflight_requests{") and all(x in line for x in labels)
    ]
    return sum(found) if found else None


def _rollout_state(server: InferdServer, model: str, version: str) -> str:
    return str((_deployment(server, model, version)["rollout"] or {}).get("state"))


def _wait_rollout(server: InferdServer, model: str, version: str, states: set[str]) -> str:
    server.wait_for(
        lambda: _rollout_state(server, model, version) in states,
        timeout_s=150,
        what=f"canary {model}:{version} to reach {states}",
    )
    return _rollout_state(server, model, version)


CANARY = {"steps": [10, 50, 100], "step_s": 3, "min_requests": 20}


class Hook:
    """A local webhook answering ``status`` with ``body``, keeping what it was sent."""

    def __init__(self, status: int, body: str) -> None:
        self.calls: list[dict[str, Any]] = []
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                size = int(self.headers["content-length"])
                hook.calls.append(json.loads(self.rfile.read(size)))
                self.send_response(status)
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/check"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_canary_as_good_as_stable_is_promoted_step_by_step(server, registry):
    _stable(registry, "promo")
    hook = Hook(200, "ok")
    try:
        with Load(server.url, model="promo", body=BODY) as load:
            registry.deployments.deploy(
                "promo",
                "same",
                strategy="canary",
                batching=ONE_AT_A_TIME,
                rollout={**CANARY, "max_latency_increase": 0.5, "webhook": hook.url,
                         "keep_old_s": 1},
                actor="test",
            )  # fmt: skip
            assert _wait_rollout(server, "promo", "same", {"promoted", "rolled_back"}) == (
                "promoted"
            ), _deployment(server, "promo", "same")["rollout"]
            server.wait_for(
                lambda: {d.version for d in registry.deployments.list_all("promo")} == {"same"},
                timeout_s=60,
                what="base removed after the keep window",
            )
    finally:
        hook.close()
    assert load.failures == [], load.failures[:5]
    assert load.versions["same"] > 0 and load.versions["base"] > 0
    history = registry.deployments.history("promo")
    reasons = [h.reason for h in reversed(history)]
    assert reasons == ["deploy", "deploy", "canary_step", "canary_promoted", "canary_done"]
    splits = [h.split for h in reversed(history)][1:4]
    assert splits == [
        {"same": 10, "base": 90},
        {"same": 50, "base": 50},
        {"same": 100, "base": 0},
    ]
    assert "step 1 of 2 passed" in history[2].detail  # newest first: the 10 -> 50 step
    # The webhook got each step's figures, canary and stable side by side.
    assert len(hook.calls) == 2 and [c["traffic_pct"] for c in hook.calls] == [10, 50]
    first = hook.calls[0]
    assert first["model"] == "promo" and first["version"] == "same"
    assert first["stable_versions"] == ["base"]
    assert first["canary"]["requests"] >= 20 and first["stable"]["requests"] > 0
    assert 15 < first["canary"]["compute_p99_ms"] < 200


def test_a_canary_20_percent_slower_is_rolled_back_before_full_rollout(server, registry):
    """The design document's practice problem, with the default thresholds (p99 of
    compute time at most 10 % above the stable version's)."""
    _stable(registry, "slowdown")
    with Load(server.url, model="slowdown", body=BODY) as load:
        registry.deployments.deploy(
            "slowdown",
            "slower",
            strategy="canary",
            batching=ONE_AT_A_TIME,
            rollout={"steps": [10, 50, 100], "step_s": 4, "min_requests": 40},
            actor="test",
        )
        state = _wait_rollout(server, "slowdown", "slower", {"promoted", "rolled_back"})
        # The load goes on past the rollback: base answers 50 more of its requests (about
        # a second of it: one replica, 20 ms a request).
        after = load.versions["base"]
        server.wait_for(
            lambda: load.versions["base"] >= after + 50,
            timeout_s=30,
            what="base to answer the load after the rollback",
        )
    assert state == "rolled_back"
    assert load.failures == [], load.failures[:5]
    deployment = _deployment(server, "slowdown", "slower")
    rollout = deployment["rollout"]
    assert deployment["status"] == "rolled_back" and deployment["traffic_pct"] == 0
    assert rollout["step"] == 0  # caught at the first step (10 %)
    assert re.match(r"compute p(50|99) .* limit \+10%", rollout["reason"]), rollout["reason"]
    canary, stable = rollout["analysis"]["canary"], rollout["analysis"]["stable"]
    ratio = canary["compute_p50_ms"] / stable["compute_p50_ms"]
    assert 1.1 < ratio < 1.4, rollout["analysis"]
    (last,) = registry.deployments.history("slowdown", 1)
    assert last.reason == "canary_rollback" and last.split == {"slower": 0, "base": 100}
    assert last.actor == "inferd" and last.detail == rollout["reason"]
    # Its replicas stop; the stable version keeps everything.
    server.wait_for(
        lambda: not _deployment(server, "slowdown", "slower")["replicas"],
        timeout_s=30,
        what="the rolled back canary's replicas to stop",
    )
    reply = server.client.post("/api/v1/models/slowdown/predict", json=BODY)
    assert reply.json()["version"] == "base"


def test_a_failing_canary_is_rolled_back_at_once_and_users_never_see_it(server, registry):
    _stable(registry, "faulty")
    with Load(server.url, model="faulty", body=BODY) as load:
        started = time.monotonic()
        registry.deployments.deploy(
            "faulty",
            "broken",
            strategy="canary",
            rollout={"steps": [50, 100], "step_s": 600, "min_requests": 10},
            actor="test",
        )
        state = _wait_rollout(server, "faulty", "broken", {"promoted", "rolled_back"})
        took = time.monotonic() - started
    assert state == "rolled_back"
    assert took < 120  # without waiting for the 600 s window
    assert load.failures == [], load.failures[:5]  # the fallback answered them
    rollout = _deployment(server, "faulty", "broken")["rollout"]
    assert rollout["reason"].startswith("error rate 100.00%")
    assert rollout["analysis"]["canary"]["errors"] >= 10


def test_a_failing_webhook_check_rolls_the_canary_back(server, registry):
    _stable(registry, "hooked")
    hook = Hook(503, "conversion rate dropped")
    try:
        with Load(server.url, model="hooked", body=BODY):
            registry.deployments.deploy(
                "hooked",
                "same",
                strategy="canary",
                batching=ONE_AT_A_TIME,
                rollout={**CANARY, "max_latency_increase": 1.0, "webhook": hook.url},
                actor="test",
            )
            state = _wait_rollout(server, "hooked", "same", {"promoted", "rolled_back"})
    finally:
        hook.close()
    assert state == "rolled_back"
    rollout = _deployment(server, "hooked", "same")["rollout"]
    assert rollout["reason"] == "webhook answered 503: conversion rate dropped"
    assert len(hook.calls) == 1


def test_shadow_traffic_is_compared_with_live_answers_and_never_slows_them(server, registry):
    deployments = registry.deployments
    deployments.deploy("mirrored", "base", traffic_pct=100, actor="test")
    deployments.deploy("mirrored", "same", strategy="shadow", traffic_pct=100, actor="test")
    _wait_shadow_ready(server, "mirrored", "same")
    for _ in range(60):
        reply = server.client.post("/api/v1/models/mirrored/predict", json=BODY)
        assert reply.status_code == 200 and reply.json()["version"] == "base"

    def shadow_figures(version: str, at_least: int) -> dict[str, Any] | None:
        live = _deployment(server, "mirrored", version)["live"] or {}
        shadow = live.get("shadow")
        return shadow if shadow and shadow["compared"] >= at_least else None

    server.wait_for(lambda: shadow_figures("same", 60), timeout_s=30, what="60 comparisons")
    assert shadow_figures("same", 60) == {
        "compared": 60,
        "agreed": 60,
        "failed": 0,
        "agreement": 1.0,
    }
    shadow = _deployment(server, "mirrored", "same")
    assert shadow["traffic_pct"] == 0 and shadow["rollout"]["mirror_pct"] == 100
    refused = server.client.put("/api/v1/deployments/mirrored/traffic", json={"same": 100})
    assert refused.status_code == 422 and "a shadow" in refused.json()["error"]["message"]

    # A shadow that answers differently and takes 200 ms: half the requests mirrored,
    # none agree, and the live answers stay as fast as without it.
    deployments.undeploy("mirrored", "same", actor="test")
    deployments.deploy("mirrored", "differs", strategy="shadow", traffic_pct=50, actor="test")
    _wait_shadow_ready(server, "mirrored", "differs")
    latencies = []
    for _ in range(80):
        started = time.perf_counter()
        reply = server.client.post("/api/v1/models/mirrored/predict", json=BODY)
        latencies.append(time.perf_counter() - started)
        assert reply.status_code == 200 and reply.json()["version"] == "base"
    assert statistics.median(latencies) < 0.1  # the shadow's 200 ms is not in them
    # Every mirrored request answered and compared: none left in the shadow's replica.
    server.wait_for(
        lambda: shadow_figures("differs", 20) and _in_flight(server, "mirrored", "differs") == 0,
        timeout_s=60,
        what="comparisons",
    )
    figures = shadow_figures("differs", 20)
    assert figures is not None and figures["agreed"] == 0 and figures["agreement"] == 0.0
    assert 20 <= figures["compared"] <= 60  # about half of 80
