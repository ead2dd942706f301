"""The demo models build locally, load in their runtimes and predict sensibly."""

from __future__ import annotations

from datetime import datetime

import numpy as np
import pytest

from inferd.demo import DemoModel, build_demo_models
from inferd.runtimes import detect_framework, inspect_artifact, load_runtime
from inferd.runtimes.base import Runtime, RuntimeConfig


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, DemoModel]:
    messages: list[str] = []
    models = build_demo_models(tmp_path_factory.mktemp("demo"), progress=messages.append)
    assert len(messages) == len(models)
    return {model.name: model for model in models}


def _runtime(model: DemoModel) -> Runtime:
    return load_runtime(
        model.framework, model.path, RuntimeConfig(1, model.metadata, model.signature)
    )


def test_demo_models_are_complete(demo: dict[str, DemoModel]) -> None:
    assert {name: m.framework for name, m in demo.items()} == {
        "fraud": "xgboost",
        "sentiment": "sklearn",
        "iris": "onnx",
        "digits": "torch",
        "image-classifier": "onnx",
    }
    for model in demo.values():
        assert [p.name for p in model.path.iterdir()] == [f"model.{_SUFFIX[model.framework]}"]
        assert detect_framework(model.path) == model.framework
        datetime.fromisoformat(model.metadata["training_date"])
        assert model.metadata["dataset"] and model.description and model.version


_SUFFIX = {"xgboost": "json", "sklearn": "joblib", "onnx": "onnx", "torch": "pt"}


def test_demo_signatures(demo: dict[str, DemoModel]) -> None:
    signatures = {
        name: inspect_artifact(m.path, m.framework, m.metadata, m.signature)[1]
        for name, m in demo.items()
    }
    shapes = {
        name: {spec.name: (spec.datatype, spec.shape) for spec in (*s.inputs, *s.outputs)}
        for name, s in signatures.items()
    }
    assert shapes == {
        "fraud": {
            "features": ("FP32", (-1, 30)),
            "label": ("BYTES", (-1,)),
            "probabilities": ("FP32", (-1, 2)),
        },
        "sentiment": {
            "text": ("BYTES", (-1,)),
            "label": ("BYTES", (-1,)),
            "probabilities": ("FP32", (-1, 2)),
        },
        "iris": {
            "features": ("FP32", (-1, 4)),
            "label": ("INT64", (-1,)),
            "probabilities": ("FP32", (-1, 3)),
        },
        "digits": {
            "features": ("FP32", (-1, 64)),
            "label": ("INT64", (-1,)),
            "probabilities": ("FP32", (-1, 10)),
        },
        "image-classifier": {
            "image": ("BYTES", (-1,)),
            "label": ("INT64", (-1,)),
            "probabilities": ("FP32", (-1, 3)),
        },
    }
    assert signatures["image-classifier"].inputs[0].media == "image"
    assert signatures["image-classifier"].labels == ("circle", "square", "triangle")
    assert signatures["fraud"].labels == ("legit", "fraud")
    assert signatures["sentiment"].labels == ("negative", "positive")
    assert signatures["iris"].labels == ("setosa", "versicolor", "virginica")
    assert signatures["digits"].labels == tuple("0123456789")


def test_fraud_quality(demo: dict[str, DemoModel]) -> None:
    fraud = demo["fraud"]
    assert fraud.metadata["accuracy"] > 0.9
    assert fraud.metadata["roc_auc"] > 0.9
    rows = np.random.default_rng(0).normal(size=(16, 30)).astype(np.float32)
    out = _runtime(fraud).predict_batch({"features": rows})
    assert set(out["label"]) <= {"legit", "fraud"}
    np.testing.assert_allclose(out["probabilities"].sum(axis=1), 1.0, rtol=1e-6)


def test_sentiment_quality(demo: dict[str, DemoModel]) -> None:
    texts = np.array(["This product is amazing!", "Terrible, broke after one day"], dtype=object)
    out = _runtime(demo["sentiment"]).predict_batch({"text": texts})
    assert list(out["label"]) == ["positive", "negative"]
    assert out["probabilities"][0, 1] > 0.8
    assert demo["sentiment"].metadata["accuracy"] > 0.9


@pytest.mark.parametrize("name", ["iris", "digits"])
def test_bundled_dataset_quality(demo: dict[str, DemoModel], name: str) -> None:
    from sklearn.datasets import load_digits, load_iris

    data = (load_iris if name == "iris" else load_digits)()
    out = _runtime(demo[name]).predict_batch({"features": data.data.astype(np.float32)})
    assert float(np.mean(out["label"] == data.target)) > 0.9
    assert demo[name].metadata["accuracy"] > 0.9
