"""Autoscaling under a load step, against the same load on a fixed replica count, and
cold starts from zero replicas.

Ramp: a model that spends 20 ms per request in its replica (a sleep: this 2-core
machine has no accelerator, and CPU-bound replicas could not scale past two cores)
gets ``inferd bench --rate`` at LOW, then HIGH, then LOW requests/s (open loop,
Poisson). Autoscaled (1..4 replicas, windows of seconds instead of minutes), then fixed
at the autoscaled run's peak count. Reported: time from the step up to the first new
replica serving, p99 during the high phase in both runs, failed requests; a PNG of
offered load, p99 and ready replicas over time.

Cold start: the demo XGBoost (fraud) and all-MiniLM-L6-v2 models deployed with
``min_replicas: 0``; once idle at zero, one request is sent and its
``x-inferd-cold-start-ms`` read (the time it was held while a replica started).

    .venv/bin/python bench/autoscale.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.conftest import InferdServer, push_folder  # noqa: E402

SLEEPY = """
import time

class Sleepy:
    signature = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    }

    def predict(self, batch):
        time.sleep(0.02)
        return {"y": batch["x"] * 2}
"""
POLICY = {
    "min_replicas": 1, "max_replicas": 4, "utilisation_up": 0.7, "up_window_s": 3,
    "utilisation_down": 0.3, "down_window_s": 15, "queue_empty_s": 10, "up_cooldown_s": 3,
    "down_cooldown_s": 5,
}  # fmt: skip
PHASES = (("low", 15), ("high", 30), ("low", 30))


def bench(url: str, model: str, rate: int, seconds: int, out: Path) -> dict[str, Any]:
    # fmt: off
    subprocess.run(
        [
            sys.executable, "-m", "inferd", "bench", url, "--target", "predict", "--model", model,
            "--rate", str(rate), "--duration", f"{seconds}s", "--warmup", "0s", "--timeout", "30s",
            "--body", '{"inputs": [{"x": 2}]}', "--json", str(out),
        ],
        check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    # fmt: on
    return json.loads(out.read_text())


def ready_replicas(server: InferdServer, model: str) -> int:
    detail = server.client.get(f"/api/v1/models/{model}/versions/v1").json()
    return sum(r["state"] == "ready" for r in detail["replicas"])


def ramp(work: Path, low: int, high: int, replicas: int | None) -> dict[str, Any]:
    """One run of the load profile; autoscaled when ``replicas`` is None."""
    data = work / ("auto" if replicas is None else f"fixed{replicas}")
    folder = data / "src"
    folder.mkdir(parents=True)
    (folder / "model.py").write_text(SLEEPY)
    push_folder(data, "sleepy", folder, batching={"max_batch_size": 1})
    server = InferdServer(data, workers=2, env={"INFERD_AUTOSCALE_INTERVAL_S": "1"})
    try:
        server.wait_ready()
        body: dict[str, Any] = {"model_name": "sleepy", "version": "v1"}
        if replicas is None:
            body["autoscaling"] = POLICY
        else:
            body["resources"] = {"replicas": replicas}
        server.client.post("/api/v1/deployments", json=body).raise_for_status()
        server.wait_for(
            lambda: ready_replicas(server, "sleepy") == (replicas or 1), what="replicas"
        )
        samples: list[tuple[float, int]] = []
        done = threading.Event()
        start = time.monotonic()

        def watch() -> None:
            while not done.is_set():
                samples.append((time.monotonic() - start, ready_replicas(server, "sleepy")))
                time.sleep(0.5)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        timeline, phases = [], []
        for name, seconds in PHASES:
            rate = high if name == "high" else low
            began = time.monotonic() - start
            result = bench(server.url, "sleepy", rate, seconds, data / f"{name}-{began:.0f}.json")
            level = result["levels"][0]
            phases.append({"phase": name, "rate": rate, "began_s": began, **level})
            for point in next(iter(result["timeline"].values())):
                timeline.append({**point, "t": began + point["t"], "offered": rate})
        done.set()
        watcher.join()
        events = server.client.get("/api/v1/deployments/sleepy").json()["scaling_events"]
        return {"phases": phases, "timeline": timeline, "replicas": samples, "events": events}
    finally:
        server.stop()


def first_new_replica_s(run: dict[str, Any]) -> float | None:
    high = next(p for p in run["phases"] if p["phase"] == "high")
    step = high["began_s"]
    later = [t for t, n in run["replicas"] if t >= step and n >= 2]
    return later[0] - step if later else None


def cold_starts(work: Path, rounds: int) -> dict[str, list[float]]:
    from bench.registry import models

    found: dict[str, list[float]] = {}
    for label, folder in models(work / "models").items():
        data = work / f"cold-{label.split()[0]}"
        push_folder(data, "m", folder)
        server = InferdServer(data, workers=1, env={"INFERD_AUTOSCALE_INTERVAL_S": "0.5"})
        try:
            server.wait_ready()
            policy = {"min_replicas": 0, "max_replicas": 1, "idle_timeout_s": 2}
            body = {"model_name": "m", "version": "v1", "autoscaling": policy}
            server.client.post("/api/v1/deployments", json=body).raise_for_status()
            signature = server.client.get("/api/v1/models/m/versions/v1").json()["signature"]
            request = _request_for(signature)
            for _ in range(rounds):
                server.wait_for(
                    lambda s=server: ready_replicas(s, "m") == 0 and _desired(s) == 0,
                    timeout_s=120, what="scaled to zero",
                )  # fmt: skip
                reply = server.client.post("/api/v1/models/m/predict", json=request, timeout=120)
                reply.raise_for_status()
                found.setdefault(label, []).append(float(reply.headers["x-inferd-cold-start-ms"]))
        finally:
            server.stop()
    return found


def _desired(server: InferdServer) -> int:
    (version,) = server.client.get("/api/v1/deployments/m").json()["versions"]
    return int(version["replicas_desired"])


def _request_for(signature: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for spec in signature["inputs"]:
        if spec["datatype"] == "BYTES":
            row[spec["name"]] = "a cold start"
        else:
            width = spec["shape"][1] if len(spec["shape"]) > 1 else None
            row[spec["name"]] = [0.1] * width if width else 0.1
    return {"inputs": [row]}


def plot(auto: dict[str, Any], fixed: dict[str, Any], peak: int, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    for run, label in ((auto, "autoscaled 1..4"), (fixed, f"fixed {peak}")):
        t = [p["t"] for p in run["timeline"]]
        axes[1].plot(t, [p["p99_ms"] for p in run["timeline"]], label=label)
        axes[2].step(*zip(*run["replicas"], strict=True), where="post", label=label)
    axes[0].plot([p["t"] for p in auto["timeline"]], [p["offered"] for p in auto["timeline"]], "k-")
    axes[0].plot([p["t"] for p in auto["timeline"]], [p["rps"] for p in auto["timeline"]], "k:")
    axes[0].set_ylabel("requests/s\n(offered, answered)")
    axes[1].set_ylabel("p99 ms (1 s bins)")
    axes[1].set_yscale("log")
    axes[2].set_ylabel("ready replicas")
    axes[2].set_xlabel("seconds")
    axes[1].legend()
    axes[2].legend()
    fig.suptitle("A load step (20 ms a request): autoscaled vs fixed at the peak count")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--low", type=int, default=20)
    parser.add_argument("--high", type=int, default=120)
    args = parser.parse_args()
    results_dir = ROOT / "bench" / "results"
    with tempfile.TemporaryDirectory(prefix="inferd-bench-autoscale-") as tmp:
        work = Path(tmp)
        auto = ramp(work, args.low, args.high, None)
        peak = max(n for _, n in auto["replicas"])
        fixed = ramp(work, args.low, args.high, peak)
        cold = cold_starts(work, args.rounds)
    plot(auto, fixed, peak, results_dir / "autoscale.png")
    high = {
        name: next(p for p in run["phases"] if p["phase"] == "high")
        for name, run in (("autoscaled", auto), ("fixed", fixed))
    }
    summary = {
        "load": {"low": args.low, "high": args.high, "phases_s": [s for _, s in PHASES]},
        "peak_replicas": peak,
        "first_new_replica_after_step_s": first_new_replica_s(auto),
        "high_phase": {
            name: {k: p[k] for k in ("requests", "errors", "latency")} for name, p in high.items()
        },
        "errors": {
            "autoscaled": sum(p["errors"] for p in auto["phases"]),
            "fixed": sum(p["errors"] for p in fixed["phases"]),
        },
        "events": auto["events"],
        "cold_start_ms": {k: {"median": statistics.median(v), "all": v} for k, v in cold.items()},
        "cores": os.cpu_count(),
    }
    (results_dir / "autoscale.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "events"}, indent=2))


if __name__ == "__main__":
    main()
