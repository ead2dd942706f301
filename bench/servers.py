"""Starting and stopping the servers a benchmark compares (used by the bench scripts)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(
    cmd: list[str], env: dict[str, str], log: Path, cwd: Path = ROOT
) -> subprocess.Popen[bytes]:
    """A server in its own session (so ``stop`` takes its children too), logging to ``log``;
    ``cwd``: the checkout whose ``inferd`` package it runs (another one for an A/B: put
    first on PYTHONPATH, so every process it starts imports that package too)."""
    return subprocess.Popen(
        cmd,
        env={**os.environ, **checkout_env(cwd), **env},
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


def stop(proc: subprocess.Popen[bytes], grace_s: float = 60, group: bool = True) -> None:
    """SIGTERM to the server's process group (``group=False``: to the server alone, for
    one that stops its own children in order, like Ray's driver), SIGKILL to the group
    after ``grace_s``; then SIGKILL to what is left of the tree it had (children in
    process groups of their own that outlived it), so no round leaves a process behind."""
    tree = process_tree(proc.pid)
    with contextlib.suppress(ProcessLookupError):  # it may have exited (and its group)
        if group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 10
    while (alive := [p for p in tree[1:] if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for p in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def checkout_env(checkout: Path) -> dict[str, str]:
    """The environment that makes Python import ``inferd`` from ``checkout``: nothing
    for this one (the virtualenv's editable install), PYTHONPATH for another."""
    if checkout.resolve() == ROOT:
        return {}
    return {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(checkout), os.environ.get("PYTHONPATH")]))
    }


@contextlib.contextmanager
def worktree(ref: str, path: Path) -> Iterator[Path]:
    """This repository as of git ``ref``, checked out at ``path`` (detached), removed after."""
    subprocess.run(["git", "worktree", "add", "--detach", str(path), ref],
                   cwd=ROOT, check=True, capture_output=True)  # fmt: skip
    try:
        yield path
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(path)],
                       cwd=ROOT, capture_output=True)  # fmt: skip


def push_model(
    data_dir: Path, name: str, source: Path, meta: dict[str, Any], checkout: Path = ROOT
) -> None:
    """Register ``source`` as ``name`` v1 in ``data_dir`` with ``checkout``'s own CLI
    (``inferd models push``), so the registry's tables are the ones that checkout's
    server expects: an older commit refuses a database migrated by newer code."""
    cmd = [sys.executable, "-m", "inferd", "models", "push", name, str(source),
           "--version", "v1", "--data-dir", str(data_dir)]  # fmt: skip
    for key, value in meta.items():
        cmd += ["--meta", f"{key}={json.dumps(value)}"]
    out = subprocess.run(
        cmd, cwd=checkout, env={**os.environ, **checkout_env(checkout)},
        capture_output=True, text=True,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"inferd models push ({checkout}) failed:\n{out.stderr[-2000:]}")


def wait_ready(
    url: str,
    timeout_s: float = 180,
    poll_s: float = 0.2,
    process: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
) -> None:
    """Until GET ``url`` answers 200 (a server's readiness probe); RuntimeError past
    ``timeout_s``, or at once when ``process`` (the server) has exited: with the end of
    its ``log``."""
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
            raise RuntimeError(f"the server exited with {process.returncode}:\n{tail}")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(poll_s)
    raise RuntimeError(f"{url} not ready in {timeout_s:.0f}s")


@contextlib.contextmanager
def inferd_serving(work: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """One ``inferd serve`` of this checkout (one gateway, its data in ``work/data``,
    ``file://`` imports from anywhere, its log ``work/server.log``) for the length of
    the block: its URL."""
    port = free_port()
    log = work / "server.log"
    cmd = [sys.executable, "-m", "inferd", "serve", "--port", str(port), "--workers", "1",
           "--grpc-port", str(free_port())]  # fmt: skip
    base = {
        "INFERD_REGISTRY__IMPORT_ROOTS": json.dumps(["/"]),
        "INFERD_DATA_DIR": str(work / "data"),
    }
    server = start(cmd, {**base, **(env or {})}, log)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url + "/health/ready", process=server, log=log)
        yield url
    finally:
        stop(server)


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


def memory_of(pid: int) -> dict[str, float]:
    """RSS, PSS and USS of one process in MiB (``/proc/PID/smaps_rollup``). PSS divides
    shared pages among the processes mapping them, so a tree's PSS adds up without
    counting the interpreter's and numpy's pages once per process."""
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, rest = line.partition(":")
        fields[key] = int(rest.split()[0])  # kB
    uss = fields["Private_Clean"] + fields["Private_Dirty"]
    return {"rss_mb": fields["Rss"] / 1024, "pss_mb": fields["Pss"] / 1024, "uss_mb": uss / 1024}


def command_kind(argv: list[str]) -> str:
    """A short name for what a process runs, from its command line: the module of
    ``python -m MODULE``, the script of ``python SCRIPT``, a multiprocessing child,
    Ray's ``ray::Actor`` titles, else the executable's name."""
    if not argv:
        return "?"
    if argv[0].startswith("ray::"):  # ray::ServeReplica:app:Deployment, ray::IDLE
        return "ray::" + argv[0].split()[0].split(":")[2]
    exe = Path(argv[0]).name
    if not exe.startswith("python"):
        return exe
    args = argv[1:]
    while args and args[0].startswith("-") and args[0] not in ("-m", "-c"):
        args = args[1:]  # interpreter flags (-u, -B, ...)
    if len(args) >= 2 and args[0] == "-m":
        return args[1]
    if len(args) >= 2 and args[0] == "-c":
        for word in ("resource_tracker", "forkserver", "spawn"):
            if word in args[1]:
                return f"multiprocessing {word}"
        return "python -c"
    return "/".join(Path(args[0]).parts[-2:]) if args else exe


def tree_memory_by_kind(
    pid: int, kind: Callable[[list[str]], str] = command_kind
) -> dict[str, dict[str, float]]:
    """The memory of a process tree per kind of process (``kind`` of each one's command
    line; a child with the root's command line is a fork, "KIND (fork)"; a replica the
    fork server forked is "inferd.serving.replica_server (forked)"): processes,
    RSS, PSS and USS (MiB) summed over the processes of each kind."""
    kinds: dict[str, dict[str, float]] = {}
    names: dict[int, str] = {}
    for p in process_tree(pid):
        try:
            argv = Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
            parent = int(Path(f"/proc/{p}/stat").read_text().rpartition(")")[2].split()[1])
            memory = memory_of(p)
        except (OSError, KeyError, ValueError):
            continue  # exited meanwhile (or a zombie: no mappings)
        name = names[p] = kind([a for a in argv.split("\0") if a])
        if names.get(parent) == "inferd.serving.zygote":
            name = "inferd.serving.replica_server (forked)"
        elif p != pid and name == names.get(pid):
            name += " (fork)"
        row = kinds.setdefault(name, {"processes": 0})
        row["processes"] += 1
        for key, value in memory.items():
            row[key] = row.get(key, 0.0) + value
    return kinds


def serve_reuseport(app: Any, port: int, workers: int) -> None:
    """Serve an ASGI ``app`` from ``workers`` forked uvicorn processes (httptools +
    uvloop), each with its own listening socket on ``port`` (SO_REUSEPORT), so the
    kernel spreads connections over them by hash, as inferd's gateways share theirs.
    Not ``uvicorn --workers``: its workers share one socket and the first to wake
    accepts a whole burst, so 64 connections opened at once may all land on one.
    Returns once SIGTERM/SIGINT stopped every worker."""
    import multiprocessing

    def worker() -> None:
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", port))
        config = uvicorn.Config(
            app, http="httptools", loop="uvloop", access_log=False, log_level="warning"
        )
        uvicorn.Server(config).run(sockets=[sock])

    processes = [multiprocessing.get_context("fork").Process(target=worker) for _ in range(workers)]
    for process in processes:
        process.start()

    def stop_workers(*_: object) -> None:
        for process in processes:
            if process.pid is not None:
                os.kill(process.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop_workers)
    signal.signal(signal.SIGINT, stop_workers)
    for process in processes:
        process.join()
