"""What OpenTelemetry tracing costs: the tabular benchmark with tracing off and on.

    .venv/bin/python bench/tracing.py [--duration 12] [--rounds 3] [--connections 64]

Serves the demo fraud model (XGBoost, 30 features) with ``inferd serve`` once per
variant and round, in alternating order: tracing off (no OTEL_* variables), on with no
request sampled (``OTEL_TRACES_SAMPLER=always_off``: the cost of the sampling decision),
on with 1 % sampled (``OTEL_TRACES_SAMPLER=traceidratio``, ``OTEL_TRACES_SAMPLER_ARG=0.01``)
and on with every request sampled, exporting over OTLP/HTTP to a collector this script
runs that reads each export and answers 200 without decoding it (a real collector runs
elsewhere; this one's CPU is still taken from the same 2 cores). Closed-loop load from
``inferd bench`` (or ``wrk``); medians over rounds and the ratios to "off"; writes
bench/results/tracing.{json,md}. Traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from servers import alternating
from tabular import measure, prepare

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


class _Sink(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    exports = 0
    received = 0

    def do_POST(self) -> None:
        length = int(self.headers["content-length"])
        self.rfile.read(length)
        _Sink.exports += 1
        _Sink.received += length
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=int, default=12)
    parser.add_argument("--connections", type=int, nargs="+", default=[64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="inferd gateway processes")
    parser.add_argument("--loadgen", choices=("wrk", "inferd"), default=None)
    args = parser.parse_args()
    if args.loadgen is None:
        args.loadgen = "wrk" if shutil.which("wrk") else "inferd"
    sink = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{sink.server_address[1]}"
    work = Path(tempfile.mkdtemp(prefix="inferd-bench-tracing-"))
    prepare(work)
    cmd = [sys.executable, "-m", "inferd", "serve", "--workers", str(args.workers),
           "--data-dir", str(work / "data"), "--grpc-port", "-1", "--port"]  # fmt: skip
    quiet = {"INFERD_LOG_LEVEL": "WARNING"}
    traced = {**quiet, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}
    variants = {
        "off": quiet,
        "none sampled": {**traced, "OTEL_TRACES_SAMPLER": "always_off"},
        "all sampled": traced,
        "1% sampled": {
            **traced,
            "OTEL_TRACES_SAMPLER": "traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "0.01",
        },
    }
    rows: list[dict[str, object]] = []
    try:
        for name, proc, port in alternating(cmd, variants, args.rounds, work):
            url = f"http://127.0.0.1:{port}/api/v1/models/fraud/predict"
            measure(name, proc, url, args, rows)
    finally:
        sink.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    write_results(rows, args, list(variants))


def write_results(
    rows: list[dict[str, object]], args: argparse.Namespace, names: list[str]
) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "tracing.json").write_text(
        json.dumps({"args": vars(args), "exports": _Sink.exports, "runs": rows}, indent=2)
    )
    lines = ["| connections | tracing | req/s (median) | vs off | p50 ms | p99 ms | errors |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for c in args.connections:
        medians = {}
        for name in names:
            runs = [r for r in rows if r["server"] == name and r["connections"] == c]
            medians[name] = {k: statistics.median(float(r[k]) for r in runs)  # type: ignore[arg-type]
                             for k in ("rps", "p50_ms", "p99_ms", "errors")}  # fmt: skip
        for name in names:
            med = medians[name]
            lines.append(
                f"| {c} | {name} | {med['rps']:.0f} | {med['rps'] / medians['off']['rps']:.3f} | "
                f"{med['p50_ms']:.2f} | {med['p99_ms']:.2f} | {med['errors']:.0f} |"
            )
    text = "\n".join([*lines, "", f"OTLP exports received: {_Sink.exports} "
                      f"({_Sink.received / 1e6:.1f} MB)", ""])  # fmt: skip
    (RESULTS / "tracing.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
