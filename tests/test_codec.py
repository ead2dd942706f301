"""JSON rows <-> columns and the wire protocol, without servers."""

from __future__ import annotations

import numpy as np
import pytest

from inferd.errors import InvalidInput
from inferd.protocols.codec import columns_to_rows, rows_to_columns
from inferd.protocols.v2 import to_binary
from inferd.shapes import replica as p
from inferd.shapes.tensors import Signature, TensorSpec

TABULAR = Signature(
    inputs=(TensorSpec("features", "FP32", (-1, 3)),),
    outputs=(TensorSpec("label", "INT64"), TensorSpec("probabilities", "FP32", (-1, 2))),
    labels=("legit", "fraud"),
)
TEXT = Signature(inputs=(TensorSpec("text", "BYTES"),), outputs=(TensorSpec("label", "BYTES"),))
TWO = Signature(
    inputs=(TensorSpec("a", "INT64"), TensorSpec("b", "FP64", (-1, 2))),
    outputs=(TensorSpec("y", "FP64"),),
)


def test_rows_become_typed_columns():
    columns, n = rows_to_columns([{"features": [1, 2, 3]}, {"features": [4, 5, 6]}], TABULAR)
    assert n == 2
    assert columns["features"].dtype == np.float32
    assert columns["features"].shape == (2, 3)


def test_bare_rows_for_single_input_models():
    columns, _ = rows_to_columns([[1, 2, 3]], TABULAR)
    assert columns["features"].shape == (1, 3)


def test_multiple_inputs():
    columns, _ = rows_to_columns([{"a": 1, "b": [0.5, 1.5]}], TWO)
    assert columns["a"].dtype == np.int64 and columns["b"].shape == (1, 2)


@pytest.mark.parametrize(
    ("rows", "signature", "message"),
    [
        ([], TABULAR, "non-empty list"),
        ({"features": [1, 2, 3]}, TABULAR, "non-empty list"),
        ([{"features": [1, 2]}], TABULAR, "expected shape [3] per row, got [2]"),
        ([{"features": [1, 2, 3]}, {"features": [1, 2]}], TABULAR, "all rows the same length"),
        ([{"features": ["a", "b", "c"]}], TABULAR, 'row 0, element [0]: the string "a" is not'),
        ([{"feature": [1, 2, 3]}], TABULAR, "missing field(s) ['features']"),
        ([{"a": 1}], TWO, "missing field(s) ['b']"),
        ([{"a": 1, "b": [1, 2], "c": 3}], TWO, "unknown field(s) ['c']"),
        ([{"text": 5}], TEXT, "must be a string, got int"),
        ([{"a": [1, 2], "b": [1, 2]}], TWO, "'a': expected shape scalar per row, got [2]"),
    ],
)
def test_mismatches_are_422_with_what_was_expected(rows, signature, message):
    with pytest.raises(InvalidInput) as info:
        rows_to_columns(rows, signature)
    assert info.value.status_code == 422
    assert message in info.value.message


def test_outputs_become_rows_with_label_names():
    outputs = {"label": np.array([1, 0]), "probabilities": np.array([[0.1, 0.9], [0.8, 0.2]])}
    rows = columns_to_rows(outputs, TABULAR)
    assert [r["label"] for r in rows] == ["fraud", "legit"]
    assert rows[0]["probabilities"].tolist() == [0.1, 0.9]


def test_wire_frames_round_trip_tensors_and_split_across_reads():
    features = np.arange(12, dtype=np.float32).reshape(4, 3)
    text = np.array(["a", "é", ""], dtype=object)
    frames = p.encode(p.Infer(7, {"f": p.to_tensor(features), "t": p.to_tensor(text)}, 4, 100.0))
    frames += p.encode(p.StatusQuery(8))
    buffer = p.FrameBuffer()
    messages = buffer.feed(frames[:5]) + buffer.feed(frames[5:20]) + buffer.feed(frames[20:])
    assert [type(m) for m in messages] == [p.Infer, p.StatusQuery]
    infer = messages[0]
    assert np.array_equal(p.from_tensor(infer.inputs["f"]), features)
    assert p.from_tensor(infer.inputs["t"]).tolist() == ["a", "é", ""]
    assert isinstance(infer.inputs["f"].data, bytes)  # raw buffer, not a list


@pytest.mark.parametrize(
    "values",
    [
        ["legit", "fraud", "legit"] * 20,  # a classifier's labels: each encoded once
        [f"text {i}" for i in range(20)],
        ["é", b"raw", "", b""] * 5,
        [1, 1.0, True, None] * 5,  # equal under ==, yet each written as its own str()
    ],
)
def test_v2_binary_bytes_outputs_are_length_prefixed(values):
    array = np.empty(len(values), dtype=object)
    array[:] = values
    items = (v if isinstance(v, bytes) else str(v).encode() for v in values)
    expected = b"".join(len(b).to_bytes(4, "little") + b for b in items)
    assert to_binary(array.reshape(-1, 1)) == expected
