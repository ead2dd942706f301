"""A 100,000-row batch job vs online closed-loop throughput, same model, same server.

    .venv/bin/python bench/batch_job.py [--rows 100000] [--rounds 3] [--duration 15]

Serves the demo fraud model (XGBoost, 30 features) with ``inferd serve`` (2 gateway
processes, default settings: the SQLite queue, chunks of 256 inputs, 4 in flight). Each
round: the online figure — ``inferd bench`` with 64 connections, one row per request,
closed loop — then one batch job of ``--rows`` rows (``POST /api/v1/batch``, inputs
inline), timed from submit to ``succeeded`` (and the runner's own start-to-finish).
Reports medians of rows/s and the ratio; writes bench/results/batch_job.{json,md}.
Traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx
from servers import free_port, start, stop
from tabular import ROW, prepare, run_inferd_bench, wait_http

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def run_job(base: str, rows: int) -> dict[str, float]:
    rng = random.Random(0)
    inputs = [{"features": [v + rng.uniform(-0.1, 0.1) for v in ROW]} for _ in range(rows)]
    body = json.dumps({"model": "fraud", "inputs": inputs})
    with httpx.Client(base_url=base, timeout=300) as client:
        submitted = time.perf_counter()
        reply = client.post("/api/v1/batch", content=body)
        accepted = time.perf_counter() - submitted
        assert reply.status_code == 202, reply.text
        job_id = reply.json()["batch_id"]
        while (job := client.get(f"/api/v1/batch/{job_id}").json())["status"] != "succeeded":
            assert job["status"] in ("queued", "running"), job
            time.sleep(0.1)
        wall = time.perf_counter() - submitted
        lines = sum(1 for _ in client.get(f"/api/v1/batch/{job_id}/results").iter_lines())
    assert lines == rows and job["failed"] == 0
    ran = (
        datetime.fromisoformat(job["finished_at"]) - datetime.fromisoformat(job["started_at"])
    ).total_seconds()
    return {"submit_s": accepted, "wall_s": wall, "run_s": ran, "rows_per_s": rows / wall,
            "run_rows_per_s": rows / ran}  # fmt: skip


def latency_during_job(base: str, url: str, rows: int) -> dict[str, float]:
    """One online client (closed loop, 5 s) while a batch job of ``rows`` runs."""
    result: dict[str, dict[str, float]] = {}
    worker = threading.Thread(target=lambda: result.update(job=run_job(base, rows)))
    worker.start()
    with httpx.Client(base_url=base, timeout=60) as client:
        while not _running(client):
            time.sleep(0.05)
    during = run_inferd_bench(url, 1, 5)
    worker.join()
    return during


def _running(client: httpx.Client) -> bool:
    return bool(client.get("/api/v1/batch", params={"status": "running"}).json()["jobs"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=int, default=15)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="inferd-bench-batch-"))
    prepare(work)
    port = free_port()
    cmd = [sys.executable, "-m", "inferd", "serve", "--workers", str(args.workers),
           "--data-dir", str(work / "data"), "--grpc-port", "-1", "--port", str(port)]  # fmt: skip
    proc = start(cmd, {"INFERD_LOG_LEVEL": "WARNING"}, work / "server.log")
    base = f"http://127.0.0.1:{port}"
    url = f"{base}/api/v1/models/fraud/predict"
    runs: list[dict[str, object]] = []
    try:
        wait_http(url)
        run_inferd_bench(url, 64, 3)  # warm-up
        for round_ in range(args.rounds):
            online = run_inferd_bench(url, 64, args.duration)
            job = run_job(base, args.rows)
            alone = run_inferd_bench(url, 1, 5)
            during = latency_during_job(base, url, args.rows * 2)
            runs.append({
                "round": round_, "online_rows_per_s": online["rps"], **job,
                "c1_p50_alone_ms": alone["p50_ms"], "c1_p99_alone_ms": alone["p99_ms"],
                "c1_p50_during_ms": during["p50_ms"], "c1_p99_during_ms": during["p99_ms"],
            })  # fmt: skip
            print(
                f"  one client alone p50 {alone['p50_ms']:.2f} p99 {alone['p99_ms']:.2f} ms;"
                f" during a job p50 {during['p50_ms']:.2f} p99 {during['p99_ms']:.2f} ms"
            )
            print(
                f"round {round_}: online {online['rps']:.0f} rows/s "
                f"(p99 {online['p99_ms']:.1f} ms);"
                f" batch job {job['rows_per_s']:.0f} rows/s submit-to-done ({job['wall_s']:.1f} s,"
                f" submit {job['submit_s']:.1f} s), {job['run_rows_per_s']:.0f} rows/s running",
                flush=True,
            )
    finally:
        stop(proc)
        shutil.rmtree(work, ignore_errors=True)
    write_results(runs, args)


def write_results(runs: list[dict[str, object]], args: argparse.Namespace) -> None:
    def med(key: str) -> float:
        return statistics.median(float(r[key]) for r in runs)  # type: ignore[arg-type]

    online, batch, running = med("online_rows_per_s"), med("rows_per_s"), med("run_rows_per_s")
    text = "\n".join([
        "| mode | rows/s (median) | vs online |",
        "|---|---|---|",
        f"| online, 64 connections, 1 row per request | {online:,.0f} | 1.00 |",
        f"| batch job, {args.rows:,} rows, submit to done | {batch:,.0f} | {batch / online:.2f} |",
        f"| batch job, runner start to finish | {running:,.0f} | {running / online:.2f} |",
        "",
        f"submit (upload + queue) {med('submit_s'):.1f} s, whole job {med('wall_s'):.1f} s "
        f"(medians of {len(runs)} rounds)",
        "",
        "| one online client (closed loop, 5 s) | p50 ms | p99 ms |",
        "|---|---|---|",
        f"| alone | {med('c1_p50_alone_ms'):.2f} | {med('c1_p99_alone_ms'):.2f} |",
        f"| while a {args.rows * 2:,}-row job runs | {med('c1_p50_during_ms'):.2f} | "
        f"{med('c1_p99_during_ms'):.2f} |",
        "",
    ])  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "batch_job.json").write_text(
        json.dumps({"args": vars(args), "runs": runs}, indent=2)
    )
    (RESULTS / "batch_job.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
