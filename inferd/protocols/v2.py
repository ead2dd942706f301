"""The Open Inference Protocol (KServe V2) without its transports: what the REST routes
(:mod:`inferd.api.v2`) and the gRPC service (:mod:`inferd.grpc`) share.

Input tensors are checked against the model's signature (name, datatype, per-row shape,
element count; every number against its datatype, :mod:`inferd.protocols.numbers`) and
become columns; the batch dimension is ``shape[0]``. Tensors come as JSON ``data`` or as
bytes in the binary layout (little-endian elements, BYTES as length-prefixed items), and
outputs go back either way.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np

from inferd.errors import InvalidInput
from inferd.priority import priority_code
from inferd.protocols.media import media_column
from inferd.protocols.numbers import check_array, json_array
from inferd.routing.router import Router
from inferd.shapes.tensors import DATATYPES, Signature, TensorSpec, datatype_of

EXTENSIONS: list[str] = ["binary_tensor_data", "schedule_policy", "generate", "model_repository"]
"""Protocol extensions implemented so far."""


def is_server_ready(router: Router) -> bool:
    """Ready once the controller's table arrived and every model has a serving version
    (a model unloaded on purpose does not count)."""
    return router.table.generation > 0 and not router.waiting_for()


def metadata_of(router: Router, model: str, version: str | None) -> dict[str, Any]:
    """The protocol's model metadata: versions, platform (the runtime) and signature."""
    target = router.target(model, version)
    return {
        "name": model,
        "versions": sorted(router.model(model).versions),
        "platform": target.framework,
        "inputs": [_spec(s) for s in target.signature.inputs],
        "outputs": [_spec(s) for s in target.signature.outputs],
    }


def _spec(spec: TensorSpec) -> dict[str, Any]:
    return {"name": spec.name, "datatype": spec.datatype, "shape": list(spec.shape)}


def parameters_of(item: dict[str, Any]) -> dict[str, Any]:
    params = item.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidInput("'parameters' must be an object")
    return params


def user_of(params: dict[str, Any]) -> str | None:
    """The ``user`` request parameter: requests with the same one get the same version
    of a model whose traffic is split (inferd's addition to the protocol)."""
    user = params.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidInput(f"parameter 'user' must be a string, not {user!r}")
    return user


def schedule_policy(params: dict[str, Any]) -> tuple[int, float | None]:
    """The schedule-policy parameters of a request: ``priority`` (a queue level, 0 for the
    model's default, or inferd's names high, normal, low, batch) and ``timeout``
    (microseconds, 0 for the server's request timeout), as (priority code, timeout in
    seconds or None)."""
    timeout_us = params.get("timeout", 0)
    if not isinstance(timeout_us, int) or isinstance(timeout_us, bool) or timeout_us < 0:
        raise InvalidInput(f"parameter 'timeout' must be an integer >= 0, not {timeout_us!r}")
    priority = priority_code(params.get("priority", 0), "parameter 'priority'")
    return priority, timeout_us / 1e6 if timeout_us else None


class InputSet:
    """The input tensors of one request, checked against the model's signature as they
    are added (known names, each once, one row count); :meth:`columns` checks that none
    is missing. Shared by every wire format of the protocol."""

    def __init__(self, signature: Signature) -> None:
        self._specs = {s.name: s for s in signature.inputs}
        self._columns: dict[str, np.ndarray] = {}
        self._rows: int | None = None

    def spec(self, name: Any) -> TensorSpec:
        spec = self._specs.get(name) if isinstance(name, str) else None
        if spec is None:
            raise InvalidInput(
                f"unknown input {name!r}; the model takes {sorted(self._specs)}", got=name
            )
        if name in self._columns:
            raise InvalidInput(f"input {name!r} is given twice")
        return spec

    def add(self, name: str, array: np.ndarray) -> None:
        rows = self._rows
        if rows is not None and array.shape[0] != rows:
            raise InvalidInput(
                f"input {name!r} has {array.shape[0]} rows (shape[0]); the others have {rows}"
            )
        self._rows = array.shape[0]
        self._columns[name] = array

    def columns(self) -> tuple[dict[str, np.ndarray], int]:
        """Columns named as the signature's inputs, and the row count."""
        missing = sorted(self._specs.keys() - self._columns.keys())
        if missing:
            raise InvalidInput(f"missing input(s) {missing}; the model takes {sorted(self._specs)}")
        if not self._rows:
            raise InvalidInput("inputs have no rows (shape[0] is 0)")
        return self._columns, self._rows


def decode_inputs(
    inputs: Any,
    signature: Signature,
    binary: memoryview | None = None,
    allow_non_finite: bool = False,
) -> tuple[dict[str, np.ndarray], int]:
    """Protocol input tensors -> columns named as the signature's inputs, and the row count.
    Tensors with a ``binary_data_size`` parameter take their bytes from ``binary``, in order.
    Every number is checked against its datatype (:mod:`inferd.protocols.numbers`)."""
    binary = binary if binary is not None else memoryview(b"")
    offset = 0
    if not isinstance(inputs, list) or not inputs:
        raise InvalidInput("'inputs' must be a non-empty list of tensors")
    found = InputSet(signature)
    for i, tensor in enumerate(inputs):
        if not isinstance(tensor, dict):
            raise InvalidInput(f"inputs[{i}] must be an object with name, shape, datatype, data")
        spec = found.spec(tensor.get("name"))
        array, offset = _decode_tensor(tensor, spec, binary, offset, allow_non_finite)
        found.add(spec.name, array)
    if offset != len(binary):
        raise InvalidInput(
            f"{len(binary) - offset} bytes of binary data are not claimed by any input's "
            "binary_data_size"
        )
    return found.columns()


def _decode_tensor(
    tensor: dict[str, Any],
    spec: TensorSpec,
    binary: memoryview,
    offset: int,
    allow_non_finite: bool,
) -> tuple[np.ndarray, int]:
    """One input, from its JSON ``data`` or from ``binary`` at ``offset``; the next offset."""
    size = parameters_of(tensor).get("binary_data_size")
    if size is None:
        return _tensor(tensor, spec, allow_non_finite), offset
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise InvalidInput(f"input {spec.name!r}: binary_data_size must be a byte count")
    if offset + size > len(binary):
        raise InvalidInput(
            f"input {spec.name!r}: binary_data_size {size} runs past the "
            f"{len(binary)} bytes of binary data after the JSON header"
        )
    shape = check_header(spec, tensor.get("shape"), tensor.get("datatype"))
    data = binary[offset : offset + size]
    return from_bytes(spec, shape, data, allow_non_finite), offset + size


def from_bytes(
    spec: TensorSpec, shape: list[int], data: memoryview | bytes, allow_non_finite: bool = False
) -> np.ndarray:
    """A tensor from its bytes in the binary layout (little-endian elements, or BYTES as
    length-prefixed items); numeric data is not copied, but checked (finite floats unless
    ``allow_non_finite``, BOOL bytes 0 or 1)."""
    count = math.prod(shape)
    if spec.datatype == "BYTES":
        flat = from_length_prefixed(data, spec.name, binary=spec.media is not None)
    else:
        dtype = spec.numpy_dtype.newbyteorder("<")
        if len(data) != count * dtype.itemsize:
            raise InvalidInput(
                f"input {spec.name!r}: binary_data_size is {len(data)} bytes; shape {shape} "
                f"of {spec.datatype} needs {count * dtype.itemsize}"
            )
        flat = check_array(np.frombuffer(data, dtype=dtype), spec, allow_non_finite)
    if flat.size != count:
        raise InvalidInput(
            f"input {spec.name!r}: binary data has {flat.size} elements; shape {shape} "
            f"needs {count}"
        )
    return flat.reshape(shape)


def from_length_prefixed(data: memoryview | bytes, name: str, binary: bool = False) -> np.ndarray:
    """BYTES in the binary extension: each element a 4-byte little-endian length + bytes
    (UTF-8 text, unless ``binary``: an image's input)."""
    values: list[Any] = []
    pos, raw = 0, bytes(data)
    while pos < len(raw):
        if pos + 4 > len(raw):
            raise InvalidInput(f"input {name!r}: truncated BYTES element length")
        n = int.from_bytes(raw[pos : pos + 4], "little")
        if pos + 4 + n > len(raw):
            raise InvalidInput(f"input {name!r}: BYTES element runs past binary_data_size")
        element = raw[pos + 4 : pos + 4 + n]
        try:
            values.append(element if binary else element.decode())
        except UnicodeDecodeError:
            raise InvalidInput(f"input {name!r}: BYTES elements must be UTF-8 text") from None
        pos += 4 + n
    if binary:
        return media_column(values, name)
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array


def to_binary(array: np.ndarray) -> bytes:
    """An output tensor's bytes in the binary extension's layout."""
    if datatype_of(array) != "BYTES":
        return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
    flat = array.reshape(-1).tolist()
    if len(flat) > 8 and set(map(type, flat)) <= _TEXT and flat.count(flat[0]) > 1:
        # A classifier's labels repeat: each distinct one is encoded once (64 rows of
        # labels: 8 -> 4 us). Only for str and bytes, which equal only their own kind.
        items = {x: _length_prefixed(x) for x in set(flat)}
        return b"".join(map(items.__getitem__, flat))
    parts: list[bytes] = []
    for x in flat:
        b = x if isinstance(x, bytes) else str(x).encode()
        parts += [len(b).to_bytes(4, "little"), b]
    return b"".join(parts)


_LENGTH = struct.Struct("<I").pack
_TEXT = {str, bytes}


def _length_prefixed(x: str | bytes) -> bytes:
    b = x if isinstance(x, bytes) else x.encode()
    return _LENGTH(len(b)) + b


def check_header(spec: TensorSpec, shape: Any, datatype: Any) -> list[int]:
    """The tensor's shape, after checking shape and datatype against the signature."""
    name = spec.name
    if (
        not isinstance(shape, list)
        or not shape
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise InvalidInput(f"input {name!r}: 'shape' must be a non-empty list of sizes >= 0")
    if datatype not in DATATYPES:
        raise InvalidInput(f"input {name!r}: unknown datatype {datatype!r}")
    if datatype != spec.datatype:
        raise InvalidInput(
            f"input {name!r}: datatype {datatype} does not match the model's {spec.datatype}"
        )
    want = spec.shape[1:]
    if len(shape) != len(spec.shape) or any(
        w not in (-1, g) for w, g in zip(want, shape[1:], strict=True)
    ):
        raise InvalidInput(
            f"input {name!r}: shape {shape} does not match the model's {list(spec.shape)}",
            expected=list(spec.shape),
            got=shape,
        )
    return shape


def _tensor(tensor: dict[str, Any], spec: TensorSpec, allow_non_finite: bool) -> np.ndarray:
    shape = check_header(spec, tensor.get("shape"), tensor.get("datatype"))
    name, datatype = spec.name, spec.datatype
    if "data" not in tensor:
        raise InvalidInput(f"input {name!r}: no 'data'")
    data = tensor["data"]
    if datatype == "BYTES":
        flat = _flat_text(data, name, spec.media is not None)
    else:
        data = data if isinstance(data, list) else [data]
        try:
            flat = json_array(data, spec, _depth(data), allow_non_finite).reshape(-1)
        except ValueError:
            raise InvalidInput(
                f"input {name!r}: data is not a list of {datatype} values (flat, or nested "
                "lists all of one depth)"
            ) from None
    needed = math.prod(shape)
    if flat.size != needed:
        raise InvalidInput(
            f"input {name!r}: data has {flat.size} elements; shape {shape} needs {needed}"
        )
    return flat.reshape(shape)


def _depth(data: list[Any]) -> int:
    """How deep ``data`` is nested, by its first elements (flat: 1)."""
    depth, item = 1, data
    while item and isinstance(item[0], list):
        depth, item = depth + 1, item[0]
    return depth


def _flat_text(data: Any, name: str, media: bool = False) -> np.ndarray:
    values: list[Any] = []

    def walk(item: Any) -> None:
        if isinstance(item, list):
            for x in item:
                walk(x)
        elif isinstance(item, str) or (media and isinstance(item, dict)):
            values.append(item)
        else:
            raise InvalidInput(f"input {name!r}: BYTES data must be strings")

    walk(data)
    if media:  # an image each: base64, {"b64": ...}, a data: URL or an s3:// URI
        return media_column(values, name)
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array


def requested_outputs(outputs: Any, signature: Signature) -> dict[str, bool | None] | None:
    """Requested output names -> whether each wants binary data (None: the request's
    ``binary_data_output`` decides); None when no outputs are named (all of them)."""
    if outputs is None:
        return None
    known = {s.name for s in signature.outputs}
    if not isinstance(outputs, list) or not all(
        isinstance(o, dict) and isinstance(o.get("name"), str) for o in outputs
    ):
        raise InvalidInput("'outputs' must be a list of objects with a 'name'")
    names: dict[str, bool | None] = {}
    for o in outputs:
        flag = parameters_of(o).get("binary_data")
        names[o["name"]] = None if flag is None else bool(flag)
    unknown = sorted(names.keys() - known)
    if unknown:
        raise InvalidInput(f"unknown output(s) {unknown}; the model gives {sorted(known)}")
    return names


def encode_output(name: str, array: np.ndarray) -> dict[str, Any]:
    datatype = datatype_of(array)
    flat = array.reshape(-1)
    if datatype == "BYTES":
        data = [x.decode() if isinstance(x, bytes) else str(x) for x in flat.tolist()]
    else:
        data = flat.tolist()
    return {"name": name, "datatype": datatype, "shape": list(array.shape), "data": data}


def encode_outputs(
    outputs: dict[str, np.ndarray],
    wanted: dict[str, bool | None] | None,
    binary_default: bool,
) -> tuple[list[dict[str, Any]], list[bytes]]:
    """The reply's output tensors (those ``wanted``, all when None) and, for those sent
    as binary data (asked for, else ``binary_default``), their bytes in order."""
    encoded, blobs = [], []
    for name, array in outputs.items():
        if wanted is not None and name not in wanted:
            continue
        flag = wanted.get(name) if wanted is not None else None
        if binary_default if flag is None else flag:
            blob = to_binary(array)
            blobs.append(blob)
            encoded.append(
                {"name": name, "datatype": datatype_of(array), "shape": list(array.shape),
                 "parameters": {"binary_data_size": len(blob)}}
            )  # fmt: skip
        else:
            encoded.append(encode_output(name, array))
    return encoded, blobs
