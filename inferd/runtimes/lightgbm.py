"""LightGBM models: Booster text files (``model.txt``/``.lgb``, which begin with the
line ``tree``) or a joblib-pickled ``LGBMClassifier``/``LGBMRegressor``.

Both predict through the Booster, with ``num_threads`` passed on every call because a
Booster loaded from a file ignores parameters given to its constructor. Objectives
``binary`` and ``multiclass``/``multiclassova`` give ``label`` + ``probabilities``;
everything else gives ``prediction``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from inferd.runtimes.base import Runtime
from inferd.runtimes.explain import Explanation, Features, tree_explanation
from inferd.runtimes.sklearn import (
    classifier_outputs,
    classifier_signature,
    label_values,
    pickled_module,
)
from inferd.shapes.tensors import Signature, TensorSpec

logger = logging.getLogger(__name__)

_BINARY = {"binary"}
_MULTICLASS = {"multiclass", "softmax", "multiclassova", "multiclass_ova", "ova", "ovr"}


def _is_lightgbm_file(path: Path) -> bool:
    if not path.is_file():
        return False
    if path.suffix in (".txt", ".lgb"):
        with path.open("rb") as f:
            return f.readline().rstrip(b"\r\n") == b"tree"
    return path.suffix in (".joblib", ".pkl") and pickled_module(path).startswith("lightgbm.")


class LightGBMRuntime(Runtime):
    framework = "lightgbm"
    file_suffixes = (".txt", ".lgb", ".joblib", ".pkl")

    @classmethod
    def accepts(cls, path: Path) -> bool:
        return _is_lightgbm_file(path)

    def load(self) -> None:
        import lightgbm

        path = self.find_file()
        classes: Any = None
        if path.suffix in (".txt", ".lgb"):
            self.booster = lightgbm.Booster(model_file=path)
        else:
            import joblib

            estimator = joblib.load(path)
            if not hasattr(estimator, "booster_"):
                raise ValueError(f"lightgbm: {path.name} holds a {type(estimator).__name__}")
            self.booster = estimator.booster_
            classes = getattr(estimator, "classes_", None)
        objective = str(self.booster.params.get("objective", ""))
        self._binary = objective in _BINARY
        self._values: np.ndarray | None = None
        if self._binary or objective in _MULTICLASS:
            n_classes = 2 if self._binary else self.booster.num_model_per_iteration()
            classes = np.arange(n_classes) if classes is None else classes
            self._values = label_values(classes, self.config.metadata.get("labels"))

    def infer_signature(self) -> Signature:
        inputs = (TensorSpec("features", "FP32", (-1, self.booster.num_feature())),)
        if self._values is not None:
            return classifier_signature(inputs, self._values)
        return Signature(inputs, (TensorSpec("prediction", "FP32"),))

    def predict_batch(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = np.asarray(inputs["features"], dtype=np.float32)
        out = np.asarray(self.booster.predict(x, num_threads=self.config.threads))
        if self._values is None:
            return {"prediction": out.astype(np.float32)}
        if self._binary:
            out = np.stack([1.0 - out, out], axis=1)
        return classifier_outputs(out, self._values)

    def explain(self, inputs: dict[str, np.ndarray], deadline: float) -> Explanation:
        """Exact TreeSHAP in raw-score space (LightGBM's ``pred_contrib``): log-odds of
        the positive class for ``binary``, a raw score per class for multiclass."""
        features = Features.of(self.signature, self.config.metadata)
        x = np.asarray(inputs["features"], dtype=np.float32)
        contributions = np.asarray(
            self.booster.predict(x, pred_contrib=True, num_threads=self.config.threads)
        )
        per_class = self.booster.num_model_per_iteration()
        contributions = contributions.reshape(len(x), per_class, -1)
        if self._values is None:
            outputs: tuple[str, ...] = ("prediction",)
        elif self._binary:
            outputs = (str(self._values[1]),)
        else:
            outputs = tuple(str(v) for v in self._values)
        return tree_explanation(contributions, features, outputs, "margin")

    def unload(self) -> None:
        del self.booster
