"""The Open Inference Protocol's model repository extension (index, load, unload).

Pure tests of the index states and of the control channel (a real Unix socket, no
server), then end-to-end against the real server: a small scikit-learn model unloaded
and loaded again (replica processes gone, then back), a model whose load fails, the
desired state kept across a restart, and the CLI's way of doing the same.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import joblib
import pytest

from inferd.control.publisher import TablePublisher
from inferd.protocols.repository import IndexEntry, _entry
from inferd.registry import Registry
from inferd.routing.router import Router
from inferd.shapes.control import ModelRoute, ReplicaRoute, RoutingTable, VersionRoute
from inferd.shapes.replica import ReplicaState
from inferd.shapes.tensors import Signature
from tests.conftest import InferdServer, push_folder, run_cli

MODELS = Path(__file__).parent / "models"
ROW = [5.1, 3.5, 1.4, 0.2]
SIGNATURE = {"inputs": [], "outputs": []}

# -- index states, from routing tables alone ---------------------------------------------


def _route(loaded: bool, serving: str | None, *replicas: tuple[str, str]) -> ModelRoute:
    reps = [
        ReplicaRoute(f"r{i}", "unix:/x", ReplicaState(state), message=msg)
        for i, (state, msg) in enumerate(replicas)
    ]
    route = VersionRoute(
        version="v1", framework="sklearn", signature=Signature.from_dict(SIGNATURE), replicas=reps
    )
    versions = {"v1": route} if replicas else {}
    return ModelRoute("iris", serving, versions, loaded)


@pytest.fixture(scope="module")
def record(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("index")
    (root / "model.py").write_text("class M:\n    pass\n")
    sig = Signature.from_dict(SIGNATURE)
    with Registry(f"sqlite:///{root / 'r.db'}", root / "artifacts") as registry:
        registry.push("iris", root / "model.py", "v1", framework="python", signature=sig)
        return registry.get_model("iris")


@pytest.mark.parametrize(
    ("route", "expected"),
    [
        (_route(True, "v1", ("ready", "")), IndexEntry("iris", "v1", "READY")),
        (_route(True, None, ("loading", "")), IndexEntry("iris", "v1", "LOADING")),
        (
            _route(True, None, ("failed", "RuntimeError: bad weights")),
            IndexEntry("iris", "v1", "UNAVAILABLE", "RuntimeError: bad weights"),
        ),
        (_route(False, None, ("draining", "")), IndexEntry("iris", "v1", "UNLOADING", "unloaded")),
        (_route(False, None), IndexEntry("iris", "v1", "UNAVAILABLE", "unloaded")),
        (None, IndexEntry("iris", "v1", "LOADING")),  # not yet seen by the controller
    ],
    ids=["ready", "loading", "failed", "unloading", "unloaded", "new"],
)
def test_index_state_of_a_route(record, route: ModelRoute | None, expected: IndexEntry) -> None:
    assert _entry(record, route) == expected


def test_gateway_asks_the_controller_to_reconcile_and_sees_each_table(tmp_path: Path) -> None:
    async def scenario() -> None:
        publisher = TablePublisher(tmp_path / "control.sock")
        asked = asyncio.Event()

        async def reconcile() -> None:  # the controller's pass publishes the new state
            publisher.publish(RoutingTable(2, {"iris": _route(False, None)}))
            asked.set()

        publisher.on_reconcile = reconcile
        await publisher.start()
        publisher.publish(RoutingTable(1, {"iris": _route(True, None, ("loading", ""))}))
        router = Router()
        try:
            await asyncio.wait_for(router.follow(publisher.path), 5)
            unloaded = router.wait_for(
                lambda table: True if not table.models["iris"].loaded else None, timeout_s=5
            )
            waiter = asyncio.ensure_future(unloaded)
            await router.server.request_reconcile("iris")
            assert await waiter is True
            assert asked.is_set() and router.table.generation == 2
            assert router.waiting_for() == []  # an unloaded model is not waited for
            assert await router.wait_for(lambda table: None, timeout_s=0.05) is None
        finally:
            router.close()
            await publisher.close()

    asyncio.run(scenario())


# -- end to end ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def iris_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sklearn.datasets import load_iris
    from sklearn.linear_model import LogisticRegression

    x, y = load_iris(return_X_y=True)
    folder = tmp_path_factory.mktemp("iris-src")
    joblib.dump(LogisticRegression(max_iter=300).fit(x, y), folder / "model.joblib")
    return folder


def _infer(client: httpx.Client, model: str = "iris") -> httpx.Response:
    tensor = {"name": "features", "shape": [1, 4], "datatype": "FP32", "data": ROW}
    return client.post(f"/v2/models/{model}/infer", json={"inputs": [tensor]})


def _index(client: httpx.Client, **body: bool) -> dict[str, dict]:
    # No body at all when there are no options: what tritonclient sends.
    reply = client.post("/v2/repository/index", json=body if body else None)
    assert reply.status_code == 200, reply.text
    return {entry["name"]: entry for entry in reply.json()}


def _pids(client: httpx.Client, model: str) -> list[int]:
    detail = client.get(f"/api/v1/models/{model}").json()
    return [r["pid"] for v in detail["versions"] for r in v["replicas"]]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _push_iris(folder: Path, data_dir: Path) -> None:
    push_folder(data_dir, "iris", folder, "v1")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, iris_model: Path) -> Iterator[InferdServer]:
    data = tmp_path_factory.mktemp("repository")
    _push_iris(iris_model, data)
    sig = Signature.from_dict(
        {
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
            "outputs": [{"name": "prediction", "datatype": "FP32", "shape": [-1]}],
        }
    )
    with Registry(f"sqlite:///{data / 'inferd.db'}", data / "artifacts") as registry:
        registry.push("broken", MODELS / "broken", "v1", framework="python", signature=sig)
        registry.set_loaded("broken", False)  # starts unloaded: no crash loop
    srv = InferdServer(data, workers=2, env={"INFERD_LOAD_TIMEOUT_S": "20"})
    try:
        srv.wait_ready()  # ready although "broken" is not: it is unloaded on purpose
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]


@pytest.mark.slow
def test_server_metadata_lists_the_extension(server: InferdServer) -> None:
    assert "model_repository" in server.client.get("/v2").json()["extensions"]


@pytest.mark.slow
def test_index_lists_every_model_with_its_state(server: InferdServer) -> None:
    c = server.client
    index = _index(c)
    assert index["iris"] == {"name": "iris", "version": "v1", "state": "READY", "reason": ""}
    assert index["broken"] == {
        "name": "broken",
        "version": "v1",
        "state": "UNAVAILABLE",
        "reason": "unloaded",
    }
    assert set(_index(c, ready=True)) == {"iris"}
    assert set(_index(c, ready=False)) == {"iris", "broken"}
    bad = c.post("/v2/repository/index", json={"ready": "yes"})
    assert bad.status_code == 400 and "ready" in bad.json()["error"]


@pytest.mark.slow
def test_unload_stops_the_replicas_and_load_brings_them_back(server: InferdServer) -> None:
    c = server.client
    assert _infer(c).status_code == 200
    pids = _pids(c, "iris")
    assert pids and all(map(_alive, pids))

    reply = c.post(
        "/v2/repository/models/iris/unload", json={"parameters": {"unload_dependents": True}}
    )
    assert (reply.status_code, reply.json()) == (200, {})
    assert not any(map(_alive, pids)), "replica processes outlived the unload"
    assert _pids(c, "iris") == []
    refused = _infer(c)
    assert refused.status_code == 503 and "iris" in refused.json()["error"]
    assert _index(c)["iris"]["state"] == "UNAVAILABLE"
    assert c.get("/v2/models/iris/ready").status_code == 503
    assert c.get("/v2/health/live").status_code == 200
    assert c.get("/health/ready").status_code == 200  # unloaded on purpose: not waited for
    assert c.get("/v2/health/ready").status_code == 200
    assert c.post("/v2/repository/models/iris/unload").status_code == 200  # already: at once

    reply = c.post("/v2/repository/models/iris/load", json={})
    assert (reply.status_code, reply.json()) == (200, {})
    assert _infer(c).status_code == 200  # serving as soon as load returned
    new_pids = _pids(c, "iris")
    assert new_pids and not set(new_pids) & set(pids)
    assert _index(c)["iris"]["state"] == "READY"
    assert c.post("/v2/repository/models/iris/load").status_code == 200  # already loaded


@pytest.mark.slow
def test_repository_over_grpc_with_tritons_client(server: InferdServer) -> None:
    import tritonclient.grpc as triton
    from tritonclient.utils import InferenceServerException

    with triton.InferenceServerClient(f"127.0.0.1:{server.grpc_port}") as client:
        index = {m.name: m for m in client.get_model_repository_index().models}
        assert index["iris"].state == "READY" and index["broken"].state == "UNAVAILABLE"
        assert index["broken"].reason == "unloaded"
        client.unload_model("iris")
        assert not client.is_model_ready("iris") and _pids(server.client, "iris") == []
        assert client.is_server_ready()  # unloaded on purpose
        client.load_model("iris")
        assert client.is_model_ready("iris")
        assert _infer(server.client).status_code == 200
        with pytest.raises(InferenceServerException) as info:
            client.load_model("nope")
        assert info.value.status() == "StatusCode.NOT_FOUND"


@pytest.mark.slow
@pytest.mark.parametrize("action", ["load", "unload"])
def test_unknown_model_is_404(server: InferdServer, action: str) -> None:
    reply = server.client.post(f"/v2/repository/models/nope/{action}")
    assert reply.status_code == 404 and "nope" in reply.json()["error"]


@pytest.mark.slow
def test_failed_load_reports_why_and_unload_stops_retrying(server: InferdServer) -> None:
    c = server.client
    reply = c.post("/v2/repository/models/broken/load")
    assert reply.status_code == 500, reply.text
    error = reply.json()["error"]
    assert "broken" in error and "weights are corrupt" in error  # the replica's own reason
    entry = _index(c)["broken"]
    assert entry["state"] in ("UNAVAILABLE", "LOADING")  # failed, or being restarted
    assert c.post("/v2/repository/models/broken/unload").status_code == 200
    assert _index(c)["broken"]["state"] == "UNAVAILABLE"
    assert _pids(c, "broken") == []
    assert (
        c.post(
            "/v2/repository/models/broken/load", json={"parameters": {"config": "{}"}}
        ).status_code
        == 400
    )


@pytest.mark.slow
def test_unloaded_stays_unloaded_across_a_restart(tmp_path: Path, iris_model: Path) -> None:
    _push_iris(iris_model, tmp_path)
    first = InferdServer(tmp_path, workers=1)
    try:
        first.wait_ready()
        run_cli("models", "unload", "iris", data_dir=tmp_path)  # the CLI: registry only
        first.wait_for(
            lambda: _index(first.client)["iris"]["state"] == "UNAVAILABLE",
            timeout_s=30,
            what="the controller's periodic pass to unload iris",
        )
    finally:
        assert first.stop() == 0, first.log()[-3000:]

    second = InferdServer(tmp_path, workers=1)
    try:
        second.wait_ready()
        assert _index(second.client)["iris"]["reason"] == "unloaded"
        assert _infer(second.client).status_code == 503
        assert _pids(second.client, "iris") == []
        assert second.client.post("/v2/repository/models/iris/load").status_code == 200
        assert _infer(second.client).status_code == 200
    finally:
        assert second.stop() == 0, second.log()[-3000:]
