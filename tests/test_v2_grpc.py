"""The Open Inference Protocol over gRPC against the real server with the demo models:
Triton's own ``tritonclient.grpc``, and its generated messages for what the client
library does not expose (typed contents, malformed requests)."""

from __future__ import annotations

import queue

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc
from tritonclient.utils import InferenceServerException

from tests.conftest import InferdServer

ROWS = np.stack([np.arange(30, dtype=np.float32) * 0.1, np.arange(30, dtype=np.float32)[::-1]])


@pytest.fixture(scope="module")
def client(demo_server: InferdServer):
    with triton.InferenceServerClient(f"127.0.0.1:{demo_server.grpc_port}") as c:
        yield c


@pytest.fixture(scope="module")
def stub(demo_server: InferdServer):
    with grpc.insecure_channel(f"127.0.0.1:{demo_server.grpc_port}") as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


def features(rows: np.ndarray = ROWS) -> triton.InferInput:
    tensor = triton.InferInput("features", list(rows.shape), "FP32")
    tensor.set_data_from_numpy(rows)
    return tensor


def v1_probabilities(server: InferdServer, rows: np.ndarray) -> np.ndarray:
    body = {"inputs": [{"features": r.tolist()} for r in rows]}
    reply = server.client.post("/api/v1/models/fraud/predict", json=body).json()
    return np.array([o["probabilities"] for o in reply["outputs"]])


def test_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "inferd"
    assert {"binary_tensor_data", "schedule_policy"} <= set(meta["extensions"])
    assert client.is_model_ready("fraud")
    model = client.get_model_metadata("fraud", as_json=True)
    assert model["platform"] == "xgboost" and model["versions"]
    assert model["inputs"] == [{"name": "features", "datatype": "FP32", "shape": ["-1", "30"]}]
    assert client.is_model_ready("fraud", model["versions"][0])


def test_unknown_model_is_not_found(client):
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("nope")
    assert info.value.status() == "StatusCode.NOT_FOUND" and "nope" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        client.infer("nope", [features()])
    assert info.value.status() == "StatusCode.NOT_FOUND"


def test_infer_raw_matches_the_v1_api(client, demo_server):
    result = client.infer("fraud", [features()], request_id="req-9")
    response = result.get_response()
    assert response.id == "req-9" and response.model_name == "fraud" and response.model_version
    probs = result.as_numpy("probabilities")
    assert probs.dtype == np.float32 and probs.shape[0] == 2
    np.testing.assert_allclose(probs, v1_probabilities(demo_server, ROWS), rtol=1e-6)
    only = client.infer("fraud", [features()], outputs=[triton.InferRequestedOutput("label")])
    assert [o.name for o in only.get_response().outputs] == ["label"]


def test_infer_bytes_input(client):
    meta = client.get_model_metadata("sentiment", as_json=True)
    (spec,) = meta["inputs"]
    texts = np.array([b"This product is amazing!", b"Terrible, it broke after a day."])
    tensor = triton.InferInput(spec["name"], [2], "BYTES")
    tensor.set_data_from_numpy(texts.astype(object))
    result = client.infer("sentiment", [tensor])
    outputs = result.get_response().outputs
    assert outputs and all(o.shape[0] == 2 for o in outputs)


def _request() -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="fraud", id="typed")
    tensor = request.inputs.add(name="features", datatype="FP32", shape=list(ROWS.shape))
    tensor.contents.fp32_contents.extend(ROWS.reshape(-1).tolist())
    return request


def test_typed_contents_are_the_same_tensor(stub, demo_server):
    reply = stub.ModelInfer(_request())
    assert reply.id == "typed"
    names = [o.name for o in reply.outputs]
    probs = reply.outputs[names.index("probabilities")]
    data = np.frombuffer(reply.raw_output_contents[names.index("probabilities")], "<f4")
    np.testing.assert_allclose(
        data.reshape(list(probs.shape)), v1_probabilities(demo_server, ROWS), rtol=1e-6
    )


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda r: r.inputs[0].shape.__setitem__(1, 29), "shape"),
        (lambda r: setattr(r.inputs[0], "datatype", "FP64"), "datatype"),
        (lambda r: setattr(r.inputs[0], "name", "pixels"), "unknown input"),
        (lambda r: r.inputs[0].contents.fp32_contents.append(1.0), "61 elements"),
        (lambda r: r.raw_input_contents.extend([b"\0" * 240, b"x"]), "raw_input_contents"),
        (
            lambda r: r.parameters["priority"].CopyFrom(pb.InferParameter(int64_param=9)),
            "priority 9",
        ),
        (lambda r: r.parameters["timeout"].CopyFrom(pb.InferParameter(bool_param=True)), "timeout"),
        (lambda r: r.outputs.add(name="nope"), "nope"),
    ],
)
def test_bad_requests_are_invalid_argument(stub, change, says):
    request = _request()
    change(request)
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert says in info.value.details()


def test_schedule_policy_parameters(client):
    fast = client.infer("fraud", [features()], priority=1, timeout=10_000_000)
    assert fast.as_numpy("probabilities").shape[0] == 2
    with pytest.raises(InferenceServerException) as info:
        client.infer("fraud", [features()], timeout=1)  # 1 µs: expires before any reply
    assert info.value.status() == "StatusCode.DEADLINE_EXCEEDED"


def test_stream_infer_answers_every_request(demo_server):
    results: queue.Queue = queue.Queue()
    with triton.InferenceServerClient(f"127.0.0.1:{demo_server.grpc_port}") as c:
        c.start_stream(callback=lambda result, error: results.put((result, error)))
        for i in range(3):
            c.async_stream_infer("fraud", [features(ROWS[i % 2 : i % 2 + 1])], request_id=f"s{i}")
        c.async_stream_infer("nope", [features()], request_id="bad")
        got = [results.get(timeout=30) for _ in range(4)]
        c.stop_stream()
    answers = {r.get_response().id: r for r, e in got if e is None}
    errors = [e for _, e in got if e is not None]
    assert sorted(answers) == ["s0", "s1", "s2"]
    assert answers["s1"].as_numpy("probabilities").shape == (1, 2)
    assert len(errors) == 1 and "nope" in errors[0].message()
