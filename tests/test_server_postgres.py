"""End-to-end on PostgreSQL: the same server with its registry in the machine's PostgreSQL,
and the load timeout that is separate from request timeouts."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import text

from inferd.registry import Registry
from inferd.shapes.tensors import Signature
from tests.conftest import InferdServer, run_cli

MODELS = Path(__file__).parent / "models"
pytestmark = [pytest.mark.slow, pytest.mark.postgres]


def test_server_with_postgres_registry_and_load_timeout(tmp_path: Path, postgres_url: str):
    env = {"INFERD_DATABASE_URL": postgres_url}
    run_cli(
        "models",
        "push",
        "summer",
        str(MODELS / "slow_sum"),
        "--version",
        "v1",
        data_dir=tmp_path,
        env=env,
    )
    registry = Registry(postgres_url, tmp_path / "artifacts")
    sig = Signature.from_dict(
        {
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
            "outputs": [{"name": "prediction", "datatype": "FP32", "shape": [-1]}],
        }
    )
    registry.push("slowload", MODELS / "slowload", "v1", framework="python", signature=sig)
    registry.close()

    server = InferdServer(tmp_path, env={**env, "INFERD_LOAD_TIMEOUT_S": "2"})
    try:
        server.wait_ready(path="/health/live")
        server.wait_for(
            lambda: (
                server.client.post(
                    "/api/v1/models/summer/predict", json={"inputs": [[1, 2, 3, 4]]}
                ).status_code
                == 200
            ),
            what="summer serving from the PostgreSQL registry",
        )
        reply = server.client.post("/api/v1/models/summer/predict", json={"inputs": [[1, 2, 3, 4]]})
        assert reply.json()["outputs"] == [{"prediction": 10.0}]
        # Its inference log row lands in today's partition of the PostgreSQL table.
        rid = reply.headers["x-request-id"]
        server.wait_for(
            lambda: server.client.get("/api/v1/logs", params={"request_id": rid}).json()["logs"],
            timeout_s=10,
            what="the request's inference log row",
        )
        partition = "SELECT tableoid::regclass::text FROM inference_logs WHERE request_id = :r"
        with (
            Registry(postgres_url, tmp_path / "artifacts", migrate=False) as reg,
            reg.engine.connect() as conn,
        ):
            where = conn.execute(text(partition), {"r": rid}).scalar_one()
        assert where == f"inference_logs_{datetime.now(UTC):%Y%m%d}"
        models = {m["name"] for m in server.client.get("/api/v1/models").json()["models"]}
        assert models == {"summer", "slowload"}
        server.wait_for(
            lambda: "not ready after 2s" in server.log(),
            timeout_s=30,
            what="the slow loader killed at its load timeout",
        )
        slow = server.client.post("/api/v1/models/slowload/predict", json={"inputs": [1.0]})
        assert slow.status_code == 503
        assert slow.json()["error"]["code"] == "model_not_ready"
    finally:
        assert server.stop() == 0, server.log()[-3000:]
