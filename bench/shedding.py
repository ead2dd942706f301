"""Overload: what priorities buy a high-priority client when low-priority traffic
offers more than the model can do.

    .venv/bin/python bench/shedding.py [--duration 8] [--rounds 3] [--flood 48]

Serves one Python model that computes a batch of up to 4 rows in 40 ms (100 rows/s),
queue bound 64 rows, with ``inferd serve`` (1 gateway process). Each round measures a
high-priority client (one request at a time) three ways: alone; beside ``--flood``
closed-loop clients sending the same model ``low`` priority requests; and beside the
same flood when every request is ``normal`` (no priorities: the baseline). Flood
clients pause 20 ms after a refusal. Reports medians over rounds of the high client's
p50/p99 and the flood's answered/shed counts; writes bench/results/shedding.{json,md}.
Traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from servers import free_port, start, stop, wait_ready

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

MODEL = """
import time

import numpy as np


class Slow:
    signature = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    }

    def predict(self, batch):
        time.sleep(0.04)
        return {"y": batch["x"] + 1}
"""


async def client_loop(
    url: str, priority: str, seconds: float, clients: int
) -> list[tuple[int, float]]:
    results: list[tuple[int, float]] = []
    deadline = time.monotonic() + seconds
    body = {"inputs": [{"x": 1.0}], "params": {"priority": priority}}

    async def loop(client: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            began = time.perf_counter()
            reply = await client.post("/api/v1/models/slow/predict", json=body)
            results.append((reply.status_code, (time.perf_counter() - began) * 1000))
            if reply.status_code != 200:
                await asyncio.sleep(0.02)

    limits = httpx.Limits(max_connections=clients + 2)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        await asyncio.gather(*(loop(client) for _ in range(clients)))
    return results


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def scenario(url: str, flood: str | None, clients: int, seconds: float) -> dict:
    flood_task = None
    if flood is not None:
        flood_task = asyncio.create_task(client_loop(url, flood, seconds + 1.0, clients))
        await asyncio.sleep(1.0)  # the flood fills the queue first
    high = await client_loop(url, "high" if flood != "normal" else "normal", seconds, 1)
    flooded = await flood_task if flood_task is not None else []
    ok = [ms for status, ms in high if status == 200]
    return {
        "high_requests": len(high),
        "high_errors": len(high) - len(ok),
        "high_p50_ms": round(pct(ok, 0.5), 1),
        "high_p99_ms": round(pct(ok, 0.99), 1),
        "flood_answered": sum(1 for s, _ in flooded if s == 200),
        "flood_shed": sum(1 for s, _ in flooded if s == 503),
        "flood_other": sum(1 for s, _ in flooded if s not in (200, 503)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--flood", type=int, default=48)
    args = parser.parse_args()
    data = Path(tempfile.mkdtemp(prefix="inferd-shedding-"))
    src = data / "src"
    src.mkdir()
    (src / "model.py").write_text(MODEL)
    env = {"INFERD_DATA_DIR": str(data)}
    subprocess.run(
        [sys.executable, "-m", "inferd", "models", "push", "slow", str(src), "--version", "v1"],
        check=True, capture_output=True, env={**os.environ, **env},
    )  # fmt: skip
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(
        [sys.executable, "-m", "inferd", "serve", "--port", str(port), "--grpc-port", "-1",
         "--workers", "1", "--data-dir", str(data)],
        {**env, "INFERD_BATCHING__MAX_BATCH_SIZE": "4", "INFERD_BATCHING__MAX_WAIT_MS": "0",
         "INFERD_BATCHING__MAX_QUEUE_ROWS": "64", "INFERD_INFERENCE_LOG__ENABLED": "false"},
        data / "server.log",
    )  # fmt: skip
    rounds: dict[str, list[dict]] = {"alone": [], "low flood": [], "normal flood": []}
    try:
        wait_ready(url + "/health/ready")
        for _ in range(args.rounds):
            for name, flood in (("alone", None), ("low flood", "low"), ("normal flood", "normal")):
                result = asyncio.run(scenario(url, flood, args.flood, args.duration))
                rounds[name].append(result)
                print(name, result, flush=True)
    finally:
        stop(proc)
    summary = {
        name: {key: statistics.median(r[key] for r in results) for key in results[0]}
        for name, results in rounds.items()
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "shedding.json").write_text(
        json.dumps({"rounds": rounds, "median": summary}, indent=2)
    )
    lines = [
        "| high-priority client | p50 ms | p99 ms | errors | flood answered | flood shed (503) |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        lines.append(
            f"| {name} | {s['high_p50_ms']} | {s['high_p99_ms']} | {s['high_errors']:g} "
            f"| {s['flood_answered']:g} | {s['flood_shed']:g} |"
        )
    (RESULTS / "shedding.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
