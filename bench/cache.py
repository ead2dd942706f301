"""The result cache: what one call costs in each store, whether gateway processes share
answers, and what the cache buys on a workload where 40 % of the requests repeat.

    .venv/bin/python bench/cache.py [--parts calls,hits,throughput] [--calls 2000]
        [--duration 12] [--rounds 3] [--connections 64]

Three parts, each comparing the machine's shared store (``SQLiteCache``, what ``inferd
serve`` uses) with the per-process LRU it replaced (``LocalCache``):

- ``calls``: median and p99 µs of get (hit), get (miss) and put (a new key) per call on
  the event loop, in this process, for answers of 128 B, 4 KiB, 64 KiB and 1 MiB, and
  the CPU a put costs with the shared store's writer thread (which writes behind)
  counted; the shared store on /dev/shm and on this disk. Then two processes, each a
  get and on a miss a put per turn, on one file: a turn's cost and the puts skipped
  (their writer's queue full).
- ``hits``: ``inferd serve`` with 2 gateway processes; the same request 20 times, each
  on a new connection (the kernel spreads them over both processes), one after the
  other: the ``X-Cache`` sequence. The per-process baseline
  is the same server with ``INFERD_CACHE__DIR`` naming a folder that cannot be made, so
  each gateway falls back to its own LRU (what every gateway did before the shared
  store).
- ``throughput``: the demo fraud model (XGBoost, 30 features) with 2 gateway processes,
  cache off / per process / shared, alternating each round, driven by ``inferd bench
  --payloads`` (a JSONL file where each body is, with probability 0.4, one of 200
  recurring inputs, else a fresh one); req/s, latency, the gateway processes' CPU time
  per request, and the hit rate the server's ``/metrics`` counted over the run.

Writes bench/results/cache.{json,md}. Traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from servers import alternating, process_tree
from tabular import prepare, wait_http

from inferd.routing.cache import LocalCache, SQLiteCache

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
REPEAT = 0.4
SIZES = {"128 B": 16, "4 KiB": 512, "64 KiB": 8192, "1 MiB": 131072}  # float64 values
MAX_BYTES = 256 << 20


# -- calls ------------------------------------------------------------------------------


async def _timed(call: Callable[[int], Awaitable[Any]], n: int) -> tuple[float, float]:
    """Median and p99 µs of ``call(i)`` for i in 0..n-1, the loop running between calls
    (as a server's does between requests)."""
    spent = []
    for i in range(n):
        start = time.perf_counter_ns()
        await call(i)
        spent.append(time.perf_counter_ns() - start)
        await asyncio.sleep(0)
    spent.sort()
    return spent[n // 2] / 1000, spent[min(n - 1, n * 99 // 100)] / 1000


async def _costs(store: Any, values: int, n: int) -> dict[str, float]:
    keys = [os.urandom(20) for _ in range(n)]
    answer = {"y": np.random.default_rng(0).random(values)}

    async def put(i: int) -> None:
        await store.put(keys[i], answer, 600)

    async def hit(i: int) -> None:
        assert await store.get(kept[i]) is not None

    async def miss(i: int) -> None:
        assert await store.get(b"x" + keys[i]) is None

    cpu = time.process_time()
    put_p50, put_p99 = await _timed(put, n)
    if isinstance(store, SQLiteCache):
        await store.settled()  # all written: the gets below read the file
        assert len(store) + store.skipped == n
    put_cpu = (time.process_time() - cpu) / n * 1e6
    kept = [key for key in keys if await store.get(key) is not None]  # (not the skipped)
    hit_p50, hit_p99 = await _timed(hit, len(kept))
    miss_p50, miss_p99 = await _timed(miss, n)
    await store.close()
    return {
        "hit_p50_us": hit_p50, "hit_p99_us": hit_p99, "miss_p50_us": miss_p50,
        "miss_p99_us": miss_p99, "put_p50_us": put_p50, "put_p99_us": put_p99,
        "put_cpu_us": put_cpu, "skipped": n - len(kept),
    }  # fmt: skip


def calls(work: Path, n: int) -> list[dict[str, Any]]:
    folders = {"shared, /dev/shm": Path("/dev/shm"), "shared, disk": work}
    rows = []
    for size, values in SIZES.items():
        count = n if values < 100_000 else max(50, n // 20)
        row = asyncio.run(_costs(LocalCache(MAX_BYTES), values, count))
        rows.append({"store": "per process (LocalCache)", "answer": size, **row})
        for name, folder in folders.items():
            if not folder.is_dir():
                continue
            path = Path(tempfile.mkdtemp(dir=folder)) / "results.db"
            try:
                row = asyncio.run(_costs(SQLiteCache(path, MAX_BYTES), values, count))
            finally:
                shutil.rmtree(path.parent)
            rows.append({"store": name, "answer": size, **row})
        for r in rows[-len(folders) - 1 :]:
            print(f"{r['store']:>26} {size:>6}: hit {r['hit_p50_us']:7.1f} µs  miss "
                  f"{r['miss_p50_us']:6.1f} µs  put {r['put_p50_us']:7.1f} µs (p99 "
                  f"{r['put_p99_us']:.0f}; CPU, both threads: {r['put_cpu_us']:.1f})")  # fmt: skip
    return rows


def _contender(path: str, seed: int, n: int, out: Any) -> None:
    async def run() -> dict[str, float]:
        store = SQLiteCache(Path(path), MAX_BYTES)
        rng = random.Random(seed)
        answer = {"y": np.zeros(16)}
        mine = [rng.randbytes(20) for _ in range(n)]

        async def turn(i: int) -> None:
            if await store.get(mine[i // 2] if i % 2 else mine[i]) is None:
                await store.put(mine[i], answer, 600)

        p50, p99 = await _timed(turn, n)
        result = {"p50_us": p50, "p99_us": p99, "puts": n - store.hits, "skipped": store.skipped}
        await store.close()
        return result

    out.put(asyncio.run(run()))


def contention(n: int) -> dict[str, Any]:
    """Two processes on one file, each a get then (on a miss) a put per turn."""
    path = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    db = path / "results.db"
    asyncio.run(SQLiteCache(db, MAX_BYTES).close())  # the file, made once
    out: Any = multiprocessing.get_context("spawn").Queue()
    procs = [
        multiprocessing.get_context("spawn").Process(target=_contender, args=(str(db), s, n, out))
        for s in (1, 2)
    ]
    for proc in procs:
        proc.start()
    try:
        results = [out.get(timeout=120) for _ in procs]
        for proc in procs:
            proc.join()
    finally:
        shutil.rmtree(path)
    puts = sum(r["puts"] for r in results)
    skipped = sum(r["skipped"] for r in results)
    summary = {
        "turn_p50_us": statistics.median(r["p50_us"] for r in results),
        "turn_p99_us": max(r["p99_us"] for r in results),
        "puts": puts, "skipped": skipped, "skipped_share": skipped / puts,
    }  # fmt: skip
    print(f"two processes, get + put on a miss: {summary['turn_p50_us']:.1f} µs a turn "
          f"(p99 {summary['turn_p99_us']:.0f}), {skipped} of {puts} puts skipped")  # fmt: skip
    return summary


# -- servers ----------------------------------------------------------------------------


def _variants(work: Path) -> dict[str, dict[str, str]]:
    blocker = work / "not-a-folder"
    blocker.write_text("")  # so INFERD_CACHE__DIR below it cannot be made
    base = {"INFERD_LOG_LEVEL": "WARNING"}
    return {
        "off": {**base, "INFERD_CACHE__ENABLED": "false"},
        "per process": {**base, "INFERD_CACHE__ENABLED": "true",
                        "INFERD_CACHE__DIR": str(blocker / "cache")},
        "shared": {**base, "INFERD_CACHE__ENABLED": "true"},
    }  # fmt: skip


def _serve(work: Path) -> list[str]:
    return [sys.executable, "-m", "inferd", "serve", "--workers", "2", "--data-dir",
            str(work / "data"), "--grpc-port", "-1", "--port"]  # fmt: skip


def serving(url: str, log: Path, timeout_s: float = 120) -> None:
    """Until the server says it serves (all its gateway processes listen: they start one
    after the other, so the first answering is not enough) and ``url`` answers."""
    deadline = time.monotonic() + timeout_s
    while "serving on" not in log.read_text():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start: {log.read_text()[-2000:]}")
        time.sleep(0.2)
    wait_http(url)


def hits(work: Path, requests: int = 20) -> dict[str, Any]:
    variants = {k: v for k, v in _variants(work).items() if k != "off"}
    body = json.dumps({"inputs": [{"features": [0.5] * 30}]})
    seen: dict[str, Any] = {}
    for name, _, port in alternating(_serve(work), variants, 1, work):
        url = f"http://127.0.0.1:{port}/api/v1/models/fraud/predict"
        serving(url, work / f"{name}.log")  # (a warm-up body of its own, not this one)
        marks = []
        for _ in range(requests):
            with httpx.Client(timeout=10) as client:  # a new connection each
                marks.append(client.post(url, content=body).headers["x-cache"])
        seen[name] = {"sequence": marks, "hits": marks.count("hit")}
        print(f"{name:>12}: {marks.count('hit')} hits of {requests}: {' '.join(marks)}")
    return seen


def write_payloads(path: Path, lines: int, seed: int = 7) -> None:
    rng = random.Random(seed)

    def row() -> str:
        features = [round(rng.uniform(-2, 2), 4) for _ in range(30)]
        return json.dumps({"inputs": [{"features": features}]})

    recurring = [row() for _ in range(200)]
    with path.open("w") as f:
        for _ in range(lines):
            f.write((rng.choice(recurring) if rng.random() < REPEAT else row()) + "\n")


def run(url: str, payloads: Path, connections: int, duration_s: int) -> dict[str, float]:
    out = Path(tempfile.mkdtemp()) / "result.json"
    subprocess.run(
        [sys.executable, "-m", "inferd", "bench", url, "--payloads", str(payloads),
         "-c", str(connections), "-d", f"{duration_s}s", "--warmup", "0s", "--timeout", "10s",
         "--json", str(out)],
        capture_output=True, check=True,
    )  # fmt: skip
    level = json.loads(out.read_text())["levels"][0]
    shutil.rmtree(out.parent)
    return {
        "rps": level["rps"], "p50_ms": level["latency"]["p50"],
        "p99_ms": level["latency"]["p99"], "requests": level["requests"],
        "errors": level["errors"],
    }  # fmt: skip


def counted_hit_rate(base: str, expected: int) -> float | None:
    """Hits over lookups in the server's ``/metrics`` once it counted ``expected``
    lookups (log rows reach the server about a second after their requests)."""
    deadline = time.monotonic() + 15
    while True:
        text = httpx.get(f"{base}/metrics", timeout=10).text
        found = dict(re.findall(r'inferd_cache_requests_total\{.*result="(\w+)"\} (\d+)', text))
        hit, miss = int(found.get("hit", 0)), int(found.get("miss", 0))
        if hit + miss >= expected or time.monotonic() > deadline:
            return hit / (hit + miss) if hit + miss else None
        time.sleep(0.5)


def gateways_cpu_s(server: int) -> float:
    """CPU seconds (user + system) the server's gateway processes used so far."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in process_tree(server):
        try:
            if b"inferd.api.worker" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def throughput(work: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    payloads = work / "payloads.jsonl"
    write_payloads(payloads, lines=200_000)
    rows: list[dict[str, Any]] = []
    for name, proc, port in alternating(_serve(work), _variants(work), args.rounds, work):
        url = f"http://127.0.0.1:{port}/api/v1/models/fraud/predict"
        serving(url, work / f"{name}.log")
        cpu_s = gateways_cpu_s(proc.pid)
        r: dict[str, Any] = run(url, payloads, args.connections, args.duration)
        r["gateway_cpu_us"] = (gateways_cpu_s(proc.pid) - cpu_s) / r["requests"] * 1e6
        r["hit_rate"] = None
        if name != "off":
            r["hit_rate"] = counted_hit_rate(f"http://127.0.0.1:{port}", int(r["requests"]))
        rows.append({"server": name, **r})
        rate = "" if r["hit_rate"] is None else f"  hits {r['hit_rate']:.1%}"
        print(f"{name:>12} {r['rps']:8.0f} req/s  p50 {r['p50_ms']:6.2f} ms  "
              f"p99 {r['p99_ms']:6.2f} ms  errors {r['errors']:.0f}  gateway CPU "
              f"{r['gateway_cpu_us']:.0f} µs/request{rate}")  # fmt: skip
    return rows


# -- report -----------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="calls,hits,throughput")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--duration", type=int, default=12)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    parts = args.parts.split(",")
    work = Path(tempfile.mkdtemp(prefix="inferd-bench-cache-"))
    report: dict[str, Any] = {"args": vars(args)}
    try:
        if "calls" in parts:
            report["calls"] = calls(work, args.calls)
            report["contention"] = contention(args.calls * 5)
        if "hits" in parts or "throughput" in parts:
            prepare(work)
        if "hits" in parts:
            report["hits"] = hits(work)
        if "throughput" in parts:
            report["throughput"] = throughput(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_results(report)


def write_results(report: dict[str, Any]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cache.json").write_text(json.dumps(report, indent=2))
    lines: list[str] = []
    if "calls" in report:
        lines += ["| store | answer | get hit µs | get miss µs | put µs (p99) | put CPU µs "
                  "| puts skipped |", "|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in report["calls"]:
            lines.append(f"| {r['store']} | {r['answer']} | {r['hit_p50_us']:.1f} | "
                         f"{r['miss_p50_us']:.1f} | {r['put_p50_us']:.1f} "
                         f"({r['put_p99_us']:.0f}) | {r['put_cpu_us']:.1f} | "
                         f"{r['skipped']} |")  # fmt: skip
        c = report["contention"]
        lines += ["", f"two processes on one file, a get then a put on a miss: "
                  f"{c['turn_p50_us']:.1f} µs a turn (p99 {c['turn_p99_us']:.0f} µs), "
                  f"{c['skipped']} of {c['puts']} puts skipped "
                  f"({c['skipped_share']:.1%})", ""]  # fmt: skip
    for name, seen in report.get("hits", {}).items():
        lines.append(f"{name}: {seen['hits']} hits of 20 on new connections: "
                     + " ".join(seen["sequence"]))  # fmt: skip
    if "throughput" in report:
        lines += ["", "| result cache | req/s (median) | p50 ms | p99 ms | errors | gateway "
                  "CPU µs/request | hit rate |", "|---|---|---|---|---|---|---|"]  # fmt: skip
        for name in ("off", "per process", "shared"):
            runs = [r for r in report["throughput"] if r["server"] == name]
            m = {k: statistics.median(float(r[k]) for r in runs)
                 for k in ("rps", "p50_ms", "p99_ms", "errors", "gateway_cpu_us")}  # fmt: skip
            rates = [r["hit_rate"] for r in runs if r["hit_rate"] is not None]
            rate = f"{statistics.median(rates):.1%}" if rates else "-"
            lines.append(f"| {name} | {m['rps']:.0f} | {m['p50_ms']:.2f} | "
                         f"{m['p99_ms']:.2f} | {m['errors']:.0f} | "
                         f"{m['gateway_cpu_us']:.0f} | {rate} |")  # fmt: skip
    text = "\n".join([*lines, ""])
    (RESULTS / "cache.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
