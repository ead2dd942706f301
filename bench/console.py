"""The web console's figures: what it weighs, how fast the overview loads with many
models, and what an open console costs the gateway.

    .venv/bin/python bench/console.py [--rounds 6] [--duration 15] [--models 200 --deployed 20]

1. **Size**: the console's files as served (gzip where the gateway gzips them).
2. **Overview load** with ``--models`` registered models of which ``--deployed`` run
   (the others registered and unloaded): Debian's Chromium (Playwright) opens
   ``/ui/`` in a new browser context each time (a cold cache) and times navigation
   start to the overview's last chart drawn (the page's ``inferd:overview-charts``
   mark) and to its models table; median of ``--loads``.
3. **Cost on the gateway**: ``bench/tabular.py``'s load (the fraud model, one row per
   request, ``wrk`` at 64 connections, or ``inferd bench`` without wrk) against one
   ``inferd serve``, in rounds rotating the order of *no console*, *one console open
   on the overview* (Debian's Chromium showing ``/ui/``, no automation attached: a
   person's browser); the ratio of the medians. The browser runs on the same 2 cores,
   so the ratio also counts Chromium's own work; a third variant replays just the
   console's requests at its rates (no browser) to tell the gateway's share from the
   browser's.

4. **Idle CPU**: what the server's processes and the browser use per minute with no
   other load, the overview open vs not (``--idle-s`` each, twice).

Writes bench/results/console.json and console.md. Servers and the browser are started
and stopped here; traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from servers import free_port, start, stop
from tabular import prepare, run_inferd_bench, run_wrk, wait_http

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))

from tests.browser import browser_session  # noqa: E402  (the tests' Chromium launcher)

MODEL = """
import numpy as np


class Echo:
    signature = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    }

    def predict(self, batch):
        return {"y": np.asarray(batch["x"], dtype=np.float32) * 2}
"""


def size() -> dict[str, object]:
    from inferd.console import Assets

    files = Assets().files
    shown = {
        name: {"bytes": len(a.body), "gzip": len(a.gzipped) if a.gzipped else len(a.body)}
        for name, a in sorted(files.items())
        if name
    }
    total = sum(f["gzip"] for f in shown.values())
    raw = sum(f["bytes"] for f in shown.values())
    print(f"console files: {raw / 1024:.1f} KiB, {total / 1024:.1f} KiB as served (gzip)")
    return {"files": shown, "bytes": raw, "served_bytes": total}


# -- overview load with many models ----------------------------------------------------


def wait_drawn(page, timeout_s: float = 60) -> None:
    """Until the overview drew its charts (polled: the page's CSP forbids the string
    evaluation ``wait_for_function`` uses)."""
    deadline = time.monotonic() + timeout_s
    while not page.evaluate("performance.getEntriesByName('inferd:overview-charts').length"):
        if time.monotonic() > deadline:
            raise TimeoutError("the overview drew no chart")
        page.wait_for_timeout(20)


def register_many(data: Path, models: int, deployed: int) -> None:
    from inferd.registry import Registry
    from inferd.shapes.tensors import Signature

    src = data.parent / "src"
    src.mkdir(parents=True, exist_ok=True)
    (src / "model.py").write_text(MODEL)
    signature = Signature.from_dict(
        {
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
        }
    )
    registry = Registry(f"sqlite:///{data / 'inferd.db'}", data / "artifacts")
    for i in range(models):
        name = f"model-{i:03d}"
        registry.push(
            name, src, "v1", framework="python", signature=signature,
            metadata={"team": f"team-{i % 7}"}, description=f"Benchmark model {i}",
        )  # fmt: skip
        if i >= deployed:
            registry.set_loaded(name, False)
    registry.close()


def overview_load(args: argparse.Namespace, work: Path) -> dict[str, object]:
    data = work / "many" / "data"
    data.mkdir(parents=True)
    register_many(data, args.models, args.deployed)
    port = free_port()
    cmd = [sys.executable, "-m", "inferd", "serve", "--data-dir", str(data), "--grpc-port",
           "-1", "--port", str(port)]  # fmt: skip
    proc = start(cmd, {"INFERD_LOG_LEVEL": "WARNING"}, work / "many.log")
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health/ready", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        with httpx.Client(base_url=url) as client:  # a little traffic for the charts
            for i in range(args.deployed):
                for _ in range(5):
                    body = {"inputs": [{"x": 1}]}
                    client.post(f"/api/v1/models/model-{i:03d}/predict", json=body)
        time.sleep(3)
        loads = []
        with browser_session() as browser:
            for _ in range(args.loads):
                context = browser.new_context(viewport={"width": 1400, "height": 900})
                page = context.new_page()
                page.goto(url + "/ui/")
                wait_drawn(page)
                page.wait_for_selector(f"a[href='#/models/model-{args.models - 1:03d}']")
                charts, table, rows = page.evaluate(
                    """() => [performance.getEntriesByName('inferd:overview-charts')[0].startTime,
                    performance.now(), document.querySelectorAll('main tbody tr').length]"""
                )
                loads.append({"charts_ms": charts, "table_ms": table, "rows": rows})
                context.close()
        median = statistics.median(x["charts_ms"] for x in loads)
        print(f"overview with {args.models} models ({args.deployed} deployed), cold cache: "
              f"last chart drawn at {median:.0f} ms (median of {len(loads)})")  # fmt: skip
        return {"models": args.models, "deployed": args.deployed, "loads": loads,
                "charts_ms_median": median}  # fmt: skip
    finally:
        stop(proc)


# -- cost on the gateway -------------------------------------------------------------------


class Replay:
    """The console's requests without a browser: the overview every 10 s, the series
    every 5 s (``since`` the last answer), as the overview page polls."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run)

    def run(self) -> None:
        since = None
        next_overview = 0.0
        with httpx.Client(base_url=self.url, timeout=10) as client:
            while not self.stopping.is_set():
                now = time.monotonic()
                if now >= next_overview:
                    client.get("/api/v1/console/overview")
                    next_overview = now + 10
                params = {"window_s": 300} | ({"since": since - 0.001} if since else {})
                since = client.get("/api/v1/console/series", params=params).json()["until"]
                self.stopping.wait(5)

    def __enter__(self) -> Replay:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join()


@contextlib.contextmanager
def fraud_server(work: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``inferd serve`` (2 gateway processes) with ``bench/tabular.py``'s fraud model,
    ready: (its process, its base URL)."""
    prepare(work)
    port = free_port()
    cmd = [sys.executable, "-m", "inferd", "serve", "--workers", "2", "--data-dir",
           str(work / "data"), "--grpc-port", "-1", "--port", str(port)]  # fmt: skip
    proc = start(cmd, {"INFERD_LOG_LEVEL": "WARNING"}, work / "server.log")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/api/v1/models/fraud/predict")
        yield proc, base
    finally:
        stop(proc)


def cost(args: argparse.Namespace, work: Path) -> dict[str, object]:
    load = run_wrk if shutil.which("wrk") else run_inferd_bench
    rows: list[dict[str, object]] = []
    with fraud_server(work) as (_, base):
        url = base + "/api/v1/models/fraud/predict"
        load(url, 64, 3)  # warm-up
        variants = args.variants
        for round_ in range(args.rounds):
            # rotated, so that each variant runs in each position equally often
            order = variants[round_ % len(variants) :] + variants[: round_ % len(variants)]
            for variant in order:
                r = _one_round(variant, base, url, load, args.duration)
                rows.append({"variant": variant, "round": round_, **r})
                print(f"round {round_} {variant:>8}: {r['rps']:8.0f} req/s  "
                      f"p99 {r['p99_ms']:6.2f} ms", flush=True)  # fmt: skip
    med = {
        v: statistics.median(float(r["rps"]) for r in rows if r["variant"] == v)  # type: ignore[arg-type]
        for v in args.variants
    }
    paired = {  # each round's ratio: its variants ran back to back, in the same weather
        v: statistics.median(
            float(a["rps"]) / float(b["rps"])  # type: ignore[arg-type]
            for a in rows
            for b in rows
            if a["variant"] == v and b["variant"] == "none" and a["round"] == b["round"]
        )
        for v in args.variants
        if v != "none"
    }
    out: dict[str, object] = {"loadgen": load.__name__, "runs": rows, "median_rps": med}
    for v in paired:
        out[f"ratio_{v}"] = med[v] / med["none"]
        out[f"paired_ratio_{v}"] = paired[v]
        print(f"{v}: {med[v] / med['none']:.3f}x of no console (ratio of medians), "
              f"{paired[v]:.3f}x (median of each round's ratio)")  # fmt: skip
    return out


def tree_cpu_s(root: int) -> float:
    """CPU seconds used so far by ``root`` and every process under it (from /proc)."""
    from inferd.monitoring.exposition import process_usage

    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat[1])
    tree, total = {root}, 0.0
    changed = True
    while changed:
        found = {pid for pid, ppid in parents.items() if ppid in tree} - tree
        changed = bool(found)
        tree |= found
    for pid in tree:
        usage = process_usage(pid)
        total += usage[0] if usage is not None else 0.0
    return total


def idle_cpu(args: argparse.Namespace, work: Path) -> dict[str, object]:
    """CPU the console itself costs, with no other load: the server's processes (server,
    gateways, replica) and the browser's, per minute, with the overview open vs not."""
    out: dict[str, object] = {}
    with fraud_server(work) as (proc, base):
        time.sleep(3)
        for variant in ("none", "browser", "none", "browser"):
            with contextlib.ExitStack() as stack:
                browser_pid = None
                if variant == "browser":
                    browser_pid = stack.enter_context(open_console(base + "/ui/"))
                server_before = tree_cpu_s(proc.pid)
                browser_before = tree_cpu_s(browser_pid) if browser_pid else 0.0
                time.sleep(args.idle_s)
                server = (tree_cpu_s(proc.pid) - server_before) / args.idle_s * 60
                browser = (
                    (tree_cpu_s(browser_pid) - browser_before) / args.idle_s * 60
                    if browser_pid
                    else 0.0
                )
            out.setdefault(variant, []).append(
                {"server_cpu_s_per_min": server, "browser_cpu_s_per_min": browser}
            )  # type: ignore[union-attr]
            print(f"idle, {variant:>7}: server processes {server:.2f} CPU s/min, "
                  f"browser {browser:.2f} CPU s/min", flush=True)  # fmt: skip
    return out


def _one_round(variant, base, url, load, duration_s) -> dict[str, float]:
    if variant == "none":
        return load(url, 64, duration_s)
    if variant == "replay":
        with Replay(base):
            return load(url, 64, duration_s)
    with open_console(base + "/ui/"):
        return load(url, 64, duration_s)


@contextlib.contextmanager
def open_console(url: str) -> Iterator[int]:
    """Debian's Chromium showing ``url`` as a person's browser would: no automation
    attached (Playwright's would add its own traffic), given 4 s to load and draw."""
    from tests.browser import CHROMIUM, CHROMIUM_ARGS

    profile = Path(tempfile.mkdtemp(prefix="inferd-chromium-"))
    proc = subprocess.Popen(
        [str(CHROMIUM), "--headless=new", *CHROMIUM_ARGS, "--window-size=1400,900",
         f"--user-data-dir={profile}", url],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        time.sleep(4)
        yield proc.pid
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
        shutil.rmtree(profile, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--duration", type=int, default=15)
    parser.add_argument("--models", type=int, default=200)
    parser.add_argument("--deployed", type=int, default=20)
    parser.add_argument("--loads", type=int, default=5)
    parser.add_argument("--idle-s", type=int, default=60, help="each idle CPU measurement")
    parser.add_argument(
        "--variants", nargs="+", default=["none", "browser", "replay"],
        help="the cost rounds' variants (none is the baseline)",
    )  # fmt: skip
    parser.add_argument("--skip", nargs="*", default=[], choices=("load", "cost", "idle"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="inferd-console-bench-"))
    results: dict[str, object] = {"size": size()}
    try:
        if "load" not in args.skip:
            results["overview_load"] = overview_load(args, work)
        if "idle" not in args.skip:
            results["idle"] = idle_cpu(args, work / "idle")
        if "cost" not in args.skip:
            results["cost"] = cost(args, work / "cost")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "console.json").write_text(json.dumps({"args": vars(args), **results}, indent=2))
    write_md(results)


def write_md(results: dict[str, object]) -> None:
    size_ = results["size"]
    lines = ["| figure | value |", "|---|---|",
             f"| console files as served (gzip) | {size_['served_bytes'] / 1024:.1f} KiB "  # type: ignore[index]
             f"({size_['bytes'] / 1024:.1f} KiB uncompressed) |"]  # type: ignore[index]  # fmt: skip
    if "overview_load" in results:
        o = results["overview_load"]
        lines.append(
            f"| overview load, {o['models']} models ({o['deployed']} deployed), cold cache, "  # type: ignore[index]
            f"to the last chart drawn | {o['charts_ms_median']:.0f} ms (median) |"  # type: ignore[index]
        )
    if "idle" in results:
        idle = results["idle"]
        for variant, label in (("none", "no console"), ("browser", "the overview open")):
            runs = idle[variant]  # type: ignore[index]
            server = statistics.median(r["server_cpu_s_per_min"] for r in runs)
            browser = statistics.median(r["browser_cpu_s_per_min"] for r in runs)
            lines.append(f"| CPU, idle server, {label}: server processes / browser | "
                         f"{server:.2f} / {browser:.2f} CPU s per minute |")  # fmt: skip
    if "cost" in results:
        c: dict[str, Any] = results["cost"]  # type: ignore[assignment]
        names = {"browser": "console open", "replay": "its requests alone"}
        rounds = len([r for r in c["runs"] if r["variant"] == "none"])
        lines.append(
            f"| tabular req/s, median of {rounds} rounds: no console / "
            + " / ".join(names[v] for v in c["median_rps"] if v != "none")
            + " | " + " / ".join(f"{m:.0f}" for m in c["median_rps"].values()) + " |"
        )  # fmt: skip
        for v in (v for v in c["median_rps"] if v != "none"):
            lines.append(f"| {names[v]} vs none: ratio of medians; median of each round's ratio | "
                         f"{c[f'ratio_{v}']:.3f}; {c[f'paired_ratio_{v}']:.3f} |")  # fmt: skip
    (RESULTS / "console.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
