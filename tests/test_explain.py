"""Explanations: exact TreeSHAP for tree models, KernelSHAP for the rest, through the
runtimes (no sockets) and through the real server's routes."""

from __future__ import annotations

import itertools
import math
import time
from pathlib import Path

import numpy as np
import pytest

from inferd.demo.build import build_demo_model
from inferd.errors import InvalidInput
from inferd.runtimes import load_runtime
from inferd.runtimes.base import RuntimeConfig
from inferd.runtimes.explain import COALITIONS, Features, background_of
from tests.conftest import InferdServer, push_folder, upload_arithmetic

FAR = time.monotonic() + 3600


@pytest.fixture(scope="module")
def demo_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    out = tmp_path_factory.mktemp("demo")
    return {name: build_demo_model(name, out) for name in ("fraud", "iris")}


def _runtime(model, **metadata):
    config = RuntimeConfig(1, {**model.metadata, **metadata}, model.signature)
    runtime = load_runtime(model.framework, model.path, config)
    return runtime


def exact_shapley(f, x: np.ndarray, background: np.ndarray) -> np.ndarray:
    """Shapley values by their definition: every subset of the other features, v(S) the
    mean output over the background with S's features taken from x."""
    m = len(x)

    def v(members: tuple[int, ...]) -> np.ndarray:
        batch = background.copy()
        batch[:, list(members)] = x[list(members)]
        return f(batch).mean(axis=0)

    phi = np.zeros((m, f(x[None]).shape[1]))
    for i in range(m):
        others = [j for j in range(m) if j != i]
        for size in range(m):
            weight = math.factorial(size) * math.factorial(m - size - 1) / math.factorial(m)
            for s in itertools.combinations(others, size):
                phi[i] += weight * (v(tuple(sorted((*s, i)))) - v(s))
    return phi


def test_kernel_shap_on_iris_equals_the_exact_shapley_values(demo_folders):
    runtime = _runtime(demo_folders["iris"])
    runtime.load()
    features = Features.of(runtime.signature, runtime.config.metadata)
    background = background_of(runtime, features)
    rows = np.array([[5.1, 3.5, 1.4, 0.2], [6.2, 2.9, 4.3, 1.3], [7.7, 3.0, 6.1, 2.3]])
    explanation = runtime.explain({"features": rows.astype(np.float32)}, FAR)

    def f(batch: np.ndarray) -> np.ndarray:
        out = runtime.predict_batch({"features": batch.astype(np.float32)})
        return out["probabilities"].astype(np.float64)

    assert explanation.method == "kernel_shap" and explanation.space == "probability"
    assert explanation.features == ("sepal_length", "sepal_width", "petal_length", "petal_width")
    assert explanation.outputs == ("setosa", "versicolor", "virginica")
    for i, row in enumerate(rows):
        exact = exact_shapley(f, row, background)
        np.testing.assert_allclose(explanation.attributions[i], exact, atol=1e-5)
        total = explanation.attributions[i].sum(axis=0)
        np.testing.assert_allclose(total, explanation.values[i] - explanation.expected, atol=1e-6)
    np.testing.assert_allclose(explanation.expected, f(background).mean(axis=0), atol=1e-6)


def test_sampled_kernel_shap_is_exact_for_an_additive_model(tmp_path: Path):
    """With more features than fit COALITIONS, coalitions are sampled; for a linear
    model v(S) is additive, so any coalitions give its exact values, w * (x - E[b])."""
    m = 14
    assert 2**m - 2 > COALITIONS
    rng = np.random.default_rng(1)
    weights = rng.normal(size=m)
    (tmp_path / "model.py").write_text(
        "import numpy as np\n"
        f"W = np.array({weights.tolist()!r})\n"
        "class Linear:\n"
        "    signature = {'inputs': [{'name': 'features', 'datatype': 'FP64',"
        f" 'shape': [-1, {m}]}}],"
        " 'outputs': [{'name': 'prediction', 'datatype': 'FP64', 'shape': [-1]}]}\n"
        "    def predict(self, batch):\n"
        "        return {'prediction': batch['features'] @ W}\n"
    )
    background = rng.normal(size=(40, m))
    config = RuntimeConfig(1, {"background_samples": background.tolist()})
    runtime = load_runtime("python", tmp_path, config)
    runtime.load()
    x = rng.normal(size=(2, m))
    explanation = runtime.explain({"features": x}, FAR)
    expected = weights * (x - background.mean(axis=0))
    np.testing.assert_allclose(explanation.attributions[:, :, 0], expected, atol=1e-8)
    assert explanation.features[0] == "features[0]"


def test_tree_shap_of_the_fraud_model_sums_to_its_margin(demo_folders):
    runtime = _runtime(demo_folders["fraud"])
    runtime.load()
    x = np.random.default_rng(0).normal(size=(20, 30)).astype(np.float32)
    explanation = runtime.explain({"features": x}, FAR)
    margin = runtime.booster.inplace_predict(x, predict_type="margin", validate_features=False)
    assert explanation.method == "tree_shap" and explanation.space == "margin"
    assert explanation.outputs == ("fraud",)
    assert explanation.features[:2] == ("amount", "hour_of_day")
    total = explanation.attributions.sum(axis=1)[:, 0] + explanation.expected[0]
    np.testing.assert_allclose(total, margin, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(explanation.values[:, 0], margin, rtol=1e-5, atol=1e-5)
    p = runtime.predict_batch({"features": x})["probabilities"][:, 1]
    np.testing.assert_allclose(1 / (1 + np.exp(-explanation.values[:, 0])), p, atol=1e-5)


def test_tree_shap_of_lightgbm_and_scikit_learn_forests(tmp_path: Path):
    import joblib
    import lightgbm
    from sklearn.datasets import make_classification
    from sklearn.ensemble import RandomForestClassifier

    x, y = make_classification(n_samples=400, n_features=6, n_informative=4, random_state=0)
    x = x.astype(np.float32)
    lgb_dir, rf_dir = tmp_path / "lgb", tmp_path / "rf"
    lgb_dir.mkdir()
    rf_dir.mkdir()
    booster = lightgbm.train(
        {"objective": "binary", "verbose": -1, "num_leaves": 8}, lightgbm.Dataset(x, y), 30
    )
    booster.save_model(str(lgb_dir / "model.txt"))
    joblib.dump(
        RandomForestClassifier(20, max_depth=5, random_state=0).fit(x, y), rf_dir / "m.joblib"
    )

    lgb = load_runtime("lightgbm", lgb_dir, RuntimeConfig(1, {"labels": ["no", "yes"]}))
    lgb.load()
    e = lgb.explain({"features": x[:10]}, FAR)
    raw = booster.predict(x[:10], raw_score=True)
    assert (e.method, e.space, e.outputs) == ("tree_shap", "margin", ("yes",))
    np.testing.assert_allclose(e.attributions.sum(axis=1)[:, 0] + e.expected[0], raw, atol=1e-6)

    rf = load_runtime("sklearn", rf_dir, RuntimeConfig(1, {}))
    rf.load()
    e = rf.explain({"features": x[:10]}, FAR)
    proba = rf.predict_batch({"features": x[:10]})["probabilities"]
    assert (e.method, e.space, e.outputs) == ("tree_shap", "probability", ("0", "1"))
    np.testing.assert_allclose(e.attributions.sum(axis=1) + e.expected, proba, atol=1e-5)
    np.testing.assert_allclose(e.values, proba, atol=1e-5)


def test_what_cannot_be_explained_is_refused_by_name(demo_folders, tmp_path: Path):
    from inferd.runtimes import inspect_artifact

    iris = demo_folders["iris"]
    bad = {**iris.metadata, "background_samples": [{"features": [1.0, 2.0]}]}
    with pytest.raises(ValueError, match="background_samples: input 'features' has rows of shape"):
        inspect_artifact(iris.path, "onnx", bad, iris.signature)  # refused at push
    runtime = _runtime(demo_folders["iris"], background_samples=None)
    runtime.config.metadata.pop("background_samples")
    runtime.load()
    with pytest.raises(InvalidInput, match="background_samples"):
        runtime.explain({"features": np.zeros((1, 4), np.float32)}, FAR)
    (tmp_path / "model.py").write_text(
        "import numpy as np\n"
        "class Echo:\n"
        "    signature = {'inputs': [{'name': 'text', 'datatype': 'BYTES', 'shape': [-1]}],"
        " 'outputs': [{'name': 'n', 'datatype': 'INT64', 'shape': [-1]}]}\n"
        "    def predict(self, batch):\n"
        "        return {'n': np.array([len(t) for t in batch['text']])}\n"
    )
    echo = load_runtime("python", tmp_path, RuntimeConfig(1, {"background_samples": ["a"]}))
    echo.load()
    with pytest.raises(InvalidInput, match="input 'text' is BYTES"):
        echo.explain({"text": np.array(["hello"], dtype=object)}, FAR)


# -- through the server --------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory, demo_folders):
    data = tmp_path_factory.mktemp("explain-server")
    for model in demo_folders.values():
        push_folder(data, model.name, model.path, framework=model.framework, **model.metadata)
    srv = InferdServer(data, env={"INFERD_INFERENCE_LOG__FLUSH_INTERVAL_S": "0.2"})
    try:
        srv.wait_ready()
        srv.wait_for(
            lambda: all(
                srv.client.get(f"/v2/models/{m}/ready").status_code == 200
                for m in ("fraud", "iris")
            ),
            what="both models ready",
        )
        yield srv
    finally:
        assert srv.stop() == 0


def _sums(answer: dict) -> None:
    """Each row's attributions add up to its value less the expected value."""
    for row in answer["explanations"]:
        for output, attributions in row["attributions"].items():
            total = sum(attributions.values())
            gap = row["value"][output] - answer["expected_value"][output]
            assert total == pytest.approx(gap, abs=1e-5), (output, total, gap)


def test_the_fraud_model_is_explained_in_log_odds_that_sum_to_its_margin(server):
    rng = np.random.default_rng(3)
    rows = [{"features": r} for r in rng.normal(size=(5, 30)).round(3).tolist()]
    reply = server.client.post("/api/v1/models/fraud/explain", json={"inputs": rows})
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert (answer["model"], answer["version"]) == ("fraud", "v1")
    assert (answer["method"], answer["space"], answer["outputs"]) == (
        "tree_shap",
        "margin",
        ["fraud"],
    )
    assert answer["features"][0] == "amount" and len(answer["features"]) == 30
    assert len(answer["explanations"]) == 5
    _sums(answer)
    predicted = server.client.post("/api/v1/models/fraud/predict", json={"inputs": rows}).json()
    for row, out in zip(answer["explanations"], predicted["outputs"], strict=True):
        p = 1 / (1 + math.exp(-row["value"]["fraud"]))
        assert p == pytest.approx(out["probabilities"][1], abs=1e-5)
    assert float(reply.headers["server-timing"].split("compute;dur=")[1].split(",")[0]) > 0


def test_iris_is_explained_by_kernel_shap_through_both_routes(server):
    rows = [{"features": [5.1, 3.5, 1.4, 0.2]}, {"features": [6.7, 3.1, 4.7, 1.5]}]
    ours = server.client.post("/api/v1/models/iris/versions/v1/explain", json={"inputs": rows})
    assert ours.status_code == 200, ours.text
    answer = ours.json()
    assert answer["method"] == "kernel_shap" and answer["space"] == "probability"
    assert answer["outputs"] == ["setosa", "versicolor", "virginica"]
    _sums(answer)
    predicted = server.client.post("/api/v1/models/iris/predict", json={"inputs": rows}).json()
    for row, out in zip(answer["explanations"], predicted["outputs"], strict=True):
        assert list(row["value"].values()) == pytest.approx(out["probabilities"], abs=1e-6)
    # setosa's petals are short: petal length pushes its setosa probability up most
    first = answer["explanations"][0]["attributions"]["setosa"]
    assert max(first, key=lambda f: first[f]).startswith("petal")

    kserve = server.client.post("/v1/models/iris:explain", json={"instances": rows})
    assert kserve.status_code == 200, kserve.text
    assert kserve.json()["explanations"] == answer["explanations"]


def test_bad_explain_requests_are_4xx_naming_what_was_wrong(server):
    client = server.client
    reply = client.post("/api/v1/models/nope/explain", json={"inputs": [[1, 2, 3, 4]]})
    assert reply.status_code == 404 and "nope" in reply.text
    reply = client.post("/api/v1/models/iris/explain", json={"inputs": [{"features": [1, 2]}]})
    assert reply.status_code == 422 and "features" in reply.text
    reply = client.post("/api/v1/models/iris/explain", json={"rows": []})
    assert reply.status_code == 422 and "inputs" in reply.text
    many = {"inputs": [{"features": [5.0, 3.0, 1.5, 0.2]}] * 101}
    reply = client.post("/api/v1/models/iris/explain", json=many)
    assert reply.status_code == 413 and "limit of 100" in reply.text
    reply = client.post("/v1/models/iris:explain", json={"inputs": []})
    assert reply.status_code == 400 and "instances" in reply.text  # /v1/: OpenAI's shape
    assert upload_arithmetic(client, "calc", "v1", "x * 2").status_code == 201
    reply = client.post("/api/v1/models/calc/explain", json={"inputs": [{"x": 1.0}]})
    assert reply.status_code == 422, reply.text
    assert "background_samples" in reply.json()["error"]["message"]


def test_explanations_are_logged_apart_from_predictions(server):
    rows = {"inputs": [{"features": [5.1, 3.5, 1.4, 0.2]}]}
    assert server.client.post("/api/v1/models/iris/explain", json=rows).status_code == 200

    def counted() -> bool:
        text = server.client.get("/metrics").text
        return any(
            line.startswith("inferd_requests_total{") and 'api="explain"' in line
            and 'model="iris"' in line
            for line in text.splitlines()
        )  # fmt: skip

    server.wait_for(counted, what="explain requests counted under api=explain")
