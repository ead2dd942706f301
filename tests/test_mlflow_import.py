"""Versions imported from a real MLflow tracking server (``mlflow server``: a SQLite backend
store, artifacts served from a local folder through its ``mlflow-artifacts`` proxy, as a
team's shared server runs), with models logged by the MLflow client.

Each flavor imported through ``POST /api/v1/models/{model}/versions`` with
``source_uri: models:/…`` answers as the logged model does, takes MLflow's signature,
and keeps the run's metrics, params and id as metadata; bad sources are clear 4xx/503s.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.conftest import InferdServer, free_port, run_cli

pytestmark = pytest.mark.slow
mlflow = pytest.importorskip("mlflow")
ROWS = [[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3], [5.9, 3.0, 4.2, 1.5]]


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    log = open(root / "server.log", "w")  # noqa: SIM115 -- closed below
    # fmt: off
    command = [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination", str(root / "artifacts"),
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
    ]
    # fmt: on
    proc = subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=root,
        start_new_session=True,  # it starts job consumers: they go with it, as a group
    )
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            if httpx.get(f"{uri}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, (root / "server.log").read_text()[-2000:]
        assert time.monotonic() < deadline, "mlflow server did not start"
        time.sleep(0.25)
    try:
        yield uri
    finally:
        # a throwaway server: nothing of it is kept (its graceful stop takes ~9 s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(20)
        log.close()


@pytest.fixture(scope="module")
def logged(tracking_uri: str) -> dict[str, Any]:
    """One registered MLflow model per flavor; what each answers on ROWS."""
    import lightgbm
    import pandas as pd
    import torch
    import xgboost
    from sklearn.datasets import load_iris
    from sklearn.linear_model import LogisticRegression

    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_registry_uri(tracking_uri)
    X, y = load_iris(return_X_y=True, as_frame=True)
    rows = np.asarray(ROWS)
    frame = pd.DataFrame(rows, columns=X.columns)
    expected: dict[str, Any] = {}

    def log(name: str, flavor: Any, model: Any, example: Any, **kwargs: Any) -> str:
        # MLflow's own code warns under pandas 3 and newer torch: not what is tested here
        with warnings.catch_warnings(), mlflow.start_run() as run:
            warnings.simplefilter("ignore")
            mlflow.log_metric("accuracy", 0.97)
            mlflow.log_param("flavor", name)
            flavor.log_model(
                *([] if model is None else [model]),
                name="model",
                input_example=example,
                registered_model_name=name,
                pip_requirements=[],  # no requirement inference (a subprocess per model)
                **kwargs,
            )
        return run.info.run_id

    sk = LogisticRegression(max_iter=500).fit(X, y)
    expected["sk"] = sk.predict_proba(frame)
    expected["sk-run"] = log("sk", mlflow.sklearn, sk, X.iloc[:2])
    xgb = xgboost.XGBClassifier(n_estimators=8, max_depth=2).fit(X, y)
    expected["xgb"] = xgb.predict_proba(frame)
    log("xgb", mlflow.xgboost, xgb, X.iloc[:2])
    lgb = lightgbm.LGBMClassifier(n_estimators=8, verbose=-1).fit(X, y)
    expected["lgb"] = lgb.predict_proba(frame)
    log("lgb", mlflow.lightgbm, lgb, X.iloc[:2])
    booster = lightgbm.train(
        {"objective": "regression", "verbose": -1}, lightgbm.Dataset(X.to_numpy(), y), 5
    )
    expected["lgb-booster"] = booster.predict(rows)
    log("lgb-booster", mlflow.lightgbm, booster, X.to_numpy()[:2])

    from skl2onnx import to_onnx

    onnx_model = to_onnx(
        sk, X.to_numpy()[:1].astype(np.float32), target_opset=17, options={"zipmap": False}
    )
    log("onnx", mlflow.onnx, onnx_model, X.to_numpy()[:2].astype(np.float32))

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    with torch.no_grad():
        expected["torch"] = net(torch.tensor(rows, dtype=torch.float32)).numpy()
    example = X.to_numpy()[:2].astype(np.float32)
    log("torch", mlflow.pytorch, net, example)  # MLflow 3: torch.export, model.pt2
    log("torch-pickle", mlflow.pytorch, net, example, serialization_format="pickle")

    import keras

    keras.utils.set_random_seed(0)
    keras_in = keras.Input((4,), name="features")
    keras_model = keras.Model(keras_in, keras.layers.Dense(3, activation="softmax")(keras_in))
    expected["tf"] = np.asarray(keras_model(rows.astype(np.float32), training=False))
    log("tf", mlflow.tensorflow, keras_model, X.to_numpy()[:2].astype(np.float32))

    class Doubler(mlflow.pyfunc.PythonModel):
        def predict(self, context, model_input, params=None):
            return model_input["sepal length (cm)"] * 2 + model_input["petal width (cm)"]

    doubler = Doubler()

    log("pyfunc", mlflow.pyfunc, None, X.iloc[:2], python_model=doubler)
    expected["pyfunc"] = rows[:, 0] * 2 + rows[:, 3]

    client = mlflow.MlflowClient(tracking_uri, registry_uri=tracking_uri)
    client.set_registered_model_alias("sk", "champion", "1")
    return expected


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tracking_uri: str) -> Iterator[InferdServer]:
    env = {"INFERD_REGISTRY__MLFLOW_TRACKING_URI": tracking_uri}
    server = InferdServer(tmp_path_factory.mktemp("inferd"), workers=1, env=env)
    try:
        server.wait_ready()
        yield server
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def _import(server: InferdServer, model: str, uri: str, **extra: Any) -> httpx.Response:
    body = {"version": "v1", "source_uri": uri, **extra}
    return server.client.post(f"/api/v1/models/{model}/versions", json=body, timeout=120)


def _predict(
    server: InferdServer, model: str, name: str = "features"
) -> list[dict[str, Any]] | None:
    reply = server.client.post(
        f"/api/v1/models/{model}/predict", json={"inputs": [{name: r} for r in ROWS]}
    )
    return reply.json()["outputs"] if reply.status_code == 200 else None


@pytest.mark.parametrize(
    ("model", "framework", "kind"),
    [
        ("sk", "sklearn", "classifier"),
        ("xgb", "xgboost", "classifier"),
        ("lgb", "lightgbm", "classifier"),
        ("lgb-booster", "lightgbm", "regressor"),
        ("onnx", "onnx", "onnx"),
        ("torch", "torch", "tensor"),
        ("torch-pickle", "torch", "tensor"),
        ("pyfunc", "python", "pyfunc"),
        ("tf", "onnx", "keras"),  # converted to ONNX, checked against TensorFlow
    ],
)
def test_each_flavor_answers_like_the_logged_model(
    server: InferdServer, logged: dict[str, Any], model: str, framework: str, kind: str
):
    imported = _import(server, model, f"models:/{model}/1")
    assert imported.status_code == 201, imported.text
    record = imported.json()["version"]
    assert record["framework"] == framework
    meta = record["metadata"]
    assert meta["mlflow"]["model_name"] == model and meta["mlflow"]["model_version"] == "1"
    assert len(meta["mlflow"]["run_id"]) == 32
    assert meta["metrics"] == {"accuracy": 0.97}
    inputs = record["signature"]["inputs"]
    if kind in ("classifier", "pyfunc"):  # MLflow's column schema: four doubles
        assert inputs == [{"name": "features", "datatype": "FP64", "shape": [-1, 4]}]
        assert meta["feature_names"][0] == "sepal length (cm)"
    name = inputs[0]["name"]  # an ONNX graph names its own
    server.wait_for(lambda: _predict(server, model, name) is not None, what=f"{model} serving")
    outputs = _predict(server, model, name)
    assert outputs is not None
    if kind == "classifier":
        got = np.array([o["probabilities"] for o in outputs])
        np.testing.assert_allclose(got, logged[model], rtol=1e-4, atol=1e-5)
        # the class itself, an INT64 as the signature says (v1 once answered "0", "2", "1")
        assert [o["label"] for o in outputs] == [0, 2, 1]
    elif kind == "onnx":  # skl2onnx's graph of the scikit-learn model
        got = np.array([o["probabilities"] for o in outputs])
        np.testing.assert_allclose(got, logged["sk"], rtol=1e-3, atol=1e-4)
    elif kind == "keras":
        assert meta["converted_from"] == "tensorflow"
        (name,) = [s["name"] for s in record["signature"]["outputs"]]
        got = np.array([o[name] for o in outputs])
        np.testing.assert_allclose(got, logged["tf"], rtol=1e-5, atol=1e-6)
    else:
        got = np.array([o["prediction"] for o in outputs])
        want = logged["torch" if kind == "tensor" else model]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_alias_and_runs_uris_name_the_same_model(server: InferdServer, logged: dict[str, Any]):
    by_alias = _import(server, "sk-alias", "models:/sk@champion")
    assert by_alias.status_code == 201, by_alias.text
    assert by_alias.json()["version"]["metadata"]["mlflow"]["model_version"] == "1"
    run = _import(server, "sk-run", f"runs:/{logged['sk-run']}/model")
    assert run.status_code == 201, run.text
    assert run.json()["version"]["metadata"]["params"] == {"flavor": "sk"}
    server.wait_for(lambda: _predict(server, "sk-run") is not None, what="sk-run serving")
    got = np.array([o["probabilities"] for o in _predict(server, "sk-run") or []])
    np.testing.assert_allclose(got, logged["sk"], rtol=1e-4, atol=1e-5)


def test_bad_mlflow_sources_are_named(
    server: InferdServer, tracking_uri: str, logged: dict[str, Any], tmp_path: Path
):
    unknown = _import(server, "nope", "models:/no-such-model/1")
    assert unknown.status_code == 422
    assert "no-such-model" in unknown.json()["error"]["message"]
    shape = _import(server, "nope", "models:/sk")
    assert shape.status_code == 422 and "models:/<name>/<version>" in shape.text

    # a model of a flavor inferd does not serve (as a Spark model's MLmodel reads)
    folder = tmp_path / "spark"
    folder.mkdir()
    (folder / "MLmodel").write_text(
        "flavors:\n  spark:\n    model_data: sparkml\n  python_function:\n"
        "    loader_module: mlflow.spark\n"
    )
    client = mlflow.MlflowClient(tracking_uri)
    run = client.create_run(client.get_experiment_by_name("Default").experiment_id)
    client.log_artifacts(run.info.run_id, str(folder), "model")
    flavor = _import(server, "spark", f"runs:/{run.info.run_id}/model")
    assert flavor.status_code == 422, flavor.text
    assert "spark" in flavor.json()["error"]["message"]
    assert server.client.get("/api/v1/models/spark").status_code == 404
    assert not list((server.data_dir / "uploads").iterdir())  # nothing left behind


def test_an_unreachable_mlflow_is_a_503_naming_it(tmp_path: Path):
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens
    server = InferdServer(tmp_path, workers=1, env={"INFERD_REGISTRY__MLFLOW_TRACKING_URI": gone})
    try:
        server.wait_ready()
        refused = _import(server, "sk", "models:/sk/1")
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "store_unavailable" and gone in error["message"]
        assert server.client.get("/api/v1/models/sk").status_code == 404
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def test_the_cli_imports_locally_and_through_a_server(
    server: InferdServer, tracking_uri: str, logged: dict[str, Any], tmp_path: Path
):
    env = {"INFERD_REGISTRY__MLFLOW_TRACKING_URI": tracking_uri}
    local = run_cli(
        "models", "push", "calc", "models:/pyfunc/1", "-v", "v1", data_dir=tmp_path, env=env
    )
    assert "registered calc:v1 (python)" in local.stderr
    stored = tmp_path / "artifacts" / "calc" / "v1"
    assert (stored / "mlflow_model" / "MLmodel").is_file() and (stored / "model.py").is_file()

    remote = run_cli(
        "models", "push", "cli-xgb", "models:/xgb/1", "-v", "v1", "--url", server.url,
        data_dir=tmp_path / "unused",
    )  # fmt: skip
    assert "registered cli-xgb:v1 (xgboost)" in remote.stderr, remote.stderr
    record = server.client.get("/api/v1/models/cli-xgb/versions/v1").json()
    assert record["metadata"]["mlflow"]["source_uri"] == "models:/xgb/1"
