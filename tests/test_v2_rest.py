"""The Open Inference Protocol over REST against the real server with the demo models:
raw HTTP for the wire format and the errors, and Triton's own ``tritonclient.http``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import InferdServer

ROW = [0.1 * i for i in range(30)]


def features(server: InferdServer, model: str) -> dict:
    meta = server.client.get(f"/v2/models/{model}").json()
    (spec,) = meta["inputs"]
    return spec


def test_server_health_and_metadata(demo_server: InferdServer):
    c = demo_server.client
    assert c.get("/v2/health/live").json() == {"live": True}
    ready = c.get("/v2/health/ready")
    assert ready.status_code == 200 and ready.json() == {"ready": True}
    meta = c.get("/v2").json()
    assert meta["name"] == "inferd" and isinstance(meta["extensions"], list)


def test_model_metadata_and_readiness(demo_server: InferdServer):
    c = demo_server.client
    meta = c.get("/v2/models/fraud").json()
    assert meta["name"] == "fraud" and meta["platform"] == "xgboost"
    assert meta["inputs"] == [{"name": "features", "datatype": "FP32", "shape": [-1, 30]}]
    assert {o["name"] for o in meta["outputs"]} >= {"probabilities"}
    version = meta["versions"][0]
    assert c.get(f"/v2/models/fraud/versions/{version}").json()["name"] == "fraud"
    assert c.get("/v2/models/fraud/ready").json() == {"name": "fraud", "ready": True}
    assert c.get(f"/v2/models/fraud/versions/{version}/ready").status_code == 200
    missing = c.get("/v2/models/nope/ready")
    assert missing.status_code == 404 and "nope" in missing.json()["error"]
    assert c.get("/v2/models/fraud/versions/v999").status_code == 404


def test_infer_json_matches_the_v1_api(demo_server: InferdServer):
    c = demo_server.client
    body = {
        "id": "req-7",
        "inputs": [
            {"name": "features", "shape": [2, 30], "datatype": "FP32", "data": [ROW, ROW[::-1]]}
        ],
    }
    reply = c.post("/v2/models/fraud/infer", json=body)
    assert reply.status_code == 200, reply.text
    out = reply.json()
    assert out["model_name"] == "fraud" and out["id"] == "req-7" and out["model_version"]
    probs = next(o for o in out["outputs"] if o["name"] == "probabilities")
    assert probs["datatype"] == "FP32" and probs["shape"][0] == 2
    v1 = c.post("/api/v1/models/fraud/predict", json={"inputs": [{"features": ROW}]}).json()
    first = np.asarray(probs["data"]).reshape(probs["shape"])[0]
    np.testing.assert_allclose(first, v1["outputs"][0]["probabilities"], rtol=1e-6)
    # Flat data (row-major) is the same tensor; requested outputs filter the reply.
    flat = {
        "inputs": [{"name": "features", "shape": [1, 30], "datatype": "FP32", "data": ROW}],
        "outputs": [{"name": "probabilities"}],
    }
    only = c.post("/v2/models/fraud/infer", json=flat).json()["outputs"]
    assert [o["name"] for o in only] == ["probabilities"]
    np.testing.assert_allclose(only[0]["data"], first, rtol=1e-6)


def test_infer_bytes_input(demo_server: InferdServer):
    spec = features(demo_server, "sentiment")
    assert spec["datatype"] == "BYTES"
    body = {
        "inputs": [
            {
                "name": spec["name"],
                "shape": [2],
                "datatype": "BYTES",
                "data": ["This product is amazing!", "Terrible, it broke after a day."],
            }
        ]
    }
    reply = demo_server.client.post("/v2/models/sentiment/infer", json=body)
    assert reply.status_code == 200, reply.text
    outputs = {o["name"]: o for o in reply.json()["outputs"]}
    assert all(o["shape"][0] == 2 for o in outputs.values())


@pytest.mark.parametrize(
    ("tensor", "says"),
    [
        ({"name": "features", "shape": [1, 30], "datatype": "FP64", "data": ROW}, "datatype"),
        ({"name": "features", "shape": [1, 30], "datatype": "FP32", "data": ROW[:29]}, "29"),
        ({"name": "features", "shape": [1, 29], "datatype": "FP32", "data": ROW[:29]}, "shape"),
        ({"name": "features", "shape": [30], "datatype": "FP32", "data": ROW}, "shape"),
        ({"name": "pixels", "shape": [1, 30], "datatype": "FP32", "data": ROW}, "unknown input"),
        ({"name": "features", "shape": [1, 30], "datatype": "FP32", "data": ["x"] * 30}, "FP32"),
        ({"name": "features", "shape": [1, 30], "datatype": "FP32"}, "data"),
        ({"name": "features", "shape": [-1, 30], "datatype": "FP32", "data": ROW}, "shape"),
        ({"name": "features", "shape": [1, 30], "datatype": "FLOAT", "data": ROW}, "datatype"),
    ],
)
def test_bad_tensors_are_400_with_the_protocol_error_body(
    demo_server: InferdServer, tensor: dict, says: str
):
    reply = demo_server.client.post("/v2/models/fraud/infer", json={"inputs": [tensor]})
    assert reply.status_code == 400, reply.text
    assert says in reply.json()["error"]


def test_other_infer_errors(demo_server: InferdServer):
    c = demo_server.client
    good = {"name": "features", "shape": [1, 30], "datatype": "FP32", "data": ROW}
    unknown_output = c.post(
        "/v2/models/fraud/infer", json={"inputs": [good], "outputs": [{"name": "nope"}]}
    )
    assert unknown_output.status_code == 400 and "nope" in unknown_output.json()["error"]
    assert c.post("/v2/models/fraud/infer", json={"inputs": []}).status_code == 400
    assert c.post("/v2/models/nope/infer", json={"inputs": [good]}).status_code == 404
    assert (
        c.post("/v2/models/fraud/versions/v999/infer", json={"inputs": [good]}).status_code == 404
    )
    bad_json = c.post("/v2/models/fraud/infer", content=b"{nope")
    assert bad_json.status_code == 400 and "error" in bad_json.json()


def test_tritonclient_http_with_json_tensors(demo_server: InferdServer):
    """Triton's own client, unchanged (JSON tensors; the binary extension comes later)."""
    import tritonclient.http as httpclient

    url = demo_server.url.removeprefix("http://")
    client = httpclient.InferenceServerClient(url=url)
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("fraud")
        meta = client.get_model_metadata("fraud")
        assert meta["inputs"][0]["name"] == "features"
        batch = np.asarray([ROW, ROW[::-1]], dtype=np.float32)
        tensor = httpclient.InferInput("features", list(batch.shape), "FP32")
        tensor.set_data_from_numpy(batch, binary_data=False)
        wanted = httpclient.InferRequestedOutput("probabilities", binary_data=False)
        result = client.infer("fraud", [tensor], outputs=[wanted], request_id="t-1")
        probs = result.as_numpy("probabilities")
        assert probs is not None and probs.shape[0] == 2
        assert result.get_response()["id"] == "t-1"
    finally:
        client.close()


def test_tritonclient_http_default_binary_tensors(demo_server: InferdServer):
    """tritonclient's defaults: binary input and output tensors (the binary extension)."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url=demo_server.url.removeprefix("http://"))
    try:
        batch = np.asarray([ROW, ROW[::-1], ROW], dtype=np.float32)
        tensor = httpclient.InferInput("features", list(batch.shape), "FP32")
        tensor.set_data_from_numpy(batch)  # binary_data=True by default
        result = client.infer("fraud", [tensor], outputs=[
            httpclient.InferRequestedOutput("probabilities"),  # binary by default
        ])  # fmt: skip
        probs = result.as_numpy("probabilities")
        json_probs = client.infer(
            "fraud",
            [tensor],
            outputs=[httpclient.InferRequestedOutput("probabilities", binary_data=False)],
        ).as_numpy("probabilities")
        assert probs is not None and probs.shape[0] == 3
        np.testing.assert_array_equal(probs, json_probs)
        np.testing.assert_array_equal(probs[0], probs[2])
        # BYTES travel length-prefixed in the binary extension.
        text = np.asarray([b"This product is amazing!", b"Awful."], dtype=object)
        name = features(demo_server, "sentiment")["name"]
        words = httpclient.InferInput(name, [2], "BYTES")
        words.set_data_from_numpy(text)
        reply = client.infer("sentiment", [words])  # no outputs named: all, as JSON
        assert all(o["shape"][0] == 2 for o in reply.get_response()["outputs"])
    finally:
        client.close()


def test_binary_extension_errors(demo_server: InferdServer):
    c = demo_server.client
    data = np.asarray([ROW], dtype=np.float32).tobytes()

    def send(header: dict, blob: bytes, length: int | None = None) -> tuple[int, str]:
        head = json.dumps({"inputs": [header]}).encode()
        reply = c.post(
            "/v2/models/fraud/infer",
            content=head + blob,
            headers={
                "Inference-Header-Content-Length": str(len(head) if length is None else length)
            },
        )
        return reply.status_code, reply.json()["error"] if reply.status_code != 200 else ""

    tensor = {"name": "features", "shape": [1, 30], "datatype": "FP32"}
    ok = {**tensor, "parameters": {"binary_data_size": len(data)}}
    assert send(ok, data) == (200, "")
    code, error = send({**tensor, "parameters": {"binary_data_size": len(data) - 4}}, data[:-4])
    assert code == 400 and "needs 120" in error
    code, error = send(ok, data[:-4])
    assert code == 400 and "runs past" in error
    code, error = send(ok, data + b"xx")
    assert code == 400 and "not claimed" in error
    code, error = send(ok, data, length=10**6)
    assert code == 400 and "Inference-Header-Content-Length" in error
    assert "binary_tensor_data" in c.get("/v2").json()["extensions"]


def test_binary_data_output_is_the_default_for_outputs_that_do_not_say(demo_server: InferdServer):
    good = {"name": "features", "shape": [1, 30], "datatype": "FP32", "data": ROW}
    body = {
        "inputs": [good],
        "outputs": [
            {"name": "probabilities"},
            {"name": "label", "parameters": {"binary_data": False}},
        ],
        "parameters": {"binary_data_output": True},
    }
    reply = demo_server.client.post("/v2/models/fraud/infer", json=body)
    assert reply.status_code == 200, reply.text
    size = int(reply.headers["inference-header-content-length"])
    head = json.loads(reply.content[:size])
    outputs = {o["name"]: o for o in head["outputs"]}
    blob = outputs["probabilities"]["parameters"]["binary_data_size"]
    assert "data" not in outputs["probabilities"] and len(reply.content) == size + blob
    assert "data" in outputs["label"]  # its own binary_data: false wins


def test_schedule_policy_parameters(demo_server: InferdServer):
    c = demo_server.client
    tensor = {"name": "features", "shape": [1, 30], "datatype": "FP32", "data": ROW}

    def infer(parameters: dict):
        return c.post("/v2/models/fraud/infer", json={"inputs": [tensor], "parameters": parameters})

    assert infer({"priority": 1, "timeout": 10_000_000}).status_code == 200
    assert infer({"priority": 4}).status_code == 200
    assert infer({"priority": "high"}).status_code == 200
    too_low = infer({"priority": 5})
    assert too_low.status_code == 400 and "priority 5 is not a level" in too_low.json()["error"]
    assert "'priority'" in infer({"priority": "urgent"}).json()["error"]
    assert infer({"timeout": -5}).status_code == 400
    expired = infer({"timeout": 1})  # 1 µs: the deadline passes before any reply
    assert expired.status_code == 504, expired.text
    assert "schedule_policy" in c.get("/v2").json()["extensions"]
