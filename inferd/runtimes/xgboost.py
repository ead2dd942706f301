"""XGBoost models: native Booster files (``.json``/``.ubj``) or a joblib-pickled
``XGBClassifier``/``XGBRegressor``.

Both run through ``Booster.inplace_predict``: for the small batches a server sees it
skips building a DMatrix, which costs more than the trees themselves. The objective
decides the outputs: ``binary:logistic`` and ``multi:*`` give ``label`` +
``probabilities``; everything else gives ``prediction``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from inferd.runtimes.base import Runtime
from inferd.runtimes.explain import Explanation, Features, tree_explanation
from inferd.runtimes.sklearn import (
    classifier_outputs,
    classifier_signature,
    import_sklearn,
    label_values,
    pickled_module,
)
from inferd.shapes.tensors import Signature, TensorSpec

logger = logging.getLogger(__name__)


def _is_xgboost_file(path: Path) -> bool:
    """Cheap check: an XGBoost JSON/UBJSON model starts with its ``learner`` object
    (so ``config.json`` and friends are not taken); a pickle must hold an xgboost
    estimator at its top (a Pipeline around one is scikit-learn's to run)."""
    if not path.is_file():
        return False
    if path.suffix in (".json", ".ubj"):
        with path.open("rb") as f:
            return b"learner" in f.read(4096)
    return path.suffix in (".joblib", ".pkl") and pickled_module(path).startswith("xgboost.")


class XGBoostRuntime(Runtime):
    framework = "xgboost"
    file_suffixes = (".json", ".ubj", ".joblib", ".pkl")

    @classmethod
    def accepts(cls, path: Path) -> bool:
        return _is_xgboost_file(path)

    def load(self) -> None:
        import_sklearn()  # xgboost imports it for its estimator wrappers
        import xgboost

        path = self.find_file()
        classes: Any = None
        if path.suffix in (".json", ".ubj"):
            self.booster = xgboost.Booster()
            self.booster.load_model(path)
        else:
            import joblib

            estimator = joblib.load(path)
            if not hasattr(estimator, "get_booster"):
                raise ValueError(f"xgboost: {path.name} holds a {type(estimator).__name__}")
            self.booster = estimator.get_booster()
            classes = getattr(estimator, "classes_", None)
        self.booster.set_param({"nthread": self.config.threads})
        learner = json.loads(self.booster.save_config())["learner"]
        self._objective: str = learner["objective"]["name"]
        params = learner["learner_model_param"]
        best = self.booster.attr("best_iteration")
        # Like the scikit-learn wrapper: an early-stopped model predicts with its best trees.
        self._iterations = (0, int(best) + 1) if best is not None else (0, 0)
        self._values: np.ndarray | None = None
        if self._objective == "binary:logistic" or self._objective.startswith("multi:"):
            n_classes = max(int(params["num_class"]), 2)
            classes = np.arange(n_classes) if classes is None else classes
            self._values = label_values(classes, self.config.metadata.get("labels"))
        self._targets = int(params.get("num_target", 1))

    def infer_signature(self) -> Signature:
        inputs = (TensorSpec("features", "FP32", (-1, self.booster.num_features())),)
        if self._values is not None:
            return classifier_signature(inputs, self._values)
        shape = (-1,) if self._targets == 1 else (-1, self._targets)
        return Signature(inputs, (TensorSpec("prediction", "FP32", shape),))

    def predict_batch(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = np.asarray(inputs["features"], dtype=np.float32)
        # multi:softmax predicts class ids; its margins give the probabilities.
        kind = "margin" if self._objective == "multi:softmax" else "value"
        out = self.booster.inplace_predict(
            x, predict_type=kind, iteration_range=self._iterations, validate_features=False
        )
        if self._values is None:
            return {"prediction": np.asarray(out, dtype=np.float32)}
        if self._objective == "binary:logistic":
            out = np.stack([1.0 - out, out], axis=1)
        elif kind == "margin":
            out = np.exp(out - out.max(axis=1, keepdims=True))
            out /= out.sum(axis=1, keepdims=True)
        return classifier_outputs(out, self._values)

    def explain(self, inputs: dict[str, np.ndarray], deadline: float) -> Explanation:
        """Exact TreeSHAP in margin space (XGBoost's ``pred_contribs``): log-odds of the
        positive class for ``binary:logistic``, a margin per class for ``multi:*``."""
        import xgboost

        known = self.booster.feature_names
        features = Features.of(self.signature, self.config.metadata, list(known) if known else None)
        data = xgboost.DMatrix(np.asarray(inputs["features"], dtype=np.float32), nthread=1)
        contributions = self.booster.predict(
            data, pred_contribs=True, iteration_range=self._iterations, validate_features=False
        )
        if self._values is None:
            outputs = (
                ("prediction",)
                if self._targets == 1
                else tuple(f"prediction[{i}]" for i in range(self._targets))
            )
        elif self._objective == "binary:logistic":
            outputs = (str(self._values[1]),)
        else:
            outputs = tuple(str(v) for v in self._values)
        return tree_explanation(contributions, features, outputs, "margin")

    def unload(self) -> None:
        del self.booster
