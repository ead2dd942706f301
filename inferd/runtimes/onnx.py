"""ONNX models run by onnxruntime (CUDA first where the GPU build is installed).

The signature is read from the session; outputs keep their ONNX names, so a
skl2onnx classifier converted with ``final_types`` naming them ``label`` and
``probabilities`` is formatted like every other classifier. Sequence-of-map outputs
(skl2onnx's ZipMap) are refused at load: they are not tensors and cannot be batched.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from inferd.runtimes.base import Runtime
from inferd.shapes.tensors import Signature, TensorSpec

logger = logging.getLogger(__name__)

_TENSOR_TYPES = {
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(float16)": "FP16",
    "tensor(int64)": "INT64",
    "tensor(int32)": "INT32",
    "tensor(int16)": "INT16",
    "tensor(int8)": "INT8",
    "tensor(uint64)": "UINT64",
    "tensor(uint32)": "UINT32",
    "tensor(uint16)": "UINT16",
    "tensor(uint8)": "UINT8",
    "tensor(bool)": "BOOL",
    "tensor(string)": "BYTES",
}
_PROVIDERS = ("CUDAExecutionProvider", "CPUExecutionProvider")


def _tensor_spec(node: Any) -> TensorSpec:
    """A TensorSpec from an onnxruntime NodeArg; symbolic or unknown dims become -1."""
    if node.type.startswith("seq(map"):
        raise ValueError(
            f"onnx: output {node.name!r} is a ZipMap ({node.type}), a list of dicts that "
            'cannot be batched; convert the model with options={"zipmap": False}'
        )
    if node.type not in _TENSOR_TYPES:
        raise ValueError(f"onnx: {node.name!r} has unsupported type {node.type}")
    dims = [d if isinstance(d, int) and d > 0 else -1 for d in (node.shape or [None])]
    return TensorSpec(node.name, _TENSOR_TYPES[node.type], (-1, *dims[1:]))


class OnnxRuntime(Runtime):
    framework = "onnx"
    file_suffixes = (".onnx",)

    def load(self) -> None:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = self.config.threads
        options.inter_op_num_threads = 1
        available = onnxruntime.get_available_providers()
        self.session = onnxruntime.InferenceSession(
            str(self.find_file()),
            sess_options=options,
            providers=[p for p in _PROVIDERS if p in available],
        )
        self._inputs = tuple(_tensor_spec(n) for n in self.session.get_inputs())
        self._outputs = tuple(_tensor_spec(n) for n in self.session.get_outputs())
        self._output_names = [spec.name for spec in self._outputs]
        logger.debug("onnx session providers: %s", self.session.get_providers())

    def infer_signature(self) -> Signature:
        labels = self.config.metadata.get("labels")
        return Signature(self._inputs, self._outputs, tuple(labels) if labels else None)

    def predict_batch(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feed = {spec.name: _as_onnx(inputs[spec.name], spec) for spec in self._inputs}
        results = self.session.run(self._output_names, feed)
        return dict(zip(self._output_names, results, strict=True))

    def unload(self) -> None:
        del self.session


def _as_onnx(array: np.ndarray, spec: TensorSpec) -> np.ndarray:
    if spec.datatype != "BYTES":
        return np.asarray(array, dtype=spec.numpy_dtype)
    # onnxruntime takes str objects for string tensors, not bytes.
    flat = [v.decode() if isinstance(v, bytes) else str(v) for v in array.ravel()]
    return np.array(flat, dtype=object).reshape(array.shape)
