"""The container image's HEALTHCHECK: is the inferd role in this container serving?

- ``serve``, ``gateway``: ``GET /health/live`` on the HTTP port answers 200 (liveness,
  not readiness: a gateway waiting for a model's replica is alive and must not be
  restarted for it).
- ``control``, ``replica``: their TCP port (``--listen``) is listening. It is not
  connected to: a connection that does not prove the cluster token would be refused and
  logged as an intruder every few seconds.

The role and port come from the inferd process's command line (``--port``, ``--listen``)
and its environment (``INFERD_PORT``, ``INFERD_CLUSTER__CONTROL_LISTEN``), else inferd's
defaults; a port set only in a YAML file needs the health check overridden. Standard
library only, run with ``python -I -S`` (about 20 ms; importing inferd's CLI would take
about a second on every check).
"""

from __future__ import annotations

import sys
import urllib.request
from pathlib import Path

ROLES = ("serve", "gateway", "control", "replica")
DEFAULT_LISTEN = {"control": "0.0.0.0:7070", "replica": "0.0.0.0:9100"}


def inferd_process(proc: Path = Path("/proc")) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of the container's inferd process (PID 1, or
    the first one found under an init such as tini)."""
    pids = sorted(int(p.name) for p in proc.iterdir() if p.name.isdigit())
    for pid in pids:
        try:
            argv = (proc / str(pid) / "cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if any(Path(arg).name == "inferd" for arg in argv[:2]) and role_of(argv):
            raw = (proc / str(pid) / "environ").read_bytes().decode(errors="replace")
            env = dict(item.partition("=")[::2] for item in raw.split("\0") if "=" in item)
            return argv, env
    raise LookupError("no inferd serve|gateway|control|replica process in this container")


def role_of(argv: list[str]) -> str | None:
    return next((arg for arg in argv if arg in ROLES), None)


def option(argv: list[str], name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE``, the last one given."""
    found = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith(name + "="):
            found = arg.partition("=")[2]
    return found


def target(argv: list[str], env: dict[str, str]) -> tuple[str, int]:
    """("http", port) for a role with an HTTP port, ("tcp", port) for the others."""
    role = role_of(argv)
    if role in ("serve", "gateway"):
        return "http", int(option(argv, "--port") or env.get("INFERD_PORT") or 8000)
    assert role is not None
    listen = option(argv, "--listen")
    if listen is None and role == "control":
        listen = env.get("INFERD_CLUSTER__CONTROL_LISTEN")
    return "tcp", int((listen or DEFAULT_LISTEN[role]).rpartition(":")[2])


def listening(port: int, proc: Path = Path("/proc/net")) -> bool:
    """A socket of this network namespace listens on ``port`` (IPv4 or IPv6)."""
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rpartition(":")[2], 16) == port:
                return True
    return False


def main() -> int:
    try:
        argv, env = inferd_process()
    except LookupError as exc:
        print(exc, file=sys.stderr)
        return 1
    kind, port = target(argv, env)
    if kind == "tcp":
        ok = listening(port)
        print(f"port {port} {'listening' if ok else 'not listening'}")
        return 0 if ok else 1
    url = f"http://127.0.0.1:{port}/health/live"
    try:
        with urllib.request.urlopen(url, timeout=3) as reply:
            print(url, reply.status)
            return 0 if reply.status == 200 else 1
    except OSError as exc:
        print(url, exc, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
