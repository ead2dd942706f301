"""HTTP server overhead: uvicorn (httptools + uvloop) vs granian, hello-world ASGI app.

    .venv/bin/python bench/http_servers.py [--duration 10] [--connections 64 500] [--rounds 3]

The app is in this file (``app``, below): one plain Starlette route, ``POST /echo``, that
parses a small JSON body and returns a small JSON body, so what is measured is the
server's HTTP/ASGI machinery, not the application. Each round starts, in turn,

* uvicorn: ``--workers 2 --http httptools --loop uvloop --no-access-log``
* granian: ``--interface asgi --workers 2 --loop uvloop --no-access-log``

on a free 127.0.0.1 port, warms it with a short wrk run, then drives it with
``wrk -t2 -cN -dDs --latency`` (POST, via a Lua script) for each connection count, and
stops it. Rounds interleave the servers (uvicorn, granian, uvicorn, granian, ...); the
table shows medians over rounds of req/s and wrk's p50/p99, and granian/uvicorn ratios.
Writes bench/results/http_servers.json. Needs ``wrk`` on PATH.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from importlib.metadata import version
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
BODY = '{"name": "world", "n": 3}'
PATH = "/echo"
SERVERS = ("uvicorn", "granian")


# ----------------------------------------------------------------------------- the app


async def echo(request: Request) -> JSONResponse:
    body = await request.json()
    return JSONResponse({"hello": body.get("name", "?"), "n": body.get("n", 0) + 1})


app = Starlette(routes=[Route(PATH, echo, methods=["POST"])])


# --------------------------------------------------------------------------- the bench


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def command(server: str, port: int) -> list[str]:
    bindir = Path(sys.executable).parent
    target = "bench.http_servers:app"
    if server == "uvicorn":
        return [
            sys.executable, "-m", "uvicorn", target, "--host", "127.0.0.1", "--port", str(port),
            "--workers", "2", "--http", "httptools", "--loop", "uvloop", "--no-access-log",
            "--log-level", "warning",
        ]  # fmt: skip
    return [
        str(bindir / "granian"), "--interface", "asgi", "--host", "127.0.0.1",
        "--port", str(port), "--workers", "2", "--loop", "uvloop", "--no-access-log",
        "--log-level", "warning", "--working-dir", str(ROOT), target,
    ]  # fmt: skip


def start(server: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            command(server, port), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's whole process group, SIGKILL it if it lingers."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(15)
    with contextlib.suppress(ProcessLookupError):  # workers that outlived their master
        os.killpg(proc.pid, signal.SIGKILL)


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    request = urllib.request.Request(
        url, data=BODY.encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(request, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout_s}s")


def run_wrk(url: str, connections: int, duration_s: int, script: Path) -> dict[str, float]:
    out = subprocess.run(
        ["wrk", "-t2", f"-c{connections}", f"-d{duration_s}s", "--latency", "--timeout", "5s",
         "-s", str(script), url],
        capture_output=True, text=True, check=True, timeout=duration_s + 30,
    ).stdout  # fmt: skip
    return parse_wrk(out)


def _ms(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", text).groups()  # type: ignore[union-attr]
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


def _find(pattern: str, out: str) -> str:
    match = re.search(pattern, out)
    if match is None:
        raise RuntimeError(f"unexpected wrk output:\n{out}")
    return match.group(1)


def parse_wrk(out: str) -> dict[str, float]:
    result = {"rps": float(_find(r"Requests/sec:\s+([\d.]+)", out))}
    for pct in ("50", "99"):
        result[f"p{pct}_ms"] = _ms(_find(rf"\s{pct}%\s+(\S+)", out))
    result["requests"] = int(_find(r"(\d+) requests in", out))
    kinds = ("connect", "read", "write", "timeout")
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    for kind, n in zip(kinds, m.groups() if m else (0,) * 4, strict=True):
        result[f"err_{kind}"] = int(n)
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    result["err_status"] = int(m.group(1)) if m else 0
    result["errors"] = sum(result[f"err_{k}"] for k in (*kinds, "status"))
    return result


def summarize(runs: list[dict[str, Any]], connections: list[int]) -> list[dict[str, Any]]:
    summary = []
    for c in connections:
        med: dict[str, dict[str, float]] = {}
        for server in SERVERS:
            mine = [r for r in runs if r["server"] == server and r["connections"] == c]
            if mine:
                med[server] = {
                    k: statistics.median(float(r[k]) for r in mine)
                    for k in ("rps", "p50_ms", "p99_ms", "errors")
                }
                med[server]["rounds"] = len(mine)
        for server, m in med.items():
            ratio = m["rps"] / med["uvicorn"]["rps"] if "uvicorn" in med else float("nan")
            summary.append({"connections": c, "server": server, **m, "rps_vs_uvicorn": ratio})
    return summary


def table(summary: list[dict[str, Any]]) -> str:
    lines = [
        "| connections | server | req/s (median) | p50 ms | p99 ms | errors | vs uvicorn |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for s in summary:
        lines.append(
            f"| {s['connections']} | {s['server']} | {s['rps']:,.0f} | {s['p50_ms']:.2f} | "
            f"{s['p99_ms']:.2f} | {s['errors']:.0f} | {s['rps_vs_uvicorn']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=int, default=10, help="seconds per wrk run")
    parser.add_argument("--connections", type=int, nargs="+", default=[64, 500])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2, help="seconds of wrk before measuring")
    parser.add_argument("--out", type=Path, default=RESULTS / "http_servers.json")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("wrk is needed: apt-get install wrk")

    work = Path(tempfile.mkdtemp(prefix="inferd-http-"))
    script = work / "post.lua"
    script.write_text(
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = '{BODY}'\n"
    )
    runs: list[dict[str, Any]] = []
    started = time.monotonic()
    try:
        for rnd in range(args.rounds):
            for server in SERVERS:
                port = free_port()
                url = f"http://127.0.0.1:{port}{PATH}"
                proc = start(server, port, work / f"{server}.log")
                try:
                    wait_ready(url, proc)
                    run_wrk(url, 64, args.warmup, script)
                    for c in args.connections:
                        r = run_wrk(url, c, args.duration, script)
                        runs.append({"round": rnd, "server": server, "connections": c, **r})
                        print(
                            f"round {rnd} {server:>8} c={c:<4} {r['rps']:9,.0f} req/s  "
                            f"p50 {r['p50_ms']:6.2f} ms  p99 {r['p99_ms']:6.2f} ms  "
                            f"errors {r['errors']:.0f}",
                            flush=True,
                        )
                finally:
                    stop(proc)
    except BaseException:
        for log in work.glob("*.log"):
            print(f"--- {log.name}\n{log.read_text()[-3000:]}", file=sys.stderr)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)

    summary = summarize(runs, args.connections)
    md = table(summary)
    print()
    print(md)
    meta = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "uvicorn": version("uvicorn"),
        "granian": version("granian"),
        "httptools": version("httptools"),
        "uvloop": version("uvloop"),
        "starlette": version("starlette"),
        "commands": {s: " ".join(command(s, 0)) for s in SERVERS},
        "wrk": f"wrk -t2 -cN -d{args.duration}s --latency --timeout 5s -s post.lua",
        "wall_s": round(time.monotonic() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "args": {**vars(args), "out": str(args.out)},
                "meta": meta,
                "summary": summary,
                "runs": runs,
                "table": md,
            },
            indent=2,
        )
    )
    print(f"\nwrote {args.out} in {meta['wall_s']}s")


if __name__ == "__main__":
    main()
