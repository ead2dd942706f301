"""Is `inferd bench` the bottleneck? It against wrk on the same trivial server.

    .venv/bin/python bench/loadgen_vs_wrk.py [--duration 8] [--rounds 5] [--connections 64]

The server is bench/hello_app.py (raw ASGI hello world, uvicorn, httptools + uvloop, one
SO_REUSEPORT socket per worker so connections spread evenly), in two set-ups:

* **shared**: 2 workers and the load generator share both cores (the machine as
  it is): the generator that needs less CPU per request leaves more to the server.
* **pinned**: 1 worker on core 0, the load generator on core 1 (``taskset``):
  a generator that can keep one server core saturated from one core of its own is not
  the bottleneck.

In each set-up `wrk -t1`, `wrk -t2` (shared only) and `inferd bench` run in interleaved
rounds, in a shuffled order per round, all at the same connection count. Reported per
generator: req/s (median over rounds) and the generator's own CPU time per request
(user + system: wrk's whole process from ``getrusage``; `inferd bench`'s own figure for
the load window, which leaves out starting Python and summarising afterwards).
Writes bench/results/loadgen.json and bench/results/loadgen.md.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from servers import ROOT, free_port, start, stop

BODY = '{"x": 1}'
RESULTS = ROOT / "bench" / "results"


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _timed(cmd: list[str]) -> tuple[str, float]:
    """Run a generator to completion; its stdout and the CPU seconds it used."""
    before = _children_cpu()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return out, _children_cpu() - before


def wrk(url: str, threads: int, connections: int, duration: int, pin: list[str]) -> tuple:
    script = Path(tempfile.mkdtemp()) / "post.lua"
    script.write_text(
        f"wrk.method = \"POST\"\nwrk.body = '{BODY}'\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
    )
    out, cpu = _timed(
        [*pin, "wrk", f"-t{threads}", f"-c{connections}", f"-d{duration}s", "-s", str(script), url]
    )
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    return rps, cpu / (rps * duration)


def inferd_bench(url: str, connections: int, duration: int, pin: list[str]) -> tuple:
    result = Path(tempfile.mkdtemp()) / "result.json"
    _timed(
        [
            *pin,
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
            str(result),
        ]
    )
    level = json.loads(result.read_text())["levels"][0]
    assert level["errors"] == 0, level
    # Its own figure for the load window: the whole process also starts Python and
    # summarises the samples afterwards, which takes no CPU from the server under load.
    return float(level["rps"]), level["client_cpu"] * level["duration_s"] / level["requests"]


def run_setup(name: str, workers: int, server_pin: list[str], gen_pin: list[str], args) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}/hello"
    cmd = [
        *server_pin,
        sys.executable,
        "bench/hello_app.py",
        "--workers",
        str(workers),
        "--port",
        str(port),
    ]
    server = start(cmd, {}, RESULTS / f"loadgen-{name}-server.log")
    generators = {
        "wrk -t1": lambda: wrk(url, 1, args.connections, args.duration, gen_pin),
        "inferd bench": lambda: inferd_bench(url, args.connections, args.duration, gen_pin),
    }
    if not gen_pin:
        generators["wrk -t2"] = lambda: wrk(url, 2, args.connections, args.duration, gen_pin)
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in generators}
    rng = random.Random(args.seed)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.post(url, content=BODY, timeout=2)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        wrk(url, 1, args.connections, 2, gen_pin)  # warm-up
        for _ in range(args.rounds):
            order = list(generators)
            rng.shuffle(order)
            for key in order:
                runs[key].append(generators[key]())
            print(name, {k: round(v[-1][0]) for k, v in runs.items()}, flush=True)
    finally:
        stop(server)
    return {
        key: {
            "rps": [round(r) for r, _ in values],
            "cpu_us_per_request": [round(c * 1e6, 2) for _, c in values],
            "median_rps": statistics.median(r for r, _ in values),
            "median_cpu_us": statistics.median(c * 1e6 for _, c in values),
        }
        for key, values in runs.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--setups", default="shared,pinned")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("wrk is not installed (apt-get install wrk)")
    results = {}
    for setup in args.setups.split(","):
        if setup == "shared":
            results[setup] = run_setup(setup, 2, [], [], args)
        elif setup == "pinned":
            core0, core1 = ["taskset", "-c", "0"], ["taskset", "-c", "1"]
            results[setup] = run_setup(setup, 1, core0, core1, args)
        else:
            sys.exit(f"unknown set-up {setup!r}: shared or pinned")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "loadgen.json").write_text(
        json.dumps({"args": vars(args), "results": results}, indent=2)
    )
    lines = [
        f"{args.connections} connections, {args.rounds} rounds of {args.duration} s, medians",
        "",
        "| set-up | load generator | req/s | vs inferd bench | generator CPU µs/request |",
        "|---|---|---|---|---|",
    ]
    for setup, gens in results.items():
        ours = gens["inferd bench"]["median_rps"]
        for key, r in gens.items():
            lines.append(
                f"| {setup} | {key} | {r['median_rps']:,.0f} | {r['median_rps'] / ours:.2f}x "
                f"| {r['median_cpu_us']:.1f} |"
            )
    table = "\n".join(lines)
    (RESULTS / "loadgen.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
