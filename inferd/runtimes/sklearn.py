"""scikit-learn estimators and pipelines pickled with joblib.

The input is ``text`` (BYTES, one document per row) when the first step consumes raw
strings (a Count/Tfidf/Hashing vectorizer), else ``features`` (FP32, one row per
sample). Classifiers return ``label`` + ``probabilities`` from one ``predict_proba``
call; regressors return ``prediction``.

The tree-model runtimes (xgboost, lightgbm) share the classifier helpers below, so
every classifier formats ``label`` the same way.
"""

from __future__ import annotations

import importlib.abc
import io
import logging
import pickletools
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

from inferd.runtimes.base import Runtime
from inferd.runtimes.explain import Explanation, Features
from inferd.shapes.tensors import Signature, TensorSpec, datatype_of

logger = logging.getLogger(__name__)


def pickled_module(path: Path) -> str:
    """The module of a pickle's top-level object ('' when unknown), read from its first
    global without unpickling: how xgboost and lightgbm claim their wrappers' files."""
    with path.open("rb") as f:
        head = io.BytesIO(f.read(4096))
    strings: list[str] = []
    try:
        for opcode, arg, _ in pickletools.genops(head):
            if opcode.name == "GLOBAL":
                return str(arg).partition(" ")[0]
            if opcode.name == "STACK_GLOBAL":
                return strings[-2] if len(strings) >= 2 else ""
            if isinstance(arg, str):
                strings.append(arg)
    except ValueError:  # not a pickle (e.g. compressed), or the head cut an opcode
        pass
    return ""


def label_values(classes: Sequence[Any] | np.ndarray, names: Sequence[str] | None) -> np.ndarray:
    """What ``label`` holds for each class: names given at push time, string classes
    (object array, BYTES) or integral classes (INT64)."""
    if names is not None:
        if len(names) != len(classes):
            raise ValueError(f"{len(names)} labels given for a model with {len(classes)} classes")
        return np.array([str(n) for n in names], dtype=object)
    values = np.asarray(classes)
    if values.dtype.kind in "iub" or (
        values.dtype.kind == "f" and bool(np.all(np.mod(values, 1) == 0))
    ):
        return values.astype(np.int64)
    return np.array([str(c) for c in values], dtype=object)


def classifier_signature(inputs: tuple[TensorSpec, ...], values: np.ndarray) -> Signature:
    """``label`` holds the class itself (:func:`label_values`). The signature names the
    classes (``labels``, what an integer ``label`` indexes) only where they are names: a
    model with integer classes and no names given answers the class, an INT64, on every
    API (v1 once answered it as its string, from the classes kept as names)."""
    outputs = (
        TensorSpec("label", datatype_of(values)),
        TensorSpec("probabilities", "FP32", (-1, len(values))),
    )
    labels = None if values.dtype.kind in "iu" else tuple(str(v) for v in values)
    return Signature(inputs, outputs, labels=labels)


def classifier_outputs(probabilities: np.ndarray, values: np.ndarray) -> dict[str, np.ndarray]:
    probabilities = np.asarray(probabilities, dtype=np.float32)
    return {"label": values[probabilities.argmax(axis=1)], "probabilities": probabilities}


def import_sklearn() -> None:
    """Import scikit-learn without the pandas it would import with it.

    ``sklearn.utils.fixes`` imports pandas at import time when it is installed, for one
    helper; scikit-learn imports pandas itself wherever it uses it. pandas (with the
    pyarrow it loads) costs a replica ~60 MiB it never uses on NumPy inputs. Only that
    one import is refused, so a model whose pickle holds pandas objects, or another
    thread, still imports pandas as usual. The finder that refuses it stays in
    ``sys.meta_path``: taking it out while another thread walks the list could make
    that thread skip a finder."""
    if "sklearn" in sys.modules:
        return
    if not any(isinstance(f, _PandasNotForSklearnFixes) for f in sys.meta_path):
        sys.meta_path.insert(0, _PandasNotForSklearnFixes())
    import sklearn.base  # noqa: F401


class _PandasNotForSklearnFixes(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname != "pandas":
            return None
        frame: FrameType | None = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith("<frozen"):
            frame = frame.f_back  # importlib's own frames, up to the import statement
        if frame is not None and frame.f_globals.get("__name__") == "sklearn.utils.fixes":
            raise ModuleNotFoundError("pandas is not imported with scikit-learn", name=fullname)
        return None


class SklearnRuntime(Runtime):
    framework = "sklearn"
    file_suffixes = (".joblib", ".pkl")

    def load(self) -> None:
        import_sklearn()
        import joblib
        from threadpoolctl import threadpool_limits

        # BLAS/OpenMP pools are process-wide; the replica owns its process.
        self._limits = threadpool_limits(limits=self.config.threads)
        # A model fitted on a DataFrame (as MLflow's are) warns on every unnamed matrix;
        # the signature already fixes the column order. The replica owns its process.
        warnings.filterwarnings("ignore", message="X does not have valid feature names")
        self.model = joblib.load(self.find_file())
        if not hasattr(self.model, "predict"):
            raise ValueError(f"sklearn: {type(self.model).__name__} has no predict()")
        self._input = "text" if _consumes_text(self.model) else "features"
        self._has_proba = hasattr(self.model, "predict_proba") and hasattr(self.model, "classes_")
        self._values: np.ndarray | None = None
        if hasattr(self.model, "classes_"):
            self._values = label_values(self.model.classes_, self.config.metadata.get("labels"))
        self._output_shape = (-1,) if self._values is not None else self._regression_shape()

    def _regression_shape(self) -> tuple[int, ...]:
        # Whether a regressor is multi-output is only certain from one prediction.
        if self._input == "text":
            probe: Any = np.array(["warm up"], dtype=object)
        else:
            probe = np.zeros((1, int(getattr(self.model, "n_features_in_", 1))), np.float32)
        prediction = np.asarray(self.model.predict(probe))
        return (-1, *prediction.shape[1:])

    def infer_signature(self) -> Signature:
        if self._input == "text":
            inputs = (TensorSpec("text", "BYTES"),)
        else:
            n = int(getattr(self.model, "n_features_in_", -1))
            inputs = (TensorSpec("features", "FP32", (-1, n)),)
        if self._values is not None and self._has_proba:
            return classifier_signature(inputs, self._values)
        if self._values is not None:
            label = TensorSpec("label", datatype_of(self._values))
            return Signature(inputs, (label,), labels=tuple(str(v) for v in self._values))
        return Signature(inputs, (TensorSpec("prediction", "FP32", self._output_shape),))

    def _model_input(self, inputs: dict[str, np.ndarray]) -> Any:
        if self._input == "text":
            return inputs["text"]
        return np.asarray(inputs["features"], dtype=np.float32)

    def predict_batch(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = self._model_input(inputs)
        if self._values is not None and self._has_proba:
            return classifier_outputs(self.model.predict_proba(x), self._values)
        if self._values is not None:
            # No probabilities: map predicted classes to their position, then to labels.
            index = np.searchsorted(self.model.classes_, self.model.predict(x))
            return {"label": self._values[index]}
        return {"prediction": np.asarray(self.model.predict(x), dtype=np.float32)}

    def explain(self, inputs: dict[str, np.ndarray], deadline: float) -> Explanation:
        """Exact TreeSHAP (the ``shap`` package) for a forest or boosted trees taking the
        features as they come; KernelSHAP for the rest, and where ``shap`` is missing or
        does not take the model."""
        explainer = self._tree_explainer()
        if explainer is None:
            return super().explain(inputs, deadline)
        x = np.asarray(inputs["features"], dtype=np.float64)
        values = np.asarray(explainer.shap_values(x, check_additivity=False), dtype=np.float64)
        attributions = values if values.ndim == 3 else values[:, :, None]
        expected = np.atleast_1d(np.asarray(explainer.expected_value, dtype=np.float64))
        k = attributions.shape[2]
        labels = [str(v) for v in self._values] if self._values is not None else []
        if len(labels) == k:
            outputs = tuple(labels)
        elif labels and k == 1:
            outputs = (labels[-1],)  # a binary boosted classifier: the positive class
        else:
            outputs = ("prediction",) if k == 1 else tuple(f"prediction[{i}]" for i in range(k))
        space = "prediction" if not labels else "probability"
        if labels and type(self.model).__name__.startswith("GradientBoosting"):
            space = "margin"
        features = Features.of(self.signature, self.config.metadata, self._feature_names())
        return Explanation(
            attributions, expected + attributions.sum(axis=1), expected, features.names,
            outputs, "tree_shap", space,
        )  # fmt: skip

    def _tree_explainer(self) -> Any:
        """shap's TreeExplainer of the model (made once), or None: not a tree ensemble of
        scikit-learn's own taking raw features, ``shap`` not installed, or refused."""
        if not hasattr(self, "_explainer"):
            self._explainer: Any = None
            module = type(self.model).__module__
            if self._input == "features" and module.startswith(
                ("sklearn.ensemble", "sklearn.tree")
            ):
                try:
                    import shap

                    self._explainer = shap.TreeExplainer(self.model)
                except ImportError:
                    logger.info("shap is not installed (inferd[explain]): KernelSHAP instead")
                except Exception as exc:  # shap's InvalidModelError: not a model it takes
                    logger.info("TreeSHAP does not take %s (%s): KernelSHAP instead", module, exc)
        return self._explainer

    def _feature_names(self) -> list[str] | None:
        names = getattr(self.model, "feature_names_in_", None)
        return None if names is None else [str(n) for n in names]

    def unload(self) -> None:
        self._limits.restore_original_limits()
        del self.model


def _consumes_text(model: Any) -> bool:
    from sklearn.feature_extraction.text import CountVectorizer, HashingVectorizer

    first = model.steps[0][1] if hasattr(model, "steps") else model
    return isinstance(first, CountVectorizer | HashingVectorizer)
