"""Inference graph overhead: a two-node sequence graph against the client making the two
calls itself, on the same server in the same run.

    .venv/bin/python bench/graphs.py [--rounds 5] [--requests 300]

``inferd serve`` (1 gateway process) with two Python models, ``plus`` (y = x + 1) and
``double`` (y = x * 2), and the graph ``chain`` = sequence(plus, double). Each round
sends ``--requests`` one-row requests one after the other on a kept-alive connection
in each of three ways, in an order that alternates between rounds: ``one call``
(``plus`` alone, for scale), ``client, two calls`` (``plus``, then ``double`` on its
answer) and ``graph`` (``/api/v1/graphs/chain/predict``). Every request has a new x, so
no answer comes from a cache. Per round p50 and p99; the figures are the medians over
the rounds. Derived: ``graph, second node`` = graph p50 - one call p50 (what a second
node costs inside a graph, graph walk included) and ``saved`` = two calls p50 - graph
p50 (what the client's second HTTP round trip cost over that).

Writes bench/results/graphs.{json,md}. Traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
from servers import free_port, start, stop

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MODEL = """
import numpy as np


class Arithmetic:
    signature = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    }

    def predict(self, batch):
        x = batch["x"]
        return {"y": np.asarray(EXPRESSION, dtype=np.float32)}
"""
CHAIN = {
    "root": "s",
    "nodes": {
        "a": {"model": "plus"},
        "b": {"model": "double", "inputs": {"x": "a.y"}},
        "s": {"sequence": ["a", "b"]},
    },
}


def prepare(data: Path) -> None:
    """The two models and the graph, registered as ``inferd models push`` would."""
    from inferd.registry import Registry
    from inferd.runtimes import inspect_artifact

    folders = {}
    for name, expression in (("plus", "x + 1"), ("double", "x * 2")):
        folder = folders[name] = data / "src" / name
        folder.mkdir(parents=True)
        (folder / "model.py").write_text(MODEL.replace("EXPRESSION", expression))
    folder = folders["chain"] = data / "src" / "chain"
    folder.mkdir()
    (folder / "graph.json").write_text(json.dumps(CHAIN))
    with Registry(f"sqlite:///{data / 'inferd.db'}", data / "artifacts") as registry:
        for name, folder in folders.items():
            framework, signature = inspect_artifact(folder)
            registry.push(name, folder, "v1", framework=framework, signature=signature)


def one_call(client: httpx.Client, x: float) -> float:
    reply = client.post("/api/v1/models/plus/predict", json={"inputs": [{"x": x}]})
    return float(reply.json()["outputs"][0]["y"])


def two_calls(client: httpx.Client, x: float) -> float:
    y = one_call(client, x)
    reply = client.post("/api/v1/models/double/predict", json={"inputs": [{"x": y}]})
    return float(reply.json()["outputs"][0]["y"])


def graph(client: httpx.Client, x: float) -> float:
    reply = client.post("/api/v1/graphs/chain/predict", json={"inputs": [{"x": x}]})
    return float(reply.json()["outputs"][0]["y"])


WAYS: dict[str, Callable[[httpx.Client, float], float]] = {
    "one call": one_call,
    "client, two calls": two_calls,
    "graph": graph,
}


def measure(client: httpx.Client, way: str, requests: int) -> dict[str, float]:
    call, spent = WAYS[way], []
    for _ in range(requests):
        x = random.uniform(-1e6, 1e6)
        began = time.perf_counter()
        call(client, x)
        spent.append((time.perf_counter() - began) * 1000)
    return {
        "p50_ms": float(np.percentile(spent, 50)),
        "p99_ms": float(np.percentile(spent, 99)),
    }


def wait_ready(client: httpx.Client, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if client.get("/health/ready").status_code == 200 and graph(client, 1.0) == 4.0:
                return
        except (httpx.TransportError, KeyError, ValueError):
            pass
        time.sleep(0.3)
    raise RuntimeError("the server did not become ready")


def run(rounds: int, requests: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="inferd-bench-graphs-") as tmp:
        data = Path(tmp)
        prepare(data)
        port = free_port()
        cmd = [sys.executable, "-m", "inferd", "serve", "--port", str(port),
               "--grpc-port", str(free_port()), "--workers", "1",
               "--data-dir", str(data)]  # fmt: skip
        proc = start(cmd, {}, data / "server.log")
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                wait_ready(client)
                for way in WAYS:  # warm every path up
                    measure(client, way, 50)
                per_round: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
                for round_ in range(rounds):
                    order = list(WAYS) if round_ % 2 == 0 else list(reversed(WAYS))
                    for way in order:
                        per_round[way].append(measure(client, way, requests))
        finally:
            stop(proc)
    figures = {
        way: {k: statistics.median(r[k] for r in results) for k in ("p50_ms", "p99_ms")}
        for way, results in per_round.items()
    }
    p50 = {way: f["p50_ms"] for way, f in figures.items()}
    return {
        "rounds": rounds,
        "requests_per_round": requests,
        "figures": figures,
        "second_node_in_graph_p50_ms": p50["graph"] - p50["one call"],
        "saved_vs_client_p50_ms": p50["client, two calls"] - p50["graph"],
        "per_round": per_round,
    }


def markdown(result: dict) -> str:
    lines = [
        "# Inference graph overhead (bench/graphs.py)",
        "",
        f"Two-node sequence graph vs the client making the two calls; {result['rounds']} "
        f"rounds x {result['requests_per_round']} sequential one-row requests, 1 gateway "
        "process, medians over rounds.",
        "",
        "| way | p50 ms | p99 ms |",
        "|---|---|---|",
    ]
    for way, f in result["figures"].items():
        lines.append(f"| {way} | {f['p50_ms']:.3f} | {f['p99_ms']:.3f} |")
    lines += [
        "",
        f"A second node inside the graph (graph - one call, p50): "
        f"{result['second_node_in_graph_p50_ms']:.3f} ms; the graph saves "
        f"{result['saved_vs_client_p50_ms']:.3f} ms (p50) against the client's two calls.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    result = run(args.rounds, args.requests)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "graphs.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "graphs.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
