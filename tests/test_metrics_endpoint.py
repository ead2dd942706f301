"""``/metrics`` against the real server with two gateway processes: after known traffic
the request counts, latency histogram, cache hits, rate-limit refusals, replica state,
batches and processes all say what happened, whichever gateway served each request and
whichever answers the scrape."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from inferd.monitoring.exposition import Text, _escape
from tests.conftest import InferdServer, arithmetic_model, push_source

pytestmark = pytest.mark.slow

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples of an exposition; every line must be a comment or a valid sample."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        match = SAMPLE.match(line)
        assert match, f"not a sample line: {line!r}"
        labels = dict(LABEL.findall(match.group(2) or ""))
        samples.append((match.group(1), labels, float(match.group(3))))
    return samples


def value(samples: list, name: str, **labels: str) -> float:
    found = [
        v for n, ls, v in samples if n == name and all(ls.get(k) == w for k, w in labels.items())
    ]
    return sum(found)


def test_the_text_format_escapes_label_values():
    out = Text()
    out.family("inferd_x_total", "counter", "X.")
    out.sample("inferd_x_total", {"model": 'a"b\\c\nd'}, 2)
    assert out.render().splitlines()[-1] == 'inferd_x_total{model="a\\"b\\\\c\\nd"} 2'
    assert _escape("plain") == "plain"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferdServer]:
    data = tmp_path_factory.mktemp("metrics")
    push_source(data, "plus", arithmetic_model("x + 1"))
    env = {
        "INFERD_CACHE__ENABLED": "true",
        "INFERD_INFERENCE_LOG__FLUSH_INTERVAL_S": "0.2",
        "INFERD_RATE_LIMITS__MODELS": '{"plus": {"requests_per_s": 0.01, "burst": 30}}',
    }
    server = InferdServer(Path(data), workers=2, env=env)
    try:
        server.wait_ready()
        yield server
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def scrape(server: InferdServer) -> list:
    reply = httpx.get(f"{server.url}/metrics", timeout=10)  # a new connection each time
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse(reply.text)


def test_metrics_after_known_traffic(server: InferdServer):
    for i in range(20):  # new connections: both gateway processes take some
        reply = httpx.post(
            f"{server.url}/api/v1/models/plus/predict", json={"inputs": [{"x": float(i % 10)}]}
        )
        assert reply.status_code == 200
    bad = httpx.post(f"{server.url}/api/v1/models/plus/predict", json={"inputs": [{"z": 1}]})
    assert bad.status_code == 422
    refused = 0
    for _ in range(50):  # past the bursts of 30 (one per gateway process: 60 in all)
        refused += (
            httpx.post(
                f"{server.url}/api/v1/models/plus/predict", json={"inputs": [{"x": 50.0}]}
            ).status_code
            == 429
        )
    assert refused >= 11
    ok = 20 + 50 - refused
    deadline = time.monotonic() + 15
    while True:
        samples = scrape(server)
        counted = value(samples, "inferd_requests_total", model="plus", code="200")
        limited = value(samples, "inferd_rate_limited_total", limit="requests")
        if (counted >= ok and limited >= refused) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert counted == ok
    assert value(samples, "inferd_requests_total", model="plus", api="v1", code="422") == 1
    assert value(samples, "inferd_request_duration_seconds_count", model="plus") == ok + 1
    le = [ls["le"] for n, ls, _ in samples if n == "inferd_request_duration_seconds_bucket"]
    assert "0.05" in le and le.count("+Inf") >= 1
    hits = value(samples, "inferd_cache_requests_total", model="plus", result="hit")
    misses = value(samples, "inferd_cache_requests_total", model="plus", result="miss")
    assert hits + misses == ok and misses >= 11  # 11 distinct inputs; each gateway keeps its own
    assert value(samples, "inferd_rate_limited_total", limit="requests") >= refused
    assert value(samples, "inferd_replicas", model="plus", state="ready") == 1
    batches = value(samples, "inferd_batches_total", model="plus")
    assert batches >= 1
    assert value(samples, "inferd_batch_size_rows_count", model="plus") == batches
    assert value(samples, "inferd_batch_rows_total", model="plus") == misses
    assert value(samples, "inferd_replica_request_duration_seconds_count", model="plus") == misses
    assert value(samples, "inferd_queue_rows", model="plus") == 0
    processes = {
        ls["process"] + ls["id"]
        for n, ls, _ in samples
        if n == "inferd_process_resident_memory_bytes"
    }
    assert {"serverserver", "gateway0", "gateway1"} <= processes
    assert any(p.startswith("replica") for p in processes)
    assert not [n for n, _, _ in samples if n.startswith("inferd_gpu_")]  # no GPU here
