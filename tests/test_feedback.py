"""Accuracy feedback against the real server: ground truth joined to logged single-row
predictions by request id, the rolling accuracy / mean absolute error per version and
the version's alert threshold in /metrics, and every bad input a clear 4xx."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import InferdServer, arithmetic_model, push_source
from tests.test_metrics_endpoint import parse, value

pytestmark = pytest.mark.slow

CLASSIFIER = """
import numpy as np


class Size:
    signature = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "label", "datatype": "BYTES", "shape": [-1]}],
    }

    def predict(self, batch):
        return {"label": np.array(["big" if v > 5 else "small" for v in batch["x"]], dtype=object)}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferdServer]:
    data = tmp_path_factory.mktemp("feedback")
    push_source(data, "size", CLASSIFIER, "--meta", "accuracy_threshold=0.8")
    push_source(data, "double", arithmetic_model("x * 2"))
    server = InferdServer(
        Path(data), workers=2, env={"INFERD_INFERENCE_LOG__FLUSH_INTERVAL_S": "0.2"}
    )
    try:
        server.wait_ready()
        yield server
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def _predict(server: InferdServer, model: str, rid: str, *xs: float) -> None:
    reply = server.client.post(
        f"/api/v1/models/{model}/predict",
        json={"inputs": [{"x": x} for x in xs]},
        headers={"X-Request-Id": rid},
    )
    assert reply.status_code == 200, reply.text


def _feedback(server: InferdServer, **body: object):
    """POST feedback, retrying a 404 for the second the log takes to receive the row."""
    deadline = time.monotonic() + 10
    while True:
        reply = server.client.post("/api/v1/feedback", json=body)
        if reply.status_code != 404 or time.monotonic() > deadline:
            return reply
        time.sleep(0.2)


def test_feedback_makes_the_accuracy_metric(server: InferdServer):
    for i in range(10):  # x = 0..9: "small" up to 5, "big" after
        _predict(server, "size", f"size-{i}", float(i))
    truth = ["small"] * 6 + ["small"] * 4  # the model is right for 0..5, wrong for 6..9
    for i, label in enumerate(truth):
        reply = _feedback(server, request_id=f"size-{i}", label=label)
        assert reply.status_code == 201, reply.text
        body = reply.json()
        assert body["model_name"] == "size" and body["version"] == "v1"
        assert body["prediction"] == ("small" if i <= 5 else "big")
        assert body["correct"] is (i <= 5)
    again = _feedback(server, request_id="size-0", label="small")  # replaces, not adds
    assert again.status_code == 201
    _predict(server, "double", "double-1", 3.0)
    numeric = _feedback(server, request_id="double-1", value=7.5)
    assert numeric.status_code == 201 and numeric.json()["abs_error"] == pytest.approx(1.5)
    samples = parse(server.client.get("/metrics").text)
    assert value(samples, "inferd_model_accuracy", model="size", version="v1") == 0.6
    assert value(samples, "inferd_model_feedback", model="size", version="v1") == 10
    assert value(samples, "inferd_model_accuracy_threshold", model="size") == 0.8
    assert value(samples, "inferd_model_mean_absolute_error", model="double") == 1.5


def test_bad_feedback_is_a_clear_4xx(server: InferdServer):
    c = server.client
    unknown = c.post("/api/v1/feedback", json={"request_id": "never-sent", "label": "big"})
    assert unknown.status_code == 404 and "never-sent" in unknown.json()["error"]["message"]
    _predict(server, "size", "size-many", 1.0, 9.0)  # two rows: no single prediction
    many = _feedback(server, request_id="size-many", label="big")
    assert many.status_code == 422 and "one row" in many.json()["error"]["message"]
    _predict(server, "size", "size-x", 9.0)
    for body, says in (
        ({"request_id": "size-x", "label": "big", "value": 1}, "exactly one"),
        ({"request_id": "size-x"}, "exactly one"),
        ({"label": "big"}, "request_id"),
        ({"request_id": "size-x", "label": "big", "extra": 1}, "unknown field"),
        ({"request_id": "size-x", "value": "big"}, "'value' must be a number"),
    ):
        reply = _feedback(server, **body)
        assert reply.status_code == 422, (body, reply.text)
        assert says in reply.json()["error"]["message"]
    not_a_number = _feedback(server, request_id="size-x", value=3.0)
    assert not_a_number.status_code == 422 and "not a number" in not_a_number.text
    assert c.post("/api/v1/feedback", content=b"[").status_code == 400
