"""One policy on every door, tried with keys limited to some models: a real server with
auth on and per-model rate limits. A graph never widens what a key reaches (each model
it can reach must be allowed, checked before any node runs), its node calls take from
their models' limits, and the routes that name their model in the body or in a path the
gates do not parse (graphs, KServe V1's ``:explain``, ``/api/v1/predict``, jobs, gRPC)
take from the same limits as the model's own routes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from inferd.grpc import grpc_service_pb2 as pb
from inferd.grpc import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import InferdServer, arithmetic_model, create_key, push_folder, push_source

CHAIN = {
    "root": "s",
    "nodes": {
        "first": {"model": "plus"},
        "then": {"model": "double", "inputs": {"x": "first.y"}},
        "s": {"sequence": ["first", "then"]},
    },
}


def _graph(data: Path, name: str, spec: dict[str, Any]) -> None:
    folder = data / f"graph-{name}"
    folder.mkdir()
    (folder / "graph.json").write_text(json.dumps(spec))
    push_folder(data, name, folder)


@pytest.fixture(scope="module")
def policed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    data = tmp_path_factory.mktemp("abuse-policy")
    push_source(data, "plus", arithmetic_model("x + 1"))
    push_source(data, "double", arithmetic_model("x * 2"))
    push_source(data, "limited", arithmetic_model("x"))
    _graph(data, "chain", CHAIN)
    _graph(data, "outer", {"root": "c", "nodes": {"c": {"model": "chain"}}})  # nested
    keys = {
        "graph_only": create_key(data, "g", "infer", models=["chain"]),
        "graph_and_plus": create_key(data, "gp", "infer", models=["chain", "plus"]),
        "graph_and_nodes": create_key(data, "gn", "infer", models=["chain", "plus", "double"]),
        "outer_all": create_key(data, "o", "infer", models=["outer", "chain", "plus", "double"]),
        "outer_only": create_key(data, "oo", "infer", models=["outer", "chain"]),
        "everything": create_key(data, "all", "infer"),
    }
    limits = {
        "limited": {"requests_per_s": 0.01, "burst": 2},
        "double": {"requests_per_s": 0.01, "burst": 3},
        "chain": {"requests_per_s": 0.01, "burst": 1000},
    }
    env = {"INFERD_AUTH__ENABLED": "true", "INFERD_RATE_LIMITS__MODELS": json.dumps(limits)}
    server = InferdServer(data, workers=1, env=env)
    try:
        server.wait_ready()
        yield {"server": server, "keys": keys}
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def _client(policed: dict[str, Any], key: str) -> httpx.Client:
    server: InferdServer = policed["server"]
    headers = {"authorization": f"Bearer {policed['keys'][key]}"}
    return httpx.Client(base_url=server.url, headers=headers, timeout=30)


def _graph_predict(client: httpx.Client, graph: str = "chain") -> httpx.Response:
    return client.post(f"/api/v1/graphs/{graph}/predict", json={"inputs": [{"x": 1.0}]})


def test_a_graph_needs_every_model_it_reaches(policed: dict[str, Any]) -> None:
    with _client(policed, "graph_only") as client:
        refused = _graph_predict(client)
        assert refused.status_code == 403, refused.text
        assert "may not use model 'double'" in refused.json()["error"]["message"]
        # the model route too: the graph is not a door to its nodes
        assert _graph_predict(client).status_code == 403
        direct = client.post("/api/v1/models/chain/predict", json={"inputs": [{"x": 1.0}]})
        assert direct.status_code == 403
    with _client(policed, "graph_and_plus") as client:
        refused = _graph_predict(client)
        assert refused.status_code == 403
        assert "'double'" in refused.json()["error"]["message"]
    with _client(policed, "graph_and_nodes") as client:
        answer = _graph_predict(client)
        assert answer.status_code == 200, answer.text
        assert answer.json()["outputs"] == [{"y": 4.0}]  # (1 + 1) * 2
    with _client(policed, "outer_only") as client:  # through a nested graph as well
        assert _graph_predict(client, "outer").status_code == 403
    with _client(policed, "outer_all") as client:
        assert _graph_predict(client, "outer").status_code == 200


def test_a_refused_graph_runs_none_of_its_nodes(policed: dict[str, Any]) -> None:
    """The check comes before any node: ``plus`` (allowed) is not called either, which
    its rate limit would show if it were (``double``'s limit is untouched)."""
    with _client(policed, "graph_and_plus") as client:
        for _ in range(5):
            assert _graph_predict(client).status_code == 403
    with _client(policed, "graph_and_nodes") as client:
        assert _graph_predict(client).status_code in (200, 429)


def test_graph_node_calls_take_from_their_models_limits(policed: dict[str, Any]) -> None:
    """``double`` allows 3 requests per client: the chain's node calls count, and once
    they are spent the graph is refused 429 naming the model's limit."""
    with _client(policed, "everything") as client:
        statuses = [_graph_predict(client).status_code for _ in range(5)]
        assert statuses == [200, 200, 200, 429, 429], statuses
        refused = _graph_predict(client).json()["error"]["message"]
        assert "rate limit exceeded" in refused and "this model" in refused
        direct = client.post("/api/v1/models/double/predict", json={"inputs": [{"x": 1.0}]})
        assert direct.status_code == 429  # the same bucket


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/v1/predict", {"model": "limited", "input": {"x": 1.0}}),
        ("/v1/models/limited:explain", {"instances": [[1.0]]}),
    ],
    ids=["body-named", "kserve-explain"],
)
def test_routes_the_gates_cannot_read_take_from_the_models_limit(
    policed: dict[str, Any], path: str, body: dict[str, Any]
) -> None:
    server: InferdServer = policed["server"]
    key = create_key(server.data_dir, f"fresh-{path}", "infer")  # a client of its own
    with httpx.Client(
        base_url=server.url, headers={"authorization": f"Bearer {key}"}, timeout=30
    ) as client:
        statuses = [client.post(path, json=body).status_code for _ in range(3)]
    assert statuses[2] == 429, statuses
    assert 429 not in statuses[:2], statuses


def test_an_explanation_with_a_key_for_another_model_is_refused(policed: dict[str, Any]) -> None:
    with _client(policed, "graph_only") as client:
        for path in ("/v1/models/plus:explain", "/api/v1/models/plus/explain"):
            refused = client.post(path, json={"instances": [[1.0]], "inputs": [{"x": 1.0}]})
            assert refused.status_code == 403, (path, refused.text)


def test_jobs_are_admitted_against_the_graph_s_models_when_submitted(
    policed: dict[str, Any],
) -> None:
    with _client(policed, "graph_only") as client:
        batch = client.post("/api/v1/batch", json={"model": "chain", "inputs": [{"x": 1.0}]})
        assert batch.status_code == 403, batch.text
        later = client.post(
            "/api/v1/graphs/chain/predict?async=true", json={"inputs": [{"x": 1.0}]}
        )
        assert later.status_code in (403, 404), later.text  # never accepted


def test_grpc_graph_calls_are_held_to_the_same_policy(policed: dict[str, Any]) -> None:
    server: InferdServer = policed["server"]
    request = pb.ModelInferRequest(model_name="chain")
    tensor = request.inputs.add()
    tensor.name, tensor.datatype = "x", "FP32"
    tensor.shape.append(1)
    request.raw_input_contents.append(b"\x00\x00\x80?")
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        metadata = [("authorization", f"Bearer {policed['keys']['graph_only']}")]
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(request, metadata=metadata, timeout=10)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "'double'" in str(refused.value.details())
        metadata = [("authorization", f"Bearer {policed['keys']['graph_and_nodes']}")]
        codes = []
        for _ in range(5):
            try:
                stub.ModelInfer(request, metadata=metadata, timeout=10)
                codes.append("OK")
            except grpc.RpcError as exc:
                codes.append(exc.code().name)
        assert codes[-1] == "RESOURCE_EXHAUSTED", codes  # double's 3, spent
