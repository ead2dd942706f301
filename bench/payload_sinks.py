"""What payload logging to sinks costs, and how many rows a sink ships.

    .venv/bin/python bench/payload_sinks.py [--duration 8] [--rounds 3] [--connections 64]

1. The tabular benchmark (bench/tabular.py's fraud model, XGBoost, 30 features, and its
   load generator: ``wrk``, else ``inferd bench``), served three ways in alternating
   order each round: no sink; an HTTP sink with full payloads (every request's bodies,
   ``redact: [user]``) to a receiver this script runs in a process of its own; sinks
   that are down (a closed port and a listener that never answers). Medians over rounds,
   throughput ratios against no sink, and the rows the HTTP sink delivered a second
   under that load (``inferd_payload_sink_rows_sent_total`` before and after).
2. Each sink's own rate, without a server: a :class:`SinkRunner` fed rows with payloads
   as fast as it takes them (HTTP to the receiver, Redis Streams to 127.0.0.1:6379 when
   it answers, Parquet to moto's S3 server when moto is installed: a Python server, so
   that figure is moto's more than the sink's). Kafka: not measured without a broker.

Writes bench/results/payload_sinks.{json,md}. Traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
from servers import alternating, free_port, process_tree, tree_cpu_s
from tabular import BODY, prepare, run_inferd_bench, run_wrk, wait_http

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


# -- the receiver: a process of its own, counting events without parsing them ----------------


def receive(port: int) -> None:
    """``--receive PORT``: POSTed CloudEvent batches are counted (``GET`` answers the count)."""
    count = [0]
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            with lock:
                count[0] += body.count(b'"specversion":')
            self._answer(204, b"")

        def do_GET(self) -> None:
            self._answer(200, str(count[0]).encode())

        def _answer(self, code: int, body: bytes) -> None:
            self.send_response(code)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


@contextlib.contextmanager
def receiver() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--receive", str(port)])
    url = f"http://127.0.0.1:{port}/events"
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(httpx.TransportError):
                httpx.get(url, timeout=1)
                break
            if time.monotonic() > deadline:
                raise RuntimeError("the receiver did not start")
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@contextlib.contextmanager
def black_hole() -> Iterator[str]:
    """A listener that accepts connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(sock.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/events"
    finally:
        sock.close()
        for conn in held:
            conn.close()


# -- 1. the tabular benchmark with and without sinks -------------------------------------------


def sink_rows(port: int, name: str = "sent") -> float:
    """Rows the server's sinks ``sent`` (``dropped``, ``failed``) so far, all sinks."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    family = f"inferd_payload_sink_rows_{name}_total"
    return sum(float(m) for m in re.findall(rf"^{family}{{[^}}]*}} (\S+)$", text, re.M))


def cpu_split(pid: int) -> tuple[float, float]:
    """CPU seconds so far of the server process alone (where the sinks' threads run) and
    of its gateway processes (where bodies are captured)."""
    own = gateways = 0.0
    for p in process_tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rpartition(")")[2].split()
            gateway = b"inferd.api.worker" in Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            continue  # exited meanwhile
        used = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        own += used if p == pid else 0.0
        gateways += used if gateway else 0.0
    return own, gateways


def load_rounds(args: argparse.Namespace, work: Path, up: str, down: list[str]) -> list[dict]:
    prepare(work)
    cmd = [sys.executable, "-m", "inferd", "serve", "--workers", str(args.workers),
           "--data-dir", str(work / "data"), "--grpc-port", "-1", "--port"]  # fmt: skip
    quiet = {"INFERD_LOG_LEVEL": "WARNING"}
    payloads = {"INFERD_PAYLOAD_LOG__PAYLOADS": "true", "INFERD_PAYLOAD_LOG__REDACT": '["user"]'}
    variants = {
        "no sink": quiet,
        "http sink, full payloads": {
            **quiet, **payloads, "INFERD_PAYLOAD_LOG__SINKS": json.dumps([up]),
        },
        "sinks down": {
            **quiet, **payloads, "INFERD_PAYLOAD_LOG__SINKS": json.dumps(down),
            "INFERD_PAYLOAD_LOG__TIMEOUT_S": "1",
        },
    }  # fmt: skip
    load = run_wrk if args.loadgen == "wrk" else run_inferd_bench
    rows: list[dict[str, Any]] = []
    for i, (name, proc, port) in enumerate(alternating(cmd, variants, args.rounds, work)):
        url = f"http://127.0.0.1:{port}/api/v1/models/fraud/predict"
        wait_http(url)
        load(url, args.connections, 3)  # warm-up
        before, started = sink_rows(port), time.monotonic()
        cpu, (own, gateways) = tree_cpu_s(proc.pid), cpu_split(proc.pid)
        result = load(url, args.connections, args.duration)
        after = cpu_split(proc.pid)
        cpu, own, gateways = tree_cpu_s(proc.pid) - cpu, after[0] - own, after[1] - gateways
        time.sleep(1.5)  # the last rows' flush: gateway, then the sink
        rows_per_s = (sink_rows(port) - before) / (time.monotonic() - started)
        lost = sink_rows(port, "dropped") + sink_rows(port, "failed")
        per = 1e6 / max(1.0, float(result["requests"]))
        rows.append({"server": name, "round": i // len(variants), **result,
                     "sink_rows_per_s": rows_per_s, "cpu_us_per_request": cpu * per,
                     "server_cpu_us_per_request": own * per,
                     "gateway_cpu_us_per_request": gateways * per,
                     "sink_rows_lost": lost})  # fmt: skip
        print(
            f"{name:>26}  {result['rps']:8.0f} req/s  p50 {result['p50_ms']:6.2f} ms  "
            f"p99 {result['p99_ms']:6.2f} ms  errors {result['errors']:.0f}  "
            f"sink {rows_per_s:7.0f} rows/s  CPU/request: all {cpu * per:4.0f} us, "
            f"server process {own * per:4.0f} us, gateways {gateways * per:4.0f} us; "
            f"sink rows dropped or failed {lost:.0f}",
            flush=True,
        )
    return rows


# -- 2. each sink's own rate ---------------------------------------------------------------------


def capacity(uri: str, rows_n: int, env: dict[str, str] | None = None) -> dict[str, float]:
    """Rows a second one sink ships (rows with a predict's bodies, redacting ``user``),
    fed in frames of 500 rows as gateways ship them, as fast as its buffer takes them."""
    from inferd.config import PayloadLogConfig
    from inferd.monitoring.sinks import open_sinks
    from inferd.shapes.logs import LogRow, Payload

    response = b'{"model":"fraud","version":"v1","outputs":[{"label":"0","probabilities":[0.9]}]}'
    payload = Payload(BODY.encode(), response, len(BODY), len(response))
    cfg = PayloadLogConfig(sinks=[uri], payloads=True, redact=["user"], max_buffer_rows=rows_n,
                           max_buffer_mb=4096, timeout_s=30)  # fmt: skip
    with _environ(env or {}):
        (runner,) = open_sinks(cfg)
        frame = [
            LogRow(request_id=uuid.uuid4().hex, model_name="fraud", version="v1", api="v1",
                   status_code=200, latency_ms=2.5, payload=payload)
            for _ in range(500)
        ]  # fmt: skip
        started = time.perf_counter()
        for _ in range(rows_n // len(frame)):
            runner.offer(frame)
        while runner.sent + runner.failed < rows_n:
            time.sleep(0.01)
        elapsed = time.perf_counter() - started
        runner.close()
    return {"rows": runner.sent, "failed": runner.failed, "rows_per_s": runner.sent / elapsed}


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def capacities(up: str, rows_n: int) -> dict[str, dict[str, float]]:
    out = {"http": capacity(up, rows_n)}
    with contextlib.suppress(Exception):
        import redis

        redis.from_url("redis://127.0.0.1:6379/0").ping()
        stream = f"inferd-bench-{uuid.uuid4().hex[:8]}"
        out["redis"] = capacity(f"redis://127.0.0.1:6379/0?stream={stream}&maxlen=100000",
                                rows_n)  # fmt: skip
        redis.from_url("redis://127.0.0.1:6379/0").delete(stream)
    with contextlib.suppress(ImportError), _moto() as aws:
        out["s3 (moto)"] = capacity("s3://bench/payloads", rows_n // 4, aws)
    for name, figure in out.items():
        print(f"{name:>10} sink alone: {figure['rows_per_s']:9.0f} rows/s", flush=True)
    return out


@contextlib.contextmanager
def _moto() -> Iterator[dict[str, str]]:
    import moto  # noqa: F401 -- ImportError: no S3 figure
    import s3fs

    port = free_port()
    cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("moto did not start") from None
                time.sleep(0.1)
        s3fs.S3FileSystem(key="test", secret="test", endpoint_url=env["AWS_ENDPOINT_URL"]).mkdir(
            "bench"
        )
        yield env
    finally:
        proc.terminate()
        proc.wait(10)


def write_results(
    runs: list[dict[str, Any]], alone: dict[str, dict[str, float]], args: argparse.Namespace
) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "payload_sinks.json").write_text(
        json.dumps({"args": vars(args), "runs": runs, "sink_alone": alone}, indent=2)
    )
    names = list(dict.fromkeys(r["server"] for r in runs))
    keys = (
        "rps",
        "p50_ms",
        "p99_ms",
        "errors",
        "sink_rows_per_s",
        "sink_rows_lost",
        "cpu_us_per_request",
        "server_cpu_us_per_request",
        "gateway_cpu_us_per_request",
    )
    med = {
        n: {k: statistics.median(float(r[k]) for r in runs if r["server"] == n) for k in keys}
        for n in names
    }
    lines = [f"c={args.connections}, {args.rounds} rounds of {args.duration} s, medians "
             "(paired: the median over rounds of each round's ratio to that round's no sink):",
             "", "| server | req/s | ratio vs no sink | paired ratio | p50 ms | p99 ms | errors "
             "| sink rows/s | sink rows dropped or failed | CPU us/request: all processes "
             "| server process | gateways |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for n in names:
        m = med[n]
        lines.append(
            f"| {n} | {m['rps']:.0f} | {m['rps'] / med['no sink']['rps']:.3f} | "
            f"{_paired(runs, n):.3f} | {m['p50_ms']:.2f} | {m['p99_ms']:.2f} | "
            f"{m['errors']:.0f} | {m['sink_rows_per_s']:.0f} | {m['sink_rows_lost']:.0f} | "
            f"{m['cpu_us_per_request']:.0f} | "
            f"{m['server_cpu_us_per_request']:.0f} | {m['gateway_cpu_us_per_request']:.0f} |"
        )
    lines += ["", "| sink alone | rows | rows/s |", "|---|---|---|"]
    lines += [f"| {n} | {f['rows']:.0f} | {f['rows_per_s']:.0f} |" for n, f in alone.items()]
    text = "\n".join(lines) + "\n"
    (RESULTS / "payload_sinks.md").write_text(text)
    print(text)


def _paired(runs: list[dict[str, Any]], name: str) -> float:
    """The median over rounds of ``name``'s throughput over that round's no sink (the two
    measured minutes apart at most, so a noisy hour weighs on both alike)."""
    base = {r["round"]: float(r["rps"]) for r in runs if r["server"] == "no sink"}
    return statistics.median(
        float(r["rps"]) / base[r["round"]] for r in runs if r["server"] == name
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=int, default=8)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="inferd gateway processes")
    parser.add_argument("--loadgen", choices=("wrk", "inferd"), default=None)
    parser.add_argument("--capacity-rows", type=int, default=100_000)
    parser.add_argument("--receive", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receive:
        receive(args.receive)
        return
    if args.loadgen is None:
        args.loadgen = "wrk" if shutil.which("wrk") else "inferd"
    work = Path(tempfile.mkdtemp(prefix="inferd-bench-sinks-"))
    try:
        with receiver() as up, black_hole() as silent:
            closed = f"http://127.0.0.1:{free_port()}/events"
            runs = load_rounds(args, work, up, [closed, silent])
            alone = capacities(up, args.capacity_rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_results(runs, alone, args)


if __name__ == "__main__":
    main()
