"""``inferd jobs`` against the real server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import InferdServer, arithmetic_model, push_source, run_cli

pytestmark = pytest.mark.slow


def test_submit_wait_status_results_cancel(tmp_path: Path):
    push_source(tmp_path, "calc", arithmetic_model("x + 1"))
    server = InferdServer(tmp_path, workers=1)
    try:
        server.wait_ready(timeout_s=120)
        url = ["--url", server.url]
        infile = tmp_path / "in.jsonl"
        infile.write_text("".join(json.dumps({"x": float(i)}) + "\n" for i in range(50)))
        done = run_cli("jobs", "submit", "calc", "--file", str(infile), "--wait", *url,
                       data_dir=tmp_path)  # fmt: skip
        job = json.loads(done.stdout)
        assert (job["status"], job["succeeded"]) == ("succeeded", 50)
        assert "succeeded: 50/50" in done.stderr
        status = json.loads(
            run_cli("jobs", "status", job["batch_id"], *url, data_dir=tmp_path).stdout
        )
        assert status["batch_id"] == job["batch_id"]
        out = tmp_path / "out.jsonl"
        run_cli("jobs", "results", job["batch_id"], "-o", str(out), *url, data_dir=tmp_path)
        lines = [json.loads(x) for x in out.read_text().splitlines()]
        assert [x["output"]["y"] for x in lines] == [float(i + 1) for i in range(50)]
        queued = run_cli(
            "jobs", "submit", "calc", "--inputs", '[{"x": 1}]', *url, data_dir=tmp_path
        )
        cancel = run_cli("jobs", "cancel", json.loads(queued.stdout)["batch_id"], *url,
                         data_dir=tmp_path, check=False)  # fmt: skip
        assert cancel.returncode in (0, 1)  # cancelled, or already done (409)
        bad = run_cli("jobs", "submit", "nope", "--inputs", "[1]", *url, data_dir=tmp_path,
                      check=False)  # fmt: skip
        assert bad.returncode == 1 and "404" in bad.stderr and "nope" in bad.stderr
    finally:
        assert server.stop() == 0, server.log()[-3000:]
