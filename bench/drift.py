"""Input drift: how soon a shift is flagged, how often an unshifted stream is, and what
counting the inputs costs the predict path.

    .venv/bin/python bench/drift.py [--duration 10] [--rounds 3] [--connections 64]
        [--windows 1000] [--trials 5]

The demo fraud model (XGBoost, 30 features) is registered with a reference sample
(``drift_reference.npz``: 5,000 rows of its own synthetic training distribution, the
features named by its metadata). Three measurements:

1. **Statistics** (no server; the code the server runs: ``Binner``, ``DriftWindow``,
   ``scores``): the false-alarm rate over ``--windows`` windows of 1,000 unshifted rows
   (a window with any of the 30 features at or over PSI 0.2), and the detection delay in
   rows for one feature moved by 0.5, 1 and 2 standard deviations, with the window fed
   100 rows a look (median and p90 over 50 trials).
2. **Cost**: in process, what counting a batch adds to the model's compute of it
   (``DriftCounter.observe``, its bulk counts included, against ``predict_batch`` of the
   same rows, interleaved, medians); then ``inferd serve`` with ``drift.enabled`` off and
   on (``interval_s`` 1, so the replica counts and the server collects all along),
   alternating order, each driven by the tabular benchmark's closed loop (one row per
   request): the medians and the on/off throughput ratio.
3. **Detection end to end**: the server (drift on, 1 s collections, 1,000-row window)
   takes a steady stream of unshifted rows (25-row requests, ~500 rows/s), then one
   feature moved by 2 sigma; the seconds and rows from the shift to the drift view
   naming that feature, over ``--trials`` shifts (back to unshifted between them until
   the view is calm again). Every view read while the stream is unshifted and the window
   full counts towards the end-to-end false-alarm rate.

Writes bench/results/drift.{json,md}. Servers are started and stopped here; traffic
stays on 127.0.0.1.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as replicas run (no spinning threads)

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from servers import alternating, free_port, start, stop, wait_ready
from tabular import measure

from inferd.monitoring.drift_stats import Counts, DriftWindow, scores
from inferd.shapes.drift import Profile
from inferd.shapes.tensors import Signature, TensorSpec
from inferd.telemetry.drift import REFERENCE_FILE, Binner, build_profile

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
THRESHOLD = 0.2
WINDOW_ROWS = 1000
LOOK_ROWS = 100
SHIFTED = 3
"""The feature moved (the fourth of the demo's 30)."""


def fraud_data() -> np.ndarray:
    """The fraud demo's synthetic transactions (its training distribution), shuffled."""
    from sklearn.datasets import make_classification

    from inferd.demo.build import FRAUD_FEATURES, SEED

    x, _ = make_classification(
        n_samples=20_000, n_features=len(FRAUD_FEATURES), n_informative=12, n_redundant=6,
        weights=[0.95], flip_y=0.005, class_sep=1.2, random_state=SEED,
    )  # fmt: skip
    return np.random.default_rng(0).permutation(x.astype(np.float32))


# -- 1. statistics -------------------------------------------------------------------------


def simulate(data: np.ndarray, windows: int) -> dict[str, object]:
    """False alarms over ``windows`` unshifted windows; detection delays in rows."""
    from inferd.demo.build import FRAUD_FEATURES

    signature = Signature((TensorSpec("features", "FP32", (-1, 30)),), ())
    names = {"features": list(FRAUD_FEATURES)}
    profile = build_profile(signature, {"features": data[:5000]}, "sample", names)
    pool, std = data[5000:], data[:5000].std(axis=0)
    rng = np.random.default_rng(1)
    binner = Binner(profile.features)

    def look(rows: int, shift: float = 0.0) -> Counts:
        x = pool[rng.integers(0, len(pool), rows)].copy()
        x[:, SHIFTED] += shift * std[SHIFTED]
        counts, sums, squares, n = binner.count({"features": x})
        return Counts(0, 0, n, counts, sums, squares)

    alarms, largest = 0, []
    began = time.perf_counter()
    for _ in range(windows):
        found = scores(profile, look(WINDOW_ROWS), THRESHOLD)
        alarms += any(e["drifted"] for e in found)
        largest.append(found[0]["psi"])
    score_s = (time.perf_counter() - began) / windows
    delays = {str(shift): delay_rows(profile, look, shift) for shift in (0.5, 1.0, 2.0)}
    return {
        "windows": windows,
        "false_alarm_rate": alarms / windows,
        "largest_psi_median": statistics.median(largest),
        "largest_psi_max": max(largest),
        "count_and_score_ms_per_window": round(score_s * 1000, 3),
        "delay_rows": delays,
        "feature": profile.features[SHIFTED].name,
    }


def delay_rows(profile: Profile, look: object, shift: float, trials: int = 50) -> dict:
    """Rows after the shift until the moved feature is flagged (looks of 100 rows)."""
    found: list[int] = []
    missed = 0
    for _ in range(trials):
        window = DriftWindow()
        for t in range(WINDOW_ROWS // LOOK_ROWS):
            window.add(_at(look(LOOK_ROWS), t))  # type: ignore[operator]
        for n in range(1, 4 * WINDOW_ROWS // LOOK_ROWS + 1):
            t = WINDOW_ROWS // LOOK_ROWS + n
            window.add(_at(look(LOOK_ROWS, shift), t))  # type: ignore[operator]
            current = window.current(t, WINDOW_ROWS, 1e9)
            flagged = [e["name"] for e in scores(profile, current, THRESHOLD) if e["drifted"]]  # type: ignore[arg-type]
            if profile.features[SHIFTED].name in flagged:
                found.append(n * LOOK_ROWS)
                break
        else:
            missed += 1
    quantiles = np.quantile(found, [0.5, 0.9]) if found else [None, None]
    return {"median": quantiles[0], "p90": quantiles[1], "missed": missed, "trials": trials}


def _at(counts: Counts, t: float) -> Counts:
    counts.since, counts.until = t - 1, t
    return counts


# -- 2. cost ------------------------------------------------------------------------------


def prepare(work: Path, data: np.ndarray) -> Path:
    """The demo fraud model with its reference sample, registered; its stored folder."""
    from inferd.demo.build import build_demo_model
    from inferd.registry import Registry
    from inferd.runtimes import inspect_artifact

    demo = build_demo_model("fraud", work / "src")
    np.savez(demo.path / REFERENCE_FILE, features=data[:5000])
    framework, signature = inspect_artifact(
        demo.path, demo.framework, demo.metadata, demo.signature
    )
    registry = Registry(f"sqlite:///{work / 'data' / 'inferd.db'}", work / "data" / "artifacts")
    registry.push(
        "fraud", demo.path, "v1", framework=framework, signature=signature, metadata=demo.metadata
    )
    registry.close()
    return work / "data" / "artifacts" / "fraud" / "v1"


def hot_path(folder: Path, data: np.ndarray, repeats: int = 2000) -> list[dict[str, float]]:
    """Microseconds a batch: counting it for drift (every row, and at the default cap of
    5,000 rows/s: this loop gives rows far faster), and the model computing it."""
    from inferd.runtimes import load_runtime, read_manifest
    from inferd.runtimes.base import RuntimeConfig
    from inferd.telemetry.drift import DriftCounter

    manifest = read_manifest(folder)
    runtime = load_runtime(manifest["framework"], folder, RuntimeConfig(1, manifest["metadata"]))
    signature = runtime.signature
    profile = build_profile(signature, {"features": data[:5000]}, "sample", manifest["metadata"])
    out = []
    for cap in (10_000_000, 5000):
        counter = DriftCounter(signature, {})
        counter.configure(profile, 1000, 50, max_rows_per_s=cap)
        for rows in (1, 4, 32, 256):
            out.append(_one_size(runtime, counter, data, rows, repeats, cap))
    return out


def _one_size(
    runtime: Any, counter: Any, data: np.ndarray, rows: int, repeats: int, cap: int
) -> dict[str, float]:
    batches = [{"features": data[5000 + i * rows : 5000 + (i + 1) * rows]} for i in range(50)]
    counting, computing = [], []
    for i in range(repeats):
        batch = batches[i % len(batches)]
        began = time.perf_counter()
        counter.observe(batch)
        counting.append(time.perf_counter() - began)
        began = time.perf_counter()
        runtime.predict_batch(batch)
        computing.append(time.perf_counter() - began)
    count_us = statistics.mean(counting) * 1e6  # the mean: bulk counts included
    compute_us = statistics.median(computing) * 1e6
    return {
        "max_rows_per_s": cap, "rows": rows, "count_us": round(count_us, 2),
        "compute_us": round(compute_us, 1), "ratio": count_us / compute_us,
    }  # fmt: skip


def cost(work: Path, args: argparse.Namespace) -> list[dict[str, object]]:
    cmd = [sys.executable, "-m", "inferd", "serve", "--workers", str(args.workers),
           "--data-dir", str(work / "data"), "--grpc-port", "-1", "--port"]  # fmt: skip
    variants = {
        "drift off": {"INFERD_LOG_LEVEL": "WARNING", "INFERD_DRIFT__ENABLED": "false"},
        "drift on": {"INFERD_LOG_LEVEL": "WARNING", "INFERD_DRIFT__INTERVAL_S": "1"},
    }
    rows: list[dict[str, object]] = []
    for name, proc, port in alternating(cmd, variants, args.rounds, work):
        url = f"http://127.0.0.1:{port}/api/v1/models/fraud/predict"
        measure(name, proc, url, args, rows)
    return rows


# -- 3. detection end to end --------------------------------------------------------------


class Stream:
    """25-row requests of the demo's distribution, paced to ~``rate`` rows/s."""

    def __init__(self, url: str, data: np.ndarray, rate: float) -> None:
        self.client = httpx.Client(base_url=url, timeout=10)
        self.pool, self.std = data[5000:], data[:5000].std(axis=0)
        self.rng = np.random.default_rng(2)
        self.pause_s = 25 / rate
        self.sent = 0

    def send(self, shift: float) -> None:
        x = self.pool[self.rng.integers(0, len(self.pool), 25)].copy()
        x[:, SHIFTED] += shift * self.std[SHIFTED]
        body = {"inputs": [{"features": row} for row in x.round(4).tolist()]}
        began = time.monotonic()
        answer = self.client.post("/api/v1/models/fraud/predict", json=body)
        answer.raise_for_status()
        self.sent += 25
        time.sleep(max(0.0, self.pause_s - (time.monotonic() - began)))

    def view(self) -> dict:
        return self.client.get("/api/v1/models/fraud/drift").json()  # type: ignore[no-any-return]


def detection(work: Path, data: np.ndarray, trials: int) -> dict[str, object]:
    port = free_port()
    env = {
        "INFERD_LOG_LEVEL": "WARNING", "INFERD_DRIFT__INTERVAL_S": "1",
        "INFERD_DRIFT__WINDOW_ROWS": str(WINDOW_ROWS),
    }  # fmt: skip
    cmd = [sys.executable, "-m", "inferd", "serve", "--workers", "1", "--data-dir",
           str(work / "data"), "--grpc-port", "-1", "--port", str(port)]  # fmt: skip
    proc = start(cmd, env, work / "detection.log")
    try:
        wait_ready(
            f"http://127.0.0.1:{port}/health/ready", process=proc, log=work / "detection.log"
        )
        stream = Stream(f"http://127.0.0.1:{port}", data, rate=500)
        return _trials(stream, trials)
    finally:
        stop(proc)


def _trials(stream: Stream, trials: int) -> dict[str, object]:
    calm_views = alarms = 0
    seconds, rows = [], []
    for _ in range(trials):
        while (view := stream.view())["status"] != "ok":  # unshifted until the window is calm
            stream.send(0.0)
        for _ in range(20):  # then a while of unshifted traffic: every view a check
            stream.send(0.0)
            calm_views += 1
            alarms += stream.view()["status"] == "drifted"
        began, sent = time.monotonic(), stream.sent
        while SHIFTED_NAME not in (view := stream.view())["drifted"]:
            stream.send(2.0)
        seconds.append(time.monotonic() - began)
        rows.append(stream.sent - sent)
        assert view["drifted"] == [SHIFTED_NAME], view["drifted"]
        for _ in range(WINDOW_ROWS // 25 + 20):  # the window turns over
            stream.send(0.0)
    return {
        "trials": trials,
        "delay_s": seconds,
        "delay_rows": rows,
        "delay_s_median": statistics.median(seconds),
        "delay_rows_median": statistics.median(rows),
        "calm_views": calm_views,
        "false_alarms": alarms,
    }


def _shifted_name() -> str:
    from inferd.demo.build import FRAUD_FEATURES

    return FRAUD_FEATURES[SHIFTED]


SHIFTED_NAME = _shifted_name()


# -- results --------------------------------------------------------------------------------


def write_results(
    args: argparse.Namespace, stats: dict, hot: list[dict], runs: list[dict],
    e2e: dict[str, object],
) -> None:  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    found = {"args": vars(args), "statistics": stats, "hot_path": hot, "cost": runs,
             "detection": e2e}  # fmt: skip
    (RESULTS / "drift.json").write_text(json.dumps(found, indent=2, default=float))
    lines = [
        f"Statistics: {stats['windows']} unshifted windows of {WINDOW_ROWS} rows x 30 features: "
        f"false-alarm rate {stats['false_alarm_rate']:.3%} (largest PSI of a window: median "
        f"{stats['largest_psi_median']:.3f}, max {stats['largest_psi_max']:.3f}, line "
        f"{THRESHOLD}); counting and scoring a window {stats['count_and_score_ms_per_window']} ms.",
        "",
        "| shift of one feature | rows to flag (median) | p90 | missed (of 50) |",
        "|---|---|---|---|",
    ]
    for shift, d in stats["delay_rows"].items():
        lines.append(f"| {shift} sigma | {d['median']} | {d['p90']} | {d['missed']} |")
    lines += [
        "",
        "| counted | rows a batch | counting it, us (mean) | XGBoost computing it, us "
        "(median) | ratio |",
        "|---|---|---|---|---|",
    ]
    for h in hot:
        counted = "every row" if h["max_rows_per_s"] > 1e6 else "cap 5,000 rows/s"
        lines.append(
            f"| {counted} | {h['rows']} | {h['count_us']} | {h['compute_us']} | {h['ratio']:.3f} |"
        )
    lines += ["", "| connections | drift | req/s (median) | p50 ms | p99 ms | errors |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for c in args.connections:
        medians = {}
        for name in ("drift off", "drift on"):
            mine = [r for r in runs if r["server"] == name and r["connections"] == c]
            med = {k: statistics.median(float(r[k]) for r in mine)
                   for k in ("rps", "p50_ms", "p99_ms", "errors")}  # fmt: skip
            medians[name] = med
            lines.append(
                f"| {c} | {name.split()[1]} | {med['rps']:.0f} | {med['p50_ms']:.2f} | "
                f"{med['p99_ms']:.2f} | {med['errors']:.0f} |"
            )
        ratio = medians["drift on"]["rps"] / medians["drift off"]["rps"]
        lines.append(f"\nc={c}: throughput with drift on / off = {ratio:.3f}")
    lines += [
        "",
        f"End to end (1 s collections, {WINDOW_ROWS}-row window, ~500 rows/s): a 2 sigma shift "
        f"of {SHIFTED_NAME} flagged after {e2e['delay_s_median']:.1f} s, "
        f"{e2e['delay_rows_median']:.0f} rows (median of {e2e['trials']}; each: "
        f"{', '.join(f'{s:.1f}' for s in e2e['delay_s'])} s); false alarms: "  # type: ignore[attr-defined]
        f"{e2e['false_alarms']} of {e2e['calm_views']} views of a calm window.",
        "",
    ]
    text = "\n".join(lines)
    (RESULTS / "drift.md").write_text(text)
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--connections", type=int, nargs="+", default=[64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="inferd gateway processes")
    parser.add_argument("--loadgen", choices=("wrk", "inferd"), default=None)
    parser.add_argument("--windows", type=int, default=1000)
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    if args.loadgen is None:
        args.loadgen = "wrk" if shutil.which("wrk") else "inferd"
    data = fraud_data()
    stats = simulate(data, args.windows)
    print(json.dumps(stats, default=float), flush=True)
    work = Path(tempfile.mkdtemp(prefix="inferd-bench-drift-"))
    try:
        folder = prepare(work, data)
        hot = hot_path(folder, data)
        print(json.dumps(hot), flush=True)
        runs = cost(work, args)
        e2e = detection(work, data, args.trials)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_results(args, stats, hot, runs, e2e)


if __name__ == "__main__":
    main()
