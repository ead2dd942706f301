"""Latency at low load, on the real server: a request that finds its replica idle is not
held for companions (adaptive batching), every predict reply says where its time went
(``Server-Timing``, and the same fields in the inference log), and a version that was
just deployed, or a model just registered, is waited for, never answered 404."""

from __future__ import annotations

import itertools
import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import InferdServer, push_source, served

MODEL = """
import numpy as np


class Double:
    signature = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    }

    def predict(self, batch):
        return {"y": (batch["x"] * 2).astype(np.float32)}
"""
SLOW_LOAD = MODEL.replace(
    "class Double:",
    "import time\n\n\nclass Double:\n    def __init__(self):\n        time.sleep(3)\n",
)
WAIT = {"max_wait_ms": 200}
BODY = {"inputs": [{"x": 1.5}]}
_NEW = itertools.count(100)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = tmp_path_factory.mktemp("latency")
    push_source(data, "eager", MODEL, "--batching", '{"max_wait_ms": 200}', "--deploy")
    window = '{"max_wait_ms": 200, "adaptive": false}'
    push_source(data, "window", MODEL, "--batching", window, "--deploy")
    push_source(data, "cached", MODEL, "--meta", "cache_ttl_s=60", "--deploy")
    push_source(data, "rolling", MODEL, "--deploy")
    push_source(data, "rolling", SLOW_LOAD, version="v2")  # registered, not deployed
    push_source(data, "rolling", SLOW_LOAD, version="v3")
    return data


@pytest.fixture(scope="module")
def server(data: Path) -> Iterator[InferdServer]:
    with served(data, env={"INFERD_CACHE__ENABLED": "true"}) as srv:
        yield srv


def _predict(client: httpx.Client, model: str, x: float | None = None) -> httpx.Response:
    """A predict of one row; a new ``x`` each time unless given (the result cache is on)."""
    body = {"inputs": [{"x": next(_NEW) if x is None else x}]}
    reply = client.post(f"/api/v1/models/{model}/predict", json=body)
    assert reply.status_code == 200, reply.text
    return reply


def _timing(header: str) -> dict[str, float]:
    """``Server-Timing`` as {name: dur}."""
    out = {}
    for entry in header.split(","):
        name, *fields = (f.strip() for f in entry.split(";"))
        out[name] = next(float(f[4:]) for f in fields if f.startswith("dur="))
    return out


def test_an_idle_replica_answers_without_waiting_out_max_wait(server: InferdServer):
    client = server.client
    _predict(client, "eager")  # warm: connections made
    eager = []
    for _ in range(5):
        started = time.perf_counter()
        _predict(client, "eager")
        eager.append(time.perf_counter() - started)
        time.sleep(0.05)  # the replica is idle again
    assert min(eager) < 0.1, eager  # max_wait_ms is 200: nobody waited it out
    assert sorted(eager)[2] < 0.1, eager
    started = time.perf_counter()
    windowed = _predict(client, "window")  # the same model with window batching
    assert time.perf_counter() - started >= 0.19
    assert _timing(windowed.headers["server-timing"])["queue"] >= 190


def test_server_timing_adds_up_to_latency_ms_on_v1_and_v2(server: InferdServer):
    client = server.client
    reply = _predict(client, "eager")
    timing = _timing(reply.headers["server-timing"])
    assert list(timing) == ["gateway", "cache", "queue", "batch", "compute", "total"]
    assert "desc=miss" in reply.headers["server-timing"]  # the result cache is on here
    assert timing["total"] == pytest.approx(reply.json()["latency_ms"], abs=0.01)
    parts = sum(v for k, v in timing.items() if k != "total")
    assert parts == pytest.approx(timing["total"], abs=0.01)
    assert all(v >= 0 for v in timing.values()) and timing["compute"] > 0
    assert 'desc="rows=1"' in reply.headers["server-timing"]  # its batch: this one row

    v2 = client.post(
        "/v2/models/eager/infer",
        json={"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1, 2]}]},
    )
    assert v2.status_code == 200, v2.text
    timing = _timing(v2.headers["server-timing"])
    assert set(timing) == {"gateway", "cache", "queue", "batch", "compute", "total"}
    parts = sum(v for k, v in timing.items() if k != "total")
    assert parts == pytest.approx(timing["total"], abs=0.01)

    first = _predict(client, "cached", 1.5)  # a miss, computed; then a hit, no replica
    assert _timing(first.headers["server-timing"]).keys() >= {"cache", "queue", "compute"}
    hit = None
    for _ in range(20):  # the shared store is written a few ms after the reply
        hit = _predict(client, "cached", 1.5)
        if hit.headers["x-cache"] == "hit":
            break
    assert hit is not None and hit.headers["x-cache"] == "hit"
    assert list(_timing(hit.headers["server-timing"])) == ["gateway", "cache", "total"]
    assert "desc=hit" in hit.headers["server-timing"]


def test_the_inference_log_keeps_the_same_timings(server: InferdServer):
    reply = _predict(server.client, "eager")
    rid = reply.json()["request_id"]
    rows: list[dict] = []

    def logged() -> bool:
        rows[:] = server.client.get("/api/v1/logs", params={"request_id": rid}).json()["logs"]
        return bool(rows)

    server.wait_for(logged, timeout_s=20, what="the request's log row")
    row = rows[0]
    timing = _timing(reply.headers["server-timing"])
    for name in ("queue", "batch", "compute"):
        assert row[f"{name}_ms"] == pytest.approx(timing[name], abs=0.01)
    assert row["cache_ms"] == pytest.approx(timing["cache"], abs=0.01)
    total = sum(row[f"{name}_ms"] for name in ("gateway", "cache", "queue", "batch", "compute"))
    assert total == pytest.approx(row["latency_ms"], abs=0.05)


def test_a_version_just_deployed_is_waited_for_not_404(server: InferdServer):
    client = server.client
    missing = client.post(
        "/api/v1/models/rolling/predict", json={**BODY, "params": {"version": "v9"}}
    )
    assert missing.status_code == 404 and "not deployed" in missing.json()["error"]["message"]
    deployed = client.post(
        "/api/v1/deployments",
        json={"model_name": "rolling", "version": "v2", "traffic_percent": 0},
    )
    assert deployed.status_code == 201, deployed.text
    started = time.perf_counter()
    reply = client.post(
        "/api/v1/models/rolling/predict", json={**BODY, "params": {"version": "v2"}}
    )
    waited = time.perf_counter() - started
    assert reply.status_code == 200, reply.text  # held while its replica loaded (3 s)
    assert reply.json()["version"] == "v2" and reply.json()["outputs"] == [{"y": 3.0}]
    assert waited >= 1.0  # it did wait for the load, rather than answer at once
    again = client.post(
        "/api/v1/models/rolling/predict", json={**BODY, "params": {"version": "v9"}}
    )
    assert again.status_code == 404  # unknown versions still get their 404


def test_over_grpc_too_a_version_just_deployed_is_waited_for(server: InferdServer):
    import numpy as np
    import tritonclient.grpc as triton

    client = triton.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    x = triton.InferInput("x", [1], "FP32")
    x.set_data_from_numpy(np.array([2.0], dtype=np.float32))
    assert client.is_server_live()  # the channel is open: the call below goes at once
    deployed = server.client.post(
        "/api/v1/deployments",
        json={"model_name": "rolling", "version": "v3", "traffic_percent": 0},
    )
    assert deployed.status_code == 201, deployed.text
    result = client.infer("rolling", [x], model_version="v3")  # held while it loads
    assert result.as_numpy("y").tolist() == [4.0]
    assert result.get_response().model_version == "v3"
    client.close()


def test_a_model_just_registered_is_waited_for_not_404(server: InferdServer):
    """The registry knows it before the controller's next pass publishes it (and before
    each gateway process hears of it; passes are 2 s apart here): an unpinned request is
    held until it is listed and its first replica is ready, on our API and on V2; a
    name the registry does not know is still 404 at once."""
    client = server.client
    unknown = client.post("/api/v1/models/nowhere/predict", json=BODY)
    assert unknown.status_code == 404 and "not found" in unknown.json()["error"]["message"]
    push_source(server.data_dir, "fresh", MODEL)
    reply = client.post("/api/v1/models/fresh/predict", json=BODY)
    assert reply.status_code == 200, reply.text
    assert reply.json()["version"] == "v1" and reply.json()["outputs"] == [{"y": 3.0}]
    push_source(server.data_dir, "fresh-v2", MODEL)
    v2 = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [2.0]}]}
    reply = client.post("/v2/models/fresh-v2/infer", json=v2)
    assert reply.status_code == 200, reply.text
    assert reply.json()["outputs"][0]["data"] == [4.0]
    again = client.post("/api/v1/models/nowhere/predict", json=BODY)
    assert again.status_code == 404


# -- the protocol's own answers (api/http_protocol.py): what a client sees on the wire ------


def _exchange(server: InferdServer, data: bytes, answers: int) -> tuple[list[bytes], bool]:
    """Send ``data`` (one or more raw requests) on one connection; the first ``answers``
    responses whole (head and body), and whether the server then closed the connection."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(data)
        buffer, out = b"", []
        while len(out) < answers:
            chunk = sock.recv(65536)
            assert chunk, f"connection closed after {len(out)} answers: {buffer!r}"
            buffer += chunk
            while b"\r\n\r\n" in buffer:
                head, _, rest = buffer.partition(b"\r\n\r\n")
                if head.startswith(b"HTTP/1.1 100 "):  # interim: no body
                    out.append(head)
                    buffer = rest
                    continue
                found = re.search(rb"(?im)^content-length: (\d+)", head)
                assert found is not None, head
                length = int(found.group(1))
                if len(rest) < length:
                    break
                out.append(head + b"\r\n\r\n" + rest[:length])
                buffer = rest[length:]
        sock.settimeout(2)
        try:
            closed = sock.recv(1) == b""
        except TimeoutError:
            closed = False
    return out, closed


def _post(path: str, body: bytes, *headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: test", "Content-Type: application/json",
             f"Content-Length: {len(body)}", *headers]  # fmt: skip
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _json_of(answer: bytes) -> dict:
    return json.loads(answer.partition(b"\r\n\r\n")[2])


V2_TWO = json.dumps(
    {"id": "two", "inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [2]}]}
).encode()


def test_pipelined_requests_are_answered_in_order_on_one_connection(server: InferdServer):
    requests = [
        _post("/api/v1/models/eager/predict", b'{"inputs": [{"x": 1}]}', "X-Request-Id: one"),
        _post("/v2/models/eager/infer", V2_TWO),
        b"GET /health/live HTTP/1.1\r\nHost: test\r\n\r\n",
        _post("/api/v1/models/nosuch/predict", b'{"inputs": []}', "X-Request-Id: four"),
    ]
    answers, closed = _exchange(server, b"".join(requests), 4)
    assert not closed  # kept alive
    first, second, third, fourth = answers
    assert first.startswith(b"HTTP/1.1 200 ") and _json_of(first)["outputs"] == [{"y": 2.0}]
    assert _json_of(first)["request_id"] == "one"
    head = first.partition(b"\r\n\r\n")[0].lower()
    for name in (b"date", b"server", b"content-type: application/json", b"x-request-id: one",
                 b"server-timing", b"x-inferd-model-version: v1"):  # fmt: skip
        assert b"\r\n" + name in head, head
    assert second.startswith(b"HTTP/1.1 200 ") and _json_of(second)["id"] == "two"
    assert _json_of(second)["outputs"][0]["data"] == [4.0]
    assert third.startswith(b"HTTP/1.1 200 ")  # liveness: 200 whatever other tests left loading
    assert fourth.startswith(b"HTTP/1.1 404 ")
    assert _json_of(fourth)["error"]["request_id"] == "four"


def test_connection_close_is_honoured_and_expect_100_continue_answered(server: InferdServer):
    body = b'{"inputs": [{"x": 3}]}'
    request = _post("/api/v1/models/eager/predict", body, "Connection: close")
    (answer,), closed = _exchange(server, request, 1)
    assert answer.startswith(b"HTTP/1.1 200 ") and _json_of(answer)["outputs"] == [{"y": 6.0}]
    assert b"\r\nconnection: close" in answer.lower() and closed

    # The body only after the interim answer, as curl sends a large one.
    head = _post("/api/v1/models/eager/predict", b"", "Expect: 100-continue")
    head = head.replace(b"Content-Length: 0", f"Content-Length: {len(body)}".encode())
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head)
        assert sock.recv(65536).startswith(b"HTTP/1.1 100 Continue")
        sock.sendall(body)
        reply = sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 200 ") and _json_of(reply)["outputs"] == [{"y": 6.0}]
