"""Jobs on a server with authentication and rate limits on: a job runs (its runner holds
the server's internal credential, and is not rate limited), each client sees only its
own jobs, a key limited to some models cannot submit for others."""

from __future__ import annotations

import time

import pytest

from tests.conftest import InferdServer, arithmetic_model, create_key, push_source

pytestmark = pytest.mark.slow


def test_jobs_with_auth_and_rate_limits(tmp_path):
    for name in ("calc", "other"):
        push_source(tmp_path, name, arithmetic_model("x * 2"))

    alice, bob = create_key(tmp_path, "alice"), create_key(tmp_path, "bob")
    admin = create_key(tmp_path, "ops", "admin")
    calc_only = create_key(tmp_path, "p", models=["calc"])
    env = {
        "INFERD_AUTH__ENABLED": "true",
        "INFERD_RATE_LIMITS__DEFAULT__REQUESTS_PER_S": "0.01",  # no refill during the test
        "INFERD_RATE_LIMITS__DEFAULT__BURST": "20",
        "INFERD_JOBS__CHUNK_ITEMS": "10",  # 50 requests from the runner: far over the burst
    }
    server = InferdServer(tmp_path, workers=2, env=env)
    try:
        server.wait_ready(timeout_s=120)
        c = server.client

        def as_(k: str) -> dict[str, str]:
            return {"authorization": f"Bearer {k}"}

        assert (
            c.post("/api/v1/batch", json={"model": "calc", "inputs": [{"x": 1}]}).status_code == 401
        )
        job = c.post(
            "/api/v1/batch",
            json={"model": "calc", "inputs": [{"x": float(i)} for i in range(500)]},
            headers=as_(alice),
        )
        assert job.status_code == 202, job.text
        job_id = job.json()["batch_id"]
        deadline = time.monotonic() + 60
        pause = 0.1  # growing: alice's 20 requests of budget must outlast a slow machine
        while (state := c.get(f"/api/v1/batch/{job_id}", headers=as_(alice)).json()).get(
            "status"
        ) != "succeeded":
            assert "status" in state and time.monotonic() < deadline, (state, server.log()[-3000:])
            time.sleep(pause)
            pause = min(pause * 1.5, 3.0)
        assert (state["succeeded"], state["failed"]) == (500, 0)
        # bob does not see alice's job; an admin does
        assert c.get(f"/api/v1/batch/{job_id}", headers=as_(bob)).status_code == 404
        assert c.get(f"/api/v1/batch/{job_id}/results", headers=as_(bob)).status_code == 404
        assert c.delete(f"/api/v1/batch/{job_id}", headers=as_(bob)).status_code == 404
        assert c.get(f"/api/v1/batch/{job_id}", headers=as_(admin)).status_code == 200
        assert [
            j["batch_id"] for j in c.get("/api/v1/batch", headers=as_(alice)).json()["jobs"]
        ] == [job_id]
        assert c.get("/api/v1/batch", headers=as_(bob)).json()["jobs"] == []
        # a key limited to calc cannot submit for another model, inline or async
        refused = c.post("/api/v1/batch", json={"model": "other", "inputs": [{"x": 1}]},
                         headers=as_(calc_only))  # fmt: skip
        assert refused.status_code == 403
        refused = c.post("/api/v1/models/other/predict?async=true", json={"inputs": [{"x": 1}]},
                         headers=as_(calc_only))  # fmt: skip
        assert refused.status_code == 403
        queued = c.post("/api/v1/predict?async=true", json={"model": "calc", "input": {"x": 2}},
                        headers=as_(calc_only)).json()  # fmt: skip
        deadline = time.monotonic() + 30
        while (r := c.get(queued["status_url"], headers=as_(calc_only)).json())[
            "status"
        ] != "succeeded":
            assert time.monotonic() < deadline, r
            time.sleep(0.05)
        assert r["result"]["prediction"] == 4.0
        assert c.get(queued["status_url"], headers=as_(alice)).status_code == 404
        # OpenAI batch files are their owner's; a batch is checked against its model
        line = b'{"custom_id": "a", "url": "/v1/embeddings", "body": {"model": "other"}}\n'
        upload = {"files": {"file": ("in.jsonl", line)}, "data": {"purpose": "batch"}}
        assert c.post("/v1/files", **upload).status_code == 401
        file_id = c.post("/v1/files", **upload, headers=as_(calc_only)).json()["id"]
        assert c.get(f"/v1/files/{file_id}", headers=as_(bob)).status_code == 404
        assert c.get(f"/v1/files/{file_id}/content", headers=as_(bob)).status_code == 404
        assert c.delete(f"/v1/files/{file_id}", headers=as_(bob)).status_code == 404
        assert c.get("/v1/files", headers=as_(bob)).json()["data"] == []
        assert c.get(f"/v1/files/{file_id}", headers=as_(admin)).status_code == 200
        batch = {"input_file_id": file_id, "endpoint": "/v1/embeddings"}
        assert c.post("/v1/batches", json=batch, headers=as_(bob)).status_code == 404
        assert c.post("/v1/batches", json=batch, headers=as_(calc_only)).status_code == 403
    finally:
        assert server.stop() == 0, server.log()[-3000:]
