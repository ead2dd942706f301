"""Batch jobs and asynchronous requests against the real server: results in input order,
input files, bad input refused at submit time, cancel, signed and retried callbacks,
async round trips."""

from __future__ import annotations

import gzip
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from inferd.jobs.callbacks import SIGNATURE_HEADER, TIMESTAMP_HEADER, verify
from tests.conftest import (
    InferdServer,
    arithmetic_model,
    build_tiny_gpt2,
    push_folder,
    push_source,
)

pytestmark = pytest.mark.slow
SECRET = "callback-secret-for-tests"
SLOW = arithmetic_model("x * 2").replace(
    "        x = batch", "        import time\n        time.sleep(0.03)\n        x = batch"
)
BOOM = arithmetic_model("x * 2").replace(
    "        x = batch",
    "        if (batch['x'] < 0).any():\n            raise ValueError('negative x')\n"
    "        x = batch",
)


PICKY = arithmetic_model("x * 2").replace(
    "        x = batch",
    "        if len(batch['x']) > 2:\n            raise ValueError('two rows at most')\n"
    "        x = batch",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferdServer]:
    data = tmp_path_factory.mktemp("jobs")
    push_source(data, "calc", arithmetic_model("x * 2"))
    push_source(data, "slow", SLOW, "--batching", '{"max_batch_size": 8}')
    push_source(data, "boom", BOOM)
    push_source(data, "fresh", arithmetic_model("x * 3"))
    push_source(data, "picky", PICKY)
    folder = build_tiny_gpt2(data / "src" / "tiny")
    push_folder(data, "tiny", folder, "v1")
    env = {
        "INFERD_JOBS__MAX_ITEMS": "20000",
        "INFERD_JOBS__CALLBACK_SECRET": SECRET,
        "INFERD_JOBS__CALLBACK_FIRST_DELAY_S": "0.2",
        "INFERD_JOBS__CHUNK_ITEMS": "100",
    }
    server = InferdServer(data, workers=2, env=env)
    try:
        server.wait_ready(timeout_s=120)
        yield server
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def wait_job(server: InferdServer, job_id: str, timeout_s: float = 60) -> dict[str, Any]:
    return server.wait_job(job_id, timeout_s)


def _queued_chunks(server: InferdServer, topic: str) -> float | None:
    """Chunks of ``topic`` on the job queue not acknowledged yet (``/metrics``)."""
    sample = f'inferd_job_queue_messages{{topic="{topic}"}} '
    for line in server.client.get("/metrics").text.splitlines():
        if line.startswith(sample):
            return float(line.split()[-1])
    return None


def _callback(server: InferdServer, job_id: str) -> dict[str, Any]:
    """The job's callback delivery: its state and attempts."""
    return dict(server.client.get(f"/api/v1/batch/{job_id}").json()["callback"])


def results(server: InferdServer, job_id: str) -> list[dict[str, Any]]:
    reply = server.client.get(f"/api/v1/batch/{job_id}/results")
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in reply.text.splitlines()]


def test_a_batch_of_thousands_comes_back_in_input_order(server: InferdServer):
    n = 5000
    reply = server.client.post(
        "/api/v1/batch", json={"model": "calc", "inputs": [{"x": float(i)} for i in range(n)]}
    )
    assert reply.status_code == 202, reply.text
    body = reply.json()
    assert body["status"] == "queued" and body["total"] == n
    assert reply.headers["location"] == f"/api/v1/batch/{body['batch_id']}"
    job = wait_job(server, body["batch_id"])
    assert (job["status"], job["succeeded"], job["failed"], job["progress"]) == (
        "succeeded",
        n,
        0,
        1.0,
    )
    assert job["items_per_s"] > 0 and job["started_at"] and job["finished_at"]
    lines = results(server, body["batch_id"])
    assert [line["index"] for line in lines] == list(range(n))
    assert all(line["output"] == {"y": 2.0 * line["index"]} for line in lines)
    metrics = server.client.get("/metrics").text
    assert 'inferd_jobs{kind="batch",status="succeeded"}' in metrics
    assert 'inferd_job_queue_messages{topic="batch"}' in metrics
    ok = [
        line
        for line in metrics.splitlines()
        if line.startswith('inferd_job_items_total{result="succeeded"}')
    ]
    assert ok and float(ok[0].split()[-1]) >= n
    # the next job of this model gets an estimate from this one's rate
    again = server.client.post("/api/v1/batch", json={"model": "calc", "inputs": [{"x": 1.0}]})
    assert again.json()["estimated_time"] is not None
    wait_job(server, again.json()["batch_id"])


def test_input_files_and_their_bad_lines(server: InferdServer):
    inputs = server.data_dir / "inputs"
    inputs.mkdir(exist_ok=True)
    lines = [json.dumps({"x": float(i)}) for i in range(10)]
    lines[3] = "{not json"
    lines[6] = json.dumps({"z": 1.0})  # not this model's input
    (inputs / "in.jsonl").write_text("\n".join(lines) + "\n\n")
    job = server.client.post("/api/v1/batch", json={"model": "calc", "input_uri": "in.jsonl"})
    assert job.status_code == 202, job.text
    done = wait_job(server, job.json()["batch_id"])
    assert (done["status"], done["succeeded"], done["failed"]) == ("succeeded", 8, 2)
    out = results(server, done["batch_id"])
    assert [line["index"] for line in out] == list(range(10))
    assert out[3]["status"] == 422 and "not JSON" in out[3]["error"]["message"]
    assert out[6]["status"] == 422 and out[6]["error"]["code"] == "invalid_input"
    assert out[9]["output"] == {"y": 18.0}
    # CSV (a header naming the input), gzipped, by absolute path
    with gzip.open(inputs / "in.csv.gz", "wt") as f:
        f.write("x\n1.5\n2.5\n")
    uri = f"file://{inputs / 'in.csv.gz'}"
    job = server.client.post("/api/v1/batch", json={"model": "calc", "input_uri": uri})
    done = wait_job(server, job.json()["batch_id"])
    assert [r["output"] for r in results(server, done["batch_id"])] == [{"y": 3.0}, {"y": 5.0}]


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"model": "nope", "inputs": [{"x": 1}]}, 404, "nope"),
        ({"model": "calc", "version": "v9", "inputs": [{"x": 1}]}, 404, "v9"),
        ({"model": "calc", "input_uri": "missing.jsonl"}, 422, "no such file"),
        ({"model": "calc", "input_uri": "/etc/passwd.jsonl"}, 403, "outside"),
        ({"model": "calc", "input_uri": "data.parquet"}, 422, ".jsonl"),
        ({"model": "calc", "inputs": [{"x": 1}], "callback_url": "ftp://x/y"}, 422, "http"),
        ({"model": "calc", "inputs": [{"x": 1}], "input_uri": "a.jsonl"}, 422, "either"),
        ({"model": "calc", "inputs": []}, 422, "non-empty"),
        ({"model": "calc", "inputs": [{"x": 1}], "priority": "urgent"}, 422, "priority"),
        ({"model": "calc", "inputs": [{"x": 1}] * 20001}, 413, "20000"),
        ({"inputs": [{"x": 1}]}, 422, "model"),
    ],
)
def test_bad_submissions_are_refused_at_once(server: InferdServer, body, status, says):
    reply = server.client.post("/api/v1/batch", json=body)
    assert reply.status_code == status, reply.text
    assert says in reply.json()["error"]["message"]


def test_unknown_ids_and_non_json(server: InferdServer):
    assert server.client.get("/api/v1/batch/b-nope").status_code == 404
    assert server.client.get("/api/v1/batch/b-nope/results").status_code == 404
    assert server.client.get("/api/v1/requests/r-nope").status_code == 404
    reply = server.client.post("/api/v1/batch", content=b"{oops")
    assert reply.status_code == 400 and "invalid JSON" in reply.json()["error"]["message"]


def test_model_errors_fail_only_their_items(server: InferdServer):
    inputs = [{"x": float(i if i % 50 else -1)} for i in range(300)]
    job = server.client.post("/api/v1/batch", json={"model": "boom", "inputs": inputs}).json()
    done = wait_job(server, job["batch_id"])
    assert (done["status"], done["succeeded"], done["failed"]) == ("succeeded", 294, 6)
    bad = [line for line in results(server, job["batch_id"]) if "error" in line]
    assert [line["index"] for line in bad] == [0, 50, 100, 150, 200, 250]
    assert all(line["status"] == 500 and "negative x" in line["error"]["message"] for line in bad)


def test_cancel_stops_a_job(server: InferdServer):
    n = 3000  # 375 batches of 8 at 30 ms: ~11 s
    job = server.client.post(
        "/api/v1/batch", json={"model": "slow", "inputs": [{"x": float(i)} for i in range(n)]}
    ).json()
    deadline = time.monotonic() + 30
    while server.client.get(f"/api/v1/batch/{job['batch_id']}").json()["succeeded"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    cancelled = server.client.delete(f"/api/v1/batch/{job['batch_id']}")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    # The chunks in flight stop and the others are dropped: each one is acknowledged,
    # none is left on the queue (earlier tests' jobs all ended).
    server.wait_for(
        lambda: _queued_chunks(server, "batch") == 0, timeout_s=30, what="an empty batch queue"
    )
    settled = len(results(server, job["batch_id"]))
    # Nothing to wait for: this checks that nothing more happens. No result may land
    # for 1 s, longer than a chunk of this model takes (13 batches of 30 ms).
    time.sleep(1.0)
    assert len(results(server, job["batch_id"])) == settled < n
    assert server.client.get(f"/api/v1/batch/{job['batch_id']}").json()["status"] == "cancelled"
    again = server.client.delete(f"/api/v1/batch/{job['batch_id']}")
    assert again.status_code == 409


class Receiver:
    """A callback endpoint: answers 500 to the first ``fail_first`` calls, then 200."""

    def __init__(self, fail_first: int) -> None:
        self.calls: list[tuple[dict[str, str], bytes, int]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                status = 500 if len(receiver.calls) < fail_first else 200
                receiver.calls.append(
                    ({k.lower(): v for k, v in self.headers.items()}, body, status)
                )
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_callback_is_signed_and_retried_until_delivered(server: InferdServer):
    receiver = Receiver(fail_first=1)
    try:
        job = server.client.post(
            "/api/v1/batch",
            json={
                "model": "calc",
                "inputs": [{"x": 1.0}, {"x": 2.0}],
                "callback_url": receiver.url,
            },
        ).json()
        deadline = time.monotonic() + 30
        while len(receiver.calls) < 2:
            assert time.monotonic() < deadline, receiver.calls
            time.sleep(0.05)
        for headers, body, _ in receiver.calls:
            assert verify(SECRET, headers[TIMESTAMP_HEADER], body, headers[SIGNATURE_HEADER])
            assert not verify("another secret", headers[TIMESTAMP_HEADER], body,
                              headers[SIGNATURE_HEADER])  # fmt: skip
        summary = json.loads(receiver.calls[1][1])
        assert summary["batch_id"] == job["batch_id"] and summary["status"] == "succeeded"
        assert summary["succeeded"] == 2
        deadline = time.monotonic() + 10
        while (status := server.client.get(f"/api/v1/batch/{job['batch_id']}").json())["callback"][
            "state"
        ] != "delivered":
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
        assert [a["status"] for a in status["callback"]["attempts"]] == [500, 200]
    finally:
        receiver.close()


def test_a_batch_of_prompts_on_a_generative_model(server: InferdServer):
    prompts = [{"prompt": "The server", "max_tokens": 4, "temperature": 0} for _ in range(3)]
    prompts.append({"prompt": "x", "max_tokens": -1})
    job = server.client.post("/api/v1/batch", json={"model": "tiny", "inputs": prompts}).json()
    done = wait_job(server, job["batch_id"])
    assert (done["succeeded"], done["failed"]) == (3, 1)
    out = results(server, job["batch_id"])
    assert len({line["output"]["text"] for line in out[:3]}) == 1  # greedy: the same text
    assert out[0]["output"]["usage"]["completion_tokens"] <= 4
    assert out[3]["status"] == 422


def _poll(server: InferdServer, url: str) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while (state := server.client.get(url).json())["status"] not in ("succeeded", "failed"):
        assert time.monotonic() < deadline, state
        time.sleep(0.05)
    return state


def test_async_requests_round_trip(server: InferdServer):
    body = {"inputs": [{"x": 4.0}, {"x": 5.0}]}
    sync = server.client.post("/api/v1/models/calc/predict", json=body).json()
    reply = server.client.post(
        "/api/v1/models/calc/predict?async=true", json=body, headers={"x-request-id": "later-1"}
    )
    assert reply.status_code == 202, reply.text
    queued = reply.json()
    assert queued["status"] == "queued" and queued["request_id"] == "later-1"
    assert reply.headers["location"] == queued["status_url"]
    state = _poll(server, queued["status_url"])
    assert state["status_code"] == 200 and state["request_id"] == "later-1"
    assert state["result"]["outputs"] == sync["outputs"]
    assert state["result"]["request_id"] == "later-1"  # the same id, end to end
    # Prefer: respond-async, the model in the body; a generation too
    reply = server.client.post(
        "/api/v1/predict",
        json={"model": "calc", "input": {"x": 1.0}},
        headers={"prefer": "respond-async"},
    )
    assert reply.status_code == 202 and reply.headers["preference-applied"] == "respond-async"
    assert _poll(server, reply.json()["status_url"])["result"]["prediction"] == 2.0
    reply = server.client.post(
        "/api/v1/models/tiny/generate?async=1", json={"prompt": "The", "max_tokens": 3}
    )
    assert _poll(server, reply.json()["status_url"])["result"]["usage"]["completion_tokens"] <= 3
    # an error answer is the request's result, as it would have been online
    reply = server.client.post(
        "/api/v1/models/boom/predict?async=true", json={"inputs": [{"x": -1}]}
    )
    state = _poll(server, reply.json()["status_url"])
    assert state["status_code"] == 500 and state["result"]["error"]["code"] == "model_error"


def test_async_requests_are_checked_before_they_are_queued(server: InferdServer):
    unknown = server.client.post("/api/v1/models/nope/predict?async=true", json={"inputs": []})
    assert unknown.status_code == 404
    stream = server.client.post(
        "/api/v1/models/tiny/generate?async=true", json={"prompt": "x", "stream": True}
    )
    assert stream.status_code == 422 and "stream" in stream.json()["error"]["message"]
    not_json = server.client.post("/api/v1/models/calc/predict?async=true", content=b"[")
    assert not_json.status_code == 400
    # not asked: answered online as always
    online = server.client.post(
        "/api/v1/models/calc/predict?async=false", json={"inputs": [{"x": 1}]}
    )
    assert online.status_code == 200


def test_a_cancelled_job_calls_back_too(server: InferdServer):
    receiver = Receiver(fail_first=0)
    try:
        job = server.client.post(
            "/api/v1/batch",
            json={"model": "slow", "inputs": [{"x": float(i)} for i in range(2000)],
                  "callback_url": receiver.url},
        ).json()  # fmt: skip
        assert server.client.delete(f"/api/v1/batch/{job['batch_id']}").status_code == 200
        deadline = time.monotonic() + 15
        while not receiver.calls:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        headers, body, _ = receiver.calls[0]
        summary = json.loads(body)
        assert (summary["batch_id"], summary["status"]) == (job["batch_id"], "cancelled")
        assert summary["error"] == "cancelled by the client"
        assert verify(SECRET, headers[TIMESTAMP_HEADER], body, headers[SIGNATURE_HEADER])
        server.wait_for(
            lambda: _callback(server, job["batch_id"])["state"] == "delivered",
            timeout_s=10,
            what="the delivery recorded",
        )
        # Nothing to wait for: this checks that nothing more happens. The server looks
        # for undelivered callbacks of ended jobs every 2 s (not a setting): 2.5 s lets
        # one more of those passes go by, and it must not send this one again.
        time.sleep(2.5)
        assert len(receiver.calls) == 1  # delivered once
    finally:
        receiver.close()


def test_async_v2_and_openai_requests(server: InferdServer):
    v2 = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1.0, 2.0]}]}
    sync = server.client.post("/v2/models/calc/versions/v1/infer", json=v2).json()
    reply = server.client.post("/v2/models/calc/versions/v1/infer?async=true", json=v2)
    assert reply.status_code == 202, reply.text
    state = _poll(server, reply.json()["status_url"])
    assert state["status_code"] == 200
    assert state["result"]["outputs"] == sync["outputs"]
    assert (
        server.client.post("/v2/models/calc/versions/v9/infer?async=true", json=v2).status_code
        == 404
    )
    binary = server.client.post(
        "/v2/models/calc/infer?async=true", content=b"{}",
        headers={"inference-header-content-length": "2"},
    )  # fmt: skip
    assert binary.status_code == 400 and "binary" in binary.json()["error"]  # V2's shape
    reply = server.client.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": "The server", "max_tokens": 3},
        headers={"prefer": "respond-async"},
    )
    assert reply.status_code == 202, reply.text
    state = _poll(server, reply.json()["status_url"])
    assert state["result"]["object"] == "text_completion"
    assert state["result"]["usage"]["completion_tokens"] <= 3
    chat = server.client.post(
        "/v1/chat/completions?async=true",
        json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert chat.status_code == 404


def test_every_job_has_an_estimate_that_says_how_it_was_made(server: InferdServer):
    def submit(model: str, n: int) -> dict[str, Any]:
        inputs = [{"x": float(i)} for i in range(n)]
        reply = server.client.post("/api/v1/batch", json={"model": model, "inputs": inputs})
        assert reply.status_code == 202, reply.text
        return reply.json()

    first = submit("fresh", 10)  # nothing measured yet: a probe
    assert first["estimated_time"] and first["estimate"]["method"] == "probe", first
    assert "a probe of 10 rows took" in first["estimate"]["basis"]
    assert first["estimate"]["seconds"] > 0 and first["estimate"]["items_per_s"] > 0
    wait_job(server, first["batch_id"])
    second = submit("fresh", 600)  # the replica counted what it computed
    assert second["estimate"]["method"] == "replicas", second
    assert "ms of compute per row over" in second["estimate"]["basis"]
    status = server.client.get(f"/api/v1/batch/{second['batch_id']}").json()
    assert status["estimated_time"] and status["estimate"]["method"] in ("replicas", "progress")
    done = wait_job(server, second["batch_id"])
    assert done["estimated_time"] == "0s"
    third = submit("fresh", 10)  # a finished job of 500+ inputs: its rate
    assert third["estimate"]["method"] == "history", third
    assert "last batch job ran at" in third["estimate"]["basis"]
    wait_job(server, third["batch_id"])
    picky = submit("picky", 5)  # the probe of 5 rows fails: a stated default
    assert picky["estimate"]["method"] == "default", picky
    assert "two rows at most" in picky["estimate"]["basis"] and picky["estimated_time"]
    assert wait_job(server, picky["batch_id"])["succeeded"] == 5
    prompts = [{"prompt": "The server", "max_tokens": 4}] * 3
    reply = server.client.post("/api/v1/batch", json={"model": "tiny", "inputs": prompts})
    estimate = reply.json()["estimate"]
    assert estimate["method"] in ("probe", "replicas") and estimate["seconds"] > 0, estimate
    wait_job(server, reply.json()["batch_id"])


# -- OpenAI's Batch API ----------------------------------------------------------------------


def _line(custom_id: str, body: dict[str, Any], url: str = "/v1/completions") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def _jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "\n".join(json.dumps(line) for line in lines).encode() + b"\n"


def _openai(server: InferdServer):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def _wait_batch(client: Any, batch_id: str, timeout_s: float = 90) -> Any:
    deadline = time.monotonic() + timeout_s
    while (batch := client.batches.retrieve(batch_id)).status in ("validating", "in_progress"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)
    return batch


def test_openai_batch_api_with_the_official_client(server: InferdServer):
    import openai

    client = _openai(server)
    prompts = [f"The server number {i}" for i in range(12)]
    lines = [
        _line(f"req-{i}", {"model": "tiny", "prompt": p, "max_tokens": 4, "temperature": 0})
        for i, p in enumerate(prompts)
    ]
    lines.insert(5, _line("bad", {"model": "tiny", "prompt": "x", "max_tokens": -1}))
    data = _jsonl(lines)
    uploaded = client.files.create(file=("prompts.jsonl", data), purpose="batch")
    assert uploaded.bytes == len(data) and uploaded.purpose == "batch"
    assert uploaded.filename == "prompts.jsonl"
    assert uploaded.expires_at == uploaded.created_at + 30 * 86400  # OpenAI's default, batch
    kept = client.files.create(
        file=("kept.jsonl", data), purpose="batch",
        expires_after={"anchor": "created_at", "seconds": 7200},
    )  # fmt: skip
    assert kept.expires_at == kept.created_at + 7200
    assert client.files.retrieve(kept.id).expires_at == kept.expires_at
    with pytest.raises(openai.BadRequestError, match="expires_after"):
        client.files.create(
            file=("k.jsonl", data), purpose="batch",
            expires_after={"anchor": "created_at", "seconds": 60},
        )  # fmt: skip
    assert client.files.delete(kept.id).deleted
    assert client.files.retrieve(uploaded.id).id == uploaded.id
    assert client.files.content(uploaded.id).content == data
    assert uploaded.id in [f.id for f in client.files.list(purpose="batch")]

    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h",
        metadata={"run": "test"},
    )  # fmt: skip
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"run": "test"}
    done = _wait_batch(client, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed) == (13, 12)
    assert done.request_counts.failed == 1 and done.completed_at and done.in_progress_at
    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in out] == [f"req-{i}" for i in range(12)]  # input order
    assert all(o["response"]["status_code"] == 200 and o["error"] is None for o in out)
    assert {o["response"]["body"]["object"] for o in out} == {"text_completion"}
    online = client.completions.create(**lines[3]["body"])  # greedy: the same text online
    assert out[3]["response"]["body"]["choices"][0]["text"] == online.choices[0].text
    (error,) = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 400
    assert "max_tokens" in error["error"]["message"]
    output_file = client.files.retrieve(done.output_file_id)
    assert output_file.purpose == "batch_output"
    assert output_file.bytes == len(client.files.content(done.output_file_id).content)
    assert batch.id in [b.id for b in client.batches.list(limit=100)]
    with pytest.raises(openai.ConflictError, match="already completed"):
        client.batches.cancel(batch.id)
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)
    assert client.batches.retrieve(batch.id).status == "completed"  # its output stays


def test_an_openai_batch_is_cancelled_with_the_lines_not_yet_run(server: InferdServer):
    client = _openai(server)
    body = {"model": "tiny", "prompt": "The server", "max_tokens": 32, "ignore_eos": True}
    data = _jsonl([_line(f"r{i}", body) for i in range(1000)])
    uploaded = client.files.create(file=("many.jsonl", data), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
    )
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at
    time.sleep(1.0)
    later = client.batches.retrieve(batch.id)
    assert later.request_counts.completed + later.request_counts.failed < 1000
    time.sleep(1.0)
    assert client.batches.retrieve(batch.id).request_counts == later.request_counts


@pytest.mark.parametrize(
    ("lines", "endpoint", "status", "says"),
    [
        ([_line("a", {"model": "tiny", "prompt": "x"}), _line("a", {"model": "tiny"})],
         "/v1/completions", 400, "line 2 repeats custom_id 'a'"),
        ([_line("a", {"model": "tiny", "prompt": "x"}, url="/v1/embeddings")],
         "/v1/completions", 400, "line 1 has url '/v1/embeddings', not the batch's endpoint"),
        ([_line("a", {"model": "tiny", "prompt": "x", "stream": True})],
         "/v1/completions", 400, "asks for a stream"),
        ([_line("a", {"model": "tiny", "prompt": "x"}), _line("b", {"model": "calc"})],
         "/v1/completions", 400, "one model per batch"),
        ([{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}],
         "/v1/completions", 400, "naming its 'model'"),
        ([_line("a", {"model": "nope", "prompt": "x"})], "/v1/completions", 404, "nope"),
        ([_line("a", {"model": "tiny", "prompt": "x"})], "/v1/responses", 400, "'endpoint'"),
    ],
)  # fmt: skip
def test_bad_openai_batches_are_refused_naming_their_lines(
    server: InferdServer, lines: list[dict[str, Any]], endpoint: str, status: int, says: str
):
    files = {"file": ("in.jsonl", _jsonl(lines))}
    uploaded = server.client.post("/v1/files", files=files, data={"purpose": "batch"})
    assert uploaded.status_code == 200, uploaded.text
    reply = server.client.post(
        "/v1/batches", json={"input_file_id": uploaded.json()["id"], "endpoint": endpoint}
    )
    assert reply.status_code == status, reply.text
    assert says in reply.json()["error"]["message"]


def test_bad_openai_files_and_batch_requests(server: InferdServer):
    c = server.client
    data = _jsonl([_line("a", {"model": "tiny", "prompt": "x"})])
    wrong = c.post("/v1/files", files={"file": ("a.jsonl", data)}, data={"purpose": "fine-tune"})
    assert wrong.status_code == 400 and "'purpose' must be 'batch'" in wrong.text
    assert c.post("/v1/files", data={"purpose": "batch"}).status_code == 400
    assert "multipart" in c.post("/v1/files", json={"purpose": "batch"}).text
    empty = c.post("/v1/files", files={"file": ("e.jsonl", b"\n")}, data={"purpose": "batch"})
    assert empty.status_code == 400 and "empty" in empty.text
    file_id = c.post(
        "/v1/files", files={"file": ("a.jsonl", data)}, data={"purpose": "batch"}
    ).json()["id"]
    for body, says in (
        ({"input_file_id": "file-nope", "endpoint": "/v1/completions"}, "No such File"),
        ({"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "1h"},
         "'completion_window'"),
        ({"input_file_id": file_id, "endpoint": "/v1/completions", "metadata": {"k": 5}},
         "'metadata'"),
        ({"input_file_id": file_id, "endpoint": "/v1/completions", "tools": []},
         "Unrecognized request argument supplied: tools"),
    ):  # fmt: skip
        reply = c.post("/v1/batches", json=body)
        assert reply.status_code in (400, 404) and says in reply.text, reply.text
    assert c.get("/v1/batches/b-nope").status_code == 404
    assert c.get("/v1/files/file-b-nope-output").status_code == 404
    assert c.post("/v1/batches/b-nope/cancel").status_code == 404
    bad = c.post(
        "/api/v1/models/calc/predict", json={"inputs": [{"x": 1.0}]},
        headers={"x-inferd-priority": "soonest"},
    )  # fmt: skip
    assert bad.status_code == 422 and "X-Inferd-Priority" in bad.text
