"""End-to-end: `inferd serve --demo` serves one model per runtime, and bad input is 4xx."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import InferdServer, run_cli

pytestmark = pytest.mark.slow
FRAUD_ROW = [0.1] * 30


def test_health_and_model_listing(demo_server: InferdServer):
    c = demo_server.client
    assert c.get("/health/live").json() == {"status": "live"}
    ready = c.get("/health/ready").json()
    assert ready["status"] == "ready"
    assert set(ready["models"]) == {
        "fraud", "sentiment", "iris", "digits", "image-classifier", "all-minilm-l6-v2",
        "sentiment-minilm", "rerank-minilm",
    }  # fmt: skip
    models = {m["name"]: m for m in c.get("/api/v1/models").json()["models"]}
    assert models["fraud"]["framework"] == "xgboost"
    assert models["sentiment"]["framework"] == "sklearn"
    assert models["iris"]["framework"] == "onnx"
    assert models["digits"]["framework"] == "torch"
    assert models["image-classifier"]["framework"] == "onnx"
    assert all(m["serving_version"] == "v1" and m["ready"] for m in models.values())


def test_model_detail_has_signature_status_and_metadata(demo_server: InferdServer):
    detail = demo_server.client.get("/api/v1/models/fraud").json()
    (version,) = detail["versions"]
    assert version["status"] == "serving"
    assert version["signature"]["inputs"] == [
        {"name": "features", "datatype": "FP32", "shape": [-1, 30]}
    ]
    assert version["metadata"]["accuracy"] > 0.9
    assert len(version["sha256"]) == 64
    assert version["replicas"][0]["state"] == "ready"
    one = demo_server.client.get("/api/v1/models/fraud/versions/v1").json()
    assert one["version"] == "v1" and one["status"] == "serving"


def test_xgboost_fraud_predict(demo_server: InferdServer):
    reply = demo_server.client.post(
        "/api/v1/models/fraud/predict", json={"inputs": [{"features": FRAUD_ROW}] * 3}
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["model"] == "fraud" and body["version"] == "v1"
    assert len(body["outputs"]) == 3
    out = body["outputs"][0]
    assert out["label"] in ("legit", "fraud")
    assert sum(out["probabilities"]) == pytest.approx(1.0, abs=1e-5)
    assert body["latency_ms"] > 0
    assert reply.headers["x-inferd-model-version"] == "v1"


def test_sklearn_sentiment_single_predict(demo_server: InferdServer):
    c = demo_server.client
    good = c.post(
        "/api/v1/predict",
        json={"model": "sentiment", "input": {"text": "This product is amazing!"}},
    )
    assert good.status_code == 200, good.text
    body = good.json()
    assert body["prediction"] == "positive"
    assert 0.5 < body["confidence"] <= 1.0
    assert set(body) >= {"prediction", "confidence", "latency_ms", "model", "version"}
    bad = c.post(
        "/api/v1/predict",
        json={"model": "sentiment", "input": {"text": "Terrible, broke after one day"}},
    )
    assert bad.json()["prediction"] == "negative"


def test_onnx_iris_predict(demo_server: InferdServer):
    reply = demo_server.client.post(
        "/api/v1/models/iris/predict",
        json={"inputs": [{"features": [5.1, 3.5, 1.4, 0.2]}, {"features": [6.7, 3.0, 5.2, 2.3]}]},
    )
    assert reply.status_code == 200, reply.text
    assert [o["label"] for o in reply.json()["outputs"]] == ["setosa", "virginica"]


def test_torch_digits_predict(demo_server: InferdServer):
    from sklearn.datasets import load_digits

    digits = load_digits()
    rows = [{"features": digits.data[i].tolist()} for i in range(10)]
    reply = demo_server.client.post("/api/v1/models/digits/predict", json={"inputs": rows})
    assert reply.status_code == 200, reply.text
    labels = [int(o["label"]) for o in reply.json()["outputs"]]
    assert sum(a == b for a, b in zip(labels, digits.target[:10], strict=True)) >= 9


@pytest.mark.parametrize(
    ("path", "body", "status", "code", "says"),
    [
        ("/api/v1/models/nope/predict", {"inputs": [[1]]}, 404, "model_not_found", "'nope'"),
        (
            "/api/v1/models/fraud/predict",
            {"inputs": [FRAUD_ROW], "params": {"version": "v9"}},
            404,
            "model_not_found",
            "'v9'",
        ),
        (
            "/api/v1/models/fraud/predict",
            {"inputs": [{"features": [1, 2, 3]}]},
            422,
            "invalid_input",
            "expected shape [30] per row, got [3]",
        ),
        (
            "/api/v1/models/fraud/predict",
            {"inputs": [{"features": ["x"] * 30}]},
            422,
            "invalid_input",
            'the string "x" is not a number (FP32)',
        ),
        (
            "/api/v1/models/fraud/predict",
            {"inputs": [{"feats": FRAUD_ROW}]},
            422,
            "invalid_input",
            "missing field(s) ['features']",
        ),
        ("/api/v1/models/fraud/predict", {"rows": []}, 422, "invalid_input", "missing 'inputs'"),
        (
            "/api/v1/models/sentiment/predict",
            {"inputs": [{"text": 42}]},
            422,
            "invalid_input",
            "must be a string",
        ),
        ("/api/v1/predict", {"input": {"text": "hi"}}, 422, "invalid_input", "missing 'model'"),
        ("/api/v1/predict", [1, 2], 400, "bad_request", "JSON object"),
        ("/api/v1/nothing", {}, 404, "not_found", "no route"),
    ],
)
def test_bad_input_is_a_clear_json_4xx(demo_server, path, body, status, code, says):
    reply = demo_server.client.post(path, json=body)
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"] == "application/json"
    error = reply.json()["error"]
    assert error["code"] == code
    assert says in error["message"]
    assert error["request_id"]


def test_invalid_json_is_400(demo_server: InferdServer):
    reply = demo_server.client.post(
        "/api/v1/models/fraud/predict",
        content=b'{"inputs": [',
        headers={"content-type": "application/json"},
    )
    assert reply.status_code == 400
    assert "invalid JSON" in reply.json()["error"]["message"]


def test_body_over_the_limit_is_413(demo_server: InferdServer):
    big = {"inputs": [{"features": FRAUD_ROW}] * 8000}  # about 1.3 MB > 1 MiB limit
    reply = demo_server.client.post("/api/v1/models/fraud/predict", json=big)
    assert reply.status_code == 413
    assert reply.json()["error"]["code"] == "payload_too_large"

    def chunks():
        payload = json.dumps(big).encode()
        for i in range(0, len(payload), 65536):
            yield payload[i : i + 65536]

    chunked = demo_server.client.post("/api/v1/models/fraud/predict", content=chunks())
    assert chunked.status_code == 413


def test_request_id_is_echoed(demo_server: InferdServer):
    reply = demo_server.client.post(
        "/api/v1/models/fraud/predict",
        json={"inputs": [FRAUD_ROW]},
        headers={"x-request-id": "abc"},
    )
    assert reply.headers["x-request-id"] == "abc"
    assert reply.json()["request_id"] == "abc"


def test_openapi_docs(demo_server: InferdServer):
    assert demo_server.client.get("/docs").status_code == 200
    spec = demo_server.client.get("/openapi.json").json()
    assert "/api/v1/models/{model}/predict" in spec["paths"]
    assert "requestBody" in spec["paths"]["/api/v1/models/{model}/predict"]["post"]


def test_cli_predict_and_models(demo_server: InferdServer):
    out = run_cli(
        "predict",
        "sentiment",
        "--text",
        "I love it, works perfectly",
        "--url",
        demo_server.url,
        data_dir=demo_server.data_dir,
    )
    assert json.loads(out.stdout)["outputs"][0]["label"] == "positive"
    missing = run_cli(
        "predict",
        "nope",
        "--features",
        "1,2",
        "--url",
        demo_server.url,
        data_dir=demo_server.data_dir,
        check=False,
    )
    assert missing.returncode == 1 and "model_not_found" in missing.stdout
    listing = run_cli("models", "list", data_dir=demo_server.data_dir)
    assert "fraud" in listing.stdout and "xgboost" in listing.stdout
    shown = json.loads(run_cli("models", "show", "iris", data_dir=demo_server.data_dir).stdout)
    assert shown["versions"][0]["framework"] == "onnx"


def test_concurrent_clients_across_gateway_processes(demo_server: InferdServer):
    from concurrent.futures import ThreadPoolExecutor

    def call(i: int) -> int:
        with httpx.Client(base_url=demo_server.url, timeout=30) as c:
            return c.post(
                "/api/v1/models/fraud/predict", json={"inputs": [{"features": [i / 100] * 30}]}
            ).status_code

    with ThreadPoolExecutor(32) as pool:
        assert set(pool.map(call, range(200))) == {200}
