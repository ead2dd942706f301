"""Numbers that are not numbers, on every path, against the real server: v1 JSON, V2
JSON, V2 binary, gRPC typed and raw contents, batch job inputs (inline and CSV). Each
bad request is refused naming the input, the element and the datatype, and the server
answers a good request right after it. A version with ``allow_non_finite`` takes NaN
and ±Infinity; a model that returns NaN is a model error."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from tests.conftest import InferdServer, push_source
from tests.inprocess import InProcessServer

Server = InferdServer | InProcessServer

TYPED = """
import numpy as np


class Typed:
    signature = {
        "inputs": [
            {"name": "f32", "datatype": "FP32", "shape": [-1, 3]},
            {"name": "f64", "datatype": "FP64", "shape": [-1]},
            {"name": "u8", "datatype": "UINT8", "shape": [-1]},
            {"name": "i8", "datatype": "INT8", "shape": [-1]},
            {"name": "i64", "datatype": "INT64", "shape": [-1]},
            {"name": "flag", "datatype": "BOOL", "shape": [-1]},
        ],
        "outputs": [
            {"name": "y", "datatype": "FP64", "shape": [-1]},
            {"name": "nans", "datatype": "INT64", "shape": [-1]},
        ],
    }

    def predict(self, batch):
        f = batch["f32"].astype(np.float64)
        y = np.nansum(f, axis=1) + np.nan_to_num(batch["f64"]) + batch["u8"] + batch["i8"]
        y = y + batch["i64"] + batch["flag"]
        # f32[:, 0] == -1 asks for a non-finite answer: a model failing numerically
        y = np.where(f[:, 0] == -1, np.nan, y)
        nans = (~np.isfinite(f)).sum(axis=1) + (~np.isfinite(batch["f64"]))
        return {"y": y, "nans": nans.astype(np.int64)}
"""
ONE = """
import numpy as np


class One:
    signature = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 3]}],
        "outputs": [
            {"name": "y", "datatype": "FP32", "shape": [-1]},
            {"name": "nans", "datatype": "INT64", "shape": [-1]},
        ],
    }

    def predict(self, batch):
        x = batch["x"]
        return {"y": np.nansum(np.where(np.isinf(x), 0, x), axis=1).astype(np.float32),
                "nans": (~np.isfinite(x)).sum(axis=1).astype(np.int64)}
"""
GOOD_ROW = {"f32": [1.0, 2.0, 3.0], "f64": 0.5, "u8": 7, "i8": -3, "i64": 10, "flag": True}
GOOD_Y = 21.5
DATATYPES = {"f32": "FP32", "f64": "FP64", "u8": "UINT8", "i8": "INT8", "i64": "INT64"}
DATATYPES["flag"] = "BOOL"
NUMPY = {"f32": np.float32, "f64": np.float64, "u8": np.uint8, "i8": np.int8}
NUMPY |= {"i64": np.int64, "flag": np.bool_}

JSON_CASES = [  # (input, bad value, what the refusal says of it)
    ("f32", None, "null is not a number (FP32)"),
    ("f32", float("nan"), "NaN is not finite (FP32)"),
    ("f32", float("inf"), "Infinity is not finite (FP32)"),
    ("f32", float("-inf"), "-Infinity is not finite (FP32)"),
    ("f32", "1.5", 'the string "1.5" is not a number (FP32); strings are never read'),
    ("f32", True, "the boolean true is not a number (FP32)"),
    ("f32", 1e39, "1e+39 is out of the range of FP32"),
    ("f32", -1e39, "-1e+39 is out of the range of FP32"),
    ("f32", {"v": 1}, "an object is not a number (FP32)"),
    ("f64", None, "null is not a number (FP64)"),
    ("f64", "NaN", 'the string "NaN" is not a number (FP64)'),
    ("u8", 300, "300 is out of the range of UINT8 (0 to 255)"),
    ("u8", -1, "-1 is out of the range of UINT8 (0 to 255)"),
    ("u8", 2.0, "2.0 is not an integer (UINT8)"),
    ("i8", 128, "128 is out of the range of INT8 (-128 to 127)"),
    ("i64", 2**63, "9223372036854775808 is out of the range of INT64"),
    ("i64", 1.5, "1.5 is not an integer (INT64)"),
    ("i64", "7", 'the string "7" is not an integer (INT64)'),
    ("i64", False, "the boolean false is not an integer (INT64)"),
    ("flag", 1, "1 is not true or false"),
    ("flag", "true", 'the string "true" is not true or false'),
    ("flag", None, "null is not true or false"),
]
JSON_IDS = [f"{name}={value!r}" for name, value, _ in JSON_CASES]


def push_models(data: Path) -> None:
    push_source(data, "typed", TYPED)
    push_source(data, "lenient", TYPED, "--meta", "allow_non_finite=true")
    push_source(data, "one", ONE)
    push_source(data, "one-lenient", ONE, "--meta", "allow_non_finite=true")


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    """The REST paths, in process: same app, same replica code, no processes."""
    server = InProcessServer(tmp_path_factory.mktemp("hygiene-app"))
    server.push_source("typed", TYPED)
    server.push_source("lenient", TYPED, allow_non_finite=True)
    server.push_source("one", ONE)
    server.push_source("one-lenient", ONE, allow_non_finite=True)
    try:
        server.wait_ready(timeout_s=120)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferdServer]:
    """gRPC and batch jobs need the real server (its gRPC port, its job runner)."""
    data = tmp_path_factory.mktemp("hygiene")
    push_models(data)
    server = InferdServer(data, env={"INFERD_JOBS__CHUNK_ITEMS": "8"})
    try:
        server.wait_ready(timeout_s=120)
        yield server
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def post_json(server: Server, path: str, body: Any) -> Any:
    """POST ``body`` as Python's json.dumps writes it (NaN and ±Infinity as literals)."""
    return server.client.post(
        path, content=json.dumps(body), headers={"content-type": "application/json"}
    )


def bad_row(name: str, value: Any) -> dict[str, Any]:
    row = json.loads(json.dumps(GOOD_ROW))
    if name == "f32":
        row["f32"][1] = value
    else:
        row[name] = value
    return row


def v1_predict(server: Server, model: str, rows: list[dict[str, Any]]) -> Any:
    return post_json(server, f"/api/v1/models/{model}/predict", {"inputs": rows})


def assert_still_serving(server: Server) -> None:
    reply = v1_predict(server, "typed", [GOOD_ROW])
    assert reply.status_code == 200, reply.text
    assert reply.json()["outputs"][0]["y"] == GOOD_Y


# -- /api/v1 JSON ----------------------------------------------------------------------


@pytest.mark.parametrize(("name", "value", "says"), JSON_CASES, ids=JSON_IDS)
def test_v1_json(app: InProcessServer, name: str, value: Any, says: str):
    reply = v1_predict(app, "typed", [GOOD_ROW, bad_row(name, value)])
    assert reply.status_code == 422, reply.text
    error = reply.json()["error"]
    where = f"input '{name}', row 1" + (", element [1]" if name == "f32" else "")
    assert error["code"] == "invalid_input"
    assert error["message"].startswith(f"{where}: {says}"), error["message"]
    assert (error["input"], error["datatype"], error["row"]) == (name, DATATYPES[name], 1)
    assert error.get("index") == ([1] if name == "f32" else None)
    assert_still_serving(app)


def test_v1_predict_one_and_a_good_request(app: InProcessServer):
    reply = post_json(app, "/api/v1/predict", {"model": "typed", "input": bad_row("u8", 256)})
    assert reply.status_code == 422
    assert "input 'u8', row 0: 256 is out of the range of UINT8" in reply.json()["error"]["message"]
    reply = post_json(app, "/api/v1/predict", {"model": "typed", "input": GOOD_ROW})
    assert reply.status_code == 200 and reply.json()["outputs"]["y"] == GOOD_Y


# -- V2 JSON ---------------------------------------------------------------------------


def v2_inputs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    tensors = []
    for name, datatype in DATATYPES.items():
        values = [row[name] for row in rows]
        shape = [len(rows), 3] if name == "f32" else [len(rows)]
        tensors.append({"name": name, "datatype": datatype, "shape": shape, "data": values})
    return tensors


def assert_v2_still_serving(server: Server) -> None:
    reply = post_json(server, "/v2/models/typed/infer", {"inputs": v2_inputs([GOOD_ROW])})
    assert reply.status_code == 200, reply.text
    assert reply.json()["outputs"][0]["data"] == [GOOD_Y]


@pytest.mark.parametrize(("name", "value", "says"), JSON_CASES, ids=JSON_IDS)
def test_v2_json(app: InProcessServer, name: str, value: Any, says: str):
    body = {"inputs": v2_inputs([GOOD_ROW, bad_row(name, value)])}
    reply = post_json(app, "/v2/models/typed/infer", body)
    assert reply.status_code == 400, reply.text
    index = 4 if name == "f32" else 1  # row-major: row 1 of [2, 3] is elements 3..5
    message = reply.json()["error"]
    assert message.startswith(f"input '{name}', element {index}: {says}"), message
    assert_v2_still_serving(app)


def test_v2_json_flat_and_nested_data_are_checked_alike(app: InProcessServer):
    inputs = v2_inputs([GOOD_ROW, bad_row("f32", "2")])
    inputs[0]["data"] = [x for row in inputs[0]["data"] for x in row]  # flat
    reply = post_json(app, "/v2/models/typed/infer", {"inputs": inputs})
    assert reply.status_code == 400
    assert reply.json()["error"].startswith("input 'f32', element 4: the string \"2\"")
    inputs[0]["data"] = [[1, 2, 3], 4, 5, 6]  # nesting that breaks off
    reply = post_json(app, "/v2/models/typed/infer", {"inputs": inputs})
    assert reply.status_code == 400 and "nested lists all of one depth" in reply.json()["error"]
    assert_v2_still_serving(app)


# -- V2 binary --------------------------------------------------------------------------


def good_arrays(rows: int = 2) -> dict[str, np.ndarray]:
    return {name: np.array([GOOD_ROW[name]] * rows, dtype=NUMPY[name]) for name in DATATYPES}


def binary_body(arrays: dict[str, np.ndarray | bytes]) -> tuple[bytes, dict[str, str]]:
    """A V2 binary-extension request; an input given as bytes is sent as they are."""
    inputs, blobs = [], []
    for name, value in arrays.items():
        blob = (
            value
            if isinstance(value, bytes)
            else value.astype(value.dtype.newbyteorder("<")).tobytes()
        )
        rows = 2
        shape = [rows, 3] if name == "f32" else [rows]
        inputs.append({"name": name, "datatype": DATATYPES[name], "shape": shape,
                       "parameters": {"binary_data_size": len(blob)}})  # fmt: skip
        blobs.append(blob)
    head = json.dumps({"inputs": inputs}).encode()
    headers = {"inference-header-content-length": str(len(head))}
    return head + b"".join(blobs), headers


SNAN32 = struct.pack("<I", 0x7FA00000)  # a signalling NaN
NEG_NAN32 = struct.pack("<I", 0xFFC00000)


def f32_bytes(flat_index: int, pattern: bytes) -> bytes:
    data = bytearray(good_arrays()["f32"].tobytes())
    data[flat_index * 4 : flat_index * 4 + 4] = pattern
    return bytes(data)


def f64_with(value: float, index: int = 1) -> bytes:
    array = good_arrays()["f64"]
    array[index] = value
    return array.tobytes()


BINARY_CASES = [  # (input, its bytes, what the refusal says)
    ("f32", f32_bytes(0, struct.pack("<f", float("nan"))), "element 0: NaN is not finite"),
    ("f32", f32_bytes(4, struct.pack("<f", float("nan"))), "element 4: NaN is not finite"),
    ("f32", f32_bytes(5, struct.pack("<f", float("nan"))), "element 5: NaN is not finite"),
    ("f32", f32_bytes(2, SNAN32), "element 2: NaN is not finite"),
    ("f32", f32_bytes(3, NEG_NAN32), "element 3: NaN is not finite"),
    ("f32", f32_bytes(1, struct.pack("<f", float("inf"))), "element 1: Infinity is not finite"),
    ("f32", f32_bytes(1, struct.pack("<f", float("-inf"))), "element 1: -Infinity is not"),
    ("f64", f64_with(float("nan")), "element 1: NaN is not finite (FP64)"),
    ("f64", f64_with(float("inf"), 0), "element 0: Infinity is not finite (FP64)"),
    ("f64", f64_with(float("-inf")), "element 1: -Infinity is not finite (FP64)"),
    ("flag", b"\x01\x02", "element 1: byte 0x02 is not a BOOL"),
    ("flag", b"\xff\x00", "element 0: byte 0xff is not a BOOL"),
    ("flag", b"\x80\x01", "element 0: byte 0x80 is not a BOOL"),
    ("f32", f32_bytes(0, b"\x00\x00\x80\x7f")[:-1], "binary_data_size is 23 bytes"),
    ("i64", struct.pack("<2f", 1.0, 2.0), "binary_data_size is 8 bytes; shape [2] of INT64"),
    ("u8", b"\x01\x02\x03", "binary_data_size is 3 bytes; shape [2] of UINT8 needs 2"),
]


@pytest.mark.parametrize(("name", "blob", "says"), BINARY_CASES)
def test_v2_binary(app: InProcessServer, name: str, blob: bytes, says: str):
    arrays: dict[str, Any] = {**good_arrays(), name: blob}
    body, headers = binary_body(arrays)
    reply = app.client.post("/v2/models/typed/infer", content=body, headers=headers)
    assert reply.status_code == 400, reply.text
    message = reply.json()["error"]
    assert message.startswith(f"input '{name}'") and says in message, message
    good, headers = binary_body(good_arrays())
    again = app.client.post("/v2/models/typed/infer", content=good, headers=headers)
    assert again.status_code == 200 and again.json()["outputs"][0]["data"] == [GOOD_Y] * 2


# -- gRPC -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stub(server: InferdServer) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


TYPED_FIELD = {"f32": "fp32_contents", "f64": "fp64_contents", "u8": "uint_contents"}
TYPED_FIELD |= {"i8": "int_contents", "i64": "int64_contents", "flag": "bool_contents"}


def grpc_request(model: str = "typed", raw: bool = False, **values: list[Any]) -> Any:
    """A ModelInfer request of two good rows, with ``values`` replacing an input's
    (flat) elements; typed contents, or ``raw_input_contents``."""
    request = pb.ModelInferRequest(model_name=model)
    for name, array in good_arrays().items():
        tensor = request.inputs.add(name=name, datatype=DATATYPES[name])
        tensor.shape.extend(array.shape)
        flat = values.get(name, array.reshape(-1).tolist())
        if raw:
            request.raw_input_contents.append(np.asarray(flat, dtype=NUMPY[name]).tobytes())
        else:
            getattr(tensor.contents, TYPED_FIELD[name]).extend(flat)
    return request


def grpc_raw(name: str, blob: bytes) -> Any:
    request = grpc_request(raw=True)
    request.raw_input_contents[list(DATATYPES).index(name)] = blob
    return request


def _with_contents_too(request: Any) -> Any:
    request.inputs[0].contents.fp32_contents.extend([1.0] * 6)
    return request


def _extra_raw(request: Any) -> Any:
    request.raw_input_contents.append(b"\x00")
    return request


F32 = [1.0, 2.0, 3.0, 1.0, 2.0, 3.0]
GRPC_CASES = [  # (request, what the refusal says)
    (grpc_request(f32=[*F32[:4], float("nan"), 3.0]), "input 'f32', element 4: NaN is not"),
    (grpc_request(f32=[float("inf"), *F32[1:]]), "input 'f32', element 0: Infinity is not"),
    (grpc_request(f32=[*F32[:5], float("-inf")]), "input 'f32', element 5: -Infinity"),
    (grpc_request(f64=[0.5, float("nan")]), "input 'f64', element 1: NaN is not finite (FP64)"),
    (grpc_request(f64=[float("inf"), 0.5]), "input 'f64', element 0: Infinity is not finite"),
    (grpc_request(u8=[7, 256]), "input 'u8', element 1: 256 is out of the range of UINT8"),
    (grpc_request(u8=[2**32 - 1, 7]), "input 'u8', element 0: 4294967295 is out of the range"),
    (grpc_request(i8=[128, -3]), "input 'i8', element 0: 128 is out of the range of INT8"),
    (grpc_request(i8=[-3, -129]), "input 'i8', element 1: -129 is out of the range of INT8"),
    (grpc_request(i8=[-3, 2**31 - 1]), "input 'i8', element 1: 2147483647 is out of the range"),
    (grpc_request(f32=F32[:5]), "input 'f32': contents has 5 elements; shape [2, 3] needs 6"),
    (grpc_request(i64=[10]), "input 'i64': contents has 1 elements; shape [2] needs 2"),
    (grpc_raw("f32", f32_bytes(2, struct.pack("<f", float("nan")))), "element 2: NaN is not"),
    (grpc_raw("f32", f32_bytes(0, SNAN32)), "input 'f32', element 0: NaN is not finite"),
    (grpc_raw("f64", f64_with(float("-inf"))), "input 'f64', element 1: -Infinity is not"),
    (grpc_raw("flag", b"\x02\x01"), "input 'flag', element 0: byte 0x02 is not a BOOL"),
    (grpc_raw("u8", b"\x01"), "binary_data_size is 1 bytes; shape [2] of UINT8 needs 2"),
    (_with_contents_too(grpc_request(raw=True)), "has typed contents and the request has raw"),
    (_extra_raw(grpc_request(raw=True)), "raw_input_contents has 7 entries for 6 inputs"),
]


@pytest.mark.parametrize(("request_", "says"), GRPC_CASES)
def test_grpc(server: InferdServer, stub: Any, request_: Any, says: str):
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request_)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert says in info.value.details()
    for raw in (False, True):
        reply = stub.ModelInfer(grpc_request(raw=raw))
        y = np.frombuffer(reply.raw_output_contents[0], "<f8")
        assert y.tolist() == [GOOD_Y, GOOD_Y]


# -- batch job inputs ---------------------------------------------------------------------


def wait_job(server: InferdServer, job_id: str, timeout_s: float = 60) -> dict[str, Any]:
    return server.wait_job(job_id, timeout_s)


def job_results(server: InferdServer, body: Any, raw: bool = False) -> list[dict[str, Any]]:
    reply = post_json(server, "/api/v1/batch", body)
    assert reply.status_code == 202, reply.text
    done = wait_job(server, reply.json()["batch_id"])
    assert done["status"] == "succeeded"
    lines = server.client.get(f"/api/v1/batch/{done['batch_id']}/results").text.splitlines()
    return [json.loads(line) for line in lines]


def test_batch_job_inputs(server: InferdServer):
    """Every bad item fails alone, naming its element; the good ones around it succeed."""
    items = []
    for name, value, _ in JSON_CASES:
        items += [GOOD_ROW, bad_row(name, value)]
    out = job_results(server, {"model": "typed", "inputs": items})
    assert [line["index"] for line in out] == list(range(len(items)))
    for i, (name, value, says) in enumerate(JSON_CASES):
        good, bad = out[2 * i], out[2 * i + 1]
        assert good["output"]["y"] == GOOD_Y, good
        assert bad["status"] == 422, (name, value, bad)
        where = f"input '{name}', row 0" + (", element [1]" if name == "f32" else "")
        assert bad["error"]["message"].startswith(f"{where}: {says}"), bad
    assert_still_serving(server)


CSV = "a,b,c\n1,2,3\nnan,2,3\n1,inf,3\n1,,3\n1,x,3\n1,1e39,3\n1,-inf,NaN\n"


@pytest.mark.parametrize("lenient", [False, True], ids=["strict", "allow_non_finite"])
def test_batch_job_csv_cells(server: InferdServer, lenient: bool):
    """CSV cells of a one-input model: ``nan``/``inf`` are non-finite numbers and an
    empty cell is missing (null): refused by a strict version, NaN for a lenient one;
    text and out-of-range numbers are refused by both."""
    model = "one-lenient" if lenient else "one"
    inputs = server.data_dir / "inputs"
    inputs.mkdir(exist_ok=True)
    (inputs / "cells.csv").write_text(CSV)
    out = job_results(server, {"model": model, "input_uri": "cells.csv"})
    assert out[0]["output"] == {"y": 6.0, "nans": 0}
    refused_by_both = {
        4: "input 'x', row 0, element [1]: the string \"x\" is not a number (FP32)",
        5: "input 'x', row 0, element [1]: 1e+39 is out of the range of FP32",
    }
    for index, says in refused_by_both.items():
        assert out[index]["status"] == 422 and out[index]["error"]["message"].startswith(says)
    non_finite = {1: ("[0]", "NaN", 1), 2: ("[1]", "Infinity", 1), 3: ("[1]", "null", 1)}
    non_finite[6] = ("[1]", "-Infinity", 2)
    for index, (element, literal, count) in non_finite.items():
        if lenient:
            assert out[index]["output"]["nans"] == count, out[index]
        else:
            says = f"input 'x', row 0, element {element}: {literal} is not"
            assert out[index]["error"]["message"].startswith(says), out[index]


# -- allow_non_finite, and models that return NaN ----------------------------------------


def test_a_lenient_version_takes_non_finite_inputs_on_every_path(server: InferdServer, stub):
    rows = [bad_row("f32", float("nan")), bad_row("f64", float("-inf"))]
    reply = v1_predict(server, "lenient", rows)
    assert reply.status_code == 200, reply.text
    assert [o["nans"] for o in reply.json()["outputs"]] == [1, 1]
    reply = v1_predict(server, "lenient", [bad_row("f32", None)])  # null: a missing value
    assert reply.json()["outputs"][0]["nans"] == 1
    body = {"inputs": v2_inputs([bad_row("f32", float("inf")), GOOD_ROW])}
    reply = post_json(server, "/v2/models/lenient/infer", body)
    assert reply.status_code == 200 and reply.json()["outputs"][1]["data"] == [1, 0]
    blob = f32_bytes(4, struct.pack("<f", float("nan")))
    body, headers = binary_body({**good_arrays(), "f32": blob})
    reply = server.client.post("/v2/models/lenient/infer", content=body, headers=headers)
    assert reply.status_code == 200 and reply.json()["outputs"][1]["data"] == [0, 1]
    reply = stub.ModelInfer(grpc_request("lenient", f64=[float("nan"), 0.5]))
    assert np.frombuffer(reply.raw_output_contents[1], "<i8").tolist() == [1, 0]
    # what does not fit the datatype stays refused: out of range, strings, booleans
    for name, value in [("f32", 1e39), ("f32", "nan"), ("u8", 300), ("flag", 0)]:
        reply = v1_predict(server, "lenient", [bad_row(name, value)])
        assert reply.status_code == 422, (name, value, reply.text)


def test_a_model_that_returns_nan_is_a_model_error(app: InProcessServer):
    nan_row = bad_row("f32", 2.0)
    nan_row["f32"][0] = -1.0  # the test model answers NaN for this row
    reply = v1_predict(app, "typed", [GOOD_ROW, nan_row])
    assert reply.status_code == 500, reply.text
    error = reply.json()["error"]
    assert error["code"] == "model_error"
    assert "returned NaN in output 'y' (row 1)" in error["message"]
    reply = post_json(app, "/v2/models/typed/infer", {"inputs": v2_inputs([nan_row])})
    assert reply.status_code == 500 and "returned NaN in output 'y'" in reply.json()["error"]
    # batched with good requests, only the request with the NaN row fails
    with ThreadPoolExecutor(8) as pool:
        bodies = [[nan_row] if i % 4 == 0 else [GOOD_ROW] for i in range(32)]
        replies = list(pool.map(lambda rows: v1_predict(app, "typed", rows), bodies))
    codes = [r.status_code for r in replies]
    assert codes == [500 if i % 4 == 0 else 200 for i in range(32)], codes
    # a version that allows non-finite numbers returns it (JSON null)
    reply = v1_predict(app, "lenient", [nan_row])
    assert reply.status_code == 200 and reply.json()["outputs"][0]["y"] is None


def test_allow_non_finite_must_be_a_boolean(app: InProcessServer):
    from tests.conftest import run_cli

    src = app.data_dir / "src-bad-meta"
    src.mkdir(exist_ok=True)
    (src / "model.py").write_text(ONE)
    result = run_cli(
        "models", "push", "bad-meta", str(src), "--version", "v1", "--meta", "allow_non_finite=yes",
        data_dir=app.data_dir, check=False,
    )  # fmt: skip
    assert result.returncode != 0
    assert "allow_non_finite must be true or false" in result.stdout + result.stderr
