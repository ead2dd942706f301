"""TensorFlow models (SavedModel folders and ``.keras`` files), built in the tests:
converted to ONNX at push time and checked against TensorFlow, or served by TensorFlow
itself when pushed as ``tensorflow`` or when tf2onnx cannot convert them."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest

from inferd.runtimes import inspect_artifact, load_runtime, prepare_artifact
from inferd.runtimes.base import RuntimeConfig
from tests.conftest import InferdServer

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
pytest.importorskip("tf2onnx")
ROWS = np.random.default_rng(1).standard_normal((5, 6)).astype(np.float32)


def _keras_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,), name="features")
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, activation="softmax", name="scores")(hidden))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("tf")
    model = _keras_model()
    (root / "keras").mkdir()
    model.save(root / "keras" / "classifier.keras")
    model.export(str(root / "saved"), verbose=False)

    class Odd(tf.Module):  # ops tf2onnx does not convert
        @tf.function(input_signature=[tf.TensorSpec([None, 6], tf.float32, name="x")])
        def serve(self, x):
            return {"y": tf.math.lgamma(tf.abs(x) + 1.0) + tf.math.bessel_i1e(x)}

    odd = Odd()
    tf.saved_model.save(odd, str(root / "odd"), signatures={"serving_default": odd.serve})
    return {
        "root": root,
        "expected": np.asarray(model(ROWS, training=False)),
        "odd": np.asarray(odd.serve(tf.constant(ROWS))["y"]),
    }


@pytest.mark.parametrize("kind", ["keras", "saved"])
def test_a_push_converts_to_onnx_checked_against_tensorflow(models, kind: str, tmp_path: Path):
    folder, framework, made = prepare_artifact(models["root"] / kind, None, tmp_path)
    assert framework == "onnx"
    assert (folder / "model.onnx").is_file() and (folder / "tensorflow").is_dir()
    conversion = made["onnx_conversion"]
    assert conversion["tool"].startswith("tf2onnx") and conversion["max_abs_diff"] < 1e-5
    framework, signature = inspect_artifact(folder, framework, made)
    assert signature.inputs[0].to_dict() == {
        "name": "features",
        "datatype": "FP32",
        "shape": [-1, 6],
    }
    runtime = load_runtime("onnx", folder, RuntimeConfig(1, made, signature))
    (output,) = runtime.run({"features": ROWS}).values()
    np.testing.assert_allclose(output, models["expected"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["keras", "saved"])
def test_the_native_runtime_answers_as_tensorflow(models, kind: str):
    framework, signature = inspect_artifact(models["root"] / kind, "tensorflow")
    assert framework == "tensorflow" and signature.inputs[0].shape == (-1, 6)
    runtime = load_runtime("tensorflow", models["root"] / kind, RuntimeConfig(1))
    (output,) = runtime.run({"features": ROWS}).values()
    np.testing.assert_allclose(output, models["expected"], rtol=1e-6)
    assert output.shape == (5, 3)


def test_a_model_tf2onnx_cannot_convert_is_served_by_tensorflow(models, tmp_path: Path):
    folder, framework, made = prepare_artifact(models["root"] / "odd", None, tmp_path)
    assert framework == "tensorflow" and folder == models["root"] / "odd"
    assert made["onnx_conversion"].startswith("failed:") and "BesselI1e" in made["onnx_conversion"]
    assert not (tmp_path / "onnx").exists()
    runtime = load_runtime("tensorflow", folder, RuntimeConfig(1))
    np.testing.assert_allclose(runtime.run({"x": ROWS})["y"], models["odd"], rtol=1e-6)


@pytest.mark.slow
def test_an_uploaded_keras_model_serves_through_the_api(models, tmp_path: Path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(models["root"] / "keras" / "classifier.keras", arcname="classifier.keras")
    body = buf.getvalue()
    server = InferdServer(tmp_path, workers=1)
    try:
        server.wait_ready()
        pushed = server.client.post(
            "/api/v1/models/shapes/versions",
            params={"version": "v1", "sha256": hashlib.sha256(body).hexdigest()},
            content=body,
            headers={"content-type": "application/gzip"},
            timeout=180,
        )
        assert pushed.status_code == 201, pushed.text
        record = pushed.json()["version"]
        assert record["framework"] == "onnx"
        assert record["metadata"]["converted_from"] == "tensorflow"

        def scores() -> list[list[float]] | None:
            reply = server.client.post(
                "/api/v1/models/shapes/predict",
                json={"inputs": [{"features": row} for row in ROWS.tolist()]},
            )
            return (
                [o["scores"] for o in reply.json()["outputs"]] if reply.status_code == 200 else None
            )

        server.wait_for(lambda: scores() is not None, what="shapes serving")
        np.testing.assert_allclose(np.array(scores()), models["expected"], rtol=1e-5, atol=1e-6)
    finally:
        assert server.stop() == 0, server.log()[-3000:]
