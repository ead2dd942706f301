"""TensorFlow models converted to ONNX when they are registered.

A SavedModel or ``.keras`` version pushed without ``--framework tensorflow`` is
converted with tf2onnx, and the ONNX model is kept only if it answers as TensorFlow
does: both run the same random inputs (a batch of 8 rows and one of 1), and every
output must agree within ``rtol=1e-3, atol=1e-4``. The version then holds
``model.onnx`` (served by onnxruntime: a fraction of TensorFlow's memory, load time and
per-request overhead, measured by ``bench/tf_vs_onnx.py``) and the original files under
``tensorflow/``, and its metadata says how it was converted and how close it came.
When tf2onnx cannot convert the model (an op it does not know) or the outputs differ,
the version stays a TensorFlow one, served by :mod:`inferd.runtimes.tensorflow`, and
its metadata says why.
"""

from __future__ import annotations

import logging
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from inferd.runtimes.base import RuntimeConfig
from inferd.runtimes.tensorflow import SAVED_MODEL, TensorFlowRuntime, import_tensorflow
from inferd.shapes.tensors import Signature

logger = logging.getLogger(__name__)

OPSET = 17
ORIGINAL = "tensorflow"
"""Where the converted version keeps the TensorFlow files it was made from."""
_RTOL, _ATOL = 1e-3, 1e-4


@dataclass
class Converted:
    folder: Path
    framework: str  # "onnx", or "tensorflow" when the conversion was not kept
    metadata: dict[str, Any] = field(default_factory=dict)


def convert(folder: Path, out: Path) -> Converted:
    """An ONNX version folder (``out``) made from the TensorFlow model in ``folder``."""
    tf_runtime = TensorFlowRuntime(folder, RuntimeConfig(threads=1))
    tf_runtime.load()
    try:
        signature = tf_runtime.signature
        try:
            with warnings.catch_warnings():  # TF's and tf2onnx's own warnings are noise:
                warnings.simplefilter("ignore")  # the comparison below is the check
                onnx_path = _to_onnx(folder, out / "model.onnx", signature)
            worst = _compare(tf_runtime, onnx_path, signature)
        except Exception as exc:  # an op tf2onnx lacks, a mismatch: serve TensorFlow itself
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            reason = f"{type(exc).__name__}: {' | '.join(lines[-3:])}"[:600]
            logger.warning("serving TensorFlow natively: the ONNX conversion failed: %s", reason)
            shutil.rmtree(out, ignore_errors=True)
            return Converted(folder, "tensorflow", {"onnx_conversion": f"failed: {reason}"})
    finally:
        tf_runtime.unload()
    import tf2onnx

    shutil.copytree(folder, out / ORIGINAL)
    meta = {
        "converted_from": "tensorflow",
        "onnx_conversion": {
            "tool": f"tf2onnx {tf2onnx.__version__}",
            "opset": OPSET,
            "max_abs_diff": worst,
            "checked_rows": [8, 1],
        },
    }
    return Converted(out, "onnx", meta)


def _to_onnx(folder: Path, target: Path, signature: Signature) -> Path:
    tf = import_tensorflow(1)
    import tf2onnx

    target.parent.mkdir(parents=True, exist_ok=True)
    if (folder / SAVED_MODEL).is_file():
        from tf2onnx import tf_loader

        graph_def, inputs, outputs, renames = tf_loader.from_saved_model(
            str(folder), None, None, tag="serve", signatures=["serving_default"],
            return_tensors_to_rename=True,
        )  # fmt: skip
        tf2onnx.convert.from_graph_def(
            graph_def,
            input_names=inputs,
            output_names=outputs,
            opset=OPSET,
            tensors_to_rename=renames,
            output_path=str(target),
        )
        return target
    import keras

    (path,) = sorted(folder.glob("*.keras"))
    model = keras.saving.load_model(path, compile=False)
    spec = [
        tf.TensorSpec([None if d == -1 else d for d in s.shape], s.numpy_dtype, name=s.name)
        for s in signature.inputs
    ]
    tf2onnx.convert.from_keras(model, input_signature=spec, opset=OPSET, output_path=str(target))
    return target


def _compare(tf_runtime: TensorFlowRuntime, onnx_path: Path, signature: Signature) -> float:
    """Run both on the same random inputs; the largest absolute difference seen."""
    from inferd.runtimes.onnx import OnnxRuntime

    onnx_runtime = OnnxRuntime(onnx_path.parent, RuntimeConfig(threads=1))
    onnx_runtime.load()
    try:
        names = sorted(s.name for s in onnx_runtime.signature.outputs)
        if names != sorted(s.name for s in signature.outputs):
            raise ValueError(f"the ONNX model's outputs are {names}, TensorFlow's differ")
        rng = np.random.default_rng(0)
        worst = 0.0
        for rows in (8, 1):
            batch = {s.name: _sample(rng, rows, s.shape, s.numpy_dtype) for s in signature.inputs}
            want, got = tf_runtime.run(batch), onnx_runtime.run(batch)
            for name, expected in want.items():
                actual = np.asarray(got[name])
                if actual.shape != expected.shape:
                    raise ValueError(f"output {name!r}: {actual.shape} from ONNX, {expected.shape}")
                if expected.dtype.kind in "fc":
                    worst = max(worst, float(np.max(np.abs(actual - expected), initial=0.0)))
                    if not np.allclose(actual, expected, rtol=_RTOL, atol=_ATOL):
                        raise ValueError(f"output {name!r} differs from TensorFlow's")
                elif not np.array_equal(actual, expected):
                    raise ValueError(f"output {name!r} differs from TensorFlow's")
        return worst
    finally:
        onnx_runtime.unload()


def _sample(rng: np.random.Generator, rows: int, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    dims = (rows, *(d if d > 0 else 4 for d in shape[1:]))
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(dims).astype(dtype)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(0, 10, dims).astype(dtype)
    if np.dtype(dtype).kind == "b":
        return rng.integers(0, 2, dims).astype(bool)
    raise ValueError(f"cannot make sample inputs of {dtype} to check the conversion")
