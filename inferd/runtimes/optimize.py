"""``inferd models optimize``: a faster variant of a registered version, measured.

``--int8`` applies PyTorch dynamic quantization to the linear layers of a transformers
model (weights int8, activations quantized on the fly; CPU), except the feed-forward
down-projections whose inputs carry BERT's activation outliers (``--all-layers``: those
too; faster, and measured less accurate). The new version holds the same files as the
original, with metadata ``quantization: int8`` (or ``int8-all``) telling the runtime to
quantize when it loads (dynamic quantization is deterministic: every replica computes
the same int8 weights), and ``optimization`` holding what was measured here, on this
machine, before registering it:

- speed: texts/s of the float32 and the int8 model over the evaluation texts in batches
  of ``batch_size`` (best of ``rounds`` passes each, alternating), and their ratio;
- quality: for embeddings, the cosine similarity of each int8 embedding to the float32
  one (mean and minimum); for classifiers, how often both predict the same label, and
  accuracy of each where the evaluation texts have labels.

Evaluation texts: a CSV (``text`` and optional ``label`` columns) or JSON Lines file
(``{"text", "label"?}``), by default the product reviews bundled with the demo.
"""

from __future__ import annotations

import csv
import json
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from inferd.errors import InvalidInput
from inferd.runtimes import load_runtime
from inferd.runtimes.base import Runtime, RuntimeConfig

METHOD = "PyTorch dynamic quantization (qint8) of the linear layers but the down-projections"
METHOD_ALL = "PyTorch dynamic quantization (qint8) of every linear layer"


@dataclass
class EvalSet:
    texts: list[str]
    labels: list[str] | None
    source: str


def read_eval_set(path: Path | None) -> EvalSet:
    if path is None:
        from inferd.demo.text import read_reviews

        texts, labels = read_reviews()
        return EvalSet(texts, labels, "inferd/demo/data/sentiment.csv (bundled product reviews)")
    rows: list[dict[str, Any]]
    if path.suffix == ".csv":
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
    else:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows or any(not isinstance(r, dict) or not r.get("text") for r in rows):
        raise InvalidInput(f"{path}: every row needs a non-empty 'text'")
    texts = [str(r["text"]) for r in rows]
    labelled = all(r.get("label") for r in rows)
    return EvalSet(texts, [str(r["label"]) for r in rows] if labelled else None, str(path))


def _texts(batch: list[str]) -> dict[str, np.ndarray]:
    array = np.empty(len(batch), dtype=object)
    array[:] = batch
    return {"text": array}


def _run_all(runtime: Runtime, texts: list[str], batch_size: int) -> dict[str, np.ndarray]:
    parts = [
        runtime.run(_texts(texts[i : i + batch_size])) for i in range(0, len(texts), batch_size)
    ]
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


def _timed(runtime: Runtime, texts: list[str], batch_size: int) -> float:
    started = time.perf_counter()
    _run_all(runtime, texts, batch_size)
    return time.perf_counter() - started


def measure_int8(
    artifact_dir: Path,
    metadata: dict[str, Any],
    evalset: EvalSet,
    threads: int = 1,
    batch_size: int = 32,
    rounds: int = 3,
    every_layer: bool = False,
) -> dict[str, Any]:
    """Load the float32 and the int8 model from ``artifact_dir``, compare them on
    ``evalset``; the ``optimization`` metadata of the int8 version."""
    base_meta = {k: v for k, v in metadata.items() if k not in ("quantization", "optimization")}
    if base_meta.get("dtype", "float32") != "float32":
        raise InvalidInput("int8 quantization starts from a float32 version")
    base_meta["device"] = "cpu"
    fp32 = load_runtime("transformers", artifact_dir, RuntimeConfig(threads, base_meta))
    if getattr(fp32, "task", None) == "score":
        fp32.unload()
        raise InvalidInput(
            "int8 is measured for embedding models and classifiers; a cross-encoder (task "
            "score) takes text pairs, which the evaluation set does not have"
        )
    scheme = "int8-all" if every_layer else "int8"
    int8 = load_runtime(
        "transformers", artifact_dir, RuntimeConfig(threads, {**base_meta, "quantization": scheme})
    )
    try:
        texts = evalset.texts
        reference = _run_all(fp32, texts, batch_size)
        quantized = _run_all(int8, texts, batch_size)
        fp32_s, int8_s = [], []
        for _ in range(rounds):  # alternating, so drift on a shared machine hits both
            fp32_s.append(_timed(fp32, texts, batch_size))
            int8_s.append(_timed(int8, texts, batch_size))
        result: dict[str, Any] = {
            "method": METHOD_ALL if every_layer else METHOD,
            "quantization": scheme,
            "fp32_texts_per_s": round(len(texts) / min(fp32_s), 1),
            "int8_texts_per_s": round(len(texts) / min(int8_s), 1),
            "speedup": round(min(fp32_s) / min(int8_s), 3),
            "eval_texts": len(texts),
            "eval_source": evalset.source,
            "batch_size": batch_size,
            "threads": threads,
            "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        if "embedding" in reference:
            result.update(_embedding_quality(reference["embedding"], quantized["embedding"]))
        else:
            result.update(_classifier_quality(fp32, reference, quantized, evalset))
        return result
    finally:
        fp32.unload()
        int8.unload()


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def _embedding_quality(reference: np.ndarray, quantized: np.ndarray) -> dict[str, float]:
    """Cosine of each int8 embedding to its float32 one; and what a search sees: how
    often a text's nearest other text is the same, and the rank correlation (Spearman)
    of all pairwise similarities."""
    cosine = _cosine(reference, quantized)
    a = reference / np.linalg.norm(reference, axis=1, keepdims=True)
    b = quantized / np.linalg.norm(quantized, axis=1, keepdims=True)
    sim_a, sim_b = a @ a.T, b @ b.T
    np.fill_diagonal(sim_a, -np.inf)
    np.fill_diagonal(sim_b, -np.inf)
    upper = np.triu_indices(len(a), 1)
    return {
        "cosine_mean": round(float(cosine.mean()), 6),
        "cosine_min": round(float(cosine.min()), 6),
        "nearest_neighbour_agreement": round(
            float(np.mean(sim_a.argmax(axis=1) == sim_b.argmax(axis=1))), 6
        ),
        "similarity_spearman": round(_spearman(sim_a[upper], sim_b[upper]), 6),
    }


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    rank_x = np.empty(len(x))
    rank_x[np.argsort(x, kind="stable")] = np.arange(len(x))
    rank_y = np.empty(len(y))
    rank_y[np.argsort(y, kind="stable")] = np.arange(len(y))
    return float(np.corrcoef(rank_x, rank_y)[0, 1])


def _classifier_quality(
    runtime: Runtime,
    reference: dict[str, np.ndarray],
    quantized: dict[str, np.ndarray],
    evalset: EvalSet,
) -> dict[str, Any]:
    if "label" not in reference:  # a regression head
        diff = np.abs(reference["prediction"] - quantized["prediction"])
        return {"max_abs_diff": round(float(diff.max()), 6)}
    result: dict[str, Any] = {
        "label_agreement": round(float(np.mean(reference["label"] == quantized["label"])), 6),
        "max_probability_diff": round(
            float(np.abs(reference["probabilities"] - quantized["probabilities"]).max()), 6
        ),
    }
    labels = runtime.signature.labels
    if evalset.labels is not None and labels is not None:
        names = np.asarray(labels, dtype=object)
        truth = np.asarray(evalset.labels, dtype=object)
        if set(truth) <= set(labels):
            result["fp32_accuracy"] = round(float(np.mean(names[reference["label"]] == truth)), 6)
            result["int8_accuracy"] = round(float(np.mean(names[quantized["label"]] == truth)), 6)
    return result
