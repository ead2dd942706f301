"""Isolation in a shared replica process (#56): one version hangs beside 49 neighbours,
after it answered many fast requests.

    .venv/bin/python bench/isolation.py [--neighbours 49] [--warm-up 10000]
        [--budget-s 2] [--callers 4]

Fifty small Python models (``y = 2x``; the one named ``hanging`` sleeps 600 s on the
input 7), registered into one data folder, served by one ``inferd serve`` (one gateway
process, auth on) with ``models.versions_per_process`` 50, so all share one process,
and ``models.predict_budget_s`` ``--budget-s``. Once every version is ready:

1. ``--warm-up`` requests to ``hanging``, one after another (each a batch of its own:
   the light batches after which the old batcher moved a model's compute onto the
   event loop the neighbours share);
2. ``--callers`` clients call random neighbours for 3 s, one request after another
   (``before``);
3. ``hanging`` gets its input 7 while the same clients call random neighbours until that
   request ends (``during``; each call bounded at 5 s, a call with no answer counts as
   an error);
4. how long until ``hanging`` serves again, from a process of its own.

Reported: neighbours' p50 / p99 / max before and during the hang, and when the hung
request failed (status, seconds, seconds past the budget). Latencies are client-side
(httpx, one kept connection per client). Writes bench/results/isolation.{json,md}.
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
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.conftest import InferdServer, create_key, push_source  # noqa: E402

RESULTS = ROOT / "bench" / "results"
MODEL = """
import time


class Model:
    signature = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    }

    def predict(self, batch):
        x = batch["x"]
        if HANGS and (x == 7).any():
            time.sleep(600)
        return {"y": x * 2}
"""
BEFORE_S = 3.0
CALL_TIMEOUT_S = 5.0


def predict(client: httpx.Client, name: str, x: float) -> tuple[int, float]:
    """A predict's status (599: no answer within ``CALL_TIMEOUT_S``) and its seconds."""
    began = time.perf_counter()
    try:
        reply = client.post(f"/api/v1/models/{name}/predict", json={"inputs": [{"x": x}]})
    except httpx.TimeoutException:
        return 599, time.perf_counter() - began
    return reply.status_code, time.perf_counter() - began


def pids(client: httpx.Client, name: str) -> list[int]:
    replicas = client.get(f"/api/v1/models/{name}/versions/v1").json()["replicas"]
    return [r["pid"] for r in replicas if r["state"] == "ready"]


def wait_all_ready(client: httpx.Client, n: int, timeout_s: float = 300) -> float:
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        listing = client.get("/api/v1/models").json()
        if sum(m["ready"] for m in listing["models"]) == n:
            return time.monotonic() - began
        time.sleep(0.5)
    raise RuntimeError(f"not all {n} versions ready in {timeout_s}s")


def call_neighbours(
    server: InferdServer, key: str, names: list[str], seed: int, until: Callable[[], bool]
) -> list[tuple[int, float]]:
    """Random neighbours, one request after another, while ``until()`` says so."""
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {key}"}
    calls = []
    with httpx.Client(base_url=server.url, headers=headers, timeout=CALL_TIMEOUT_S) as client:
        while until():
            calls.append(predict(client, rng.choice(names), 2.0))
    return calls


def callers(
    pool: ThreadPoolExecutor,
    server: InferdServer,
    key: str,
    names: list[str],
    n: int,
    seed: int,
    until: Callable[[], bool],
) -> list[tuple[int, float]]:
    """``n`` clients calling random neighbours while ``until()`` holds: their calls."""
    running = [pool.submit(call_neighbours, server, key, names, seed + i, until) for i in range(n)]
    return [call for caller in running for call in caller.result()]


def figures(calls: list[tuple[int, float]]) -> dict[str, float]:
    ordered = sorted(t for _, t in calls)
    return {
        "requests": len(calls),
        "errors": sum(code != 200 for code, _ in calls),
        "p50_ms": round(statistics.median(ordered) * 1000, 2),
        "p99_ms": round(ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)] * 1000, 2),
        "max_ms": round(ordered[-1] * 1000, 2),
    }


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    data = work / "data"
    names = [f"neighbour-{i:02d}" for i in range(args.neighbours)]
    for name in ["hanging", *names]:
        push_source(data, name, MODEL.replace("HANGS", str(name == "hanging")))
    key = create_key(data, "bench", "infer", "admin")
    env = {
        "INFERD_LOG_LEVEL": "WARNING",
        "INFERD_AUTH__ENABLED": "true",
        "INFERD_MODELS__VERSIONS_PER_PROCESS": str(args.neighbours + 1),
        "INFERD_MODELS__PREDICT_BUDGET_S": str(args.budget_s),
    }
    server = InferdServer(data, workers=1, env=env)
    server.client.headers["Authorization"] = f"Bearer {key}"
    out: dict[str, Any] = {"args": vars(args)}
    try:
        server.wait_ready(timeout_s=300, path="/health/live")
        client = server.client
        out["ready_s"] = round(wait_all_ready(client, args.neighbours + 1), 1)
        hosts = {pid for name in ["hanging", *names] for pid in pids(client, name)}
        assert len(hosts) == 1, f"not one shared process: {hosts}"
        (host,) = hosts
        began = time.perf_counter()
        warm = [predict(client, "hanging", float(i % 5)) for i in range(args.warm_up)]
        out["warm_up"] = {**figures(warm), "s": round(time.perf_counter() - began, 1)}
        with ThreadPoolExecutor(args.callers + 1) as pool:
            stop_at = time.monotonic() + BEFORE_S
            before = callers(
                pool, server, key, names, args.callers, 0, lambda: time.monotonic() < stop_at
            )
            out["before"] = figures(before)
            out["hung"], out["during"] = hang(pool, server, key, names, args)
        out["own_process_after_s"] = round(back_alone(client, host), 1)
        out["neighbours_stayed"] = all(pids(client, n) == [host] for n in names)
    finally:
        server.stop(timeout_s=120)
    return out


def hang(
    pool: ThreadPoolExecutor,
    server: InferdServer,
    key: str,
    names: list[str],
    args: argparse.Namespace,
) -> tuple[dict[str, Any], dict[str, float]]:
    """The hanging request, and the neighbours' calls while it lasts."""

    def hung() -> dict[str, Any]:
        began = time.perf_counter()
        reply = server.client.post(
            "/api/v1/models/hanging/predict",
            json={"inputs": [{"x": 7}]},
            headers={"X-Request-Timeout": str(args.budget_s * 5)},
            timeout=args.budget_s * 5 + 10,
        )
        took = time.perf_counter() - began
        return {
            "status": reply.status_code,
            "message": reply.json().get("error", {}).get("message", ""),
            "s": round(took, 3),
            "past_budget_s": round(took - args.budget_s, 3),
        }

    stuck: Future[dict[str, Any]] = pool.submit(hung)
    during = callers(pool, server, key, names, args.callers, 100, lambda: not stuck.done())
    return stuck.result(), figures(during)


def back_alone(client: httpx.Client, host: int, timeout_s: float = 60) -> float:
    """Seconds until ``hanging`` serves again from a process other than ``host``."""
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        found = pids(client, "hanging")
        if found and found[0] != host and predict(client, "hanging", 1.0)[0] == 200:
            return time.monotonic() - began
        time.sleep(0.1)
    return math.inf


def table(out: dict[str, Any]) -> str:
    a = out["args"]
    hung = out["hung"]
    lines = [
        f"One version hanging beside {a['neighbours']} neighbours in one shared process, "
        f"after {a['warm_up']:,} fast requests to it (`bench/isolation.py --neighbours "
        f"{a['neighbours']} --warm-up {a['warm_up']} --budget-s {a['budget_s']:g} --callers "
        f"{a['callers']}`; auth on, one gateway process, {a['callers']} clients)",
        "",
        "| neighbours' requests | requests | errors | p50 ms | p99 ms | max ms |",
        "|---|---|---|---|---|---|",
    ]
    for phase in ("before", "during"):
        f = out[phase]
        lines.append(
            f"| {phase} the hang | {f['requests']} | {f['errors']} | {f['p50_ms']} "
            f"| {f['p99_ms']} | {f['max_ms']} |"
        )
    lines += [
        "",
        f"The hung request: {hung['status']} after {hung['s']} s, {hung['past_budget_s']} s "
        f'past its {a["budget_s"]:g} s budget ("{hung["message"]}"). Back from a process '
        f"of its own {out['own_process_after_s']} s later; the neighbours stayed in theirs: "
        f"{out['neighbours_stayed']}. Warm-up: {out['warm_up']['requests']:,} requests in "
        f"{out['warm_up']['s']} s (p50 {out['warm_up']['p50_ms']} ms), "
        f"{out['warm_up']['errors']} errors.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--neighbours", type=int, default=49)
    parser.add_argument("--warm-up", type=int, default=10_000)
    parser.add_argument("--budget-s", type=float, default=2.0)
    parser.add_argument("--callers", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="inferd-bench-isolation-") as tmp:
        out = run(args, Path(tmp))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "isolation.json").write_text(json.dumps(out, indent=2))
    (RESULTS / "isolation.md").write_text(table(out))
    print(table(out))


if __name__ == "__main__":
    main()
