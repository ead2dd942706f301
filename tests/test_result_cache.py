"""The result cache: the LRU itself, then the real server — a repeated input is a hit
(also across v1 JSON and V2), a new version never gets an old version's answer, a TTL
expires, a model marked non-cacheable is never cached, and two gateway processes share
answers through the machine's real Redis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from inferd.routing.cache import LocalCache, cache_key
from inferd.shapes.replica import to_tensor
from tests.conftest import InferdServer, arithmetic_model, push_source
from tests.inprocess import InProcessServer


def test_keys_depend_on_version_and_values_only():
    a = {"x": to_tensor(np.array([1.0, 2.0], dtype=np.float32))}
    same = {"x": to_tensor(np.array([1, 2], dtype=np.float32))}
    other = {"x": to_tensor(np.array([1.0, 2.5], dtype=np.float32))}
    assert cache_key("m", "v1", a) == cache_key("m", "v1", same)
    assert cache_key("m", "v1", a) != cache_key("m", "v2", a)
    assert cache_key("m", "v1", a) != cache_key("m", "v1", other)
    assert cache_key("m", "v1", a) != cache_key("n", "v1", a)


def test_a_request_naming_an_s3_object_is_never_cacheable():
    from inferd.routing.cache import fetches
    from inferd.shapes.tensors import Signature, TensorSpec

    image = TensorSpec("image", "BYTES", (-1,), media="image")
    text = TensorSpec("text", "BYTES", (-1,))
    signature = Signature((image, text), (TensorSpec("y", "FP32", (-1,)),))

    def column(*values: object) -> np.ndarray:
        array = np.empty(len(values), dtype=object)
        array[:] = list(values)
        return array

    def request(images: np.ndarray, texts: np.ndarray) -> dict:
        return {"image": to_tensor(images), "text": to_tensor(texts)}

    assert not fetches(signature, request(column(b"\xff\xd8jpeg"), column("s3://a/b")))
    assert fetches(signature, request(column(b"\xff\xd8jpeg", "s3://images/a.jpg"), column("x")))
    assert not fetches(Signature((text,), ()), {"text": to_tensor(column("s3://images/a"))})


def test_the_lru_is_bounded_in_bytes_and_entries_expire():
    async def run() -> None:
        cache = LocalCache(max_bytes=100_000)
        big = {"y": np.zeros(1000, dtype=np.float64)}  # 8 kB + overhead
        for i in range(20):
            await cache.put(bytes([i]), big, ttl_s=60)
        assert cache.bytes <= 100_000 and len(cache) == 12  # the oldest went first
        assert await cache.get(bytes([0])) is None and await cache.get(bytes([19])) is not None
        await cache.put(b"short", big, ttl_s=0.05)
        assert await cache.get(b"short") is not None
        await asyncio.sleep(0.1)
        assert await cache.get(b"short") is None
        await cache.put(b"huge", {"y": np.zeros(10_000, dtype=np.float64)}, ttl_s=60)
        assert await cache.get(b"huge") is None  # over an eighth of the cache: not kept
        assert (cache.hits, cache.misses) == (2, 3)

    asyncio.run(run())


def _push(data: Path, model: str, version: str, offset: float, *meta: str) -> None:
    extra = [a for m in meta for a in ("--meta", m)] + ["--deploy"]
    push_source(data, model, arithmetic_model(f"x + {offset!r}"), *extra, version=version)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = tmp_path_factory.mktemp("cache")
    _push(data, "plus", "v1", 1.0)
    _push(data, "short", "v1", 1.0, "cache_ttl_s=1")
    _push(data, "never", "v1", 1.0, "cache_ttl_s=0")
    return data


@pytest.fixture(scope="module")
def server(data: Path) -> Iterator[InProcessServer]:
    """In process: the cache lives in the gateway app, the log in the control plane."""
    server = InProcessServer(data, cache={"enabled": True})
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def _predict(client: httpx.Client, model: str, x: float) -> httpx.Response:
    reply = client.post(f"/api/v1/models/{model}/predict", json={"inputs": [{"x": x}]})
    assert reply.status_code == 200, reply.text
    return reply


def test_hits_misses_versions_and_ttls(server: InProcessServer, data: Path):
    c = server.client
    first, second = _predict(c, "plus", 2.0), _predict(c, "plus", 2.0)
    assert (first.headers["x-cache"], second.headers["x-cache"]) == ("miss", "hit")
    assert second.json()["outputs"] == first.json()["outputs"] == [{"y": 3.0}]
    assert _predict(c, "plus", 5.0).headers["x-cache"] == "miss"
    v2 = c.post("/v2/models/plus/infer", json={
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [2.0]}]
    })  # fmt: skip
    assert v2.headers["x-cache"] == "hit" and v2.json()["outputs"][0]["data"] == [3.0]

    # A new version never answers with the old one's results.
    _push(data, "plus", "v2", 100.0)
    server.wait_for(lambda: _predict(c, "plus", 7.0).json()["version"] == "v2", what="v2 serving")
    fresh = _predict(c, "plus", 2.0)
    assert fresh.json()["version"] == "v2" and fresh.json()["outputs"] == [{"y": 102.0}]
    assert fresh.headers["x-cache"] == "miss"
    assert _predict(c, "plus", 2.0).headers["x-cache"] == "hit"

    # Per-version TTL, and a version that is never cached.
    assert _predict(c, "short", 1.0).headers["x-cache"] == "miss"
    assert _predict(c, "short", 1.0).headers["x-cache"] == "hit"
    time.sleep(1.3)
    assert _predict(c, "short", 1.0).headers["x-cache"] == "miss"
    never = [_predict(c, "never", 1.0) for _ in range(2)]
    assert all("x-cache" not in r.headers for r in never)

    # The inference log says which answers came from the cache.
    rid = second.headers["x-request-id"]
    server.wait_for(
        lambda: c.get("/api/v1/logs", params={"request_id": rid}).json()["logs"],
        timeout_s=10,
        what="the hit's log row",
    )
    (row,) = c.get("/api/v1/logs", params={"request_id": rid}).json()["logs"]
    assert row["cache_hit"] is True


@pytest.mark.slow
@pytest.mark.redis
def test_gateway_processes_share_answers_through_redis(data: Path, redis_url: str):
    env = {"INFERD_CACHE__ENABLED": "true", "INFERD_REDIS_URL": redis_url}
    server = InferdServer(data, workers=2, env=env)
    try:
        server.wait_ready()
        x = float(np.random.default_rng().integers(1, 10**6))  # not cached by an earlier run
        seen = []
        for _ in range(8):  # a new connection each: both gateway processes answer
            with httpx.Client(base_url=server.url, timeout=30) as client:
                seen.append(_predict(client, "plus", x).headers["x-cache"])
        assert seen == ["miss"] + ["hit"] * 7, seen
    finally:
        assert server.stop() == 0, server.log()[-3000:]
