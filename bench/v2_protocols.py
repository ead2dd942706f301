"""Wire formats side by side: /api/v1 JSON, Open Inference Protocol REST with the binary
tensor extension, and Open Inference Protocol gRPC, on the same server and model.

    .venv/bin/python bench/v2_protocols.py [--duration 8] [--rounds 3] [--concurrency 32]
        [--grpc-client raw|grpcio] [--grpc-connections N] [--max-batch-size ROWS]

Builds the demo fraud model (XGBoost, 30 FP32 features), registers it in a scratch data
folder and starts one ``inferd serve`` (2 gateway processes, HTTP and gRPC). Each round
runs every protocol at 1 and at 64 rows per request, in shuffled order, closed loop with
``--concurrency`` requests in flight, for ``--duration`` seconds after a 1 s warm-up:

- HTTP (v1 JSON, V2 binary) with inferd's own load generator (pre-encoded requests over
  ``--concurrency`` keep-alive connections);
- gRPC, one ModelInferRequest with ``raw_input_contents``, the same number of calls in
  flight over ``--grpc-connections`` HTTP/2 connections (default: as many as HTTP's).
  The client is, by default, this folder's ``grpc_load.py``: the calls as pre-encoded
  HTTP/2 frames, the counterpart of the HTTP load generator (~30 µs of CPU per call at
  one row, ~65 at 64, as the HTTP client); ``--grpc-client grpcio`` uses grpcio's
  asyncio client instead (~110 and ~260 µs), what a Python application calling inferd
  pays, and takes that CPU from the server on these 2 cores.
  Connections rather than channels count: the kernel hands each connection to one
  gateway process (SO_REUSEPORT), and 4 connections land 3:1 or 4:0 on the 2 gateways
  five times in eight, which made a round's figure depend on that draw.

The clients run in this process, on the same 2 cores as the server: the table reports
each client's CPU per request (a heavier client leaves less CPU to the server), the
server's (all its processes) and the gateways' alone (the replica's work is the same
whatever the wire format), and the requests one CPU-second serves, client and server
together: on a machine shared with other work, requests/s swing with what else runs,
CPU per request much less. ``--max-batch-size`` sets the replica's batching limit
(default: the server's, 32 rows, so a 64-row request runs as two batches).
Writes bench/results/v2_protocols.json and .md (medians over rounds). Traffic stays on
127.0.0.1; the server is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import orjson
from grpc_load import closed_loop
from servers import free_port, process_tree, start, stop, wait_ready
from tabular import ROW, prepare

from inferd.bench.connection import encode_request, request_head
from inferd.bench.loadgen import LoadGenerator, LoadSpec
from inferd.bench.stats import summarize

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PROTOCOLS = ("v1 JSON", "V2 REST binary", "V2 gRPC")
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
_OWN_CONNECTION = ("grpc.use_local_subchannel_pool", 1)
"""Each gRPC channel opens its own connection instead of sharing one per target."""


def v1_request(host: str, rows: int) -> bytes:
    head = request_head(
        "POST", "/api/v1/models/fraud/predict", host, {"Content-Type": "application/json"}
    )
    return encode_request(head, orjson.dumps({"inputs": [{"features": ROW}] * rows}))


def v2_binary_request(host: str, rows: int) -> bytes:
    data = np.tile(np.asarray(ROW, dtype="<f4"), (rows, 1)).tobytes()
    header = orjson.dumps({
        "inputs": [{"name": "features", "shape": [rows, 30], "datatype": "FP32",
                    "parameters": {"binary_data_size": len(data)}}],
        "parameters": {"binary_data_output": True},
    })  # fmt: skip
    head = request_head(
        "POST",
        "/v2/models/fraud/infer",
        host,
        {
            "Content-Type": "application/octet-stream",
            "Inference-Header-Content-Length": str(len(header)),
        },
    )
    return encode_request(head, header + data)


def server_cpu_s(server: int) -> tuple[float, float]:
    """CPU seconds used so far by the server's processes, and by its gateways alone."""
    tick = os.sysconf("SC_CLK_TCK")
    total = gateways = 0.0
    for pid in process_tree(server):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            gateway = b"inferd.api.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue  # exited meanwhile
        used = (int(stat[11]) + int(stat[12])) / tick
        total += used
        gateways += used if gateway else 0.0
    return total, gateways


def run_http(port: int, request: bytes, args: argparse.Namespace, server: int) -> dict[str, float]:
    def spec(duration_s: float) -> LoadSpec:
        return LoadSpec(
            "127.0.0.1", port, lambda: request, concurrency=args.concurrency, duration_s=duration_s
        )

    asyncio.run(LoadGenerator(spec(1.0)).run())  # warm-up, discarded
    before = server_cpu_s(server)
    result = asyncio.run(LoadGenerator(spec(args.duration)).run())
    after = server_cpu_s(server)
    s = summarize(result.samples, result.duration_s)
    return {
        "rps": s.success_rps,
        "p50_ms": s.latency["p50"],
        "p99_ms": s.latency["p99"],
        "errors": float(s.errors),
        "client_us_per_request": 1e6 * result.cpu_s / max(s.requests, 1),
        "server_us_per_request": 1e6 * (after[0] - before[0]) / max(s.requests, 1),
        "gateway_us_per_request": 1e6 * (after[1] - before[1]) / max(s.requests, 1),
    }


def run_grpc(port: int, rows: int, args: argparse.Namespace, server: int) -> dict[str, float]:
    load = _grpc_raw_load if args.grpc_client == "raw" else _grpc_load
    return asyncio.run(load(port, rows, args, server))


def _infer_request(rows: int) -> bytes:
    from inferd.grpc import grpc_service_pb2 as pb

    request = pb.ModelInferRequest(model_name="fraud")
    request.inputs.add(name="features", datatype="FP32", shape=[rows, 30])
    request.raw_input_contents.append(np.tile(np.asarray(ROW, dtype="<f4"), (rows, 1)).tobytes())
    return request.SerializeToString()


async def _grpc_raw_load(
    port: int, rows: int, args: argparse.Namespace, server: int
) -> dict[str, float]:
    """The calls as pre-encoded HTTP/2 frames (:mod:`grpc_load`)."""
    used: list[tuple[float, float]] = []
    latencies, errors, wall, cpu = await closed_loop(
        "127.0.0.1", port, MODEL_INFER, _infer_request(rows), args.concurrency,
        args.grpc_connections, args.duration, on_window=lambda: used.append(server_cpu_s(server)),
    )  # fmt: skip
    return _figures(latencies, errors, wall, cpu, used[0], used[1])


async def _grpc_load(
    port: int, rows: int, args: argparse.Namespace, server: int
) -> dict[str, float]:
    """The calls through grpcio's asyncio client, one channel per connection."""
    import grpc

    from inferd.grpc import grpc_service_pb2 as pb
    from inferd.grpc import grpc_service_pb2_grpc as pb_grpc

    request = pb.ModelInferRequest.FromString(_infer_request(rows))
    channels = [
        grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[_OWN_CONNECTION])
        for _ in range(args.grpc_connections)
    ]
    stubs = [pb_grpc.GRPCInferenceServiceStub(c) for c in channels]
    latencies: list[float] = []
    errors = 0
    measuring = False
    stop_at = time.perf_counter() + 1.0 + args.duration

    async def worker(stub: Callable[..., object]) -> None:
        nonlocal errors
        while (now := time.perf_counter()) < stop_at:
            try:
                await stub.ModelInfer(request)  # type: ignore[attr-defined]
            except grpc.RpcError:
                errors += measuring
                continue
            if measuring:
                latencies.append(time.perf_counter() - now)

    async def measure_window() -> tuple[float, float, tuple[float, float], tuple[float, float]]:
        nonlocal measuring
        await asyncio.sleep(1.0)  # warm-up, discarded
        measuring = True
        started, cpu, before = time.perf_counter(), time.process_time(), server_cpu_s(server)
        await asyncio.sleep(stop_at - time.perf_counter())
        measuring = False
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
        return wall, cpu, before, server_cpu_s(server)

    tasks = [worker(stubs[i % len(stubs)]) for i in range(args.concurrency)]
    window, *_ = await asyncio.gather(measure_window(), *tasks)
    for channel in channels:
        await channel.close()
    return _figures(latencies, errors, *window)


def _figures(
    latencies: list[float],
    errors: int,
    wall: float,
    cpu: float,
    before: tuple[float, float],
    after: tuple[float, float],
) -> dict[str, float]:
    ms = sorted(x * 1000 for x in latencies)
    n = max(len(ms), 1)
    return {
        "rps": len(ms) / wall,
        "p50_ms": ms[len(ms) // 2],
        "p99_ms": ms[min(len(ms) - 1, int(len(ms) * 0.99))],
        "errors": float(errors),
        "client_us_per_request": 1e6 * cpu / n,
        "server_us_per_request": 1e6 * (after[0] - before[0]) / n,
        "gateway_us_per_request": 1e6 * (after[1] - before[1]) / n,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--grpc-client", choices=("raw", "grpcio"), default="raw",
        help="gRPC load from pre-encoded HTTP/2 frames (bench/grpc_load.py) or grpcio's client",
    )  # fmt: skip
    parser.add_argument(
        "--grpc-connections", type=int, default=None,
        help="connections the gRPC calls share (default: --concurrency, as many as HTTP's)",
    )  # fmt: skip
    parser.add_argument(
        "--max-batch-size", type=int, default=None,
        help="rows per replica batch (default: the server's; a request over it is split)",
    )  # fmt: skip
    args = parser.parse_args()
    args.grpc_connections = args.grpc_connections or args.concurrency
    work = Path(tempfile.mkdtemp(prefix="inferd-bench-v2-"))
    prepare(work)
    port, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "inferd", "serve", "--workers", "2", "--data-dir",
           str(work / "data"), "--port", str(port), "--grpc-port", str(grpc_port)]  # fmt: skip
    env = {"INFERD_LOG_LEVEL": "WARNING"}
    if args.max_batch_size is not None:
        env["INFERD_BATCHING__MAX_BATCH_SIZE"] = str(args.max_batch_size)
    proc = start(cmd, env, work / "inferd.log")
    host = f"127.0.0.1:{port}"
    runs: dict[tuple[str, int], Callable[[], dict[str, float]]] = {}
    for rows in (1, 64):
        v1, v2 = v1_request(host, rows), v2_binary_request(host, rows)
        runs[("v1 JSON", rows)] = lambda r=v1: run_http(port, r, args, proc.pid)
        runs[("V2 REST binary", rows)] = lambda r=v2: run_http(port, r, args, proc.pid)
        runs[("V2 gRPC", rows)] = lambda n=rows: run_grpc(grpc_port, n, args, proc.pid)
    results: dict[tuple[str, int], list[dict[str, float]]] = {key: [] for key in runs}
    rng = random.Random(args.seed)
    try:
        wait_ready(f"http://{host}/health/ready")
        time.sleep(2)
        for round_ in range(args.rounds):
            order = list(runs)
            rng.shuffle(order)
            for key in order:
                r = runs[key]()
                results[key].append(r)
                print(
                    f"round {round_ + 1}  {key[0]:>15} rows={key[1]:<3} {r['rps']:8.0f} req/s  "
                    f"p50 {r['p50_ms']:6.2f} ms  p99 {r['p99_ms']:6.2f} ms  "
                    f"errors {r['errors']:.0f}  client {r['client_us_per_request']:.0f} µs/req  "
                    f"server {r['server_us_per_request']:.0f} µs/req  "
                    f"gateways {r['gateway_us_per_request']:.0f} µs/req",
                    flush=True,
                )
    finally:
        stop(proc)
        shutil.rmtree(work, ignore_errors=True)
    write_results(results, args)


def write_results(
    results: dict[tuple[str, int], list[dict[str, float]]], args: argparse.Namespace
) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows = []
    for (protocol, n), runs in results.items():
        median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        rows.append({"protocol": protocol, "rows_per_request": n, "rounds": runs, **median})
    for r in rows:  # what the machine's CPU serves, whatever else shares it
        r["per_cpu_s"] = 1e6 / (r["client_us_per_request"] + r["server_us_per_request"])
    (RESULTS / "v2_protocols.json").write_text(
        json.dumps({"args": vars(args), "results": rows}, indent=2)
    )
    batching = (
        f"batches of at most {args.max_batch_size} rows"
        if args.max_batch_size
        else "the server's default batching (at most 32 rows: a 64-row request is 2 batches)"
    )
    client = "pre-encoded HTTP/2 frames" if args.grpc_client == "raw" else "grpcio's asyncio client"
    lines = [
        f"Medians of {args.rounds} rounds of {args.duration:g} s, {args.concurrency} requests "
        "in flight, one inferd server (2 gateway processes), demo fraud model (XGBoost), "
        f"{batching}; gRPC load: {client} over {args.grpc_connections} connections.",
        "",
        "| protocol | rows/request | req/s | rows/s | vs v1 JSON | p50 ms | p99 ms | errors "
        "| client CPU µs/request | server CPU µs/request | gateways' CPU µs/request "
        "| req per CPU-s | vs v1 JSON |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {r["rows_per_request"]: r for r in rows if r["protocol"] == "v1 JSON"}
    for r in sorted(rows, key=lambda r: (r["rows_per_request"], PROTOCOLS.index(r["protocol"]))):
        n, v1 = r["rows_per_request"], base[r["rows_per_request"]]
        lines.append(
            f"| {r['protocol']} | {n} | {r['rps']:,.0f} | {r['rps'] * n:,.0f} | "
            f"{r['rps'] / v1['rps']:.2f}x | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
            f"{r['errors']:.0f} | {r['client_us_per_request']:.0f} | "
            f"{r['server_us_per_request']:.0f} | {r['gateway_us_per_request']:.0f} | "
            f"{r['per_cpu_s']:,.0f} | {r['per_cpu_s'] / v1['per_cpu_s']:.2f}x |"
        )
    (RESULTS / "v2_protocols.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
