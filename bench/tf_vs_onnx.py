"""TensorFlow models: TensorFlow's own runtime vs the ONNX model tf2onnx makes of them.

For each model (an MLP over 30 features, like the fraud demo; a small CNN over 28x28
images), saved as ``.keras`` and converted as a push converts it
(:mod:`inferd.runtimes.tf_onnx`), each runtime runs in a fresh process, one thread, as
a replica runs it: load time (imports included), memory (RSS) once loaded and warm,
latency of one-row calls and throughput of 64-row batches. Rounds alternate the two;
the table has medians and the ratio TensorFlow / ONNX.

    .venv/bin/python bench/tf_vs_onnx.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build(work: Path) -> dict[str, Path]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    keras.utils.set_random_seed(0)
    folders = {}
    mlp_in = keras.Input((30,), name="features")
    x = keras.layers.Dense(64, activation="relu")(mlp_in)
    x = keras.layers.Dense(64, activation="relu")(x)
    mlp = keras.Model(mlp_in, keras.layers.Dense(2, activation="softmax", name="probabilities")(x))
    cnn_in = keras.Input((28, 28, 1), name="image")
    y = keras.layers.Conv2D(16, 3, activation="relu")(cnn_in)
    y = keras.layers.MaxPooling2D()(y)
    y = keras.layers.Conv2D(32, 3, activation="relu")(y)
    y = keras.layers.GlobalAveragePooling2D()(y)
    cnn = keras.Model(cnn_in, keras.layers.Dense(10, activation="softmax", name="scores")(y))
    for name, model in (("mlp", mlp), ("cnn", cnn)):
        folder = work / name / "tensorflow"
        folder.mkdir(parents=True)
        model.save(folder / f"{name}.keras")
        from inferd.runtimes.tf_onnx import convert

        converted = convert(folder, work / name / "onnx")
        assert converted.framework == "onnx", converted.metadata
        folders[name] = work / name
    return folders


def measure(framework: str, folder: Path) -> dict[str, float]:
    """In this (fresh) process: load, warm up, time; the figures."""
    start = time.perf_counter()
    import numpy as np

    from inferd.runtimes import load_runtime
    from inferd.runtimes.base import RuntimeConfig

    runtime = load_runtime(framework, folder, RuntimeConfig(threads=1))
    one = runtime.warmup_inputs()
    rng = np.random.default_rng(0)
    one = {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in one.items()}
    runtime.run(one)
    load_s = time.perf_counter() - start
    latencies = []
    for _ in range(2000):
        t = time.perf_counter()
        runtime.predict_batch(one)
        latencies.append(time.perf_counter() - t)
    batch = {k: np.repeat(v, 64, axis=0) for k, v in one.items()}
    runtime.predict_batch(batch)
    t = time.perf_counter()
    calls = 0
    while time.perf_counter() - t < 3.0:
        runtime.predict_batch(batch)
        calls += 1
    rows_per_s = calls * 64 / (time.perf_counter() - t)
    rss_kib = next(
        int(line.split()[1])
        for line in Path("/proc/self/status").read_text().splitlines()
        if line.startswith("VmRSS:")
    )
    latencies.sort()
    return {
        "load_s": load_s,
        "rss_mib": rss_kib / 1024,
        "p50_us": latencies[len(latencies) // 2] * 1e6,
        "p99_us": latencies[int(len(latencies) * 0.99)] * 1e6,
        "rows_per_s_b64": rows_per_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--measure", nargs=2, metavar=("FRAMEWORK", "FOLDER"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure[0], Path(args.measure[1]))))
        return
    results: dict[str, dict[str, dict[str, list[float]]]] = {}
    with tempfile.TemporaryDirectory(prefix="inferd-bench-tf-") as tmp:
        folders = build(Path(tmp))
        for r in range(args.rounds):
            order = ("tensorflow", "onnx") if r % 2 == 0 else ("onnx", "tensorflow")
            for name, folder in folders.items():
                for framework in order:
                    out = subprocess.run(
                        [sys.executable, __file__, "--measure", framework, str(folder / framework)],
                        capture_output=True,
                        text=True,
                        check=True,
                        cwd=ROOT,
                        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
                    )
                    got = json.loads(out.stdout.strip().splitlines()[-1])
                    print(f"round {r + 1} {name} {framework}: {got}", file=sys.stderr)
                    for key, value in got.items():
                        per = results.setdefault(name, {}).setdefault(framework, {})
                        per.setdefault(key, []).append(value)
    keys = ("load_s", "rss_mib", "p50_us", "p99_us", "rows_per_s_b64")
    print(f"| model | runtime | {' | '.join(keys)} |")
    print("|---|---|" + "---|" * len(keys))
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for name, per in results.items():
        for framework, figures in per.items():
            medians = {k: statistics.median(figures[k]) for k in keys}
            summary.setdefault(name, {})[framework] = medians
            cells = " | ".join(f"{medians[k]:.3g}" for k in keys)
            print(f"| {name} | {framework} | {cells} |")
        tf_, ox = summary[name]["tensorflow"], summary[name]["onnx"]
        ratios = " | ".join(f"{tf_[k] / ox[k]:.2f}x" for k in keys)
        print(f"| {name} | TF / ONNX | {ratios} |")
    print(f"\nmedians of {args.rounds} rounds; {os.cpu_count()} cores; one thread per runtime")
    results_dir = ROOT / "bench" / "results"
    (results_dir / "tf_vs_onnx.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
