"""Inference graphs: the spec's checks and the row arithmetic (no sockets), then graphs
over real models on the real server — a graph answers what calling its nodes by hand
answers, a switch sends only its rows to a branch, splitters and ensembles do what
they say, a failing node is named, a bad spec is refused at push, and a deployment's
traffic split applies to graph versions."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from inferd.graphs import rows
from inferd.registry import Registry
from inferd.shapes.graph import Condition, GraphSpecError, parse, signature_of
from inferd.shapes.tensors import Signature, TensorSpec
from tests.conftest import InferdServer, arithmetic_model, push_folder, push_source, served

# -- the spec ---------------------------------------------------------------------------

CHAIN = {
    "root": "s",
    "nodes": {
        "a": {"model": "plus"},
        "b": {"model": "double", "inputs": {"x": "a.y"}},
        "s": {"sequence": ["a", "b"]},
    },
}


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ({"nodes": {}}, "root"),
        ({"root": "a", "nodes": {"a": {"modle": "x"}}}, "exactly one of"),
        ({"root": "s", "nodes": {"s": {"sequence": ["a", "ghost"]}, "a": {"model": "m"}}},
         "unknown node(s) ['ghost']"),
        ({"root": "a", "nodes": {"a": {"sequence": ["b"]}, "b": {"sequence": ["a"]}}},
         "cycle: a -> b -> a"),
        ({"root": "w", "nodes": {"w": {"switch": [{"when": {"source": "request.x"},
                                                    "then": "a"}], "default": "a"},
                                 "a": {"model": "m"}}}, "exactly one of between"),
        ({"root": "w", "nodes": {"w": {"switch": [{"when": {"source": "request.x", "gt": 1},
                                                    "then": "a"}]}, "a": {"model": "m"}}},
         "needs a 'default'"),
        ({"root": "e", "nodes": {"e": {"ensemble": ["a"], "combine": "median", "output": "y"},
                                 "a": {"model": "m"}}}, "combine"),
        ({"root": "p", "nodes": {"p": {"split": {"a": 0}}, "a": {"model": "m"}}}, "weights"),
    ],
)  # fmt: skip
def test_bad_specs_are_refused_naming_the_problem(spec, problem):
    with pytest.raises(GraphSpecError) as refused:
        parse(spec)
    assert problem in str(refused.value)


def test_signature_comes_from_the_first_model_and_the_root():
    x = (TensorSpec("x", "FP32", (-1,)),)
    y = (TensorSpec("y", "FP32", (-1,)),)
    graph = parse(CHAIN)
    assert graph.models() == [("plus", None), ("double", None)]
    sig = signature_of(graph, {"a": Signature(x, y), "b": Signature(x, y)})
    assert (sig.inputs, sig.outputs) == (x, y)
    bad = {**CHAIN, "outputs": ["z"]}
    with pytest.raises(GraphSpecError, match="'outputs' names"):
        signature_of(parse(bad), {"a": Signature(x, y), "b": Signature(x, y)})


# -- the row arithmetic -----------------------------------------------------------------


def test_switch_rows_split_and_merge_back_in_order():
    p = np.array([[0.9, 0.1], [0.5, 0.5], [0.05, 0.95], [0.7, 0.3]], dtype=np.float32)
    unsure = rows.holds(Condition("s.probabilities", "between", [0.2, 0.8], index=1), p)
    assert unsure.tolist() == [False, True, False, True]
    high = rows.holds(Condition("s.probabilities", "gt", 0.9, index=1), p)
    branch = rows.branch_of([unsure, high], 4)
    assert branch.tolist() == [2, 0, 1, 0]  # first match wins; 2: the default
    parts = [(np.flatnonzero(branch == i), {"y": np.full((branch == i).sum(), float(i))})
             for i in range(3)]  # fmt: skip
    merged = rows.merge([(i, {"y": c["y"].astype(np.float32)}) for i, c in parts[:2]]
                        + [parts[2]], 4)  # fmt: skip
    assert merged["y"].dtype == np.float64 and merged["y"].tolist() == [2.0, 0.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="different outputs"):
        rows.merge([(np.array([0]), {"a": np.ones(1)}), (np.array([1]), {"b": np.ones(1)})], 2)
    with pytest.raises(ValueError, match="index"):
        rows.holds(Condition("s.probabilities", "gt", 0.5), p)
    assert rows.holds(Condition("request.c", "in", ["a"]), np.array(["a", "b"])).tolist() == [
        True, False,
    ]  # fmt: skip


def test_combiners():
    a, b, c = np.array([1.0, 4.0]), np.array([3.0, 0.0]), np.array([3.0, 0.0])
    assert rows.combine([a, b], "mean").tolist() == [2.0, 2.0]
    assert rows.combine([a, b], "max").tolist() == [3.0, 4.0]
    assert rows.combine([a, b, c], "vote").tolist() == [3.0, 0.0]


# -- the real server --------------------------------------------------------------------

BOOM = """
import numpy as np


class Boom:
    signature = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    }

    def predict(self, batch):
        if (batch["x"] > 100).any():
            raise ValueError("x over 100")
        return {"y": batch["x"]}
"""


def _graph(data: Path, name: str, spec: dict, version: str = "v1", **options: object) -> None:
    folder = data / f"graph-{name}-{version}"
    folder.mkdir()
    (folder / "graph.json").write_text(json.dumps(spec))
    push_folder(data, name, folder, version, **options)  # type: ignore[arg-type]


def _pick(*nodes: str, weights: list[int]) -> dict:
    return {
        "root": "p",
        "nodes": {"p": {"split": dict(zip(nodes, weights, strict=True))},
                  "a": {"model": "plus"}, "b": {"model": "double"}},
    }  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from inferd.demo.fraud_graph import build_fraud_graph

    data = tmp_path_factory.mktemp("graphs")
    built = build_fraud_graph(data / "built")
    push_folder(data, "fraud", built["fraud"], labels=["legit", "fraud"])
    push_folder(data, "fraud-fast", built["fraud-fast"], labels=["legit", "fraud"])
    push_folder(data, "fraud-graph", built["fraud-graph"])
    push_source(data, "plus", arithmetic_model("x + 1"))
    push_source(data, "double", arithmetic_model("x * 2"))
    push_source(data, "ten", arithmetic_model("x + 10"))
    push_source(data, "boom", BOOM)
    _graph(data, "chain", CHAIN)
    ten = {**CHAIN, "nodes": {**CHAIN["nodes"], "b": {"model": "ten", "inputs": {"x": "a.y"}}}}
    _graph(data, "chain", ten, "v2")  # registered, not deployed: v1 keeps serving
    _graph(data, "avg", {"root": "e", "nodes": {
        "e": {"ensemble": ["a", "b"], "combine": "mean", "output": "y"},
        "a": {"model": "plus"}, "b": {"model": "double"}}})  # fmt: skip
    _graph(data, "mix", {"root": "e", "nodes": {
        "e": {"ensemble": ["s1", "s2"], "combine": "max", "output": "y"},
        "s1": {"sequence": ["a", "b"]}, "s2": {"sequence": ["c", "d"]},
        "a": {"model": "plus"}, "b": {"model": "double", "inputs": {"x": "a.y"}},
        "c": {"model": "ten"}, "d": {"model": "double", "inputs": {"x": "c.y"}}}})  # fmt: skip
    lazy = {"root": "b", "nodes": {"a": {"model": "plus"}, "b": CHAIN["nodes"]["b"]}}
    _graph(data, "lazy", lazy)  # b reads a.y: a is computed first
    _graph(data, "all-a", _pick("a", "b", weights=[100, 0]))
    _graph(data, "all-b", _pick("a", "b", weights=[0, 100]))
    _graph(data, "half", _pick("a", "b", weights=[50, 50]))
    _graph(data, "selfie", {"root": "a", "nodes": {"a": {"model": "plus"}}})
    _graph(data, "selfie", {"root": "a", "nodes": {"a": {"model": "selfie"}}}, "v2", deploy=True)
    push_source(data, "plus", arithmetic_model("x + 1"), version="v2")  # registered only
    _graph(data, "pinned", {"root": "p", "nodes": {"p": {"model": "plus", "version": "v2"}}})
    broken = {"root": "s", "nodes": {
        "s": {"sequence": ["first", "second"]}, "first": {"model": "plus"},
        "second": {"model": "boom", "inputs": {"x": "first.y"}}}}  # fmt: skip
    _graph(data, "broken", broken)
    _graph(data, "guard", {"root": "a", "nodes": {"a": {"model": "plus"}}})
    _graph(data, "guard", broken, "v2")  # registered only: a canary below
    _graph(data, "steady", {"root": "a", "nodes": {"a": {"model": "plus"}}})
    _graph(data, "steady", {"root": "a", "nodes": {"a": {"model": "ten"}}}, "v2")
    return data


@pytest.fixture(scope="module")
def server(data: Path) -> Iterator[InferdServer]:
    env = {"INFERD_INFERENCE_LOG__FLUSH_INTERVAL_S": "0.2"}
    with served(data, workers=1, env=env) as srv:
        yield srv


def _predict(client: httpx.Client, path: str, inputs: list, **params: object) -> dict:
    body: dict = {"inputs": inputs}
    if params:
        body["params"] = params
    reply = client.post(path, json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _batch_rows(client: httpx.Client, model: str) -> float:
    total = 0.0
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("inferd_batch_rows_total{") and f'model="{model}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_the_fraud_graph_answers_as_its_nodes_called_by_hand(server):
    from inferd.demo.build import fraud_data
    from inferd.demo.fraud_graph import UNSURE

    client = server.client
    features = fraud_data()[1][:120].tolist()
    before = _batch_rows(client, "fraud")
    graph = _predict(
        client, "/api/v1/graphs/fraud-graph/predict", [{"features": f} for f in features]
    )
    screened = sum(
        UNSURE[0] <= _predict(client, "/api/v1/models/fraud-fast/predict",
                              [{"features": f}])["outputs"][0]["probabilities"][1] <= UNSURE[1]
        for f in features
    )  # fmt: skip
    # only the unsure rows reached XGBoost (counted by its replica, before the by-hand calls)
    server.wait_for(lambda: _batch_rows(client, "fraud") - before >= screened, 10, "fraud rows")
    assert _batch_rows(client, "fraud") - before == screened
    assert 0 < screened < len(features)
    for f, answered in zip(features, graph["outputs"], strict=True):  # row by row
        fast = _predict(client, "/api/v1/models/fraud-fast/predict", [{"features": f}])
        expected = fast["outputs"][0]
        if UNSURE[0] <= expected["probabilities"][1] <= UNSURE[1]:
            expected = _predict(client, "/api/v1/models/fraud/predict", [{"features": f}])[
                "outputs"
            ][0]
        assert answered["label"] == expected["label"]
        assert np.allclose(answered["probabilities"], expected["probabilities"], atol=1e-6)
    v2 = client.post(
        "/v2/models/fraud-graph/infer",
        json={
            "inputs": [
                {"name": "features", "datatype": "FP32", "shape": [1, 30], "data": features[0]}
            ]
        },
    )
    assert v2.status_code == 200, v2.text  # fmt: skip
    assert {o["name"] for o in v2.json()["outputs"]} == {"label", "probabilities"}


def test_sequence_ensemble_and_splitters(server):
    client = server.client
    xs = [{"x": 1.0}, {"x": 2.5}]
    chain = _predict(client, "/api/v1/graphs/chain/predict", xs)
    assert [o["y"] for o in chain["outputs"]] == [4.0, 7.0]  # (x + 1) * 2
    same = _predict(client, "/api/v1/models/chain/predict", xs)  # a graph is a model
    assert same["outputs"] == chain["outputs"]
    avg = _predict(client, "/api/v1/graphs/avg/predict", xs)
    assert [o["y"] for o in avg["outputs"]] == [2.0, 4.25]  # mean of x + 1 and x * 2
    mix = _predict(client, "/api/v1/graphs/mix/predict", xs)
    assert [o["y"] for o in mix["outputs"]] == [22.0, 25.0]  # max((x + 1) * 2, (x + 10) * 2)
    lazy = _predict(client, "/api/v1/graphs/lazy/predict", xs)
    assert lazy["outputs"] == chain["outputs"]
    for graph, y in (("all-a", 3.0), ("all-b", 4.0)):
        ys = {_predict(client, f"/api/v1/graphs/{graph}/predict", [{"x": 2.0}])["outputs"][0]["y"]
              for _ in range(20)}  # fmt: skip
        assert ys == {y}
    half = Counter(
        _predict(client, "/api/v1/graphs/half/predict", [{"x": 2.0}])["outputs"][0]["y"]
        for _ in range(200)
    )
    assert set(half) == {3.0, 4.0} and 60 <= half[3.0] <= 140, half
    listed = client.get("/api/v1/graphs").json()["graphs"]
    assert {g["name"] for g in listed} >= {"chain", "fraud-graph", "half"}
    assert client.post("/api/v1/graphs/plus/predict", json={"inputs": xs}).status_code == 404


def test_a_failing_node_is_named(server):
    reply = server.client.post("/api/v1/graphs/broken/predict", json={"inputs": [{"x": 200.0}]})
    assert reply.status_code == 500, reply.text
    message = reply.json()["error"]["message"]
    assert message.startswith("graph broken: node 'second' (model boom): "), message
    pinned = server.client.post("/api/v1/graphs/pinned/predict", json={"inputs": [{"x": 1.0}]})
    assert pinned.status_code == 404, pinned.text  # plus:v2 is registered, not deployed
    assert "graph pinned: node 'p' (model plus:v2): " in pinned.json()["error"]["message"]
    loop = server.client.post("/api/v1/graphs/selfie/predict", json={"inputs": [{"x": 1.0}]})
    assert loop.status_code == 422 and "nest deeper than 8" in loop.text, loop.text
    bad = server.client.post("/api/v1/graphs/chain/predict", json={"inputs": [{"z": 1}]})
    assert bad.status_code == 422  # the graph's own signature (plus's inputs) refuses it
    ok = server.client.post("/api/v1/graphs/broken/predict", json={"inputs": [{"x": 2.0}]})
    assert ok.json()["outputs"] == [{"y": 3.0}]
    rid = ok.json()["request_id"]

    def logged() -> bool:  # each node call is a row of the log under the graph's id
        found = server.client.get("/api/v1/logs", params={"request_id": rid})
        return found.status_code == 200 and len(found.json().get("logs", [])) >= 3

    server.wait_for(logged, 10, "the graph's log rows")
    rows = server.client.get("/api/v1/logs", params={"request_id": rid}).json()["logs"]
    assert Counter((r["model_name"], r["api"]) for r in rows) == {
        ("broken", "v1"): 1, ("plus", "graph"): 1, ("boom", "graph"): 1,
    }  # fmt: skip
    metrics = server.client.get("/metrics").text
    for counted in ('{model="boom",version="",api="graph",code="500"} 1',  # its failure
                    '{model="boom",version="v1",api="graph",code="200"} 1'):  # fmt: skip
        assert f"inferd_requests_total{counted}" in metrics


def _upload(client: httpx.Client, model: str, spec: object) -> httpx.Response:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        data = json.dumps(spec).encode()
        info = tarfile.TarInfo("graph.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    body = buf.getvalue()
    return client.post(
        f"/api/v1/models/{model}/versions",
        params={"version": "v1", "sha256": hashlib.sha256(body).hexdigest()},
        content=body,
        headers={"content-type": "application/gzip"},
    )


def test_bad_specs_are_refused_at_push(server):
    cycle = {"root": "a", "nodes": {"a": {"sequence": ["b"]}, "b": {"sequence": ["a"]}}}
    refused = _upload(server.client, "loop", cycle)
    assert refused.status_code == 422 and "cycle" in refused.text, refused.text
    ghost = {
        "root": "a",
        "nodes": {"a": {"model": "nobody"}, "b": {"model": "plus", "version": "v9"}},
    }
    refused = _upload(server.client, "ghost", ghost)
    assert refused.status_code == 422, refused.text
    assert "['nobody', 'plus:v9']" in refused.json()["error"]["message"]


def test_a_deployment_splits_traffic_between_graph_versions(server, data):
    with Registry(f"sqlite:///{data / 'inferd.db'}", data / "artifacts", migrate=False) as reg:
        reg.deployments.deploy("chain", "v2", traffic_pct=50, actor="test")
    deadline = time.monotonic() + 20
    seen: Counter[float] = Counter()
    while time.monotonic() < deadline and len(seen) < 2:
        seen[
            _predict(server.client, "/api/v1/graphs/chain/predict", [{"x": 1.0}])["outputs"][0]["y"]
        ] += 1
        time.sleep(0.05)
    seen.update(
        _predict(server.client, "/api/v1/graphs/chain/predict", [{"x": 1.0}])["outputs"][0]["y"]
        for _ in range(100)
    )
    assert set(seen) == {4.0, 12.0}, seen  # v1: (x + 1) * 2, v2: (x + 1) + 10
    pinned = _predict(server.client, "/api/v1/graphs/chain/predict", [{"x": 1.0}], version="v2")
    assert pinned["version"] == "v2" and pinned["outputs"][0]["y"] == 12.0


def _rollout(server: InferdServer, model: str, version: str) -> dict:
    view = server.client.get(f"/api/v1/deployments/{model}").json()
    found = next(v for v in view["versions"] if v["version"] == version)
    return found["rollout"] or {}


def test_a_failing_graph_canary_falls_back_and_is_rolled_back(server, data):
    """The canary graph fails every request (its second node raises for x over 100):
    the serving graph answers each one instead (the deployment's fallback), and the
    canary analysis, from the gateways' rows (a graph has no replica), rolls it back
    once it has its ``min_requests``, without waiting for its window."""
    with Registry(f"sqlite:///{data / 'inferd.db'}", data / "artifacts", migrate=False) as reg:
        reg.deployments.deploy(
            "guard", "v2", strategy="canary",
            rollout={"steps": [50, 100], "step_s": 600, "min_requests": 10}, actor="test",
        )  # fmt: skip
    deadline = time.monotonic() + 60
    answers: Counter[tuple[str, float]] = Counter()
    while time.monotonic() < deadline and _rollout(server, "guard", "v2").get("state") not in (
        "rolled_back", "promoted",
    ):  # fmt: skip
        reply = _predict(server.client, "/api/v1/graphs/guard/predict", [{"x": 200.0}])
        answers[(reply["version"], reply["outputs"][0]["y"])] += 1
    rollout = _rollout(server, "guard", "v2")
    assert rollout["state"] == "rolled_back", rollout
    assert rollout["reason"].startswith("error rate 100.00%"), rollout["reason"]
    canary = rollout["analysis"]["canary"]
    assert canary["errors"] >= 10 and canary["requests"] == canary["errors"]
    assert set(answers) == {("v1", 201.0)}, answers  # every one answered, by v1

    def fell_back() -> bool:  # the log is written every 0.2 s: the rows may come after
        found = server.client.get("/api/v1/logs", params={"model": "guard", "limit": 200})
        return any(r["fallback_from"] == "v2" for r in found.json()["logs"])

    server.wait_for(fell_back, 10, "a row answered by v1 after v2 failed")


def test_a_graph_canary_as_good_as_stable_is_promoted(server, data):
    with Registry(f"sqlite:///{data / 'inferd.db'}", data / "artifacts", migrate=False) as reg:
        reg.deployments.deploy(
            "steady", "v2", strategy="canary",
            rollout={"steps": [50, 100], "step_s": 1, "min_requests": 10,
                     "min_latency_increase_ms": 50},
            actor="test",
        )  # fmt: skip
    deadline = time.monotonic() + 60
    seen: Counter[float] = Counter()
    while time.monotonic() < deadline and _rollout(server, "steady", "v2").get("state") not in (
        "rolled_back", "promoted",
    ):  # fmt: skip
        reply = _predict(server.client, "/api/v1/graphs/steady/predict", [{"x": 1.0}])
        seen[reply["outputs"][0]["y"]] += 1
    rollout = _rollout(server, "steady", "v2")
    assert rollout["state"] == "promoted", rollout
    (step,) = rollout["analyses"]
    assert step["verdict"] == "pass" and step["canary"]["requests"] >= 10
    assert step["stable"]["requests"] >= 1 and step["canary"]["errors"] == 0
    assert set(seen) == {2.0, 11.0}  # both versions answered during the canary


def test_each_node_call_is_a_span_of_the_request(tmp_path: Path):
    from tests.test_tracing import Collector

    collector = Collector()
    push_source(tmp_path, "plus", arithmetic_model("x + 1"))
    push_source(tmp_path, "double", arithmetic_model("x * 2"))
    _graph(tmp_path, "chain", CHAIN)
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.url, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    try:
        with served(tmp_path, workers=1, env=env) as server:
            reply = server.client.post(
                "/api/v1/graphs/chain/predict", json={"inputs": [{"x": 1.0}]},
                headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
            )  # fmt: skip
            assert reply.status_code == 200, reply.text
            # the request's span, and per node its span, the call to its replica and the
            # replica's two
            spans = collector.trace(trace_id, 9)
    finally:
        collector.server.shutdown()
        collector.server.server_close()
    (request,) = [s for s in spans if s.name == "POST /api/v1/graphs/{model}/predict"]
    nodes = {s.attributes["inferd.node"]: s for s in spans if s.name.startswith("inferd.graph")}
    assert set(nodes) == {"a", "b"}
    assert all(n.parent == request.span_id for n in nodes.values())
    assert (nodes["b"].attributes["inferd.graph"], nodes["b"].attributes["inferd.model"]) == (
        "chain", "double",
    )  # fmt: skip
    calls = [s for s in spans if s.name == "inferd.replica infer" and s.kind == 3]  # CLIENT
    assert sorted(c.parent for c in calls) == sorted(n.span_id for n in nodes.values())
