"""End-to-end: replica processes, batching, failures and lifecycle on the real server."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from inferd.registry import Registry
from inferd.shapes.tensors import Signature
from tests.conftest import InferdServer, push_folder, run_cli

MODELS = Path(__file__).parent / "models"
pytestmark = pytest.mark.slow


def _predict(client: httpx.Client, model: str, rows: list, **params) -> httpx.Response:
    body: dict = {"inputs": rows}
    if params:
        body["params"] = params
    return client.post(f"/api/v1/models/{model}/predict", json=body)


def _replicas(server: InferdServer, model: str) -> list[dict]:
    detail = server.client.get(f"/api/v1/models/{model}").json()
    serving = detail["serving_version"]
    version = next(v for v in detail["versions"] if v["version"] == serving)
    return version["replicas"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    data = tmp_path_factory.mktemp("lifecycle")
    run_cli(
        "models",
        "push",
        "slow_sum",
        str(MODELS / "slow_sum"),
        "--version",
        "v1",
        "--max-batch-size",
        "64",
        "--max-wait-ms",
        "10",
        data_dir=data,
    )
    registry = Registry(f"sqlite:///{data / 'inferd.db'}", data / "artifacts")
    broken_sig = Signature.from_dict(
        {
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
            "outputs": [{"name": "prediction", "datatype": "FP32", "shape": [-1]}],
        }
    )
    # Registered without the push-time check, as if its files went bad after pushing.
    registry.push("broken", MODELS / "broken", "v1", framework="python", signature=broken_sig)
    registry.close()
    srv = InferdServer(data, workers=2, env={"INFERD_LOAD_TIMEOUT_S": "20"})
    try:
        srv.wait_ready(path="/health/live")
        srv.wait_for(
            lambda: _predict(srv.client, "slow_sum", [[1, 2, 3, 4]]).status_code == 200,
            what="slow_sum ready",
        )
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]


def test_concurrent_requests_are_batched(server: InferdServer):
    before = _replicas(server, "slow_sum")[0]["stats"]

    async def fire() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=30, limits=limits) as c:
            calls = [
                c.post("/api/v1/models/slow_sum/predict", json={"inputs": [[i, 1, 1, 1]]})
                for i in range(64)
            ]
            return await asyncio.gather(*calls)

    replies = asyncio.run(fire())
    assert [r.status_code for r in replies] == [200] * 64
    assert [r.json()["outputs"][0]["prediction"] for r in replies] == [i + 3.0 for i in range(64)]
    after = _replicas(server, "slow_sum")[0]["stats"]
    requests = after["requests"] - before["requests"]
    batches = after["batches"] - before["batches"]
    assert requests == 64
    assert batches <= 16, f"64 concurrent requests ran in {batches} predict_batch calls"


def test_rows_count_toward_batches(server: InferdServer):
    reply = _predict(server.client, "slow_sum", [[1, 1, 1, 1]] * 10)
    assert reply.status_code == 200
    assert len(reply.json()["outputs"]) == 10


def test_model_error_is_a_json_500_with_request_id(server: InferdServer):
    reply = server.client.post(
        "/api/v1/models/slow_sum/predict",
        json={"inputs": [[666, 1, 1, 1]]},
        headers={"x-request-id": "req-666"},
    )
    assert reply.status_code == 500
    error = reply.json()["error"]
    assert error["code"] == "model_error"
    assert error["request_id"] == "req-666"
    assert "refuses 666" in error["message"]
    assert "Traceback" not in reply.text
    assert "Traceback" in server.log()  # the traceback goes to the server log only


def test_model_that_cannot_load_gives_503_with_retry_after(server: InferdServer):
    reply = _predict(server.client, "broken", [1.0])
    assert reply.status_code == 503
    assert reply.headers["retry-after"]
    assert reply.json()["error"]["code"] == "model_not_ready"
    server.wait_for(lambda: "weights are corrupt" in server.log(), what="load error logged")
    ready = server.client.get("/health/ready")
    assert ready.status_code == 503 and "broken" in ready.json()["waiting_for"]


def test_killed_replica_is_restarted_and_serves_again(server: InferdServer):
    (replica,) = _replicas(server, "slow_sum")
    os.kill(replica["pid"], signal.SIGKILL)
    # In-flight or immediate requests may fail fast (503), never hang.
    started = time.monotonic()
    reply = _predict(server.client, "slow_sum", [[1, 1, 1, 1]])
    assert reply.status_code in (200, 503)
    assert time.monotonic() - started < 5

    def restarted() -> bool:
        replicas = _replicas(server, "slow_sum")
        return replicas[0]["state"] == "ready" and replicas[0]["pid"] != replica["pid"]

    server.wait_for(restarted, timeout_s=60, what="replica restart")
    assert _replicas(server, "slow_sum")[0]["restarts"] == 1
    server.wait_for(
        lambda: _predict(server.client, "slow_sum", [[1, 1, 1, 1]]).status_code == 200,
        timeout_s=10,
        what="predict after restart",
    )
    assert "restarting" in server.log()


def test_pushing_a_new_version_with_deploy_switches_traffic_without_errors(
    server: InferdServer,
):
    statuses: list[int] = []
    versions: set[str] = set()
    push_folder(server.data_dir, "slow_sum", MODELS / "slow_sum", "v2", deploy=True)
    deadline = time.monotonic() + 60
    with httpx.Client(base_url=server.url, timeout=30) as c:
        while time.monotonic() < deadline and "v2" not in versions:
            reply = _predict(c, "slow_sum", [[1, 1, 1, 1]])
            statuses.append(reply.status_code)
            versions.add(reply.headers.get("x-inferd-model-version", "?"))
        for _ in range(20):  # after the switch, the old replicas drain away
            reply = _predict(c, "slow_sum", [[1, 1, 1, 1]])
            statuses.append(reply.status_code)
            versions.add(reply.headers.get("x-inferd-model-version", "?"))
    assert "v2" in versions
    assert set(statuses) == {200}, f"failed requests during the update: {statuses}"
    # v1 drains, then is retired: pinned requests get 503 meanwhile, then 404.
    server.wait_for(
        lambda: (
            _predict(server.client, "slow_sum", [[1, 1, 1, 1]], version="v1").status_code == 404
        ),
        timeout_s=30,
        what="v1 retired",
    )
    pinned = _predict(server.client, "slow_sum", [[1, 1, 1, 1]], version="v1")
    assert "not deployed" in pinned.json()["error"]["message"]


def test_sigterm_drains_in_flight_requests(tmp_path: Path):
    push_folder(tmp_path, "sleepy", MODELS / "sleepy", "v1")
    srv = InferdServer(tmp_path, workers=1)
    try:
        srv.wait_ready()
        with ThreadPoolExecutor(8) as pool, httpx.Client(base_url=srv.url, timeout=30) as c:
            futures = [pool.submit(_predict, c, "sleepy", [1.0]) for _ in range(8)]

            def inside() -> bool:  # or answered already (a batch takes 1 s)
                stats = _replicas(srv, "sleepy")[0].get("stats", {})
                return stats.get("inflight", 0) + sum(f.done() for f in futures) >= 8

            srv.wait_for(inside, what="the 8 requests inside the replica")
            started = time.monotonic()
            srv.process.send_signal(signal.SIGTERM)
            replies = [f.result() for f in futures]
            code = srv.process.wait(30)
        assert [r.status_code for r in replies] == [200] * 8
        assert code == 0
        assert time.monotonic() - started < 15
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{srv.url}/health/live", timeout=2)
    finally:
        srv.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too
        return "(Z)" not in Path(f"/proc/{pid}/stat").read_text().split(")")[1][:4]
    except FileNotFoundError:
        return False


def test_server_kill9_leaves_no_orphans_and_restart_keeps_models(tmp_path: Path):
    push_folder(tmp_path, "slow_sum", MODELS / "slow_sum", "v1")
    srv = InferdServer(tmp_path, workers=2)
    try:
        srv.wait_ready()
        proc_children = Path(f"/proc/{srv.process.pid}/task/{srv.process.pid}/children")
        # Ready once one gateway answers; the second may still be starting.
        srv.wait_for(
            lambda: len(proc_children.read_text().split()) >= 3,
            timeout_s=60,
            what="both gateways and the replica",
        )
        children = [int(p) for p in proc_children.read_text().split()]
        assert len(children) == 3  # two gateways and one replica (its framework's first)
        children += [  # and whatever they started
            int(p) for c in children
            for p in Path(f"/proc/{c}/task/{c}/children").read_text().split()
        ]  # fmt: skip
        srv.process.kill()
        srv.process.wait()
        srv.wait_for(
            lambda: not any(_alive(pid) for pid in children),
            timeout_s=30,
            what="children to exit after the server died",
        )
    finally:
        srv.stop()

    again = InferdServer(tmp_path, workers=1)
    try:
        again.wait_ready()
        reply = _predict(again.client, "slow_sum", [[1, 1, 1, 1]])
        assert reply.status_code == 200 and reply.json()["version"] == "v1"
    finally:
        assert again.stop() == 0
