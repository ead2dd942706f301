"""Explanation latency (#40): exact TreeSHAP of the demo fraud model (XGBoost, 30
features) and KernelSHAP of the demo iris model (ONNX, 4 features, every coalition,
against its 35 background rows), beside a predict of the same rows.

    .venv/bin/python bench/explain.py [--rounds 3] [--requests 50]

One ``inferd serve`` (this checkout, default settings, one gateway) with the two demo
models built here. Per round, for each model and each of 1 and 10 rows per request, in
alternating order: ``--requests`` explain requests and as many predict requests of the
same rows, one after another. Reports the medians over rounds of each one's p50 and
p99 (ms) and the explain / predict ratio of p50s; writes bench/results/explain.{json,md}.
Traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from servers import inferd_serving

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))
WIDTH = {"fraud": 30, "iris": 4}


def register(client: httpx.Client, work: Path) -> None:
    from inferd.demo.build import build_demo_model

    for name in WIDTH:
        built = build_demo_model(name, work)
        body: dict[str, Any] = {
            "version": "v1",
            "source_uri": f"file://{built.path}",
            "framework": built.framework,
            "metadata": built.metadata,
        }
        if built.signature is not None:
            body["signature"] = built.signature.to_dict()
        client.post(f"/api/v1/models/{name}/versions", json=body).raise_for_status()
    began = time.monotonic()
    while not all(client.get(f"/v2/models/{m}/ready").status_code == 200 for m in WIDTH):
        if time.monotonic() - began > 120:
            raise RuntimeError("the demo models are not ready in 120 s")
        time.sleep(0.05)


def timed(client: httpx.Client, path: str, body: dict[str, Any], n: int) -> list[float]:
    took = []
    for _ in range(n):
        began = time.perf_counter()
        client.post(path, json=body).raise_for_status()
        took.append((time.perf_counter() - began) * 1000)
    return took


def p99(values: list[float]) -> float:
    return float(np.percentile(values, 99))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=50)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {}
    rng = np.random.default_rng(0)
    with (
        tempfile.TemporaryDirectory(prefix="bench-explain-") as tmp,
        inferd_serving(Path(tmp)) as url,
    ):
        client = httpx.Client(base_url=url, timeout=120)
        register(client, Path(tmp) / "models")
        for r in range(args.rounds):
            for model, width in WIDTH.items():
                for rows in (1, 10):
                    x = rng.normal(size=(rows, width)) + (5.0 if model == "iris" else 0.0)
                    body = {"inputs": [{"features": v} for v in x.round(3).tolist()]}
                    order = ["explain", "predict"] if r % 2 == 0 else ["predict", "explain"]
                    got: dict[str, float] = {}
                    for kind in order:
                        path = f"/api/v1/models/{model}/{kind}"
                        timed(client, path, body, 3)  # its first calls: imports, threads
                        took = timed(client, path, body, args.requests)
                        got[f"{kind}_p50"] = statistics.median(took)
                        got[f"{kind}_p99"] = p99(took)
                    results.setdefault(f"{model} x{rows}", []).append(got)
                    print(f"round {r} {model:5} {rows:2} rows: explain p50 "
                          f"{got['explain_p50']:7.2f} ms p99 {got['explain_p99']:7.2f} | "
                          f"predict p50 {got['predict_p50']:6.2f} ms", flush=True)  # fmt: skip
    summary = {
        case: {
            key: round(statistics.median(run[key] for run in runs), 2)
            for key in ("explain_p50", "explain_p99", "predict_p50", "predict_p99")
        }
        for case, runs in results.items()
    }
    for figures in summary.values():
        figures["ratio_p50"] = round(figures["explain_p50"] / figures["predict_p50"], 1)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "explain.json").write_text(
        json.dumps({"args": vars(args), "rounds": results, "summary": summary}, indent=2)
    )
    text = table(summary, args)
    (RESULTS / "explain.md").write_text(text)
    print(text)


def table(summary: dict[str, dict[str, float]], args: argparse.Namespace) -> str:
    lines = [
        f"Explanation latency: `bench/explain.py --rounds {args.rounds} --requests "
        f"{args.requests}` (one client, one request at a time; medians over rounds)",
        "",
        "| model x rows | method | explain p50 / p99 ms | predict p50 / p99 ms "
        "| explain / predict p50 |",
        "|---|---|---|---|---|",
    ]
    for case, f in summary.items():
        method = "TreeSHAP (XGBoost)" if case.startswith("fraud") else "KernelSHAP (ONNX)"
        lines.append(
            f"| {case} | {method} | {f['explain_p50']:.2f} / {f['explain_p99']:.2f} "
            f"| {f['predict_p50']:.2f} / {f['predict_p99']:.2f} | {f['ratio_p50']}x |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
