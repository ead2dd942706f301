"""Numbers that are numbers: tensor elements checked against their datatype.

Every numeric input is checked here, whatever wire format brought it, before it goes
to a replica:

- JSON values must be of the datatype: a float type takes numbers within its range
  (1e39 does not fit FP32), an integer type integers within its range (300 does not
  fit UINT8; 1.5 is not an integer), BOOL takes ``true``/``false``. A string, a
  boolean where a number is expected, or ``null`` is refused: nothing is coerced.
- Binary data (the V2 binary extension, gRPC ``raw_input_contents``) and gRPC typed
  contents hold any bit pattern: float elements must be finite, BOOL bytes 0 or 1, and
  typed integers carried in a wider field (INT8 in ``int_contents``) within range.

Non-finite floats (NaN, ±Infinity) are refused unless the version's metadata says
``allow_non_finite: true`` (tree models read NaN as a missing value): then float inputs
take them, in JSON as the literals ``NaN``, ``Infinity``, ``-Infinity`` or as ``null``
(a missing value, NaN), and the version's outputs may hold them. A refusal names the
input, the element and the datatype.

Cost: no Python loop per element, accepted or refused. JSON values are validated by
msgspec's C converter against a type built once per datatype and nesting depth (a
refusal goes straight to the element msgspec names); binary data by numpy.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from typing import Annotated, Any

import msgspec
import numpy as np

from inferd.errors import InvalidInput
from inferd.shapes.tensors import TensorSpec

_FLOAT_MAX = {"FP16": 65504.0, "FP32": float(np.finfo(np.float32).max), "FP64": math.inf}
_FLOAT_RANGE = {"FP16": "±65504", "FP32": "±3.4028235e+38", "FP64": "±1.7976931348623157e+308"}
_INT_RANGE = {
    dt: (int(np.iinfo(np.dtype(dt.lower())).min), int(np.iinfo(np.dtype(dt.lower())).max))
    for dt in ("INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64")
}


def _element_type(datatype: str, allow_non_finite: bool) -> Any:
    if datatype == "BOOL":
        return bool
    if datatype in _INT_RANGE:
        lo, hi = _INT_RANGE[datatype]
        if hi > 2**63 - 1:  # msgspec bounds stop at int64; the walker checks the rest
            return Annotated[int, msgspec.Meta(ge=lo)]
        return Annotated[int, msgspec.Meta(ge=lo, le=hi)]
    if allow_non_finite:  # range of finite values: checked on the array
        return float | None
    top = _FLOAT_MAX[datatype]
    if math.isinf(top):  # FP64: any finite float (bounds refuse NaN and ±inf)
        top = float(np.finfo(np.float64).max)
    return Annotated[float, msgspec.Meta(ge=-top, le=top)]


@functools.lru_cache(maxsize=256)
def _json_type(datatype: str, depth: int, allow_non_finite: bool) -> type[msgspec.Struct]:
    """A one-field array-like Struct holding ``depth`` nested lists of the datatype's
    elements: ``msgspec.convert((values,), it)`` validates ``values`` in C. (A Struct,
    not the bare ``list[...]`` type: msgspec finds a Struct's compiled validator without
    hashing an ``Annotated`` alias in Python, 3.5 -> 1 us per call.)"""
    kind = _element_type(datatype, allow_non_finite)
    for _ in range(depth):
        kind = list[kind]  # type: ignore[valid-type]
    return msgspec.defstruct(f"{datatype}x{depth}", [("values", kind)], array_like=True)


def json_array(
    values: Any,
    spec: TensorSpec,
    depth: int,
    allow_non_finite: bool = False,
    by_row: bool = False,
) -> np.ndarray:
    """The numeric JSON ``values`` (lists ``depth`` deep) as an array of the spec's dtype,
    after checking every element; InvalidInput names the first bad one (``by_row``: the
    first index is the row, as in ``/api/v1`` rows, else the flat element index).
    Values nested other than ``depth`` deep, or ragged, raise ValueError, for the caller
    to report as a shape error."""
    try:
        msgspec.convert((values,), _json_type(spec.datatype, depth, allow_non_finite))
    except msgspec.ValidationError as exc:
        raise _refusal(values, spec, depth, allow_non_finite, by_row, exc) from None
    try:
        if not allow_non_finite:  # every value is in the datatype's range: none overflows
            return np.asarray(values, dtype=spec.numpy_dtype)
        with np.errstate(over="ignore"):  # finite values too large for the type: below
            array = np.asarray(values, dtype=spec.numpy_dtype)
    except OverflowError:  # UINT64 above 2**64 - 1 (msgspec cannot bound it)
        raise _refusal(values, spec, depth, allow_non_finite, by_row) from None
    if array.dtype.kind == "f" and spec.datatype != "FP64":
        _check_overflow(values, array, spec, by_row)
    return array


def _check_overflow(values: Any, array: np.ndarray, spec: TensorSpec, by_row: bool) -> None:
    """Finite numbers that became ±inf in a narrower float type do not fit it."""
    became_inf = np.isinf(array)
    if not became_inf.any():
        return
    wide = np.asarray(values, dtype=np.float64)
    bad = np.flatnonzero(became_inf.reshape(-1) & np.isfinite(wide).reshape(-1))
    if bad.size:
        index = int(bad[0])
        value = float(wide.reshape(-1)[index])
        path = tuple(int(i) for i in np.unravel_index(index, wide.shape))
        raise _invalid(spec, path, by_row, index, _out_of_range(value, spec.datatype))


def check_array(array: np.ndarray, spec: TensorSpec, allow_non_finite: bool = False) -> np.ndarray:
    """A tensor from binary data or gRPC typed contents, checked element by element with
    numpy: finite floats (unless ``allow_non_finite``), BOOL bytes 0 or 1, integers in
    the spec's range (an array of a wider integer type is narrowed to the spec's)."""
    kind = array.dtype.kind
    if kind == "f":
        if not allow_non_finite:
            finite = np.isfinite(array)
            if not finite.all():
                index = int(np.flatnonzero(~finite.reshape(-1))[0])
                value = float(array.reshape(-1)[index])
                raise _invalid(spec, (), False, index, _non_finite(value, spec.datatype))
        return array
    if kind == "b":
        raw = array.view(np.uint8)
        if (raw > 1).any():
            index = int(np.flatnonzero(raw.reshape(-1) > 1)[0])
            byte = int(raw.reshape(-1)[index])
            problem = f"byte {byte:#04x} is not a BOOL (0 for false, 1 for true)"
            raise _invalid(spec, (), False, index, problem)
        return array
    if kind in "iu" and array.dtype != spec.numpy_dtype:
        lo, hi = _INT_RANGE[spec.datatype]
        outside = (array < lo) | (array > hi)
        if outside.any():
            index = int(np.flatnonzero(outside.reshape(-1))[0])
            value = int(array.reshape(-1)[index])
            raise _invalid(spec, (), False, index, _out_of_range(value, spec.datatype))
        return array.astype(spec.numpy_dtype)
    return array


# -- describing a refusal (only refused requests get here) ------------------------------


_AT = re.compile(r"- at `\$\[0\]((?:\[\d+\])*)`$")
"""Where msgspec says a value failed: after the wrapping Struct's field, the indices."""


def _refusal(
    values: Any,
    spec: TensorSpec,
    depth: int,
    allow_non_finite: bool,
    by_row: bool,
    error: msgspec.ValidationError | None = None,
) -> InvalidInput | ValueError:
    """InvalidInput naming the bad element of ``values`` that msgspec's ``error`` points
    at (or, without one, the first found by walking them), or a ValueError when their
    nesting breaks there (a shape error, for the caller to word). Going straight to the
    element keeps a refusal cheap however large the body: the walk is only a fallback."""
    accepts = _accepts(spec.datatype, allow_non_finite)
    match = _AT.search(str(error)) if error is not None else None
    if match is not None:
        path = tuple(int(i) for i in re.findall(r"\d+", match.group(1)))
        try:
            item = values
            for i in path:
                item = item[i]
        except (IndexError, KeyError, TypeError):
            item = path = None  # type: ignore[assignment]
        if path is not None:
            if len(path) < depth or isinstance(item, list):
                return ValueError("the values are not nested as the shape says")
            problem = accepts(item)
            if problem is not None:
                return _invalid(spec, path, by_row, _flat_index(values, path), problem)
    return _walk(values, spec, depth, accepts, by_row)


def _flat_index(values: Any, path: tuple[int, ...]) -> int:
    """The row-major index of ``path`` in nested lists as regular as their first items."""
    sizes, item = [], values
    for _ in path:
        sizes.append(len(item) if isinstance(item, list) else 1)
        item = item[0] if isinstance(item, list) and item else None
    index = 0
    for level, i in enumerate(path):
        stride = 1
        for size in sizes[level + 1 :]:
            stride *= size
        index += i * stride
    return index


def _walk(
    values: Any,
    spec: TensorSpec,
    depth: int,
    accepts: Callable[[Any], str | None],
    by_row: bool,
) -> InvalidInput | ValueError:
    """The first bad element of ``values`` (or the first break in their nesting)."""
    flat_index = 0
    stack: list[tuple[Any, tuple[int, ...]]] = [(values, ())]
    while stack:
        item, path = stack.pop()
        if len(path) < depth:
            if not isinstance(item, list):
                return ValueError(f"{_describe(item)} where a list was expected")
            stack.extend((x, (*path, i)) for i, x in reversed(list(enumerate(item))))
            continue
        if isinstance(item, list):
            return ValueError("a list where a value was expected")
        problem = accepts(item)
        if problem is not None:
            return _invalid(spec, path, by_row, flat_index, problem)
        flat_index += 1
    return ValueError(f"data is not a list of {spec.datatype} values")


def _accepts(datatype: str, allow_non_finite: bool) -> Callable[[Any], str | None]:
    """A function telling what is wrong with one JSON value for ``datatype`` (None: fine)."""
    if datatype == "BOOL":
        return lambda v: (
            None if isinstance(v, bool) else f"{_describe(v)} is not true or false (BOOL)"
        )
    if datatype in _INT_RANGE:
        lo, hi = _INT_RANGE[datatype]

        def integer(v: Any) -> str | None:
            if isinstance(v, bool) or not isinstance(v, int):
                return f"{_describe(v)} is not an integer ({datatype}){_never_text(v)}"
            return None if lo <= v <= hi else _out_of_range(v, datatype)

        return integer
    top = _FLOAT_MAX[datatype]

    def number(v: Any) -> str | None:
        if v is None and allow_non_finite:
            return None
        if isinstance(v, bool) or not isinstance(v, int | float):
            return f"{_describe(v)} is not a number ({datatype}){_never_text(v)}"
        try:
            x = float(v)
        except OverflowError:
            return _out_of_range(v, datatype)
        if math.isnan(x) or (math.isinf(x) and isinstance(v, float)):
            return None if allow_non_finite else _non_finite(x, datatype)
        return None if abs(x) <= top else _out_of_range(v, datatype)

    return number


def _never_text(v: Any) -> str:
    return "; strings are never read as numbers" if isinstance(v, str) else ""


def _describe(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"the boolean {str(v).lower()}"
    if isinstance(v, str):
        text = v if len(v) <= 40 else v[:37] + "..."
        return f"the string {msgspec.json.encode(text).decode()}"
    if isinstance(v, dict):
        return "an object"
    if isinstance(v, list):
        return "a list"
    if isinstance(v, float):
        return _literal(v)
    return repr(v)


def _literal(x: float) -> str:
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return repr(x)


def _non_finite(x: float, datatype: str) -> str:
    return (
        f"{_literal(x)} is not finite ({datatype}); this version refuses NaN and "
        "±Infinity (version metadata allow_non_finite)"
    )


def _out_of_range(v: float | int, datatype: str) -> str:
    if datatype in _INT_RANGE:
        lo, hi = _INT_RANGE[datatype]
        return f"{v!r} is out of the range of {datatype} ({lo} to {hi})"
    return f"{v!r} is out of the range of {datatype} ({_FLOAT_RANGE[datatype]})"


def _invalid(
    spec: TensorSpec, path: tuple[int, ...], by_row: bool, flat_index: int | None, problem: str
) -> InvalidInput:
    """InvalidInput naming the input and the element: ``row R, element [i, j]`` for rows
    of ``/api/v1`` (``path`` starts with the row), else the flat (row-major) index."""
    details: dict[str, Any] = {"input": spec.name, "datatype": spec.datatype}
    where = ""
    if by_row and path:
        details["row"] = path[0]
        where = f", row {path[0]}"
        if len(path) > 1:
            details["index"] = list(path[1:])
            where += f", element {list(path[1:])}"
    elif flat_index is not None:
        details["index"] = flat_index
        where = f", element {flat_index}"
    elif path:
        where = f", at {list(path)}"
    return InvalidInput(f"input {spec.name!r}{where}: {problem}", **details)
