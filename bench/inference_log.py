"""What the inference log costs: the tabular benchmark with the log on and off.

    .venv/bin/python bench/inference_log.py [--duration 15] [--rounds 3] [--connections 64]

Serves the demo fraud model (XGBoost, 30 features) with ``inferd serve`` twice per round,
once with ``INFERD_INFERENCE_LOG__ENABLED=false`` and once with the log on (the default:
every request becomes a row of ``inference_logs`` in the SQLite registry database), in
alternating order, and drives each with the same closed-loop load (``wrk``, or
``inferd bench`` with ``--loadgen inferd``). Reports medians over rounds and the on/off
throughput ratio; writes bench/results/inference_log.{json,md}. Traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sqlite3
import statistics
import sys
import tempfile
from pathlib import Path

from servers import alternating
from tabular import measure, prepare

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=int, default=15)
    parser.add_argument("--connections", type=int, nargs="+", default=[64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="inferd gateway processes")
    parser.add_argument("--loadgen", choices=("wrk", "inferd"), default=None)
    args = parser.parse_args()
    if args.loadgen is None:
        args.loadgen = "wrk" if shutil.which("wrk") else "inferd"
    work = Path(tempfile.mkdtemp(prefix="inferd-bench-log-"))
    prepare(work)
    cmd = [sys.executable, "-m", "inferd", "serve", "--workers", str(args.workers),
           "--data-dir", str(work / "data"), "--grpc-port", "-1", "--port"]  # fmt: skip
    variants = {
        "log off": {"INFERD_LOG_LEVEL": "WARNING", "INFERD_INFERENCE_LOG__ENABLED": "false"},
        "log on": {"INFERD_LOG_LEVEL": "WARNING"},
    }
    rows: list[dict[str, object]] = []
    try:
        for name, proc, port in alternating(cmd, variants, args.rounds, work):
            url = f"http://127.0.0.1:{port}/api/v1/models/fraud/predict"
            measure(name, proc, url, args, rows)
        with sqlite3.connect(work / "data" / "inferd.db") as db:
            logged = db.execute("SELECT count(*) FROM inference_logs").fetchone()[0]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_results(rows, args, logged)


def write_results(rows: list[dict[str, object]], args: argparse.Namespace, logged: int) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "inference_log.json").write_text(
        json.dumps({"args": vars(args), "rows_logged": logged, "runs": rows}, indent=2)
    )
    lines = ["| connections | inference log | req/s (median) | p50 ms | p99 ms | errors |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    summary = []
    for c in args.connections:
        medians = {}
        for name in ("log off", "log on"):
            runs = [r for r in rows if r["server"] == name and r["connections"] == c]
            med = {k: statistics.median(float(r[k]) for r in runs)  # type: ignore[arg-type]
                   for k in ("rps", "p50_ms", "p99_ms", "errors")}  # fmt: skip
            medians[name] = med
            lines.append(
                f"| {c} | {name.split()[1]} | {med['rps']:.0f} | {med['p50_ms']:.2f} | "
                f"{med['p99_ms']:.2f} | {med['errors']:.0f} |"
            )
        ratio = medians["log on"]["rps"] / medians["log off"]["rps"]
        summary.append(f"c={c}: throughput with the log on / off = {ratio:.3f}")
    text = "\n".join([*lines, "", *summary, f"rows logged: {logged}", ""])
    (RESULTS / "inference_log.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
