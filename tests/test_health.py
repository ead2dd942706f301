"""Probes against the real server: readiness waits for every loaded model and says
which it waits for; per-model readiness; probes need no credential; a failed request's
log line in the replica carries its request id."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import InferdServer, create_key, push_folder, run_cli

pytestmark = pytest.mark.slow
MODELS = Path(__file__).parent / "models"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferdServer]:
    data = tmp_path_factory.mktemp("health")
    push_folder(data, "sum", MODELS / "slow_sum", "v1")
    server = InferdServer(data, workers=1, env={"INFERD_AUTH__ENABLED": "true"})
    try:
        server.wait_ready()
        # a model that takes a minute to load, pushed while the server runs
        run_cli(
            "models", "push", "lazy", str(MODELS / "slowload"), "--version", "v1",
            "--framework", "python", data_dir=data, env={"INFERD_TEST_LOAD_S": "0"},
        )  # fmt: skip
        yield server
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def test_readiness_overall_and_per_model(server: InferdServer):
    c = server.client
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the controller picks the new model up
        overall = c.get("/health/ready")
        if overall.status_code == 503:
            break
        time.sleep(0.2)
    assert overall.status_code == 503 and overall.headers["retry-after"] == "1"
    assert overall.json()["waiting_for"] == ["lazy"]
    health = c.get("/health")  # the same, with live and ready spelled out; public too
    assert health.status_code == 503 and health.headers["retry-after"] == "1"
    assert health.json() == {
        "status": "not_ready", "live": True, "ready": False,
        "models": {"sum": "v1", "lazy": None}, "waiting_for": ["lazy"],
    }  # fmt: skip
    assert c.get("/health/live").json() == {"status": "live"}
    # a gateway behind a Service: ready with its routing table, whatever a model waits for
    gateway = c.get("/health/ready", params={"models": "none"})
    assert gateway.status_code == 200 and gateway.json()["status"] == "ready"
    assert c.get("/health/ready", params={"models": "some"}).status_code == 422
    ready = c.get("/health/ready/sum")  # no credential needed, auth is on
    assert ready.status_code == 200 and ready.json() == {
        "status": "ready",
        "model": "sum",
        "version": "v1",
    }
    lazy = c.get("/health/ready/lazy")
    assert lazy.status_code == 503 and lazy.json()["reason"] == "no ready replica yet"
    assert c.get("/health/ready/nope").status_code == 404
    assert c.get("/metrics").status_code == 200  # public too
    assert c.get("/api/v1/models").status_code == 401  # the rest is not


def test_a_replica_logs_a_failed_request_with_its_id(server: InferdServer):
    secret = create_key(server.data_dir, "t")
    reply = server.client.post(
        "/api/v1/models/sum/predict",
        json={"inputs": [{"features": [666, 0, 0, 0]}]},
        headers={"Authorization": f"Bearer {secret}", "X-Request-Id": "req-666-abc"},
    )
    assert reply.status_code == 500 and reply.json()["error"]["code"] == "model_error"
    deadline = time.monotonic() + 5
    while "predict failed" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    line = next(x for x in server.log().splitlines() if "predict failed" in x)
    assert "[replica sum:v1]" in line and "[req req-666-abc]" in line


def test_a_replica_told_to_stop_while_it_loads_leaves_at_once(server: InferdServer):
    """Its load (a minute long) cannot be interrupted: on SIGTERM (what a server shutdown
    sends) the replica process leaves without waiting for it, not after the drain grace
    and a kill."""
    secret = create_key(server.data_dir, "ops", "admin")

    def replica_of_lazy() -> dict:
        version = server.client.get(
            "/api/v1/models/lazy/versions/v1", headers={"Authorization": f"Bearer {secret}"}
        ).json()
        (replica,) = version["replicas"]
        return dict(replica)

    # its pid is 0 until its process runs (a fork server starting, at a framework's
    # second replica, takes a moment)
    server.wait_for(lambda: replica_of_lazy()["pid"], timeout_s=30, what="lazy's process")
    replica = replica_of_lazy()
    assert replica["state"] in ("starting", "loading") and replica["pid"], replica
    os.kill(replica["pid"], signal.SIGTERM)

    def gone() -> bool:
        try:
            os.kill(replica["pid"], 0)
        except ProcessLookupError:
            return True
        return False

    server.wait_for(gone, timeout_s=5, what=f"replica {replica['pid']} to exit")


def test_health_when_ready(demo_server: InferdServer):
    """Last in this file: the first use of the demo server builds its models (a minute
    or more), past the load the test above must catch in progress."""
    reply = demo_server.client.get("/health")
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert (body["status"], body["live"], body["ready"]) == ("ready", True, True)
    assert body["models"]["iris"] == "v1" and "waiting_for" not in body
    assert body["models"] == demo_server.client.get("/health/ready").json()["models"]
