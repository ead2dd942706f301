"""TensorFlow models run by TensorFlow itself: a SavedModel folder (``saved_model.pb``,
its ``serving_default`` signature) or a Keras ``.keras`` file.

A version registered without ``--framework tensorflow`` is converted to ONNX at push
time instead (:mod:`inferd.runtimes.tf_onnx`) and served by onnxruntime; this runtime
serves the models that conversion cannot take, and those pushed as ``tensorflow`` on
purpose. ``pip install 'inferd[tensorflow]'``.

The signature is the model's own: a SavedModel's ``serving_default`` inputs and outputs
by name; a Keras model's ``inputs`` and its ``output_names``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from inferd.runtimes.base import Runtime
from inferd.shapes.tensors import Signature, TensorSpec, datatype_of

SAVED_MODEL = "saved_model.pb"
SERVING = "serving_default"


def tf_model_path(folder: Path) -> Path | None:
    """The folder itself for a SavedModel, the ``.keras`` file for Keras; else None."""
    if (folder / SAVED_MODEL).is_file():
        return folder
    found = sorted(folder.glob("*.keras"))
    return found[0] if len(found) == 1 else None


def import_tensorflow(threads: int) -> Any:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # no banner per replica
    import tensorflow as tf

    try:  # only before TensorFlow starts its pools: the first load in a process
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    except RuntimeError:
        pass
    return tf


class TensorFlowRuntime(Runtime):
    framework = "tensorflow"
    file_suffixes = (".keras",)

    @classmethod
    def detect(cls, artifact_dir: Path) -> bool:
        return tf_model_path(artifact_dir) is not None

    def load(self) -> None:
        tf = import_tensorflow(self.config.threads)
        self._tf = tf
        path = tf_model_path(self.artifact_dir)
        if path is None:
            raise FileNotFoundError(
                f"tensorflow: no {SAVED_MODEL} and no single .keras file in {self.artifact_dir}"
            )
        if path.suffix == ".keras":
            import keras

            model = keras.saving.load_model(path, compile=False)
            self._inputs = tuple(_spec(t.name, t.dtype, t.shape) for t in model.inputs)
            names = list(getattr(model, "output_names", None) or [])
            if len(names) != len(model.outputs):
                names = [f"output_{i}" for i in range(len(model.outputs))]
            self._outputs = tuple(
                _spec(n, t.dtype, t.shape) for n, t in zip(names, model.outputs, strict=True)
            )
            spec = [tf.TensorSpec(t.shape, t.dtype) for t in model.inputs]
            one = len(spec) == 1  # a one-input model takes the tensor, not a list of one

            @tf.function(input_signature=spec)
            def call(*args: Any) -> Any:
                return model(args[0] if one else list(args), training=False)

            def run(inputs: dict[str, np.ndarray]) -> Any:
                result = call(*(inputs[s.name] for s in self._inputs))
                if not isinstance(result, (list, tuple)):
                    result = [result]
                return dict(zip(names, result, strict=True))

            self._model = model
        else:
            self._model = tf.saved_model.load(str(path))
            if SERVING not in self._model.signatures:
                raise ValueError(
                    f"tensorflow: the SavedModel has no {SERVING!r} signature "
                    f"(it has {', '.join(self._model.signatures) or 'none'})"
                )
            fn = self._model.signatures[SERVING]
            _, kwargs = fn.structured_input_signature
            self._inputs = tuple(_spec(n, t.dtype, t.shape) for n, t in sorted(kwargs.items()))
            self._outputs = tuple(
                _spec(n, t.dtype, t.shape) for n, t in sorted(fn.structured_outputs.items())
            )

            def run(inputs: dict[str, np.ndarray]) -> Any:
                return fn(**{s.name: inputs[s.name] for s in self._inputs})

        self._run = run
        self._dtypes = {s.name: s.numpy_dtype for s in self._inputs}

    def infer_signature(self) -> Signature:
        return Signature(self._inputs, self._outputs)

    def predict_batch(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feed = {n: np.asarray(inputs[n], dtype=d) for n, d in self._dtypes.items()}
        result = self._run(feed)
        return {name: np.asarray(tensor) for name, tensor in result.items()}

    def unload(self) -> None:
        del self._model, self._run


def _spec(name: str, dtype: Any, shape: Any) -> TensorSpec:
    name = name.split(":")[0]
    numpy_dtype = np.dtype(getattr(dtype, "as_numpy_dtype", dtype))
    dims = [d if isinstance(d, int) and d > 0 else -1 for d in (list(shape) or [None])]
    return TensorSpec(name, datatype_of(np.empty(0, numpy_dtype)), (-1, *dims[1:]))
