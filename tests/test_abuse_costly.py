"""Costly work is admitted, not just accepted: explanations against a real server with
auth on. An explanation's cost (KernelSHAP: rows x coalitions x background rows) is
checked against ``explain.max_model_rows`` before anything runs, a replica keeps at most
``explain.max_waiting`` waiting behind the one it computes, and a deadline stops one
mid-work (its thread is free again at once, not when the work would have ended)."""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from inferd.errors import PayloadTooLarge
from inferd.replica_config import ExplainConfig
from inferd.runtimes.explain import check_rows, coalitions, kernel_cost
from tests.conftest import InferdServer, create_key, push_source

SLOW_MODEL = """
import time

import numpy as np


class Slow:
    signature = {
        "inputs": [{"name": "features", "datatype": "FP32", "shape": [-1, 6]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    }

    def predict(self, batch):
        time.sleep(0.05)  # every call: an explanation of 20 rows makes ~60 of them
        return {"y": batch["features"].sum(axis=1).astype(np.float32)}
"""
BACKGROUND = np.random.default_rng(0).normal(size=(10, 6)).round(3).tolist()


def test_the_cost_of_a_kernel_explanation() -> None:
    assert kernel_cost(rows=1, features=6, background=10, coalitions=2048) == 62 * 10 + 1 + 10
    assert kernel_cost(rows=100, features=30, background=64, coalitions=2048) == (
        100 * 2048 * 64 + 100 + 64  # what one request could cost before: 13 M model rows
    )
    assert kernel_cost(rows=5, features=1, background=10, coalitions=2048) == 15
    masks, weights = coalitions(30, np.random.default_rng(0), 100)
    assert masks.shape == (100, 30) and len(weights) == 100
    with pytest.raises(PayloadTooLarge, match=r"explain\.max_rows"):
        check_rows(11, ExplainConfig(max_rows=10))


@pytest.fixture(scope="module")
def costly(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    data: Path = tmp_path_factory.mktemp("abuse-costly")
    background = json.dumps([{"features": row} for row in BACKGROUND])
    push_source(data, "slow", SLOW_MODEL, "--meta", f"background_samples={background}")
    key = create_key(data, "app", "infer")
    env = {
        "INFERD_AUTH__ENABLED": "true",
        "INFERD_EXPLAIN__MAX_WAITING": "1",
        "INFERD_EXPLAIN__MAX_MODEL_ROWS": "20000",
    }
    server = InferdServer(data, workers=1, env=env)
    try:
        server.wait_ready()
        yield {"server": server, "key": key}
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def _explain(costly: dict[str, Any], rows: int, timeout_s: float | None = None) -> httpx.Response:
    server: InferdServer = costly["server"]
    headers = {"authorization": f"Bearer {costly['key']}"}
    if timeout_s is not None:
        headers["x-request-timeout"] = str(timeout_s)
    body = {"inputs": [{"features": BACKGROUND[i % 10]} for i in range(rows)]}
    return httpx.post(
        f"{server.url}/api/v1/models/slow/explain", json=body, headers=headers, timeout=60
    )


def _explaining(costly: dict[str, Any]) -> float:
    """The replica's explanations computing or waiting (its status, as the API shows it)."""
    server: InferdServer = costly["server"]
    headers = {"authorization": f"Bearer {costly['key']}"}
    detail = server.client.get("/api/v1/models/slow", headers=headers).json()
    (replica,) = detail["versions"][0]["replicas"]
    return replica.get("stats", {}).get("explaining", 0)


def test_an_explanation_over_its_cost_budget_is_refused_before_it_runs(costly) -> None:
    started = time.monotonic()
    refused = _explain(costly, 40)  # 40 x 62 x 10 + 50 = 24,850 model rows > 20,000
    assert refused.status_code == 413, refused.text
    message = refused.json()["error"]["message"]
    assert "24,850 model rows" in message and "explain.max_model_rows" in message
    assert time.monotonic() - started < 1.0  # nothing was computed
    assert _explain(costly, 1).status_code == 200


def test_a_replica_keeps_a_bounded_queue_of_explanations(costly) -> None:
    """Three explanations of ~3 s at once with ``max_waiting`` 1: one computes, one
    waits, the third is refused at once (503, Retry-After)."""
    server: InferdServer = costly["server"]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        first = pool.submit(_explain, costly, 20)
        server.wait_for(lambda: _explaining(costly) == 1, what="the first explanation")
        second = pool.submit(_explain, costly, 20)
        server.wait_for(lambda: _explaining(costly) == 2, what="the second one waiting")
        started = time.monotonic()
        third = pool.submit(_explain, costly, 20).result()
        refused_after = time.monotonic() - started
        answers = [first.result(), second.result()]
    assert third.status_code == 503, third.text
    assert "explain.max_waiting" in third.json()["error"]["message"]
    assert int(third.headers["retry-after"]) >= 1
    assert refused_after < 1.0
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]


def test_a_deadline_stops_an_explanation_mid_work(costly) -> None:
    started = time.monotonic()
    late = _explain(costly, 20, timeout_s=0.5)  # ~3 s of work
    took = time.monotonic() - started
    assert late.status_code == 504, late.text  # the gateway's answer at the deadline
    assert took < 1.5, took
    started = time.monotonic()  # its thread is free: the next one starts at once
    assert _explain(costly, 1).status_code == 200
    assert time.monotonic() - started < 1.5
