"""Replica starts with and without the fork server (#57 item 6): the CPU a replica's
start costs and the time a request waits for a version scaled to zero.

    .venv/bin/python bench/replica_start.py [--starts 6] [--rounds 2]

Three models built here (bench/many_models.py's: a scikit-learn pipeline, an XGBoost
booster, an ONNX pipeline, 8 features), each deployed with ``min_replicas`` 0 and
``idle_timeout_s`` 1. Variants, one ``inferd serve`` each (one gateway), in alternating
order over ``--rounds`` rounds: ``scratch`` (``models.fork_server`` off: each replica a
new interpreter) and ``forked`` (on). For each model, ``--starts`` times: wait until it
is at zero replicas, send one request (one row), and record

- the request's wall time at the client (its time to the last byte: a cold start from
  zero, as a user meets it) and the server's ``x-inferd-cold-start-ms``;
- the start's CPU: the new replica process's user + system seconds when it answered,
  plus, forked, what the fork server spent meanwhile (its fork, and the first time per
  framework its import of the framework).

Each version serves one replica from the server's start until it is deployed at zero:
that first replica of each framework starts from scratch either way; in a forked server
the first start from zero starts the fork server (it imports the framework then, and
learns the rest from that replica's report), the next ones are the steady state.
Medians over all rounds (the medians of 12 starts are steady ones). Writes
bench/results/replica_start.{json,md}. Traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.many_models import FEATURES, build  # noqa: E402
from tests.conftest import InferdServer, push_folder  # noqa: E402

RESULTS = ROOT / "bench" / "results"
VARIANTS = {"scratch": "false", "forked": "true"}
TICK = 100.0  # SC_CLK_TCK on Linux


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def fork_server_of(server: InferdServer) -> int | None:
    for pid in children(server.process.pid):
        if b"inferd.serving.zygote" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    return None


def replicas(server: InferdServer, model: str) -> list[dict[str, Any]]:
    deployment = server.client.get(f"/api/v1/deployments/{model}").json()
    return [r for v in deployment["versions"] for r in v["replicas"]]


def at_zero(server: InferdServer, model: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while replicas(server, model):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{model} not at zero in {timeout_s}s")
        time.sleep(0.1)


def one_start(server: InferdServer, model: str) -> dict[str, float]:
    at_zero(server, model)
    time.sleep(0.3)  # the scaler settles (a request now is a start from zero)
    zygote = fork_server_of(server)
    zygote_before = cpu_s(zygote) if zygote else 0.0
    body = {"inputs": [{"features": [0.5] * FEATURES}]}
    began = time.perf_counter()
    reply = server.client.post(
        f"/api/v1/models/{model}/predict", json=body, timeout=120,
        headers={"x-request-timeout": "100s"},
    )  # fmt: skip
    wall_ms = (time.perf_counter() - began) * 1000
    assert reply.status_code == 200, reply.text
    (replica,) = replicas(server, model)
    zygote = zygote or fork_server_of(server)
    zygote_cpu = cpu_s(zygote) - zygote_before if zygote else 0.0
    return {
        "wall_ms": wall_ms,
        "cold_start_ms": float(reply.headers.get("x-inferd-cold-start-ms", "nan")),
        "replica_cpu_s": cpu_s(replica["pid"]),
        "fork_server_cpu_s": zygote_cpu,
        "cpu_s": cpu_s(replica["pid"]) + zygote_cpu,
    }


def run_variant(pushed: Path, names: list[str], fork: str, starts: int) -> dict[str, Any]:
    env = {"INFERD_MODELS__FORK_SERVER": fork, "INFERD_AUTOSCALE_INTERVAL_S": "0.2"}
    data = pushed.with_name(f"data-{time.monotonic_ns()}")  # as registered: none deployed
    shutil.copytree(pushed, data)
    server = InferdServer(data, workers=1, env=env)
    try:
        server.wait_ready(path="/health/live")
        for name in names:
            policy = {"min_replicas": 0, "max_replicas": 1, "idle_timeout_s": 1}
            deployed = server.client.post(
                "/api/v1/deployments",
                json={"model_name": name, "version": "v1", "autoscaling": policy},
            )
            assert deployed.status_code in (200, 201), deployed.text
        return {name: [one_start(server, name) for _ in range(starts)] for name in names}
    finally:
        try:
            server.stop()
        except AssertionError:
            print(server.log()[-8000:], file=sys.stderr)
            raise


def summary(samples: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(s[key] for s in samples) for key in samples[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--starts", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder, data = Path(tmp) / "models", Path(tmp) / "data"
        names = build(folder, 3)
        for name in names:
            push_folder(data, name, folder / name, "v1")
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
        for round_ in range(args.rounds):
            order = list(VARIANTS) if round_ % 2 == 0 else list(reversed(VARIANTS))
            for variant in order:
                print(f"round {round_ + 1}: {variant}", flush=True)
                runs[variant].append(run_variant(data, names, VARIANTS[variant], args.starts))
    results: dict[str, Any] = {"starts": args.starts, "rounds": args.rounds, "models": {}}
    for name in names:
        entry: dict[str, Any] = {}
        for variant, rounds in runs.items():
            samples = [s for r in rounds for s in r[name]]
            entry[variant] = {"median": summary(samples), "samples": samples}
        results["models"][name] = entry
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "replica_start.json").write_text(json.dumps(results, indent=2))
    text = table(results)
    (RESULTS / "replica_start.md").write_text(text)
    print(text)


def table(results: dict[str, Any]) -> str:
    lines = [
        f"Replica starts from zero, {results['rounds']} rounds x {results['starts']} starts "
        "per model and variant; medians.",
        "",
        "| model | variant | start CPU s | request wall ms | x-inferd-cold-start-ms |",
        "|---|---|---|---|---|",
    ]
    for name, entry in results["models"].items():
        for variant in VARIANTS:
            s = entry[variant]["median"]
            lines.append(
                f"| {name} | {variant} | {s['cpu_s']:.2f} | {s['wall_ms']:.0f} | "
                f"{s['cold_start_ms']:.0f} |"
            )
        a, b = entry["scratch"]["median"], entry["forked"]["median"]
        lines.append(
            f"| {name} | forked / scratch | {b['cpu_s'] / a['cpu_s']:.2f}x | "
            f"{b['wall_ms'] / a['wall_ms']:.2f}x | {b['cold_start_ms'] / a['cold_start_ms']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
