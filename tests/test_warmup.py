"""Warm-up before ready: a replica sends requests through its own batcher before it
reports ready, so the first request routed to it after a deploy is not the one that
pays the model's first calls; the rows are the version's registered samples
(``warmup_samples``) or generated from its signature; the time is reported and the
warm-up is not counted as traffic. Against the real server, over the registration API."""

from __future__ import annotations

import hashlib
import io
import json
import statistics
import tarfile
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from inferd.runtimes.base import sample_columns
from inferd.shapes.tensors import Signature, TensorSpec
from tests.conftest import InferdServer

LAZY_S = 0.5
LAZY = f'''
import time


class Lazy:
    """The first call for each key loads that key's part for {LAZY_S} s (a per-key
    sub-model, a framework's first run of a code path), later ones are quick."""

    signature = {{
        "inputs": [
            {{"name": "key", "datatype": "BYTES", "shape": [-1]}},
            {{"name": "x", "datatype": "FP32", "shape": [-1]}},
        ],
        "outputs": [{{"name": "y", "datatype": "FP32", "shape": [-1]}}],
    }}

    def __init__(self):
        self.loaded = set()

    def predict(self, batch):
        for key in set(batch["key"].tolist()):
            if key not in self.loaded:
                time.sleep({LAZY_S})
                self.loaded.add(key)
        return {{"y": batch["x"] * 2}}
'''
SAMPLES = [{"key": "eu", "x": 1.0}, {"key": "us", "x": 2.0}]


def upload(client: httpx.Client, model: str, **params: object) -> httpx.Response:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        data = LAZY.encode()
        info = tarfile.TarInfo("model.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    body = buf.getvalue()
    query = {k: json.dumps(v) for k, v in params.items()}
    return client.post(
        f"/api/v1/models/{model}/versions",
        params={"version": "v1", "sha256": hashlib.sha256(body).hexdigest(), **query},
        content=body,
        headers={"content-type": "application/gzip"},
    )


def wait_serving(client: httpx.Client, model: str, timeout_s: float = 60) -> None:
    """Until the model has a serving version, without sending it a request."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if client.get(f"/api/v1/models/{model}").json().get("ready"):
            return
        time.sleep(0.05)
    raise AssertionError(f"{model} not ready in {timeout_s}s")


def timed_predict(client: httpx.Client, model: str, key: str) -> float:
    began = time.perf_counter()
    reply = client.post(f"/api/v1/models/{model}/predict", json={"inputs": [{"key": key, "x": 3}]})
    took = time.perf_counter() - began
    assert reply.status_code == 200, reply.text
    assert reply.json()["outputs"][0]["y"] == 6
    return took


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferdServer]:
    server = InferdServer(tmp_path_factory.mktemp("warmup"))
    try:
        server.wait_ready()
        yield server
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def test_the_first_routed_request_finds_the_replica_warm(server: InferdServer) -> None:
    client = server.client
    reply = upload(client, "sampled", metadata={"warmup_samples": SAMPLES})
    assert reply.status_code == 201, reply.text
    wait_serving(client, "sampled")
    first = timed_predict(client, "sampled", "us")
    rest = [timed_predict(client, "sampled", key) for key in ("eu", "us") * 10]
    median = statistics.median(rest)
    assert first < LAZY_S and first <= 5 * median + 0.05, (first, median)

    (replica,) = client.get("/api/v1/models/sampled/versions/v1").json()["replicas"]
    stats = replica["stats"]
    assert stats["warmup_s"] >= 2 * LAZY_S  # both samples' keys were loaded before ready
    assert stats["warmup_requests"] == 5  # 4 one-row requests, then a full batch
    assert stats["load_s"] > 0
    assert stats["requests"] == 21  # the warm-up is not traffic
    metrics = client.get("/metrics").text
    line = next(m for m in metrics.splitlines() if m.startswith("inferd_replica_warmup_seconds{"))
    assert 'model="sampled"' in line and float(line.split()[-1]) >= 2 * LAZY_S


def test_generated_rows_warm_only_what_they_touch(server: InferdServer) -> None:
    """Without samples the rows come from the signature (the text "warm up"): the
    model's first call is paid before ready, a key the rows never held is not."""
    client = server.client
    assert upload(client, "generated").status_code == 201
    wait_serving(client, "generated")
    assert timed_predict(client, "generated", "warm up") < LAZY_S
    assert timed_predict(client, "generated", "us") >= LAZY_S


def test_no_warm_up_leaves_the_first_call_to_the_first_request(server: InferdServer) -> None:
    client = server.client
    assert upload(client, "cold", batching={"warmup_requests": 0}).status_code == 201
    wait_serving(client, "cold")
    assert timed_predict(client, "cold", "warm up") >= LAZY_S
    (replica,) = client.get("/api/v1/models/cold/versions/v1").json()["replicas"]
    assert "warmup_s" not in replica["stats"]


@pytest.mark.parametrize(
    ("samples", "says"),
    [
        ([{"key": "eu"}], "no input 'x'"),
        ([["eu", 1.0]], "naming the inputs 'key', 'x'"),
        ([{"key": "eu", "x": "one"}], "input 'x' is not FP32"),
        ([{"key": "eu", "x": [1.0, 2.0]}], "input 'x' has rows of shape [2]"),
        ([], "a list of 1 to 1000 rows"),
    ],
)
def test_samples_that_do_not_fit_the_signature_are_refused_at_push(
    server: InferdServer, samples: list[object], says: str
) -> None:
    reply = upload(server.client, "badsamples", metadata={"warmup_samples": samples})
    assert reply.status_code == 422, reply.text
    message = reply.json()["error"]["message"]
    assert "warmup_samples" in message and says in message, message


def test_sample_columns_cycle_rows_and_take_bare_values_for_one_input() -> None:
    two = Signature(
        (TensorSpec("key", "BYTES"), TensorSpec("x", "FP32", (-1, 2))), (TensorSpec("y", "FP32"),)
    )
    rows = [{"key": "a", "x": [1, 2]}, {"key": "b", "x": [3, 4]}, {"key": "c", "x": [5, 6]}]
    columns = sample_columns(two, rows, 4, first=2)
    assert columns["key"].tolist() == ["c", "a", "b", "c"]
    assert columns["x"].dtype == np.float32 and columns["x"].shape == (4, 2)
    one = Signature((TensorSpec("x", "FP32", (-1, 2)),), (TensorSpec("y", "FP32"),))
    assert sample_columns(one, [[1, 2]], 2)["x"].tolist() == [[1, 2], [1, 2]]
