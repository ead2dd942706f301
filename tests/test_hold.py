"""Held, not refused: with no ready replica but one coming back (a crash restart),
requests wait for it within their deadline instead of failing at once.

Real server, real replica, real load (``inferd bench --rate``), a real ``kill -9``."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, InferdServer, arithmetic_model, push_source

pytestmark = pytest.mark.slow
BREAKS_IN_REPLICAS = """
import os

class Calc:
    signature = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    }

    def load(self, artifact_dir):
        if os.environ.get("CALC_BROKEN"):
            raise RuntimeError("weights are corrupt")

    def predict(self, batch):
        return {"y": batch["x"]}
"""


def _replica(server: InferdServer) -> dict:
    (replica,) = server.client.get("/api/v1/models/calc/versions/v1").json()["replicas"]
    return replica


def _answered(server: InferdServer) -> int:
    """Requests calc's replicas answered since they started (their live figures)."""
    view = server.client.get("/api/v1/deployments/calc").json()
    return sum((v["live"] or {}).get("requests", 0) for v in view["versions"])


def _metric(server: InferdServer, name: str) -> float:
    text = server.client.get("/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def _bench(server: InferdServer, out: Path, rate: int, duration: str) -> subprocess.Popen:
    # fmt: off
    command = [
        sys.executable, "-m", "inferd", "bench", server.url, "--target", "predict",
        "--model", "calc", "--rate", str(rate), "--duration", duration, "--warmup", "0s",
        "--timeout", "20s", "--body", '{"inputs": [{"x": 2}]}', "--json", str(out),
    ]
    # fmt: on
    return subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def test_kill_9_of_the_only_replica_under_load_fails_no_request(tmp_path: Path):
    push_source(tmp_path, "calc", arithmetic_model("x * 3"))
    server = InferdServer(tmp_path, workers=1)
    try:
        server.wait_ready()
        before = _replica(server)
        out = tmp_path / "bench.json"
        answered = _answered(server)
        load = _bench(server, out, rate=50, duration="8s")
        # Under load: once the replica has answered half a second of it (bench takes a
        # second or two to start).
        server.wait_for(
            lambda: _answered(server) >= answered + 25, timeout_s=60, what="the load under way"
        )
        os.kill(before["pid"], signal.SIGKILL)
        _, err = load.communicate(timeout=60)
        assert load.returncode == 0, err
        after = _replica(server)
        assert after["pid"] != before["pid"] and after["restarts"] == 1
        (run,) = json.loads(out.read_text())["levels"]
        assert run["requests"] >= 300, run
        assert run["errors"] == 0 and run["status_counts"] == {"200": run["requests"]}, run
        assert _metric(server, "inferd_held_requests_total") > 0
        assert _metric(server, "inferd_held_expired_total") == 0
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def test_a_model_whose_load_keeps_failing_is_not_waited_for(tmp_path: Path):
    push_source(tmp_path, "calc", BREAKS_IN_REPLICAS)
    env = {"INFERD_HOLD_TIMEOUT_S": "20", "CALC_BROKEN": "1"}
    server = InferdServer(tmp_path, workers=1, env=env)
    try:
        server.wait_ready(path="/health/live")
        server.wait_for(lambda: _replica(server)["restarts"] >= 1, what="a failed load")
        started = time.monotonic()
        reply = server.client.post("/api/v1/models/calc/predict", json={"inputs": [{"x": 1}]})
        assert reply.status_code == 503 and reply.headers["retry-after"]
        assert time.monotonic() - started < 5  # refused, not held for 20 s
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def test_a_replica_that_just_failed_the_request_counts_as_gone_before_its_connection_says() -> None:
    # the table still says ready and the connection is not marked closed yet (its
    # transport is closing: the call raised ReplicaGone): the request is held for the
    # restart, not answered 503 "no ready replica"
    from inferd.routing.holds import Holds
    from inferd.routing.router import Router
    from inferd.routing.targets import Routes
    from inferd.serving.client import ReplicaClient
    from inferd.shapes.control import ModelRoute, ReplicaRoute, RoutingTable, VersionRoute
    from inferd.shapes.replica import ReplicaState
    from inferd.shapes.tensors import Signature

    async def held() -> tuple[bool, bool]:
        router = Router(hold_timeout_s=5, hold_max_requests=10)
        replica = ReplicaRoute("r1", "unix:/nowhere", ReplicaState.READY, ever_ready=True)
        version = VersionRoute(
            version="v1", framework="python", signature=Signature([], []), replicas=[replica]
        )
        table = RoutingTable(1, {"m": ModelRoute("m", "v1", {"v1": version})})
        client = ReplicaClient("unix:/nowhere", "r1")
        client.closed = False  # what it says until its connection_lost runs
        router._clients["r1"] = client
        router.routes = Routes(table, {("m", "v1"): [client]}, None)
        holds: Holds = router.holds
        target = router.target("m")
        until = time.perf_counter() + 0.05
        return await holds.hold(target, until), await holds.hold(target, until, {client})

    without_gone, with_gone = asyncio.run(held())
    assert not without_gone  # a replica the table and its connection call ready: no hold
    assert with_gone
