"""JSON rows <-> columnar numpy batches, checked against a model signature.

``{"inputs": [{"features": [...]}, ...]}`` becomes ``{"features": array(N, 30)}``;
outputs go back as one dict per row. Errors name the field, the row and what the
signature expected, because that is what a user needs to fix the request.
"""

from __future__ import annotations

from typing import Any, NoReturn

import numpy as np

from inferd.errors import InvalidInput
from inferd.protocols.media import media_column
from inferd.protocols.numbers import json_array
from inferd.shapes.tensors import Signature, TensorSpec


def rows_to_columns(
    rows: Any, signature: Signature, allow_non_finite: bool = False
) -> tuple[dict[str, np.ndarray], int]:
    """Rows -> columns; every number checked against its datatype (see
    :mod:`inferd.protocols.numbers`; ``allow_non_finite``: the version takes NaN and ±inf)."""
    if not isinstance(rows, list) or not rows:
        raise InvalidInput("'inputs' must be a non-empty list of rows")
    specs = signature.inputs
    if len(specs) == 1 and (
        not isinstance(rows[0], dict) or (specs[0].media and rows[0].keys() == {"b64"})
    ):
        # A single-input model also takes bare rows: {"inputs": [[0.5, 1.2, ...]]}; an
        # image model {"inputs": [{"b64": "..."}]} too.
        return {specs[0].name: _column(rows, specs[0], allow_non_finite)}, len(rows)
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise InvalidInput(f"row {i} must be an object with fields {_names(specs)}")
        if len(row) != len(specs):
            _report_fields(i, row, specs)
    columns = {}
    for spec in specs:
        try:
            values = [row[spec.name] for row in rows]
        except KeyError:
            i = next(i for i, row in enumerate(rows) if spec.name not in row)
            _report_fields(i, rows[i], specs)
        columns[spec.name] = _column(values, spec, allow_non_finite)
    return columns, len(rows)


def _names(specs: tuple[TensorSpec, ...]) -> str:
    return ", ".join(repr(s.name) for s in specs)


def _report_fields(i: int, row: dict[str, Any], specs: tuple[TensorSpec, ...]) -> None:
    expected = {s.name for s in specs}
    missing = sorted(expected - row.keys())
    unknown = sorted(row.keys() - expected)
    parts = []
    if missing:
        parts.append(f"missing field(s) {missing}")
    if unknown:
        parts.append(f"unknown field(s) {unknown}")
    raise InvalidInput(f"row {i}: {'; '.join(parts)}; the model takes {_names(specs)}")


def _column(values: list[Any], spec: TensorSpec, allow_non_finite: bool) -> np.ndarray:
    if spec.datatype == "BYTES":
        return media_column(values, spec.name) if spec.media else _text_column(values, spec)
    try:
        array = json_array(values, spec, len(spec.shape), allow_non_finite, by_row=True)
    except ValueError:  # nested other than the spec's shape, or ragged
        try:
            got = np.shape(values)[1:]
        except ValueError:
            got = None
        if got is None or len(got) == len(spec.shape) - 1:
            raise InvalidInput(
                f"{spec.name!r}: expected {spec.datatype} values of shape {_shape(spec)} "
                "per row (numbers, all rows the same length)"
            ) from None
        _wrong_shape(spec, tuple(got))
    _check_shape(spec, array.shape[1:])
    return array


def _check_shape(spec: TensorSpec, got: tuple[int, ...]) -> None:
    want = spec.shape[1:]
    if len(got) != len(want) or any(w not in (-1, g) for w, g in zip(want, got, strict=True)):
        _wrong_shape(spec, got)


def _wrong_shape(spec: TensorSpec, got: tuple[int, ...]) -> NoReturn:
    raise InvalidInput(
        f"{spec.name!r}: expected shape {_shape(spec)} per row, got {list(got) or 'a scalar'}",
        expected=list(spec.shape),
        got=[-1, *got],
    )


def _text_column(values: list[Any], spec: TensorSpec) -> np.ndarray:
    for i, v in enumerate(values):
        if not isinstance(v, str):
            raise InvalidInput(f"{spec.name!r} of row {i} must be a string, got {type(v).__name__}")
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array


def _shape(spec: TensorSpec) -> str:
    per_row = spec.shape[1:]
    return str(list(per_row)) if per_row else "scalar"


def columns_to_rows(outputs: dict[str, np.ndarray], signature: Signature) -> list[dict[str, Any]]:
    """One dict per row; integer class labels become class names when known."""
    outputs = _named_labels(outputs, signature)
    names = list(outputs)
    columns = [outputs[n] for n in names]
    rows = len(columns[0]) if columns else 0
    return [{n: c[i] for n, c in zip(names, columns, strict=True)} for i in range(rows)]


def _named_labels(outputs: dict[str, np.ndarray], signature: Signature) -> dict[str, np.ndarray]:
    label = outputs.get("label")
    if signature.labels is None or label is None or label.dtype.kind not in "iu":
        return outputs
    names = np.asarray(signature.labels, dtype=object)
    return {**outputs, "label": names[label]}
