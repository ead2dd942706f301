"""An MLflow pyfunc model served by the Python runtime.

A version imported from MLflow as a pyfunc (:mod:`inferd.registry.mlflow_source`) holds
the MLflow model in ``mlflow_model/``, its signature in ``mlflow_io.json`` and a
``model.py`` whose class is this one. Batches become what ``PythonModel.predict`` was
written for: a pandas DataFrame with the logged column names when the signature has
columns, the arrays themselves when it has tensors. Serving one needs the MLflow client
(``pip install 'inferd[mlflow]'``) in the replica's environment.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from inferd.shapes.tensors import Signature


class MlflowPyfunc:
    signature: Signature

    def load(self, artifact_dir: Path) -> None:
        try:
            import mlflow.pyfunc
        except ImportError:
            raise ImportError(
                "serving an MLflow pyfunc model needs its client: pip install 'inferd[mlflow]'"
            ) from None
        io = json.loads((Path(artifact_dir) / "mlflow_io.json").read_text())
        self.signature = Signature.from_dict(io["signature"])
        self._columns: list[str] | None = io.get("columns")
        self._model = mlflow.pyfunc.load_model(str(Path(artifact_dir) / "mlflow_model"))

    def predict(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        result = self._model.predict(self._model_input(batch))
        return self._outputs(result)

    def _model_input(self, batch: dict[str, np.ndarray]) -> Any:
        names = [spec.name for spec in self.signature.inputs]
        if self._columns is None:  # tensors
            return batch[names[0]] if len(names) == 1 else {n: batch[n] for n in names}
        import pandas as pd

        if len(names) == 1 and batch[names[0]].ndim == 2:  # one matrix of numeric columns
            return pd.DataFrame(batch[names[0]], columns=self._columns)
        return pd.DataFrame({name: batch[name] for name in names})

    def _outputs(self, result: Any) -> dict[str, np.ndarray]:
        specs = self.signature.outputs
        if isinstance(result, dict):
            arrays = {k: np.asarray(v) for k, v in result.items()}
        else:
            if hasattr(result, "to_numpy"):  # a pandas Series or DataFrame
                result = result.to_numpy()
            array = np.asarray(result)
            if len(specs) == 1 and len(specs[0].shape) == 1 and array.ndim == 2:
                array = array[:, 0] if array.shape[1] == 1 else array
            arrays = {specs[0].name: array} if len(specs) == 1 else {}
            if len(specs) > 1:
                arrays = {spec.name: array[:, i] for i, spec in enumerate(specs)}
        return {spec.name: _as(arrays[spec.name], spec.numpy_dtype) for spec in specs}


def _as(array: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    if dtype == np.dtype(object):
        return array.astype(str).astype(object)
    return array.astype(dtype, copy=False)
