"""Processes of inferd's roles (``inferd control``, ``gateway``, ``replica``) for the
multi-host tests, each with its output in a log file and the cluster token set."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import ROOT

TOKEN = "roles-test-cluster-token-0123456789"


class Role:
    """One ``python -m inferd ROLE ...`` process, its output in a log file."""

    def __init__(
        self,
        data: Path,
        name: str,
        *args: str,
        token: str = TOKEN,
        netns: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        data.mkdir(parents=True, exist_ok=True)
        self.log_path = data / f"{name}.log"
        full_env = {
            **os.environ,
            "INFERD_CLUSTER__TOKEN": token,
            "INFERD_RECONCILE_INTERVAL_S": "0.3",
            "INFERD_SHUTDOWN_GRACE_S": "5",
            "INFERD_CLUSTER__LOST_CONTROL_AFTER_S": "1",
            **(env or {}),
        }
        where = [] if netns is None else ["ip", "netns", "exec", netns]
        self._log = open(self.log_path, "w")  # noqa: SIM115 -- closed in stop()
        self.process = subprocess.Popen(
            [*where, sys.executable, "-m", "inferd", *args, "--data-dir", str(data)],
            stdout=self._log, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT,
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


def wait(predicate: Callable[[], object], what: str, *roles: Role, timeout_s: float = 60):
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


def gateway_role(data: Path, control: str, port: int, name: str = "gateway", **kw: Any) -> Role:
    """``inferd gateway``: one process on 127.0.0.1:``port`` following ``control``."""
    return Role(
        data, name, "gateway", "--control", control, "--port", str(port),
        "--grpc-port", "-1", "--workers", "1", **kw,
    )  # fmt: skip


def replica_role(data: Path, name: str, control: str, model: str, listen: str, **kw: Any) -> Role:
    """``inferd replica`` of ``model:v1`` joining ``control``, listening on ``listen``."""
    return Role(
        data, name, "replica", "--control", control, "--model", model,
        "--version", "v1", "--listen", listen, **kw,
    )  # fmt: skip
