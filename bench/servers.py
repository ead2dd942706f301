"""Starting and stopping the servers a benchmark compares (used by the bench scripts)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """A server in its own session (so ``stop`` takes its children too), logging to ``log``."""
    return subprocess.Popen(
        cmd,
        env={**os.environ, **env},
        cwd=ROOT,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def stop(proc: subprocess.Popen[bytes], grace_s: float = 60) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
