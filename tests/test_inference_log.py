"""The inference log: rows written off the request path, on SQLite and PostgreSQL
(daily partitions made ahead and dropped by retention), and on the real server one row
per request with the version that answered it — the experiment assignment of a split,
sticky per user — whether a fallback answered, and the status code."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from sqlalchemy import text

from inferd.monitoring.inference_log import (
    InferenceLog,
    LogRow,
    maintain,
    query,
    user_hash,
)
from inferd.registry import Registry
from tests.conftest import InferdServer, push_folder, served

# -- the writer, on both databases ----------------------------------------------------------


def _row(
    rid: str, model: str, version: str | None, api: str, status: int, ms: float, **rest: Any
) -> LogRow:
    return LogRow(
        request_id=rid, model_name=model, version=version, api=api, status_code=status,
        latency_ms=ms, **rest,
    )  # fmt: skip


def test_rows_are_written_in_batches_and_read_back(registry: Registry):
    maintain(registry.write_engine, retention_days=7)  # PostgreSQL: today's partition
    log = InferenceLog(registry.write_engine, flush_interval_s=0.05)
    log.start()
    for i in range(250):
        version = "v2" if i % 5 else "v1"
        log.record(_row(f"r{i}", "fraud", version, "v1", 200, 1.5, user=f"u{i % 10}"))
    log.record(_row("bad", "fraud", None, "v2", 400, 0.3))
    log.record(_row("fb", "fraud", "v1", "grpc", 200, 9.0, fallback_from="v2"))
    deadline = time.monotonic() + 10
    while log.written < 252 and time.monotonic() < deadline:
        time.sleep(0.05)
    log.close()
    assert (log.written, log.dropped) == (252, 0)
    engine = registry.engine
    assert len(query(engine, model="fraud", limit=1000)) == 252
    assert len(query(engine, model="fraud", version="v1", limit=1000)) == 51
    (bad,) = query(engine, status_code=400)
    assert bad["request_id"] == "bad" and bad["version"] is None and bad["api"] == "v2"
    (fb,) = query(engine, request_id="fb")
    assert fb["fallback_from"] == "v2" and fb["latency_ms"] == 9.0
    newest = query(engine, model="fraud", limit=2)
    assert [r["request_id"] for r in newest] == ["fb", "bad"]
    r0 = query(engine, request_id="r0")[0]
    assert r0["user_hash"] == user_hash("u0") and "u0" not in str(r0)  # never the key
    future = datetime.now(UTC) + timedelta(hours=1)
    assert query(engine, since=future) == [] and len(query(engine, until=future, limit=5)) == 5


def test_the_buffer_is_bounded_and_a_full_one_drops_new_rows(registry: Registry):
    log = InferenceLog(registry.write_engine, max_buffer_rows=100)
    for i in range(150):
        log.record(_row(f"r{i}", "m", "v1", "v1", 200, 1.0))
    assert log.dropped == 50
    maintain(registry.write_engine, retention_days=7)
    assert log.flush() == 100


def test_a_database_that_refuses_rows_costs_the_rows_not_the_requests(tmp_path: Path):
    from inferd.registry.engine import create_registry_engine

    engine = create_registry_engine(f"sqlite:///{tmp_path / 'empty.db'}")  # no table
    log = InferenceLog(engine)
    log.record(_row("r", "m", "v1", "v1", 200, 1.0))
    assert log.flush() == 0 and log.dropped == 1
    engine.dispose()


@pytest.mark.postgres
def test_postgres_partitions_by_day_and_retention_drops_old_ones(postgres_url: str, tmp_path):
    with Registry(postgres_url, tmp_path / "artifacts") as registry:
        engine = registry.write_engine
        now = datetime(2026, 11, 22, 15, 0, tzinfo=UTC)
        done = maintain(engine, retention_days=7, ahead_days=2, now=now)
        assert done.created == [
            "inference_logs_20261121",
            "inference_logs_20261122",
            "inference_logs_20261123",
            "inference_logs_20261124",
        ]
        assert maintain(engine, retention_days=7, ahead_days=2, now=now).created == []
        with engine.begin() as conn:
            conn.execute(
                text(
                    'INSERT INTO inference_logs ("timestamp", request_id, model_name, api, '
                    "status_code, latency_ms) VALUES ('2026-11-23 10:00:00+00', 'x', 'm', "
                    "'v1', 200, 1.0)"
                )
            )
            where = conn.execute(text("SELECT tableoid::regclass::text FROM inference_logs"))
            assert where.scalar_one() == "inference_logs_20261123"
        later = maintain(engine, retention_days=1, ahead_days=2, now=now + timedelta(days=2))
        assert later.dropped == ["inference_logs_20261121", "inference_logs_20261122"]
        assert later.created == ["inference_logs_20261125", "inference_logs_20261126"]
        assert [r["request_id"] for r in query(registry.engine)] == ["x"]  # 23rd is kept


def test_sqlite_retention_deletes_old_rows(tmp_path: Path):
    with Registry(f"sqlite:///{tmp_path / 'r.db'}", tmp_path / "artifacts") as registry:
        log = InferenceLog(registry.write_engine)
        log.record(_row("new", "m", "v1", "v1", 200, 1.0))
        log.flush()
        with registry.write_engine.begin() as conn:
            conn.execute(
                text(
                    'INSERT INTO inference_logs ("timestamp", request_id, model_name, api, '
                    "status_code, latency_ms) VALUES ('2020-01-01 00:00:00', 'old', 'm', "
                    "'v1', 200, 1.0)"
                )
            )
        assert maintain(registry.write_engine, retention_days=7).deleted_rows == 1
        assert [r["request_id"] for r in query(registry.engine)] == ["new"]


# -- the real server ----------------------------------------------------------------------

MODEL = """
import numpy as np


class Sum:
    signature = {
        "inputs": [{"name": "features", "datatype": "FP32", "shape": [-1, 4]}],
        "outputs": [{"name": "prediction", "datatype": "FP32", "shape": [-1]}],
    }

    def predict(self, batch):
        x = batch["features"]
        if BROKEN and (x != 0).any():
            raise ValueError("broken")
        return {"prediction": x.sum(axis=1).astype(np.float32)}
"""
BODY = {"inputs": [{"features": [1, 2, 3, 4]}]}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = tmp_path_factory.mktemp("logged")
    for name, broken in (("broken", True), ("ok", False)):
        src = data / name
        src.mkdir()
        (src / "model.py").write_text(MODEL.replace("BROKEN", repr(broken)))
    push_folder(data, "ab", data / "ok", "b", deploy=True)
    push_folder(data, "ab", data / "ok", "a", deploy=True)
    push_folder(data, "fb", data / "broken", "bad", deploy=True)
    push_folder(data, "fb", data / "ok", "good", deploy=True)
    return data


@pytest.fixture(scope="module")
def server(data: Path) -> Iterator[InferdServer]:
    with served(data) as srv:
        yield srv


def _logs(server: InferdServer, **filters: Any) -> list[dict[str, Any]]:
    reply = server.client.get("/api/v1/logs", params={"limit": 1000, **filters})
    assert reply.status_code == 200, reply.text
    return list(reply.json()["logs"])


@pytest.mark.slow
def test_each_request_is_logged_with_the_version_its_user_was_assigned(server, data):
    with Registry(f"sqlite:///{data / 'inferd.db'}", data / "artifacts", migrate=False) as reg:
        reg.deployments.deploy("ab", "a", traffic_pct=100, actor="test")
        reg.deployments.deploy("ab", "b", traffic_pct=50, actor="test")
    # Both ready in every gateway process's table: whichever one a request reaches splits.
    server.wait_all_gateways(
        lambda client: {v["version"] for v in _ready_versions(client, "ab")} == {"a", "b"},
        timeout_s=60,
        what="a and b ready",
    )
    users = [f"user-{i}" for i in range(40)]
    answered: dict[str, set[str]] = defaultdict(set)
    for i in range(120):
        user = users[i % len(users)]
        if i % 3 == 0:  # the V2 protocol names the user in its parameters
            body = {
                "inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 4],
                            "data": [1, 2, 3, 4]}],
                "parameters": {"user": user},
            }  # fmt: skip
            reply = server.client.post("/v2/models/ab/infer", json=body)
            answered[user].add(reply.json()["model_version"])
        else:
            reply = server.client.post(
                "/api/v1/models/ab/predict", json=BODY, headers={"x-user-id": user}
            )
            answered[user].add(reply.json()["version"])
        assert reply.status_code == 200
    assert all(len(v) == 1 for v in answered.values())  # sticky
    server.wait_for(lambda: len(_logs(server, model="ab")) >= 120, timeout_s=10, what="rows")
    rows = _logs(server, model="ab")
    assert len(rows) == 120 and {r["api"] for r in rows} == {"v1", "v2"}
    assert {r["status_code"] for r in rows} == {200}
    by_user: dict[str, set[str]] = defaultdict(set)
    for row in rows:
        by_user[row["user_hash"]].add(row["version"])
    assert by_user == {user_hash(u): answered[u] for u in users}  # the assignment, logged
    assert {v for vs in by_user.values() for v in vs} == {"a", "b"}
    assert all(r["latency_ms"] > 0 and r["request_id"] for r in rows)


@pytest.mark.slow
def test_fallbacks_errors_and_grpc_are_logged(server, data):
    import tritonclient.grpc as grpcclient

    with Registry(f"sqlite:///{data / 'inferd.db'}", data / "artifacts", migrate=False) as reg:
        reg.deployments.deploy("fb", "good", traffic_pct=100, actor="test")
        reg.deployments.deploy("fb", "bad", traffic_pct=40, actor="test")
    server.wait_all_gateways(
        lambda client: {v["version"] for v in _ready_versions(client, "fb")} == {"good", "bad"},
        timeout_s=60,
        what="good and bad ready",
    )
    for _ in range(30):
        reply = server.client.post("/api/v1/models/fb/predict", json=BODY)
        assert reply.status_code == 200 and reply.json()["version"] == "good"
    missing = server.client.post("/api/v1/models/nope/predict", json=BODY)
    assert missing.status_code == 404
    wrong = server.client.post("/api/v1/models/fb/predict", json={"inputs": [{"x": 1}]})
    assert wrong.status_code in (400, 422)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    features = grpcclient.InferInput("features", [1, 4], "FP32")
    features.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
    result = client.infer("fb", [features], request_id="grpc-1", model_version="good")
    assert result.as_numpy("prediction").tolist() == [4.0]
    client.close()
    # each gateway process writes its rows about once a second: wait for all of them
    server.wait_for(
        lambda: (
            _logs(server, request_id="grpc-1")
            and _logs(server, model="nope")
            and len(_logs(server, model="fb")) >= 32
        ),  # 30 predictions, the 422, the gRPC one
        timeout_s=15,
        what="every request's row",
    )
    rows = _logs(server, model="fb")
    fell_back = [r for r in rows if r["fallback_from"] == "bad"]
    assert 3 <= len(fell_back) <= 25 and all(r["version"] == "good" for r in fell_back)
    (grpc_row,) = _logs(server, request_id="grpc-1")
    assert (grpc_row["api"], grpc_row["version"], grpc_row["status_code"]) == ("grpc", "good", 200)
    (nope,) = _logs(server, model="nope")
    assert nope["status_code"] == 404 and nope["version"] is None
    assert _logs(server, model="fb", status=wrong.status_code)
    bad = server.client.get("/api/v1/logs", params={"since": "yesterday"})
    assert bad.status_code == 422 and "ISO 8601" in bad.json()["error"]["message"]
    assert server.client.get("/api/v1/logs", params={"limit": 5000}).status_code == 422


def _ready_versions(client: httpx.Client, model: str) -> list[dict[str, Any]]:
    """The versions of ``model`` with a ready replica in the routing table of the
    gateway process that answers ``client``."""
    view = client.get(f"/api/v1/deployments/{model}").json()
    return [v for v in view["versions"] if v.get("replicas_ready")]


def test_logging_off(tmp_path: Path):
    """With the log off, the endpoint says so and nothing is written."""
    server = InferdServer(tmp_path, env={"INFERD_INFERENCE_LOG__ENABLED": "false"})
    try:
        server.wait_ready()
        reply = server.client.get("/api/v1/logs")
        assert reply.status_code == 422 and "inference log is off" in reply.text
    finally:
        assert server.stop() == 0
