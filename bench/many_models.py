"""Many small models on one machine (#38): memory and latency with shared replica
processes against a process per version, and versions loaded on demand.

    .venv/bin/python bench/many_models.py [--models 200] [--requests 2000]
        [--per-process 50] [--fit 30] [--variants shared,dedicated,on-demand]

The models, built here (each with its own seed): a third scikit-learn pipelines
(StandardScaler + LogisticRegression over 8 features, 2,000 rows), a third XGBoost
boosters (20 trees of depth 4), a third ONNX (such a pipeline converted by skl2onnx);
registered into one data folder, each its own model. Variants, one ``inferd serve`` each
(one gateway process), one after the other:

- ``dedicated``: a process per version (``models.versions_per_process`` 1);
- ``shared``: ``--per-process`` versions per shared process;
- ``on-demand``: shared, with a memory budget (``models.memory_budget_mb``) that fits
  about ``--fit`` versions (``--fit`` times the median ``model_bytes`` the shared variant's
  replicas reported): nothing loaded at start.

For the first two, once every version is ready: the server's process tree's memory
(RSS and PSS from ``/proc/PID/smaps_rollup``; PSS counts pages shared between processes
once), then ``--requests`` hot requests one after another, each one row to a random
version (the same sequence for both). For ``on-demand``: every version requested once in
a random order (each a cold start: its load, then the answer), then ``--requests``
random requests over all of them (loads and evictions as they come). Latencies are
client-side (httpx, one kept connection). Writes bench/results/many_models.{json,md}.
Traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.servers import tree_memory_by_kind  # noqa: E402
from tests.conftest import InferdServer, push_folder  # noqa: E402

RESULTS = ROOT / "bench" / "results"
FEATURES = 8
MIN_AVAILABLE_MB = 1500


def build(folder: Path, n: int) -> list[str]:
    """``n`` small models under ``folder``, each in its own subfolder; their names."""
    import joblib
    import xgboost
    from skl2onnx import to_onnx
    from skl2onnx.common.data_types import FloatTensorType
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    names = []
    for i in range(n):
        rng = np.random.default_rng(i)
        x = rng.normal(size=(2000, FEATURES)).astype(np.float32)
        y = (x @ rng.normal(size=FEATURES) > 0).astype(int)
        kind = ("sklearn", "xgboost", "onnx")[i % 3]
        name = f"{kind}-{i:03d}"
        out = folder / name
        out.mkdir(parents=True)
        if kind == "xgboost":
            booster = xgboost.train(
                {"max_depth": 4, "objective": "binary:logistic", "nthread": 1},
                xgboost.DMatrix(x, label=y), num_boost_round=20,
            )  # fmt: skip
            booster.save_model(out / "model.json")
        else:
            pipeline = make_pipeline(StandardScaler(), LogisticRegression()).fit(x, y)
            if kind == "sklearn":
                joblib.dump(pipeline, out / "model.joblib")
            else:
                inputs = [("features", FloatTensorType([None, FEATURES]))]
                onnx = to_onnx(pipeline, initial_types=inputs, options={"zipmap": False})
                (out / "model.onnx").write_bytes(onnx.SerializeToString())
        names.append(name)
    return names


def register(data: Path, folder: Path, names: list[str]) -> None:
    for name in names:
        push_folder(data, name, folder / name, "v1")


def available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return math.inf


def wait_all_ready(server: InferdServer, n: int, timeout_s: float = 900) -> float:
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        if available_mb() < MIN_AVAILABLE_MB:  # a process per version may not fit
            raise MemoryError(f"under {MIN_AVAILABLE_MB} MiB of memory left; stopped")
        listing = server.client.get("/api/v1/models").json()
        if sum(m["ready"] for m in listing["models"]) == n and listing["versions"]["loaded"] == n:
            return time.monotonic() - began
        time.sleep(1.0)
    raise RuntimeError(f"not all {n} versions ready in {timeout_s}s:\n{server.log()[-3000:]}")


def body(rng: random.Random) -> dict[str, Any]:
    return {"inputs": [{"features": [round(rng.gauss(0, 1), 3) for _ in range(FEATURES)]}]}


def timed_requests(client: httpx.Client, sequence: list[str], seed: int) -> tuple[list[float], int]:
    rng = random.Random(seed)
    took, errors = [], 0
    for name in sequence:
        began = time.perf_counter()
        reply = client.post(f"/api/v1/models/{name}/predict", json=body(rng), timeout=120)
        took.append(time.perf_counter() - began)
        errors += reply.status_code != 200
    return took, errors


def quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "p50_ms": round(statistics.median(ordered) * 1000, 2),
        "p99_ms": round(
            ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)] * 1000, 2
        ),
    }


def run_variant(
    data: Path, names: list[str], env: dict[str, str], requests: int, on_demand: bool
) -> dict[str, Any]:
    server = InferdServer(data, workers=1, env={"INFERD_LOG_LEVEL": "WARNING", **env})
    out: dict[str, Any] = {"env": env}
    try:
        server.wait_ready(timeout_s=600, path="/health/live")
        client = httpx.Client(base_url=server.url, timeout=120)
        rng = random.Random(1)
        sequence = [rng.choice(names) for _ in range(requests)]
        if on_demand:
            first = list(names)
            random.Random(2).shuffle(first)
            cold, errors = timed_requests(client, first, 3)
            out["cold"] = {**quantiles(cold), "errors": errors}
            hot, errors = timed_requests(client, sequence, 4)
            out["random"] = {**quantiles(hot), "errors": errors}
            metrics = client.get("/metrics").text
            for line in metrics.splitlines():
                if line.startswith(("inferd_on_demand_loads_total", "inferd_on_demand_evictions")):
                    out[line.split()[0]] = float(line.split()[1])
        else:
            out["ready_s"] = round(wait_all_ready(server, len(names)), 1)
            time.sleep(5)  # settle
            memory = tree_memory_by_kind(server.process.pid)
            out["memory"] = memory
            out["rss_mb"] = round(sum(k["rss_mb"] for k in memory.values()), 1)
            out["pss_mb"] = round(sum(k["pss_mb"] for k in memory.values()), 1)
            out["model_bytes"] = _model_bytes(client, names)
            timed_requests(client, sequence[:200], 5)  # warm the connection and gateway
            hot, errors = timed_requests(client, sequence, 6)
            out["hot"] = {**quantiles(hot), "errors": errors}
    finally:
        server.stop(timeout_s=120)
    return out


def _model_bytes(client: httpx.Client, names: list[str]) -> list[int]:
    found = []
    for name in names:
        replicas = client.get(f"/api/v1/models/{name}/versions/v1").json()["replicas"]
        stats = replicas[0].get("stats", {}) if replicas else {}
        if "model_bytes" in stats:
            found.append(int(stats["model_bytes"]))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=int, default=200)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--per-process", type=int, default=50)
    parser.add_argument("--fit", type=int, default=30)
    parser.add_argument("--variants", default="shared,dedicated,on-demand")
    args = parser.parse_args()
    variants = args.variants.split(",")
    results: dict[str, Any] = {"args": vars(args)}
    with tempfile.TemporaryDirectory(prefix="inferd-bench-many-") as tmp:
        work = Path(tmp)
        names = build(work / "models", args.models)
        register(work / "data", work / "models", names)
        shared_env = {"INFERD_MODELS__VERSIONS_PER_PROCESS": str(args.per_process)}
        for variant in variants:
            if variant == "dedicated":
                env = {"INFERD_MODELS__VERSIONS_PER_PROCESS": "1"}
            elif variant == "shared":
                env = shared_env
            else:
                sizes = results.get("shared", {}).get("model_bytes") or [8 << 20]
                budget = math.ceil(statistics.median(sizes) * args.fit / 2**20)
                env = {**shared_env, "INFERD_MODELS__MEMORY_BUDGET_MB": str(budget)}
            try:
                results[variant] = run_variant(
                    work / "data", names, env, args.requests, variant == "on-demand"
                )
            except MemoryError as exc:
                results[variant] = {"env": env, "failed": str(exc)}
                continue
            print(variant, json.dumps({k: v for k, v in results[variant].items()
                                       if k not in ("memory", "model_bytes")}),
                  file=sys.stderr, flush=True)  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "many_models.json").write_text(json.dumps(results, indent=2))
    (RESULTS / "many_models.md").write_text(table(results, args))
    print(table(results, args))


def table(results: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"{args.models} small models (`bench/many_models.py --models {args.models} --requests "
        f"{args.requests} --per-process {args.per_process} --fit {args.fit}`)",
        "",
        "| variant | processes | RSS MiB | PSS MiB | hot p50 / p99 ms | errors |",
        "|---|---|---|---|---|---|",
    ]
    for variant in ("dedicated", "shared"):
        got = results.get(variant)
        if not got or "failed" in got:
            if got:
                lines.append(f"| {variant} | {got['failed']} | | | | |")
            continue
        processes = sum(k["processes"] for k in got["memory"].values())
        hot = got["hot"]
        lines.append(
            f"| {variant} | {processes} | {got['rss_mb']:,.0f} | {got['pss_mb']:,.0f} "
            f"| {hot['p50_ms']} / {hot['p99_ms']} | {hot['errors']} |"
        )
    if "hot" in results.get("shared", {}) and "hot" in results.get("dedicated", {}):
        s, d = results["shared"], results["dedicated"]
        lines += [
            "",
            f"shared / dedicated: RSS {s['rss_mb'] / d['rss_mb']:.3f}, PSS "
            f"{s['pss_mb'] / d['pss_mb']:.3f}, hot p50 "
            f"{s['hot']['p50_ms'] / d['hot']['p50_ms']:.2f}x, "
            f"p99 {s['hot']['p99_ms'] / d['hot']['p99_ms']:.2f}x",
        ]
    if "on-demand" in results:
        o = results["on-demand"]
        lines += [
            "",
            f"on demand ({o['env'].get('INFERD_MODELS__MEMORY_BUDGET_MB')} MiB budget): first "
            f"request of each version (cold) p50 / p99 {o['cold']['p50_ms']} / "
            f"{o['cold']['p99_ms']} ms; then {args.requests} random requests p50 / p99 "
            f"{o['random']['p50_ms']} / {o['random']['p99_ms']} ms, errors "
            f"{o['cold']['errors'] + o['random']['errors']}, loads "
            f"{o.get('inferd_on_demand_loads_total', 0):.0f}, evictions "
            f"{o.get('inferd_on_demand_evictions_total', 0):.0f}",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
