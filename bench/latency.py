"""Latency at every load (#35): inferd vs a plain app vs Ray Serve, same model, same run.

    .venv/bin/python bench/latency.py [--rounds 5] [--duration 20] [--rate 1000]
        [--connections 64] [--targets inferd,plain,ray] [--inferd-env [TARGET:]KEY=VALUE]
    make bench-ray   # once: Ray Serve in .venv-ray (PyPI), for the ray target

The model is a scikit-learn Pipeline (StandardScaler + LogisticRegression) trained here
on ``make_classification`` (2,000 rows, 20 features, seed 0), pickled with joblib, as
inferd's sklearn runtime serves it; every request is one row. Targets:

- ``inferd``: ``inferd serve`` of this checkout (``--workers`` gateway processes, one
  replica), the model pushed with ``inferd models push`` into a scratch data folder of its
  own. Any other target named ``inferd-SOMETHING`` is the same with its own settings
  (``--inferd-env inferd-w2:INFERD_BATCHING__MAX_WAIT_MS=2``; ``--inferd-env KEY=VALUE``
  without a target applies to every inferd target); ``inferd@REF`` is inferd as of git
  commit REF (a temporary worktree, same virtualenv, its own data folder registered by
  its own CLI).
- ``plain``: bench/plain_app.py, Starlette + orjson with the model called inline per
  request, 2 uvicorn worker processes (one SO_REUSEPORT socket each), the same JSON
  shape as inferd's ``/api/v1/models/{model}/predict``.
- ``plain-uvicorn``: the same app as a new user starts it, ``uvicorn --workers 2`` (both
  workers accept from one socket).
- ``ray``: bench/ray_app.py under ``.venv-ray``: a local Ray cluster of ``os.cpu_count()``
  CPUs, Ray Serve's one HTTP proxy and ``--ray-replicas`` (2, as the plain app's workers)
  replicas of ``--ray-replica-cpus`` (1) CPU each, so the replicas claim the machine's
  CPUs and no more; each calls the model inline (no ``@serve.batch``) and takes up to
  ``--connections`` / replicas requests at once (``max_ongoing_requests``; Ray's default,
  5, has its router back off and retry under the closed loop; ``--ray-max-ongoing``
  sets it); Serve's access log off
  (as the plain app's; ``--ray-access-log``), ``include_dashboard`` off (Ray still runs
  its dashboard head and agent processes: they count in its memory).
  Without ``.venv-ray``, or when Ray does not start, the other targets still run and the
  results say why Ray is missing.

Each round starts every target in turn (round-robin: round r starts at target r), waits
until it answers, lets it settle for ``--settle`` seconds (its CPU use over the second
half is its idle CPU), reads its idle memory (the whole process tree, and per kind of
process, from ``/proc/PID/smaps_rollup``), then loads it twice:

- closed loop: ``wrk -t2 -c{--connections} --latency`` for ``--duration`` seconds after
  a 1 s warm-up;
- open loop: Poisson arrivals at ``--rate`` requests/s for ``--duration`` seconds after
  a 1 s warm-up, from inferd's load generator running in this process (latency from each
  request's scheduled send time, so a server that falls behind shows it as latency, not
  as a lower rate: no coordinated omission; requests time out after 10 s); its CPU use
  and the server tree's are recorded beside the figures. Last, because a server that
  cannot keep up is left with a backlog the next load would pay for.

The server and the client share this machine's cores. Writes bench/results/latency.json
(every round, the command line) and latency.md (medians per target and their ratios to
the plain app, ready for the README). Traffic stays on 127.0.0.1; every server is
started and stopped by this script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from servers import (
    ROOT,
    free_port,
    push_model,
    start,
    stop,
    tree_cpu_s,
    tree_memory_by_kind,
    worktree,
)
from tabular import run_wrk

RESULTS = ROOT / "bench" / "results"
MODEL = "tabular"
LABELS = ["negative", "positive"]
RAY_PYTHON = ROOT / ".venv-ray" / "bin" / "python"
KIND_NAMES = {
    "inferd": "server",
    "inferd.api.worker": "gateway",
    "inferd.serving.replica_server": "replica",
    "bench/plain_app.py": "supervisor",
    "bench/plain_app.py (fork)": "uvicorn worker",
    "bench/ray_app.py": "driver",
}
"""Process kinds (servers.command_kind) under the names the tables give them."""


@dataclass
class Target:
    """One server under test: how to start it on a port and when it is ready."""

    name: str
    command: list[str]
    """Its command line; ``{port}`` stands for the port."""
    env: dict[str, str] = field(default_factory=dict)
    checkout: Path = ROOT
    ready_timeout_s: float = 180
    stop_group: bool = True
    """Stop with SIGTERM to its process group (False: to the process alone)."""
    notes: str = ""

    def argv(self, port: int) -> list[str]:
        return [a.replace("{port}", str(port)) for a in self.command]


def build_model(work: Path) -> tuple[Path, list[float]]:
    """The Pipeline, fitted and pickled into ``work/src/tabular``; its folder and a row."""
    import joblib
    from sklearn.datasets import make_classification
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import StandardScaler

    x, y = make_classification(n_samples=2000, n_features=20, random_state=0)
    model = Pipeline([("scale", StandardScaler()), ("clf", LogisticRegression())]).fit(x, y)
    folder = work / "src" / MODEL
    folder.mkdir(parents=True)
    joblib.dump(model, folder / "model.joblib")
    return folder, [round(float(v), 4) for v in x[0]]


def inferd_envs(args: argparse.Namespace, names: list[str]) -> dict[str, dict[str, str]]:
    """``--inferd-env [TARGET:]KEY=VALUE`` per inferd target: unprefixed ones for all."""
    envs: dict[str, dict[str, str]] = {n: {"INFERD_LOG_LEVEL": "WARNING"} for n in names}
    for item in args.inferd_env:
        head, sep, value = item.partition("=")
        target, _, key = head.rpartition(":")
        if not sep or not key.startswith("INFERD_"):
            sys.exit(f"--inferd-env expects [TARGET:]INFERD_KEY=VALUE, got {item!r}")
        if target and target not in envs:
            sys.exit(f"--inferd-env {item!r}: {target!r} is not an inferd target of --targets")
        for name in [target] if target else names:
            envs[name][key] = value
    return envs


def inferd_target(
    name: str, env: dict[str, str], work: Path, folder: Path, args: argparse.Namespace,
    checkouts: contextlib.ExitStack,
) -> Target:  # fmt: skip
    """An inferd target: its checkout (``inferd@REF``: a worktree), its own data folder."""
    checkout = ROOT
    if "@" in name:
        ref = name.partition("@")[2]
        checkout = checkouts.enter_context(worktree(ref, work / f"checkout-{ref}"))
    data = work / f"data-{name}"
    push_model(data, MODEL, folder, {"labels": LABELS}, checkout)
    cmd = [sys.executable, "-m", "inferd", "serve", "--workers", str(args.workers),
           "--data-dir", str(data), "--port", "{port}"]  # fmt: skip
    if "INFERD_GRPC_PORT" not in env:  # a flag outranks the variable
        cmd += ["--grpc-port", str(free_port())]
    settings = " ".join(f"{k}={v}" for k, v in env.items() if k != "INFERD_LOG_LEVEL")
    notes = f"{args.workers} gateway processes, 1 replica" + (f"; {settings}" if settings else "")
    return Target(name, cmd, env, checkout, notes=notes)


def ray_target(folder: Path, work: Path, args: argparse.Namespace) -> Target | str:
    """The Ray Serve target, or why there is none."""
    if not RAY_PYTHON.exists():
        return f"no {RAY_PYTHON.relative_to(ROOT).parent.parent}: run `make bench-ray` first"
    check = subprocess.run(
        [str(RAY_PYTHON), "-c", "import ray, ray.serve, sklearn; print(ray.__version__)"],
        capture_output=True, text=True,
    )  # fmt: skip
    if check.returncode != 0:
        return f".venv-ray cannot import Ray Serve: {check.stderr.strip().splitlines()[-1:]}"
    cpus = os.cpu_count() or 1
    cmd = [str(RAY_PYTHON), "bench/ray_app.py", "--port", "{port}", "--model",
           str(folder / "model.joblib"), "--name", MODEL, "--labels", ",".join(LABELS),
           "--cpus", str(cpus), "--replicas", str(args.ray_replicas),
           "--replica-cpus", str(args.ray_replica_cpus),
           "--temp-dir", str(work / "ray")]  # fmt: skip
    # Enough requests per replica that the closed loop's connections never wait in
    # Serve's router for a free slot (Ray's default, 5, makes it back off and retry).
    ongoing = args.ray_max_ongoing or -(-args.connections // args.ray_replicas)
    cmd += ["--max-ongoing", str(ongoing)]
    if args.ray_access_log:
        cmd += ["--access-log"]
    notes = (
        f"Ray {check.stdout.strip()}, {cpus} CPUs, HTTP proxy + {args.ray_replicas} "
        f"replicas x {args.ray_replica_cpus:g} CPU, max_ongoing_requests {ongoing} "
        f"(Ray's default: 5), include_dashboard off, access log "
        f"{'on' if args.ray_access_log else 'off'}, no @serve.batch"
    )
    return Target("ray", cmd, stop_group=False, ready_timeout_s=300, notes=notes)


def plain_target(folder: Path) -> Target:
    env = {"INFERD_BENCH_MODEL": str(folder / "model.joblib"), "INFERD_BENCH_NAME": MODEL,
           "INFERD_BENCH_LABELS": ",".join(LABELS)}  # fmt: skip
    cmd = [sys.executable, "bench/plain_app.py", "--port", "{port}", "--workers", "2"]
    return Target("plain", cmd, env, notes="Starlette + orjson, 2 uvicorn workers, inline")


def plain_uvicorn_target(folder: Path) -> Target:
    """The same app as a new user starts it: ``uvicorn --workers 2`` (one socket both
    workers accept from)."""
    target = plain_target(folder)
    target.name = "plain-uvicorn"
    target.command = [sys.executable, "-m", "uvicorn", "bench.plain_app:app", "--workers", "2",
                  "--no-access-log", "--log-level", "warning", "--port", "{port}"]  # fmt: skip
    target.notes = "the same app under `uvicorn --workers 2` (one shared socket)"
    return target


def wait_answering(proc: subprocess.Popen[bytes], url: str, body: str, timeout_s: float) -> None:
    """Until POST ``body`` to ``url`` answers 200; RuntimeError if the server exits first
    or ``timeout_s`` passes."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with status {proc.returncode} before answering")
        with contextlib.suppress(httpx.TransportError):
            if httpx.post(url, content=body, timeout=5).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"did not answer within {timeout_s:.0f}s")


def open_loop(
    port: int, body: str, server: int, args: argparse.Namespace, seed: int
) -> dict[str, Any]:
    """Poisson arrivals at ``args.rate`` for ``args.duration`` s after a 1 s warm-up."""
    import uvloop

    from inferd.bench.connection import encode_request, request_head
    from inferd.bench.loadgen import LoadGenerator, LoadSpec
    from inferd.bench.stats import summarize

    head = request_head("POST", f"/api/v1/models/{MODEL}/predict", f"127.0.0.1:{port}",
                        {"Content-Type": "application/json"})  # fmt: skip
    request = encode_request(head, body.encode())
    spec = LoadSpec("127.0.0.1", port, lambda: request, rate=args.rate,
                    duration_s=args.duration, warmup_s=1.0, timeout_s=10.0, seed=seed)  # fmt: skip
    cpu = tree_cpu_s(server)
    result = uvloop.run(LoadGenerator(spec).run())
    server_cpu_s = tree_cpu_s(server) - cpu
    s = summarize(result.samples, result.duration_s)
    return {
        "offered_rps": args.rate, "achieved_rps": s.success_rps, "requests": s.requests,
        "errors": s.errors + result.unsent_arrivals, "errors_by_kind": s.errors_by_kind,
        "unsent": result.unsent_arrivals, "connect_errors": result.connect_errors,
        **{f"{k}_ms": v for k, v in s.latency.items()},
        "client_cpu_cores": result.cpu_s / result.wall_s,
        "server_cpu_cores": server_cpu_s / result.wall_s,
        "server_cpu_us_per_request": 1e6 * server_cpu_s / max(s.requests, 1),
    }  # fmt: skip


def idle_memory(pid: int) -> dict[str, Any]:
    kinds = {KIND_NAMES.get(k, k): v for k, v in tree_memory_by_kind(pid).items()}
    total = {key: sum(k.get(key, 0.0) for k in kinds.values())
             for key in ("processes", "rss_mb", "pss_mb", "uss_mb")}  # fmt: skip
    return {**total, "kinds": kinds}


def run_target(
    target: Target, body: str, args: argparse.Namespace, work: Path, seed: int
) -> dict[str, Any]:
    """Start, wait, idle memory, open loop, closed loop, stop: one target's round."""
    port = free_port()
    log = work / f"{target.name}.log"
    proc = start(target.argv(port), target.env, log, target.checkout)
    url = f"http://127.0.0.1:{port}/api/v1/models/{MODEL}/predict"
    try:
        try:
            wait_answering(proc, url, body, target.ready_timeout_s)
        except RuntimeError as e:
            tail = log.read_text()[-3000:]
            lines = [line for line in tail.splitlines() if line.strip()] or [""]
            why = next((x for x in reversed(lines) if "error" in x.lower()), lines[-1])
            raise RuntimeError(f"{target.name} {e} ({why.strip()})\nits log ends:\n{tail}") from e
        # Idle means idle for a while, not just started: a server may answer while some
        # of its processes are still starting (inferd's second gateway, Ray's agents).
        time.sleep(args.settle / 2)
        cpu = tree_cpu_s(proc.pid)
        time.sleep(args.settle / 2)
        memory = idle_memory(proc.pid)
        memory["cpu_cores"] = (tree_cpu_s(proc.pid) - cpu) / (args.settle / 2)
        # The closed loop first: it never has more than its connections in flight,
        # whereas an open loop a server cannot keep up with leaves a backlog behind
        # (timed-out requests it may still be working through) that the next load
        # would pay for.
        run_wrk(url, args.connections, 1, body)  # warm-up, discarded
        closed = run_wrk(url, args.connections, args.duration, body)
        opened = open_loop(port, body, proc.pid, args, seed)
    finally:
        stop(proc, group=target.stop_group)
    return {"idle_memory": memory, "open": opened, "closed": closed}


def main() -> None:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="inferd-bench-latency-"))
    missing: dict[str, str] = {}
    runs: list[dict[str, Any]] = []
    try:
        with contextlib.ExitStack() as checkouts:
            folder, row = build_model(work)
            body = json.dumps({"inputs": [{"features": row}]})
            targets = make_targets(args.targets.split(","), args, work, folder, checkouts, missing)
            for round_ in range(args.rounds):
                for i in range(len(targets)):
                    target = targets[(round_ + i) % len(targets)]
                    if target.name in missing:
                        continue
                    try:
                        result = run_target(target, body, args, work, seed=round_)
                    except RuntimeError as e:
                        print(f"round {round_ + 1} {target.name}: {e}", file=sys.stderr)
                        first = str(e).splitlines()[0]
                        missing[target.name] = (
                            f"failed in round {round_ + 1}, then left out: {first}"
                        )
                        continue
                    runs.append({"round": round_ + 1, "target": target.name, **result})
                    print_run(runs[-1])
            write_results(args, targets, runs, missing)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def make_targets(
    names: list[str], args: argparse.Namespace, work: Path, folder: Path,
    checkouts: contextlib.ExitStack, missing: dict[str, str],
) -> list[Target]:  # fmt: skip
    """The targets of ``--targets`` that can run; why the others cannot, in ``missing``."""
    inferds = [n for n in names if n == "inferd" or n.startswith(("inferd-", "inferd@"))]
    envs = inferd_envs(args, inferds)
    targets = []
    for name in names:
        if name in envs:
            targets.append(inferd_target(name, envs[name], work, folder, args, checkouts))
        elif name == "plain":
            targets.append(plain_target(folder))
        elif name == "plain-uvicorn":
            targets.append(plain_uvicorn_target(folder))
        elif name == "ray":
            ray = ray_target(folder, work, args)
            if isinstance(ray, str):
                missing["ray"] = f"not measured: {ray}"
                print(f"ray: not measured ({ray})", file=sys.stderr)
            else:
                targets.append(ray)
        else:
            sys.exit(
                f"unknown target {name!r}: inferd, inferd-NAME, inferd@REF, plain, "
                "plain-uvicorn or ray"
            )
    return targets


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=int, default=20, help="seconds per load, each")
    parser.add_argument("--rate", type=float, default=1000, help="open loop requests/s")
    parser.add_argument("--connections", type=int, default=64, help="closed loop (wrk)")
    parser.add_argument("--targets", default="inferd,plain,ray")
    parser.add_argument(
        "--inferd-env", action="append", default=[], metavar="[TARGET:]KEY=VALUE",
        help="an inferd setting for one inferd target (every one without TARGET:)",
    )  # fmt: skip
    parser.add_argument("--workers", type=int, default=2, help="inferd gateway processes")
    parser.add_argument("--ray-replicas", type=int, default=2)
    parser.add_argument("--ray-replica-cpus", type=float, default=1.0)
    parser.add_argument(
        "--ray-max-ongoing", type=int, default=0,
        help="max_ongoing_requests per Ray replica (default: connections / replicas)",
    )  # fmt: skip
    parser.add_argument("--ray-access-log", action="store_true", help="keep Serve's")
    parser.add_argument(
        "--settle", type=float, default=8.0,
        help="idle seconds before the loads; idle CPU is measured over the second half",
    )  # fmt: skip
    args = parser.parse_args()
    args.command = shlex.join([Path(sys.executable).name, *sys.argv])
    return args


def f(value: float | None, spec: str = ".2f") -> str:
    """A figure, or "-" where there is none (no request succeeded)."""
    return "-" if value is None else format(value, spec)


def print_run(run: dict[str, Any]) -> None:
    o, c, m = run["open"], run["closed"], run["idle_memory"]
    print(
        f"round {run['round']} {run['target']:>14}  open {f(o['achieved_rps'], '.0f')}/s "
        f"p50 {f(o['p50_ms'])} p90 {f(o['p90_ms'])} p99 {f(o['p99_ms'])} ms "
        f"err {o['errors']}  client {o['client_cpu_cores']:.2f} server "
        f"{o['server_cpu_cores']:.2f} cores | closed {f(c['rps'], '.0f')}/s p50 "
        f"{f(c['p50_ms'])} p99 {f(c['p99_ms'])} ms err {c['errors']:.0f} | idle RSS "
        f"{m['rss_mb']:.0f} PSS {m['pss_mb']:.0f} MiB, CPU {m['cpu_cores']:.3f} cores",
        flush=True,
    )


def medians(runs: list[dict[str, Any]], name: str) -> dict[str, float | None]:
    """The median over rounds of every figure of one target ("open.p99_ms", ...); None
    where no round has it (no request succeeded)."""
    mine = [r for r in runs if r["target"] == name]
    figures: dict[str, float | None] = {}
    for part in ("open", "closed", "idle_memory"):
        for key in mine[0][part]:
            if isinstance(mine[0][part][key], dict):
                continue
            values = [float(r[part][key]) for r in mine if r[part][key] is not None]
            figures[f"{part}.{key}"] = statistics.median(values) if values else None
    return figures


def write_results(
    args: argparse.Namespace, targets: list[Target], runs: list[dict[str, Any]],
    missing: dict[str, str],
) -> None:  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    ran = [t for t in targets if any(r["target"] == t.name for r in runs)]
    summary = {t.name: medians(runs, t.name) for t in ran}
    doc = {
        "command": args.command, "args": {k: v for k, v in vars(args).items() if k != "command"},
        "finished": datetime.now(UTC).isoformat(timespec="seconds"), "cpus": os.cpu_count(),
        "targets": {t.name: {"notes": t.notes, "env": t.env} for t in ran},
        "missing": missing, "medians": summary, "runs": runs,
    }  # fmt: skip
    (RESULTS / "latency.json").write_text(json.dumps(doc, indent=2) + "\n")
    text = "\n".join(markdown(args, ran, runs, summary, missing)) + "\n"
    (RESULTS / "latency.md").write_text(text)
    print(text)


def markdown(
    args: argparse.Namespace, targets: list[Target], runs: list[dict[str, Any]],
    summary: dict[str, dict[str, float | None]], missing: dict[str, str],
) -> list[str]:  # fmt: skip
    """Three tables (open loop, closed loop, idle memory) and what each target ran."""
    base = summary.get("plain")

    def ratio(name: str, key: str) -> str:
        mine, theirs = summary[name].get(key), base.get(key) if base else None
        return f"{mine / theirs:.2f}x" if mine is not None and theirs else "-"

    rate = f"{args.rate:,.0f}"
    lines = [
        f"Medians of {args.rounds} rounds, {args.duration} s per load, targets started in "
        "turn (round-robin); one row per request to a scikit-learn Pipeline (StandardScaler "
        f"+ LogisticRegression, 20 features); {os.cpu_count()} cores shared by the servers "
        f"and the load generators. `{args.command}`",
        "",
        f"Open loop, {rate} requests/s (Poisson arrivals; latency from the scheduled send; "
        "errors: non-2xx answers, timeouts after 10 s and arrivals never sent):",
        "",
        "| target | achieved req/s | p50 ms | p90 ms | p99 ms | p50 vs plain | p99 vs plain "
        "| errors | server CPU µs/request |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t in targets:
        m = summary[t.name]
        lines.append(
            f"| {t.name} | {f(m['open.achieved_rps'], ',.0f')} | {f(m['open.p50_ms'])} | "
            f"{f(m['open.p90_ms'])} | {f(m['open.p99_ms'])} | {ratio(t.name, 'open.p50_ms')} "
            f"| {ratio(t.name, 'open.p99_ms')} | {m['open.errors']:.0f} | "
            f"{f(m['open.server_cpu_us_per_request'], '.0f')} |"
        )
    lines += [
        "", f"Closed loop, {args.connections} connections (`wrk -t2 -c{args.connections}`):", "",
        "| target | req/s | p50 ms | p99 ms | req/s vs plain | p99 vs plain | errors |",
        "|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for t in targets:
        m = summary[t.name]
        lines.append(
            f"| {t.name} | {f(m['closed.rps'], ',.0f')} | {f(m['closed.p50_ms'])} | "
            f"{f(m['closed.p99_ms'])} | {ratio(t.name, 'closed.rps')} | "
            f"{ratio(t.name, 'closed.p99_ms')} | {m['closed.errors']:.0f} |"
        )
    lines += memory_table(targets, runs, summary)
    lines += ["", *(f"- {t.name}: {t.notes}" for t in targets)]
    lines += [f"- {name}: {why}" for name, why in missing.items()]
    if runs:
        client = statistics.median(r["open"]["client_cpu_cores"] for r in runs)
        lines.append(
            f"- the open-loop load generator (inferd.bench.loadgen, in the bench process) "
            f"used {client:.2f} of a core at {rate} req/s (median); wrk runs 2 threads."
        )
    return lines


def memory_table(
    targets: list[Target], runs: list[dict[str, Any]], summary: dict[str, dict[str, float | None]]
) -> list[str]:
    """Idle memory: each target's whole tree, then per kind of process."""
    lines = [
        "", "Idle memory (MiB; PSS counts pages shared between processes once):", "",
        "| target | process | processes | RSS | PSS | idle CPU (cores) |",
        "|---|---|---|---|---|---|",
    ]  # fmt: skip
    for t in targets:
        m = summary[t.name]
        lines.append(
            f"| {t.name} | **all** | {m['idle_memory.processes']:.0f} | "
            f"**{m['idle_memory.rss_mb']:.0f}** | **{m['idle_memory.pss_mb']:.0f}** | "
            f"{m['idle_memory.cpu_cores']:.3f} |"
        )
        mine = [r["idle_memory"]["kinds"] for r in runs if r["target"] == t.name]
        for kind in mine[0]:
            values = [k[kind] for k in mine if kind in k]
            lines.append(
                f"| {t.name} | {kind} | {values[0]['processes']:.0f} | "
                f"{statistics.median(v['rss_mb'] for v in values):.0f} | "
                f"{statistics.median(v['pss_mb'] for v in values):.0f} | |"
            )
    return lines


if __name__ == "__main__":
    main()
