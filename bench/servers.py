"""Starting and stopping the servers a benchmark compares (used by the bench scripts)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(
    cmd: list[str], env: dict[str, str], log: Path, cwd: Path = ROOT
) -> subprocess.Popen[bytes]:
    """A server in its own session (so ``stop`` takes its children too), logging to ``log``;
    ``cwd``: where ``python -m inferd`` finds its package (another checkout for an A/B)."""
    return subprocess.Popen(
        cmd,
        env={**os.environ, **env},
        cwd=cwd,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def alternating(
    cmd: list[str], variants: dict[str, dict[str, str]], rounds: int, logs: Path
) -> Iterator[tuple[str, subprocess.Popen[bytes], int]]:
    """A/B rounds: each round starts ``cmd`` + a free port once per variant (its env),
    in alternating order, and yields (variant, process, port); the server stops when
    the caller moves on."""
    for round_ in range(rounds):
        order = list(variants) if round_ % 2 == 0 else list(reversed(variants))
        for name in order:
            port = free_port()
            proc = start([*cmd, str(port)], variants[name], logs / f"{name}.log")
            try:
                yield name, proc, port
            finally:
                stop(proc)


def stop(proc: subprocess.Popen[bytes], grace_s: float = 60) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_ready(url: str, timeout_s: float = 180, poll_s: float = 0.2) -> None:
    """Until GET ``url`` answers 200 (a server's readiness probe); RuntimeError past
    ``timeout_s``."""
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(poll_s)
    raise RuntimeError(f"{url} not ready in {timeout_s:.0f}s")


def process_tree(pid: int) -> list[int]:
    """A process and all its descendants (a server with its gateways and replicas)."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True)
    children: dict[int, list[int]] = {}
    for line in out.stdout.splitlines():
        child, parent = (int(x) for x in line.split())
        children.setdefault(parent, []).append(child)
    tree, stack = [], [pid]
    while stack:
        p = stack.pop()
        tree.append(p)
        stack.extend(children.get(p, []))
    return tree


def tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and all its descendants, in MiB."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for p in process_tree(pid):
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * page
        except OSError:
            continue  # exited meanwhile
    return total / 2**20


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by a process and all its descendants."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in process_tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total
