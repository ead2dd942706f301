"""Runtimes against the frameworks' own predictions, on tiny models built in tmp_path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import joblib
import numpy as np
import pytest
from sklearn.datasets import make_classification, make_regression

from inferd.protocols.codec import columns_to_rows
from inferd.runtimes import (
    RUNTIMES,
    detect_framework,
    inspect_artifact,
    load_runtime,
    resolve_runtime,
)
from inferd.runtimes.base import RuntimeConfig
from inferd.runtimes.onnx import OnnxRuntime
from inferd.shapes.tensors import Signature, TensorSpec

TORCHSCRIPT_DEPRECATED = pytest.mark.filterwarnings(
    r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning"
)


def _classification(n_classes: int = 2) -> tuple[np.ndarray, np.ndarray]:
    x, y = make_classification(
        n_samples=300, n_features=6, n_informative=4, n_classes=n_classes, random_state=0
    )
    return x.astype(np.float32), y


def _folder(tmp_path: Path, name: str = "model") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    return folder


def _run(framework: str, folder: Path, config: RuntimeConfig | None = None, **inputs: np.ndarray):
    runtime = load_runtime(framework, folder, config)
    try:
        return runtime.predict_batch(inputs)
    finally:
        runtime.unload()


def _assert_classified(out: dict[str, np.ndarray], proba: np.ndarray, classes: np.ndarray) -> None:
    np.testing.assert_allclose(out["probabilities"], proba, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out["label"], classes[np.argmax(proba, axis=1)])


# -- resolving and detecting ------------------------------------------------------------


def test_importing_runtimes_imports_no_framework() -> None:
    code = (
        "import sys, inferd.runtimes as r\n"
        "[r.resolve_runtime(n) for n in r.RUNTIMES]\n"
        "heavy = {'torch', 'xgboost', 'lightgbm', 'onnxruntime', 'sklearn', 'joblib'}\n"
        "print(sorted(heavy & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_resolve_runtime_by_name_and_import_path() -> None:
    assert resolve_runtime("onnx") is OnnxRuntime
    assert resolve_runtime("inferd.runtimes.onnx:OnnxRuntime") is OnnxRuntime
    with pytest.raises(ValueError, match=r"unknown framework 'caffe'.*sklearn, xgboost"):
        resolve_runtime("caffe")
    with pytest.raises(ValueError, match="not an inferd Runtime"):
        resolve_runtime("inferd.runtimes.base:Signature")


def test_detect_refuses_empty_folder_files_and_ambiguity(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    with pytest.raises(ValueError, match=r"no model; found no files.*--framework"):
        detect_framework(folder)
    (folder / "model.onnx").write_bytes(b"")
    (folder / "model.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"several frameworks match \(onnx, torch\).*model\.onnx"):
        detect_framework(folder)
    with pytest.raises(ValueError, match="is a file"):
        inspect_artifact(folder / "model.onnx")
    with pytest.raises(FileNotFoundError):
        detect_framework(tmp_path / "missing")


def test_detect_prefers_the_more_specific_runtime(tmp_path: Path) -> None:
    import xgboost

    x, y = _classification()
    folder = _folder(tmp_path)
    joblib.dump(xgboost.XGBClassifier(n_estimators=3).fit(x, y), folder / "model.joblib")
    (folder / "inferd.json").write_text(json.dumps({"labels": ["no", "yes"]}))
    (folder / "config.json").write_text(json.dumps({"learning_rate": 0.1}))
    assert detect_framework(folder) == "xgboost"
    (folder / "model.py").write_text("class Model:\n    def predict(self, batch): ...\n")
    assert detect_framework(folder) == "python"


# -- scikit-learn -----------------------------------------------------------------------


def test_sklearn_classifier_with_integer_classes(tmp_path: Path) -> None:
    from sklearn.linear_model import LogisticRegression

    x, y = _classification(3)
    model = LogisticRegression(max_iter=500).fit(x, y + 5)
    joblib.dump(model, _folder(tmp_path) / "model.pkl")
    framework, signature = inspect_artifact(tmp_path / "model")
    assert framework == "sklearn"
    assert signature.inputs == (TensorSpec("features", "FP32", (-1, 6)),)
    assert signature.outputs == (
        TensorSpec("label", "INT64"),
        TensorSpec("probabilities", "FP32", (-1, 3)),
    )
    # the label is the class itself: no names for it to index (v1 indexed ("5", "6",
    # "7") with a 7 and answered a string where the signature says INT64)
    assert signature.labels is None
    out = _run("sklearn", tmp_path / "model", features=x[:7])
    _assert_classified(out, model.predict_proba(x[:7]), model.classes_)
    assert out["label"].dtype == np.int64
    rows = columns_to_rows(out, signature)
    assert [row["label"] for row in rows] == list(model.predict(x[:7]))
    assert all(isinstance(row["label"], np.integer) for row in rows)


def test_sklearn_text_pipeline_with_string_classes(tmp_path: Path) -> None:
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.naive_bayes import MultinomialNB
    from sklearn.pipeline import make_pipeline

    texts = ["good great fine", "bad awful poor", "great stuff", "poor stuff", "fine good"] * 4
    labels = ["pos", "neg", "pos", "neg", "pos"] * 4
    model = make_pipeline(TfidfVectorizer(), MultinomialNB()).fit(texts, labels)
    joblib.dump(model, _folder(tmp_path) / "model.joblib")
    _, signature = inspect_artifact(tmp_path / "model")
    assert signature.inputs == (TensorSpec("text", "BYTES"),)
    assert signature.outputs[0] == TensorSpec("label", "BYTES")
    assert signature.labels == ("neg", "pos")
    batch = np.array(["really great", b"awful", "fine"], dtype=object)
    out = _run("sklearn", tmp_path / "model", text=batch)
    expected = model.predict_proba(["really great", "awful", "fine"])
    _assert_classified(out, expected, model.classes_.astype(object))


def test_sklearn_regressors_single_and_multi_output(tmp_path: Path) -> None:
    from sklearn.linear_model import Ridge

    x, y = make_regression(n_samples=100, n_features=4, n_targets=2, random_state=0)
    x = x.astype(np.float32)
    for name, target in (("one", y[:, 0]), ("two", y)):
        model = Ridge().fit(x, target)
        joblib.dump(model, _folder(tmp_path, name) / "model.joblib")
        _, signature = inspect_artifact(tmp_path / name)
        assert signature.outputs == (TensorSpec("prediction", "FP32", (-1, *target.shape[1:])),)
        out = _run("sklearn", tmp_path / name, features=x[:5])
        np.testing.assert_allclose(out["prediction"], model.predict(x[:5]), rtol=1e-5)


# -- XGBoost ----------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".json", ".ubj"])
def test_xgboost_booster_files(tmp_path: Path, suffix: str) -> None:
    import xgboost

    x, y = _classification()
    booster = xgboost.train(
        {"objective": "binary:logistic", "max_depth": 3}, xgboost.DMatrix(x, label=y), 10
    )
    booster.save_model(_folder(tmp_path) / f"model{suffix}")
    assert detect_framework(tmp_path / "model") == "xgboost"
    _, signature = inspect_artifact(tmp_path / "model", metadata={"labels": ["no", "yes"]})
    assert signature.inputs == (TensorSpec("features", "FP32", (-1, 6)),)
    assert signature.outputs[0] == TensorSpec("label", "BYTES")
    assert signature.labels == ("no", "yes")
    config = RuntimeConfig(threads=3)
    runtime = load_runtime("xgboost", tmp_path / "model", config)
    assert json.loads(runtime.booster.save_config())["learner"]["generic_param"]["nthread"] == "3"
    out = runtime.predict_batch({"features": x[:9]})
    p = booster.predict(xgboost.DMatrix(x[:9]))
    _assert_classified(out, np.stack([1 - p, p], axis=1), np.array([0, 1]))
    assert out["label"].dtype == np.int64


def test_xgboost_sklearn_wrappers(tmp_path: Path) -> None:
    import xgboost

    x, y = _classification(3)
    classifier = xgboost.XGBClassifier(n_estimators=5, max_depth=3).fit(x, y)
    joblib.dump(classifier, _folder(tmp_path, "c") / "model.joblib")
    _, signature = inspect_artifact(tmp_path / "c")
    assert signature.outputs[1] == TensorSpec("probabilities", "FP32", (-1, 3))
    out = _run("xgboost", tmp_path / "c", features=x[:8])
    _assert_classified(out, classifier.predict_proba(x[:8]), np.arange(3))

    regressor = xgboost.XGBRegressor(n_estimators=5).fit(x, y * 1.5)
    joblib.dump(regressor, _folder(tmp_path, "r") / "model.joblib")
    assert inspect_artifact(tmp_path / "r")[1].outputs == (TensorSpec("prediction", "FP32"),)
    out = _run("xgboost", tmp_path / "r", features=x[:8])
    np.testing.assert_allclose(out["prediction"], regressor.predict(x[:8]), rtol=1e-5)


# -- LightGBM ---------------------------------------------------------------------------


def test_lightgbm_booster_text_file(tmp_path: Path) -> None:
    import lightgbm

    x, y = _classification()
    params = {"objective": "binary", "num_leaves": 7, "verbose": -1}
    booster = lightgbm.train(params, lightgbm.Dataset(x, label=y), 10)
    booster.save_model(_folder(tmp_path) / "model.txt")
    assert detect_framework(tmp_path / "model") == "lightgbm"
    _, signature = inspect_artifact(tmp_path / "model")
    assert signature.labels is None  # integer classes: the label is the class
    out = _run("lightgbm", tmp_path / "model", RuntimeConfig(threads=2), features=x[:6])
    p = booster.predict(x[:6])
    _assert_classified(out, np.stack([1 - p, p], axis=1), np.array([0, 1]))


def test_lightgbm_sklearn_wrappers(tmp_path: Path) -> None:
    import lightgbm

    x, y = _classification(3)
    names = np.array(["ant", "bee", "cat"])[y]
    classifier = lightgbm.LGBMClassifier(n_estimators=5, verbose=-1).fit(x, names)
    joblib.dump(classifier, _folder(tmp_path, "c") / "model.joblib")
    assert detect_framework(tmp_path / "c") == "lightgbm"
    _, signature = inspect_artifact(tmp_path / "c")
    assert signature.labels == ("ant", "bee", "cat")
    assert signature.outputs[0] == TensorSpec("label", "BYTES")
    out = _run("lightgbm", tmp_path / "c", features=x[:6])
    _assert_classified(out, classifier.predict_proba(x[:6]), classifier.classes_)

    regressor = lightgbm.LGBMRegressor(n_estimators=5, verbose=-1).fit(x, y * 2.0)
    joblib.dump(regressor, _folder(tmp_path, "r") / "model.joblib")
    assert inspect_artifact(tmp_path / "r")[1].outputs == (TensorSpec("prediction", "FP32"),)
    out = _run("lightgbm", tmp_path / "r", features=x[:6])
    np.testing.assert_allclose(out["prediction"], regressor.predict(x[:6]), rtol=1e-5)


# -- ONNX -------------------------------------------------------------------------------


def _onnx_classifier(folder: Path, zipmap: bool) -> tuple[object, np.ndarray]:
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import FloatTensorType
    from sklearn.linear_model import LogisticRegression

    x, y = _classification(3)
    model = LogisticRegression(max_iter=500).fit(x, y)
    onx = convert_sklearn(
        model,
        initial_types=[("input", FloatTensorType([None, 6]))],
        options={id(model): {"zipmap": zipmap}},
        target_opset=17,
    )
    (folder / "model.onnx").write_bytes(onx.SerializeToString())
    return model, x


def test_onnx_keeps_onnx_names(tmp_path: Path) -> None:
    model, x = _onnx_classifier(_folder(tmp_path), zipmap=False)
    _, signature = inspect_artifact(tmp_path / "model", metadata={"labels": ["a", "b", "c"]})
    assert signature.inputs == (TensorSpec("input", "FP32", (-1, 6)),)
    # skl2onnx without ZipMap already names a classifier's outputs like inferd does.
    assert signature.outputs == (
        TensorSpec("label", "INT64"),
        TensorSpec("probabilities", "FP32", (-1, 3)),
    )
    assert signature.labels == ("a", "b", "c")
    runtime = load_runtime("onnx", tmp_path / "model", RuntimeConfig(threads=3))
    assert runtime.session.get_session_options().intra_op_num_threads == 3
    out = runtime.predict_batch({"input": x[:5].astype(np.float64)})
    np.testing.assert_allclose(out["probabilities"], model.predict_proba(x[:5]), rtol=1e-4)
    np.testing.assert_array_equal(out["label"], model.predict(x[:5]))


def test_onnx_refuses_zipmap(tmp_path: Path) -> None:
    _onnx_classifier(_folder(tmp_path), zipmap=True)
    with pytest.raises(ValueError, match=r'ZipMap.*options=\{"zipmap": False\}'):
        inspect_artifact(tmp_path / "model")


# -- PyTorch ----------------------------------------------------------------------------


def _torch_classifier():
    import torch

    torch.manual_seed(0)

    class Classifier(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(6, 3)

        def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            probabilities = torch.softmax(self.linear(features), dim=1)
            return probabilities.argmax(dim=1), probabilities

    return Classifier().eval()


CLASSIFIER_SIGNATURE = Signature(
    inputs=(TensorSpec("features", "FP32", (-1, 6)),),
    outputs=(TensorSpec("label", "INT64"), TensorSpec("probabilities", "FP32", (-1, 3))),
    labels=("a", "b", "c"),
)


@TORCHSCRIPT_DEPRECATED
def test_torchscript_with_embedded_signature(tmp_path: Path) -> None:
    import torch

    model = _torch_classifier()
    extra = {"signature.json": json.dumps(CLASSIFIER_SIGNATURE.to_dict())}
    torch.jit.save(torch.jit.script(model), str(_folder(tmp_path) / "model.pt"), _extra_files=extra)
    assert inspect_artifact(tmp_path / "model") == ("torch", CLASSIFIER_SIGNATURE)
    x, _ = _classification()
    x.flags.writeable = False  # as arrays decoded from a request buffer are
    out = _run("torch", tmp_path / "model", features=x[:7])
    label, probabilities = model(torch.from_numpy(x[:7].copy()))
    np.testing.assert_allclose(out["probabilities"], probabilities.detach().numpy(), rtol=1e-6)
    np.testing.assert_array_equal(out["label"], label.numpy())


def test_torch_export_program_with_declared_signature(tmp_path: Path) -> None:
    import torch

    model = _torch_classifier()
    batch = torch.export.Dim("batch")
    program = torch.export.export(model, (torch.zeros(4, 6),), dynamic_shapes=({0: batch},))
    torch.export.save(program, _folder(tmp_path) / "model.pt2")
    with pytest.raises(ValueError, match="no signature"):
        inspect_artifact(tmp_path / "model")
    declared = Signature.from_dict(CLASSIFIER_SIGNATURE.to_dict())
    assert inspect_artifact(tmp_path / "model", signature=declared) == ("torch", declared)
    x, _ = _classification()
    config = RuntimeConfig(threads=torch.get_num_threads(), signature=declared)
    out = _run("torch", tmp_path / "model", config, features=x[:5])
    label, probabilities = model(torch.from_numpy(x[:5]))
    np.testing.assert_allclose(out["probabilities"], probabilities.detach().numpy(), rtol=1e-6)
    np.testing.assert_array_equal(out["label"], label.numpy())


# -- user Python class ------------------------------------------------------------------

MODEL_PY = """
import numpy as np

class Helper:
    pass

class Scaler:
    signature = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}],
    }

    def load(self, artifact_dir):
        self.factor = np.float32((artifact_dir / "factor.txt").read_text())

    def predict(self, batch):
        return {"y": batch["x"] * self.factor}
"""


def test_python_class_runtime(tmp_path: Path) -> None:
    for name, factor in (("v1", "2"), ("v2", "3")):
        folder = _folder(tmp_path, name)
        (folder / "model.py").write_text(MODEL_PY)
        (folder / "factor.txt").write_text(factor)
    assert detect_framework(tmp_path / "v1") == "python"
    _, signature = inspect_artifact(tmp_path / "v1")
    assert signature.outputs == (TensorSpec("y", "FP32", (-1, 2)),)
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    v1 = load_runtime("python", tmp_path / "v1")
    v2 = load_runtime("python", tmp_path / "v2")
    np.testing.assert_array_equal(v1.predict_batch({"x": x})["y"], x * 2)
    np.testing.assert_array_equal(v2.predict_batch({"x": x})["y"], x * 3)


def test_python_class_by_metadata_returning_an_array(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    (folder / "serve.py").write_text(
        "class A:\n    def predict(self, batch):\n        return batch['x'].sum(axis=1)\n"
        "class B(A):\n    pass\n"
    )
    signature = Signature(
        (TensorSpec("x", "INT64", (-1, 3)),), (TensorSpec("prediction", "INT64"),)
    )
    meta = {"python_module": "serve", "python_class": "B"}
    assert inspect_artifact(folder, "python", meta, signature) == ("python", signature)
    out = _run("python", folder, RuntimeConfig(metadata=meta), x=np.ones((4, 3), np.int64))
    np.testing.assert_array_equal(out["prediction"], [3, 3, 3, 3])
    with pytest.raises(ValueError, match=r"expected one class with predict.*A, B"):
        load_runtime("python", folder, RuntimeConfig(metadata={"python_module": "serve"}))
    with pytest.raises(ValueError, match="declares no signature"):
        inspect_artifact(folder, "python", {"python_module": "serve.py", "python_class": "A"})


def test_inspect_rejects_outputs_without_batch_dimension(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    (folder / "model.py").write_text(
        "import numpy as np\n"
        "class M:\n"
        "    signature = {'inputs': [{'name': 'x', 'datatype': 'FP32'}],\n"
        "                 'outputs': [{'name': 'prediction', 'datatype': 'FP32'}]}\n"
        "    def predict(self, batch):\n"
        "        return np.float32(batch['x'].mean())\n"
    )
    with pytest.raises(ValueError, match="lost the batch dimension"):
        inspect_artifact(folder)


def test_manifest_overrides_inference_and_arguments_override_manifest(tmp_path: Path) -> None:
    import xgboost

    x, y = _classification()
    booster = xgboost.train({"objective": "binary:logistic"}, xgboost.DMatrix(x, label=y), 3)
    folder = _folder(tmp_path)
    booster.save_model(folder / "model.json")
    (folder / "inferd.json").write_text(json.dumps({"framework": "xgboost", "labels": ["n", "y"]}))
    assert inspect_artifact(folder)[1].labels == ("n", "y")
    assert inspect_artifact(folder, metadata={"labels": ["no", "yes"]})[1].labels == ("no", "yes")
    with pytest.raises(ValueError, match="unknown framework"):
        inspect_artifact(folder, framework="caffe2")


def test_every_builtin_runtime_is_listed() -> None:
    assert set(RUNTIMES) == {
        "llm",
        "sklearn",
        "xgboost",
        "lightgbm",
        "onnx",
        "torch",
        "python",
        "gpt2",
        "transformers",
        "tensorflow",
        "graph",
    }
