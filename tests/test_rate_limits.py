"""Rate limits: the token bucket itself, then the real server — the N+1-th request of a
burst gets 429 with Retry-After and X-RateLimit-* headers, per client and per model, in
process with one gateway process, and shared through the machine's real Redis by two."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from inferd.api.limits import LocalLimiter
from inferd.config import Limit
from tests.conftest import InferdServer, run_cli


def test_a_bucket_allows_its_burst_then_refills_at_its_rate():
    limiter, limit = LocalLimiter(), Limit(requests_per_s=2.0, burst=3)
    got = [limiter.take_now("k", limit, 100.0) for _ in range(4)]
    assert [ok for ok, _ in got] == [True, True, True, False]
    assert [left for _, left in got[:3]] == [2.0, 1.0, 0.0]
    assert limiter.take_now("k", limit, 100.4)[0] is False  # 0.8 of a token
    assert limiter.take_now("k", limit, 100.5)[0] is True  # one token after 0.5 s
    assert limiter.take_now("other", limit, 100.5) == (True, 2.0)  # its own bucket
    assert limiter.take_now("k", limit, 200.0) == (True, 2.0)  # full again, capped


MODEL = """
import numpy as np


class Echo:
    signature = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    }

    def predict(self, batch):
        return {"y": batch["x"].astype(np.float32)}
"""
BODY = {"inputs": [{"x": 1.0}]}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = tmp_path_factory.mktemp("limits")
    src = data / "src"
    src.mkdir()
    (src / "model.py").write_text(MODEL)
    for name in ("a", "b"):
        run_cli("models", "push", name, str(src), "--version", "v1", data_dir=data)
    return data


def _server(data: Path, workers: int, **env: str) -> InferdServer:
    limits = {
        "INFERD_RATE_LIMITS__DEFAULT__REQUESTS_PER_S": "0.01",  # no refill during a test
        "INFERD_RATE_LIMITS__DEFAULT__BURST": "8",
        "INFERD_RATE_LIMITS__MODELS": '{"b": {"requests_per_s": 0.01, "burst": 3}}',
    }
    server = InferdServer(data, workers=workers, env={**limits, **env})
    server.wait_ready()
    return server


@pytest.fixture
def one_gateway(data: Path) -> Iterator[InferdServer]:
    server = _server(data, workers=1)
    try:
        yield server
    finally:
        assert server.stop() == 0, server.log()[-3000:]


@pytest.mark.slow
def test_the_n_plus_first_request_gets_429_with_headers(one_gateway: InferdServer):
    server = one_gateway
    replies = [server.client.post("/api/v1/models/a/predict", json=BODY) for _ in range(9)]
    assert [r.status_code for r in replies] == [200] * 8 + [429]
    first, last = replies[0], replies[-1]
    assert first.headers["x-ratelimit-limit"] == "8"
    assert first.headers["x-ratelimit-remaining"] == "7"
    assert int(first.headers["x-ratelimit-reset"]) > 0
    assert last.json()["error"]["code"] == "rate_limited"
    assert "8 requests at once" in last.json()["error"]["message"]
    assert int(last.headers["retry-after"]) >= 1 and last.headers["x-ratelimit-remaining"] == "0"
    assert server.client.get("/health/ready").status_code == 200  # never limited


@pytest.mark.slow
def test_a_model_limit_applies_on_top_of_the_default(one_gateway: InferdServer):
    server = one_gateway
    codes = [
        server.client.post("/api/v1/models/b/predict", json=BODY).status_code for _ in range(4)
    ]
    assert codes == [200, 200, 200, 429]  # b's own bucket of 3
    refused = server.client.post("/api/v1/models/b/predict", json=BODY)
    assert "for this model" in refused.json()["error"]["message"]
    assert server.client.post("/api/v1/models/a/predict", json=BODY).status_code == 200


@pytest.mark.slow
@pytest.mark.redis
def test_two_gateway_processes_share_one_redis_budget(data: Path, redis_url: str):
    import redis

    bucket = "inferd:rl:all:ip:127.0.0.1"  # this client's bucket for all routes
    redis.from_url(redis_url).delete(bucket)
    server = _server(data, workers=2, INFERD_REDIS_URL=redis_url)
    try:
        codes: Counter[int] = Counter()
        for _ in range(16):  # a new connection each: both gateway processes answer
            with httpx.Client(base_url=server.url, timeout=30) as client:
                codes[client.post("/api/v1/models/a/predict", json=BODY).status_code] += 1
        assert codes == Counter({200: 8, 429: 8}), codes
    finally:
        assert server.stop() == 0, server.log()[-3000:]
        redis.from_url(redis_url).delete(bucket)
