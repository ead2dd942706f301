"""The result cache on a workload where 40 % of the requests repeat an earlier input
(the design documents' expected hit rate), cache on vs off.

    .venv/bin/python bench/cache.py [--duration 12] [--rounds 3] [--connections 64]

Serves the demo fraud model (XGBoost, 30 features) with ``inferd serve`` (2 gateway
processes, in-process cache), alternating ``INFERD_CACHE__ENABLED=false`` and ``true``
each round, and drives each with ``inferd bench --payloads``: a JSONL file where each
body is, with probability 0.4, one of 200 recurring inputs and otherwise a fresh one.
Reports medians over rounds, the on/off ratio and the measured hit rate; writes
bench/results/cache.{json,md}. Traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from servers import alternating
from tabular import prepare, wait_http

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
REPEAT = 0.4


def write_payloads(path: Path, lines: int, seed: int = 7) -> None:
    rng = random.Random(seed)

    def row() -> str:
        features = [round(rng.uniform(-2, 2), 4) for _ in range(30)]
        return json.dumps({"inputs": [{"features": features}]})

    recurring = [row() for _ in range(200)]
    with path.open("w") as f:
        for _ in range(lines):
            f.write((rng.choice(recurring) if rng.random() < REPEAT else row()) + "\n")


def run(url: str, payloads: Path, connections: int, duration_s: int) -> dict[str, float]:
    out = Path(tempfile.mkdtemp()) / "result.json"
    subprocess.run(
        [sys.executable, "-m", "inferd", "bench", url, "--payloads", str(payloads),
         "-c", str(connections), "-d", f"{duration_s}s", "--warmup", "0s", "--timeout", "10s",
         "--json", str(out)],
        capture_output=True, check=True,
    )  # fmt: skip
    level = json.loads(out.read_text())["levels"][0]
    shutil.rmtree(out.parent)
    return {
        "rps": level["rps"], "p50_ms": level["latency"]["p50"],
        "p99_ms": level["latency"]["p99"], "requests": level["requests"],
        "errors": level["errors"],
    }  # fmt: skip


def hit_rate(url: str, payloads: Path, n: int = 2000) -> float:
    """X-Cache over the first ``n`` bodies of a fresh server (one connection)."""
    import httpx

    hits = 0
    with httpx.Client(timeout=10) as client, payloads.open() as f:
        for _, line in zip(range(n), f, strict=False):
            reply = client.post(url, content=line.strip())
            hits += reply.headers.get("x-cache") == "hit"
    return hits / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=int, default=12)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="inferd-bench-cache-"))
    prepare(work)
    payloads = work / "payloads.jsonl"
    write_payloads(payloads, lines=200_000)
    cmd = [sys.executable, "-m", "inferd", "serve", "--workers", "2", "--data-dir",
           str(work / "data"), "--grpc-port", "-1", "--port"]  # fmt: skip
    variants = {
        "cache off": {"INFERD_LOG_LEVEL": "WARNING", "INFERD_CACHE__ENABLED": "false"},
        "cache on": {"INFERD_LOG_LEVEL": "WARNING", "INFERD_CACHE__ENABLED": "true"},
    }
    rows: list[dict[str, object]] = []
    rate = None
    try:
        for name, _, port in alternating(cmd, variants, args.rounds, work):
            url = f"http://127.0.0.1:{port}/api/v1/models/fraud/predict"
            wait_http(url)
            if name == "cache on" and rate is None:
                rate = hit_rate(url, payloads)
            r = run(url, payloads, args.connections, args.duration)
            rows.append({"server": name, **r})
            line = f"{name:>9} {r['rps']:8.0f} req/s  p50 {r['p50_ms']:6.2f} ms"
            print(f"{line}  p99 {r['p99_ms']:6.2f} ms  errors {r['errors']:.0f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_results(rows, args, rate or 0.0)


def write_results(rows: list[dict[str, object]], args: argparse.Namespace, rate: float) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cache.json").write_text(
        json.dumps({"args": vars(args), "hit_rate": rate, "runs": rows}, indent=2)
    )
    lines = [
        "| result cache | req/s (median) | p50 ms | p99 ms | errors |",
        "|---|---|---|---|---|",
    ]
    med = {}
    for name in ("cache off", "cache on"):
        runs = [r for r in rows if r["server"] == name]
        med[name] = {k: statistics.median(float(r[k]) for r in runs)  # type: ignore[arg-type]
                     for k in ("rps", "p50_ms", "p99_ms", "errors")}  # fmt: skip
        m = med[name]
        lines.append(f"| {name.split()[1]} | {m['rps']:.0f} | {m['p50_ms']:.2f} | "
                     f"{m['p99_ms']:.2f} | {m['errors']:.0f} |")  # fmt: skip
    ratio = med["cache on"]["rps"] / med["cache off"]["rps"]
    text = "\n".join([*lines, "", f"throughput cache on / off = {ratio:.3f}",
                      f"hit rate over the first 2000 requests: {rate:.1%}", ""])  # fmt: skip
    (RESULTS / "cache.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
