"""The roles of ``inferd serve`` run on their own over TCP: ``inferd control`` (registry,
controller, replicas) and ``inferd gateway --control HOST:PORT``, real processes on
127.0.0.1. A gateway serves through the controller's TCP channel, stays ready with its
last routing table while the controller is gone, and follows a restarted controller
(a new epoch, whose generations start again at 1); a gateway without the cluster token
is refused before any frame."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, free_port, push_source

pytestmark = pytest.mark.slow
TOKEN = "roles-test-cluster-token-0123456789"
CALC = """
class Calc:
    signature = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    }

    def predict(self, batch):
        return {"y": batch["x"] * 2}
"""


class Role:
    """One ``python -m inferd ROLE ...`` process, its output in a log file."""

    def __init__(self, data: Path, name: str, *args: str, token: str = TOKEN) -> None:
        self.log_path = data / f"{name}.log"
        env = {
            **os.environ,
            "INFERD_CLUSTER__TOKEN": token,
            "INFERD_RECONCILE_INTERVAL_S": "0.3",
            "INFERD_SHUTDOWN_GRACE_S": "5",
            "INFERD_CLUSTER__LOST_CONTROL_AFTER_S": "1",
        }
        self._log = open(self.log_path, "w")  # noqa: SIM115 -- closed in stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "inferd", *args, "--data-dir", str(data)],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
            start_new_session=True,
        )  # fmt: skip

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            code = self.process.wait()
        self._log.close()
        return code


def _wait(predicate: Callable[[], object], what: str, *roles: Role, timeout_s: float = 60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    logs = "\n".join(r.log()[-3000:] for r in roles)
    raise AssertionError(f"timed out waiting for {what}:\n{logs}")


def test_a_gateway_on_its_own_follows_the_controller_over_tcp_and_outlives_it(tmp_path: Path):
    push_source(tmp_path, "calc", CALC)
    control_port, http_port = free_port(), free_port()
    listen = f"127.0.0.1:{control_port}"
    control = Role(tmp_path, "control", "control", "--listen", listen)
    gateway = Role(
        tmp_path, "gateway", "gateway", "--control", listen, "--port", str(http_port),
        "--grpc-port", "-1", "--workers", "1",
    )  # fmt: skip
    intruder = None
    url = f"http://127.0.0.1:{http_port}"
    try:

        def predict() -> httpx.Response:
            return httpx.post(f"{url}/api/v1/predict", json={"model": "calc", "input": {"x": 2}})

        _wait(lambda: predict().status_code == 200, "a prediction", control, gateway)
        assert predict().json()["prediction"] == 4.0
        assert "control" not in httpx.get(f"{url}/health/ready").json()

        # a gateway holding another token is refused before any frame, and says so
        intruder = Role(
            tmp_path, "intruder", "gateway", "--control", listen, "--port", str(free_port()),
            "--grpc-port", "-1", "--workers", "1", token="not-the-cluster-token-0123456789",
        )  # fmt: skip
        _wait(lambda: "wrong cluster token" in control.log(), "the refusal", control)
        _wait(lambda: "refused this gateway" in intruder.log(), "the intruder's error", intruder)

        # the controller goes: the gateway stays ready on its last table and says so
        assert control.stop() == 0
        health = {}

        def stale() -> bool:
            nonlocal health
            reply = httpx.get(f"{url}/health/ready")
            health = reply.json()
            return reply.status_code == 200 and "control" in health

        _wait(stale, "the gateway noticing the controller is gone", gateway)
        assert health["control"]["status"] == "unreachable"
        assert "serving with the last routing table" in health["control"]["detail"]

        # a new controller (new epoch, generations from 1 again): the gateway follows it
        control = Role(tmp_path, "control2", "control", "--listen", listen)
        _wait(lambda: predict().status_code == 200, "serving again", control, gateway)
        assert "control" not in httpx.get(f"{url}/health/ready").json()
        assert "reconnected to the controller" in gateway.log()
    finally:
        codes = [r.stop() for r in (gateway, control, intruder) if r is not None]
    assert codes[:2] == [0, 0], gateway.log()[-3000:]
