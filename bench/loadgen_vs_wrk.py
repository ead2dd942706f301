"""Is `inferd bench` the bottleneck? It against wrk on the same trivial server.

    .venv/bin/python bench/loadgen_vs_wrk.py [--duration 10] [--rounds 3] [--connections 64]

Starts bench/hello_app.py (raw ASGI hello world, uvicorn, 2 workers, httptools + uvloop)
and drives it in interleaved rounds with `wrk -t2`, `wrk -t1` and `inferd bench`, all at
the same connection count. Prints req/s medians and writes bench/results/loadgen.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from servers import free_port

ROOT = Path(__file__).resolve().parent.parent
BODY = '{"x": 1}'


def wrk(url: str, threads: int, connections: int, duration: int) -> float:
    script = Path(tempfile.mkdtemp()) / "post.lua"
    script.write_text(
        f"wrk.method = \"POST\"\nwrk.body = '{BODY}'\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
    )
    out = subprocess.run(
        ["wrk", f"-t{threads}", f"-c{connections}", f"-d{duration}s", "-s", str(script), url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]


def inferd_bench(url: str, connections: int, duration: int) -> float:
    out = Path(tempfile.mkdtemp()) / "result.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "inferd",
            "bench",
            url,
            "--body",
            BODY,
            "-c",
            str(connections),
            "-d",
            f"{duration}s",
            "--warmup",
            "0s",
            "--json",
            str(out),
        ],
        capture_output=True,
        check=True,
    )
    return float(json.loads(out.read_text())["levels"][0]["rps"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", type=int, default=64)
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}/hello"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "bench.hello_app:app",
            "--workers",
            "2",
            "--http",
            "httptools",
            "--loop",
            "uvloop",
            "--no-access-log",
            "--log-level",
            "warning",
            "--port",
            str(port),
        ],
        cwd=ROOT,
        start_new_session=True,
    )
    results: dict[str, list[float]] = {"wrk -t2": [], "wrk -t1": [], "inferd bench": []}
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                httpx.post(url, content=BODY, timeout=2)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        wrk(url, 2, args.connections, 2)  # warm-up
        for _ in range(args.rounds):
            results["wrk -t2"].append(wrk(url, 2, args.connections, args.duration))
            results["wrk -t1"].append(wrk(url, 1, args.connections, args.duration))
            results["inferd bench"].append(inferd_bench(url, args.connections, args.duration))
            print({k: round(v[-1]) for k, v in results.items()}, flush=True)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
    medians = {k: statistics.median(v) for k, v in results.items()}
    out = ROOT / "bench" / "results" / "loadgen.json"
    out.write_text(
        json.dumps({"args": vars(args), "runs": results, "median_rps": medians}, indent=2)
    )
    print("| load generator | req/s (median) | vs inferd bench |\n|---|---|---|")
    for name, rps in medians.items():
        print(f"| {name} | {rps:.0f} | {rps / medians['inferd bench']:.2f}x |")


if __name__ == "__main__":
    main()
