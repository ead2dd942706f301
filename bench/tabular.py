"""Tabular benchmark: inferd vs a plain uvicorn app, same model, same machine, same run.

    .venv/bin/python bench/tabular.py [--duration 20] [--connections 64 500] [--rounds 1]
    .venv/bin/python bench/tabular.py --compare f98e67e --rounds 5 --connections 64

``--compare REF`` also runs inferd as of git commit REF (a temporary worktree, same
virtualenv, its own data folder registered by its own ``inferd models push``),
alternating with this checkout round by round: an A/B for regressions.

Builds the demo fraud model (XGBoost, 30 features) locally, registers it in a scratch
data folder per inferd checkout, starts ``inferd serve`` and the plain app
(bench/plain_app.py, 2 uvicorn workers) one after the other on free ports, and drives
each at each connection count with ``wrk`` (or ``inferd bench`` with ``--loadgen
inferd``): closed loop, one row per request. Writes bench/results/tabular.json and
tabular.md. Servers are started and stopped by this script; traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from servers import free_port, push_model, start, stop, tree_rss_mb, worktree

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
ROW = [
    0.12,
    -1.3,
    0.5,
    2.1,
    -0.4,
    0.9,
    1.7,
    -2.2,
    0.3,
    0.0,
    1.1,
    -0.6,
    0.8,
    0.25,
    -1.0,
    0.6,
    1.4,
    -0.3,
    0.7,
    2.0,
    -1.8,
    0.45,
    0.05,
    -0.9,
    1.3,
    0.2,
    -0.1,
    0.95,
    -1.5,
    0.35,
]
BODY = json.dumps({"inputs": [{"features": ROW}]})


def wait_http(url: str, timeout_s: float = 180, body: str = BODY) -> None:
    """Until POST ``body`` to ``url`` answers 200; RuntimeError past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.post(url, content=body, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout_s}s")


def run_inferd_bench(url: str, connections: int, duration_s: int) -> dict[str, float]:
    out = Path(tempfile.mkdtemp()) / "result.json"
    subprocess.run(
        [sys.executable, "-m", "inferd", "bench", url, "--body", BODY, "-c", str(connections),
         "-d", f"{duration_s}s", "--warmup", "0s", "--timeout", "10s", "--json", str(out)],
        capture_output=True, check=True,
    )  # fmt: skip
    level = json.loads(out.read_text())["levels"][0]
    shutil.rmtree(out.parent)
    return {
        "rps": level["rps"], "p50_ms": level["latency"]["p50"], "p90_ms": level["latency"]["p90"],
        "p99_ms": level["latency"]["p99"], "requests": level["requests"], "errors": level["errors"],
    }  # fmt: skip


def run_wrk(url: str, connections: int, duration_s: int, body: str = BODY) -> dict[str, float]:
    """``wrk -t2 -cN --latency``, POSTing ``body`` (JSON) on every request: closed loop."""
    script = Path(tempfile.mkdtemp()) / "post.lua"
    script.write_text(
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = '{body}'\n"
    )
    out = subprocess.run(
        [
            "wrk",
            "-t2",
            f"-c{connections}",
            f"-d{duration_s}s",
            "--latency",
            "--timeout",
            "10s",
            "-s",
            str(script),
            url,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    shutil.rmtree(script.parent)
    return parse_wrk(out)


def _ms(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", text).groups()  # type: ignore[union-attr]
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


def parse_wrk(out: str) -> dict[str, float]:
    result = {"rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))}  # type: ignore[union-attr]
    for pct in ("50", "90", "99"):
        result[f"p{pct}_ms"] = _ms(re.search(rf"\s{pct}%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    errors = 0
    if m := re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out):
        errors += sum(int(x) for x in m.groups())
    if m := re.search(r"Non-2xx or 3xx responses: (\d+)", out):
        errors += int(m.group(1))
    result["requests"] = total
    result["errors"] = errors
    return result


def prepare(work: Path) -> Path:
    from inferd.demo.build import build_demo_model
    from inferd.registry import Registry
    from inferd.runtimes import inspect_artifact

    demo = build_demo_model("fraud", work / "src")
    framework, signature = inspect_artifact(
        demo.path, demo.framework, demo.metadata, demo.signature
    )
    registry = Registry(f"sqlite:///{work / 'data' / 'inferd.db'}", work / "data" / "artifacts")
    registry.push(
        "fraud", demo.path, "v1", framework=framework, signature=signature, metadata=demo.metadata
    )
    registry.close()
    return next(demo.path.glob("*.json"))


def measure(
    name: str,
    proc: subprocess.Popen[bytes],
    url: str,
    args: argparse.Namespace,
    rows: list[dict[str, object]],
) -> None:
    wait_http(url)
    time.sleep(2)
    idle = tree_rss_mb(proc.pid)
    load = run_wrk if args.loadgen == "wrk" else run_inferd_bench
    load(url, 64, 3)  # warm-up
    for connections in args.connections:
        r = load(url, connections, args.duration)
        rows.append({"server": name, "connections": connections, "idle_rss_mb": idle, **r})
        print(
            f"{name:>8} c={connections:<4} {r['rps']:8.0f} req/s  p50 {r['p50_ms']:7.2f} ms  "
            f"p99 {r['p99_ms']:7.2f} ms  errors {r['errors']:.0f}  idle RSS {idle:.0f} MiB",
            flush=True,
        )


def configure(
    args: argparse.Namespace, work: Path, checkouts: contextlib.ExitStack
) -> dict[str, tuple[list[str], dict[str, str], Path]]:
    """The servers to compare: name -> (command less its port, environment, checkout).
    Each inferd checkout serves its own data folder, registered by its own CLI: an older
    commit refuses a registry that newer code created (a migration it does not know)."""
    from inferd.demo.build import build_demo_model

    demo = build_demo_model("fraud", work / "src")
    sides = {"inferd": ROOT}
    if args.compare:
        base = checkouts.enter_context(worktree(args.compare, work / "baseline"))
        sides[f"inferd@{args.compare}"] = base
    servers: dict[str, tuple[list[str], dict[str, str], Path]] = {}
    for i, (name, checkout) in enumerate(sides.items()):
        data = work / f"data-{i}"
        push_model(data, "fraud", demo.path, {"labels": demo.metadata["labels"]}, checkout)
        cmd = [sys.executable, "-m", "inferd", "serve", "--workers", str(args.workers),
               "--data-dir", str(data), "--grpc-port", "-1", "--port"]  # fmt: skip
        servers[name] = (cmd, {"INFERD_LOG_LEVEL": "WARNING"}, checkout)
    if not args.no_plain:
        servers["plain"] = (
            [sys.executable, "-m", "uvicorn", "bench.plain_app:app", "--workers", "2",
             "--no-access-log", "--log-level", "warning", "--port"],
            {"INFERD_BENCH_MODEL": str(demo.path / "model.json")}, ROOT,
        )  # fmt: skip
    return servers


def run_rounds(
    servers: dict[str, tuple[list[str], dict[str, str], Path]],
    args: argparse.Namespace,
    work: Path,
) -> list[dict[str, object]]:
    """Each round starts every server in turn (alternating order), loads it and stops it."""
    rows: list[dict[str, object]] = []
    for round_ in range(args.rounds):
        order = list(servers) if round_ % 2 == 0 else list(reversed(servers))
        for name in order:
            cmd, env, cwd = servers[name]
            port = free_port()
            proc = start([*cmd, str(port)], env, work / f"{name}.log", cwd)
            try:
                url = f"http://127.0.0.1:{port}/api/v1/models/fraud/predict"
                measure(name, proc, url, args, rows)
            except RuntimeError:
                print((work / f"{name}.log").read_text()[-3000:], file=sys.stderr)
                raise
            finally:
                stop(proc)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=int, default=20)
    parser.add_argument("--connections", type=int, nargs="+", default=[64, 500])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2, help="inferd gateway processes")
    parser.add_argument(
        "--loadgen",
        choices=("wrk", "inferd"),
        default=None,
        help="load generator (default: wrk when installed, else inferd bench)",
    )
    parser.add_argument(
        "--compare", metavar="REF", help="also run inferd at this git commit (A/B rounds)"
    )
    parser.add_argument("--no-plain", action="store_true", help="skip the plain app")
    args = parser.parse_args()
    if args.loadgen is None:
        args.loadgen = "wrk" if shutil.which("wrk") else "inferd"
    if args.loadgen == "wrk" and shutil.which("wrk") is None:
        sys.exit("wrk is not installed (apt-get install wrk); or use --loadgen inferd")
    work = Path(tempfile.mkdtemp(prefix="inferd-bench-"))
    try:
        with contextlib.ExitStack() as checkouts:
            servers = configure(args, work, checkouts)
            rows = run_rounds(servers, args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_results(rows, args, list(servers))


def write_results(
    rows: list[dict[str, object]], args: argparse.Namespace, names: list[str]
) -> None:
    """Medians per server and connection count; ratios against the plain app, or
    against the baseline commit when there is no plain app."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "tabular.json").write_text(json.dumps({"args": vars(args), "runs": rows}, indent=2))
    against = "plain" if "plain" in names else names[-1]
    lines = [
        "| connections | server | req/s (median) | p50 ms | p99 ms | errors | idle RSS MiB |"
        f" ratio vs {against} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in args.connections:
        med = {}
        for server in names:
            runs = [r for r in rows if r["server"] == server and r["connections"] == c]
            med[server] = {
                k: statistics.median(float(r[k]) for r in runs)  # type: ignore[arg-type]
                for k in ("rps", "p50_ms", "p99_ms", "errors", "idle_rss_mb")
            }
        for server in names:
            m = med[server]
            ratio = m["rps"] / med[against]["rps"]
            lines.append(
                f"| {c} | {server} | {m['rps']:.0f} | {m['p50_ms']:.1f} | "
                f"{m['p99_ms']:.1f} | {m['errors']:.0f} | {m['idle_rss_mb']:.0f} | "
                f"{ratio:.2f}x |"
            )
    (RESULTS / "tabular.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
