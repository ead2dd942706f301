"""Every door bounded (#56): the gateway under attack, with auth on, measured as the issue
asks — its resident memory, its CPU, its open files, and an honest client's latency
beside the attack against the same client idle, in the same run.

    .venv/bin/python bench/abuse.py [--attacks grpc-flood,rapid-reset,slowloris]
        [--flood-connections 20] [--slowloris 2000] [--rounds 3]

One ``inferd serve`` (one gateway process, so every connection lands on the process
measured; ``INFERD_AUTH__ENABLED=true``, default ``connections.*`` limits), a Python
model ``echo``, an infer key limited to it for the honest client. Attacks:

- ``grpc-flood``: one connection opening 300 ModelInfer streams with no credential, each
  sending 3 MiB of a message declared 15 MiB and never finishing it (as far as the
  server lets it); then ``--flood-connections`` such connections at once, and as many
  reconnecting for 10 s as soon as each is closed. Gateway RSS growth (peak, sampled
  every 10 ms), how much the attackers got to send, and the honest gRPC client's
  p99 during the flood over its p99 in the IDLE_S just before (measured the same way),
  the median of ``--rounds``;
- ``rapid-reset``: HEADERS, a whole message and RST_STREAM at 10,000 a second on one
  connection with a valid key (each call's handler starts): when the connection is
  closed (GOAWAY ENHANCE_YOUR_CALM) and the gateway's CPU seconds over the attack's
  first second;
- ``slowloris``: ``--slowloris`` HTTP connections dribbling a request head, a byte a
  second each, and as many gRPC connections with a header block begun, for 20 s: the
  honest HTTP client's p99 during, over idle, and the gateway's open files (peak, and
  after).

Writes bench/results/abuse.{json,md}. Traffic stays on 127.0.0.1; every attack is
bounded in time and stops by itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.conftest import InferdServer, arithmetic_model, create_key, push_source  # noqa: E402
from tests.h2raw import INFER, Raw, attacker_address, message  # noqa: E402
from tests.test_abuse_grpc import Guarded, Neighbour, PeakRss, _request  # noqa: E402

RESULTS = ROOT / "bench" / "results"
MiB = 1 << 20


def quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    at = lambda q: ordered[min(len(ordered) - 1, int(len(ordered) * q))]  # noqa: E731
    return {"n": len(values), "p50_ms": at(0.5) * 1000, "p99_ms": at(0.99) * 1000}


# -- gRPC flood ------------------------------------------------------------------------


def flood_connection(
    port: int, source: str, streams: int, each: int, declared: int
) -> dict[str, int]:
    """One attacker connection from ``source``: ``streams`` unauthenticated calls, ``each``
    bytes sent on each of a ``declared``-byte message. What the server answered."""
    with Raw(port, source=source) as raw:
        ids = [raw.new_stream() for _ in range(streams)]
        raw.send(b"".join(raw.headers(s) for s in ids))
        start = message(b"", declared)
        payload = start + b"\x00" * (each - len(start))
        sent = 0
        for stream in ids:
            raw.windows[stream] = 1 << 30  # an attacker ignores the stream's window
            sent += raw.upload(stream, payload, timeout_s=60)
            if raw.closed:
                break
        raw.until(lambda: all(raw.streams.get(s) and raw.streams[s].status for s in ids), 10)
        statuses = [raw.streams[s].status for s in ids if s in raw.streams]
        return {
            "sent_kib": sent // 1024,
            "unauthenticated": sum(1 for s in statuses if s == 16),
            "other": sum(1 for s in statuses if s not in (16, None)),
            "goaway": -1 if raw.goaway is None else raw.goaway[0],
            "closed_at_accept": int(not raw.settings),
        }


def _flooder(port: int, source: str, for_s: float, ready: Any, go: Any, results: Any) -> None:
    """An attacker process: says it is ready, waits for ``go``, then floods, reconnecting
    for ``for_s``."""
    ready.put(source)
    go.wait()
    out = []
    until = time.monotonic() + for_s
    while True:
        try:
            out.append(flood_connection(port, source, 300, 3 * MiB, 15 * MiB))
        except OSError:
            out.append({"sent_kib": 0, "unauthenticated": 0, "other": 0, "goaway": -1,
                        "closed_at_accept": 1})  # fmt: skip
        if time.monotonic() >= until:
            break
    results.put(out)


def pin_to(cpus: list[int], pids: list[int] | None = None) -> None:
    for pid in pids or [0]:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(pid, cpus)


IDLE_S = 5.0
"""How long the honest client is measured with no attack, the same way as during one (its
loop on a thread, the memory sampler running), before each attack."""


def grpc_flood(guarded: Guarded, connections: int, rounds: int) -> dict[str, Any]:
    """The flood on one connection, on ``connections`` at once (each from its own
    address), and on as many that reconnect for 10 s as soon as each is closed; each
    ``rounds`` times, the medians kept."""
    variants = [
        ("one connection", 1, 0.0),
        (f"{connections} connections", connections, 0.0),
        (f"{connections} addresses reconnecting for 10 s", connections, 10.0),
    ]
    out: dict[str, Any] = {}
    for name, count, for_s in variants:
        runs = []
        for _ in range(rounds):
            runs.append(flood_round(guarded, count, for_s))
            print(name, json.dumps(runs[-1]), flush=True)
        out[name] = {
            "rounds": runs,
            "rss_growth_mib_max": max(r["rss_growth_mib"] for r in runs),
            **{
                f"{key}_median": statistics.median(r[key] for r in runs)
                for key in (
                    "neighbour_p99_idle_ms",
                    "neighbour_p99_during_ms",
                    "neighbour_p99_ratio",
                )
            },
        }
    return out


def flood_round(guarded: Guarded, count: int, for_s: float) -> dict[str, Any]:
    """One round: the honest client idle for IDLE_S, then during ``count`` attackers."""
    context = multiprocessing.get_context("spawn")
    neighbour = Neighbour(guarded)
    try:
        guarded.settle()
        with PeakRss(guarded), neighbour:
            time.sleep(IDLE_S)
        idle = neighbour.latencies
        ready, results_q, go = context.Queue(), context.Queue(), context.Event()
        attackers = [
            context.Process(
                target=_flooder,
                args=(guarded.port, attacker_address(), for_s, ready, go, results_q),
            )
            for _ in range(count)
        ]
        for attacker in attackers:  # started and settled before anything is measured
            attacker.start()
            if attacker.pid is not None:
                pin_to([(os.cpu_count() or 1) - 1], [attacker.pid])
        for _ in attackers:
            ready.get(timeout=300)
        time.sleep(1.0)
        with PeakRss(guarded) as rss, neighbour:
            cpu = guarded.cpu_s()
            started = time.monotonic()
            go.set()
            results = [r for _ in attackers for r in results_q.get(timeout=600)]
            for attacker in attackers:
                attacker.join(60)
            took = time.monotonic() - started
            cpu = guarded.cpu_s() - cpu
            time.sleep(max(0.0, 2.0 - took))  # the neighbour measures 2 s at least
        during = neighbour.latencies
    finally:
        neighbour.close()
    return {
        "attacker_connections": len(results),
        "closed_at_accept": sum(r["closed_at_accept"] for r in results),
        "sent_mib": round(sum(r["sent_kib"] for r in results) / 1024, 1),
        "refused_unauthenticated": sum(r["unauthenticated"] for r in results),
        "other_answers": sum(r["other"] for r in results),
        "closed_calm": sum(1 for r in results if r["goaway"] == 11),
        "seconds": round(took, 1),
        "gateway_cpu_s": round(cpu, 2),
        "rss_growth_mib": round(rss.growth / MiB, 1),
        "neighbour_idle": quantiles(idle),
        "neighbour_during": quantiles(during),
        "neighbour_p99_idle_ms": quantiles(idle)["p99_ms"],
        "neighbour_p99_during_ms": quantiles(during)["p99_ms"],
        "neighbour_p99_ratio": quantiles(during)["p99_ms"] / quantiles(idle)["p99_ms"],
        "neighbour_failures": len(neighbour.failures),
    }


# -- rapid reset -------------------------------------------------------------------------


def rapid_reset(guarded: Guarded) -> dict[str, Any]:
    body = message(_request())
    guarded.settle()
    cpu_before = guarded.cpu_s()
    started = time.monotonic()
    sent = 0
    with Raw(guarded.port) as raw:
        while raw.goaway is None and not raw.closed and time.monotonic() - started < 5:
            tick = time.monotonic()
            burst = []
            for _ in range(100):
                stream = raw.new_stream()
                burst += (raw.headers(stream, INFER, guarded.auth()), raw.data(stream, body))
                burst.append(raw.rst(stream))
            raw.window = raw.initial = 1 << 30
            if not raw.send(b"".join(burst)):
                break
            sent += 100
            raw.read(max(0.0, 0.01 - (time.monotonic() - tick)))  # 100 every 10 ms
        closed_after = time.monotonic() - started
        raw.until(lambda: raw.goaway is not None, 2)
        goaway = raw.goaway
    time.sleep(max(0.0, 1.0 - closed_after))
    cpu = guarded.cpu_s() - cpu_before
    out = {
        "streams_sent": sent,
        "closed_after_s": round(closed_after, 3),
        "goaway": None if goaway is None else {"code": goaway[0], "debug": goaway[1].decode()},
        "gateway_cpu_s_first_second": round(cpu, 3),
    }
    print("rapid reset", json.dumps(out), flush=True)
    return out


# -- slowloris ---------------------------------------------------------------------------


def slowloris(guarded: Guarded, count: int, http_port: int) -> dict[str, Any]:
    """``count`` HTTP and ``count`` gRPC connections dribbling heads, for the header
    timeout and a little more; the honest HTTP client's latency meanwhile."""
    client = httpx.Client(
        base_url=f"http://127.0.0.1:{http_port}",
        headers={"authorization": f"Bearer {guarded.keys['echo']}"},
        timeout=30,
    )
    body = {"inputs": [{"x": 1.0}]}

    def call() -> float:
        started = time.perf_counter()
        answer = client.post("/api/v1/models/echo/predict", json=body)
        assert answer.status_code == 200, answer.text
        return time.perf_counter() - started

    idle = [call() for _ in range(300)]
    fds_before = guarded.fds()
    head = b"POST /api/v1/models/echo/predict HTTP/1.1\r\nhost: x\r\nX-Slow: " + b"a" * 64
    socks: list[socket.socket] = []
    grpc_raws: list[Raw] = []
    for _ in range(count):
        with contextlib.suppress(OSError):
            socks.append(socket.create_connection(("127.0.0.1", http_port), timeout=5))
        with contextlib.suppress(OSError):
            raw = Raw(guarded.port)
            raw.send(raw.headers(1, INFER, guarded.auth())[:12])  # a header block begun
            grpc_raws.append(raw)
    during: list[float] = []
    peak_fds = guarded.fds()
    started = time.monotonic()
    at = 0
    while time.monotonic() - started < 20:  # a byte a second on each connection
        second = time.monotonic()
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.send(head[at % len(head) : at % len(head) + 1])
        at += 1
        while time.monotonic() - second < 1.0:
            during.append(call())
        peak_fds = max(peak_fds, guarded.fds())
    cut = sum(1 for sock in socks if _closed(sock))
    for sock in socks:
        sock.close()
    for raw in grpc_raws:
        raw.close()
    time.sleep(2)
    out = {
        "connections": {"http": len(socks), "grpc": len(grpc_raws)},
        "http_closed_by_server": cut,
        "fds_before": fds_before,
        "fds_peak": peak_fds,
        "fds_after": guarded.fds(),
        "honest_idle": quantiles(idle),
        "honest_during": quantiles(during),
        "honest_p99_ratio": quantiles(during)["p99_ms"] / quantiles(idle)["p99_ms"],
    }
    client.close()
    print("slowloris", json.dumps(out), flush=True)
    return out


def _closed(sock: socket.socket) -> bool:
    sock.settimeout(0.01)
    try:
        return sock.recv(65536) is not None
    except (TimeoutError, OSError):
        return False


def report(results: dict[str, Any]) -> str:
    """The results as the markdown tables of bench/results/abuse.md."""
    lines = ["# Every door bounded (`bench/abuse.py`)", ""]
    lines.append("One gateway process, auth on; attackers on the last core, the server and "
                 "the honest clients on the others.")  # fmt: skip
    if "grpc_flood" in results:
        lines += ["", "## Unauthenticated gRPC flood (300 calls x 3 MiB of 15 MiB each)", ""]
        lines.append("The honest gRPC client's p99 during the attack over its p99 just before "
                     "it, measured the same way (a call every 5 ms on a thread, the memory "
                     "sampler on); each attack run `--rounds` times, the median ratio "
                     "kept.")  # fmt: skip
        lines.append("")
        lines.append("| attack | attacker connections | closed at accept | sent MiB | refused "
                     "UNAUTHENTICATED | gateway CPU s | gateway RSS growth MiB | neighbour p99 "
                     "idle / during ms | ratio |")  # fmt: skip
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for name, variant in results["grpc_flood"].items():
            for i, r in enumerate(variant["rounds"], 1):
                lines.append(
                    f"| {name}, round {i} | {r['attacker_connections']} | "
                    f"{r['closed_at_accept']} | {r['sent_mib']} | {r['refused_unauthenticated']} | "
                    f"{r['gateway_cpu_s']} | {r['rss_growth_mib']} | "
                    f"{r['neighbour_p99_idle_ms']:.1f} / {r['neighbour_p99_during_ms']:.1f} | "
                    f"{r['neighbour_p99_ratio']:.2f}x |"
                )
            lines.append(
                f"| **{name}, median** | | | | | | max {variant['rss_growth_mib_max']} | "
                f"{variant['neighbour_p99_idle_ms_median']:.1f} / "
                f"{variant['neighbour_p99_during_ms_median']:.1f} | "
                f"**{variant['neighbour_p99_ratio_median']:.2f}x** |"
            )
    if "rapid_reset" in results:
        lines += ["", "## Rapid reset (HEADERS + message + RST_STREAM, 10,000 a second)", ""]
        lines.append("| round | closed after s | GOAWAY | gateway CPU s, first second |")
        lines.append("|---|---|---|---|")
        for i, r in enumerate(results["rapid_reset"]["rounds"], 1):
            goaway = r["goaway"] or {}
            said = f"{goaway.get('code')} {goaway.get('debug', '')}"
            lines.append(
                f"| {i} | {r['closed_after_s']} | {said} | {r['gateway_cpu_s_first_second']} |"
            )
    if "slowloris" in results:
        r = results["slowloris"]
        idle, during = r["honest_idle"]["p99_ms"], r["honest_during"]["p99_ms"]
        lines += ["", "## Slowloris (HTTP heads a byte a second, gRPC header blocks begun)", ""]
        lines.append("| connections | closed by the server | open files before / peak / after | "
                     "honest p99 idle / during ms | ratio |")  # fmt: skip
        lines.append("|---|---|---|---|---|")
        lines.append(
            f"| {r['connections']['http']} HTTP + {r['connections']['grpc']} gRPC | "
            f"{r['http_closed_by_server']} HTTP | {r['fds_before']} / {r['fds_peak']} / "
            f"{r['fds_after']} | {idle:.1f} / {during:.1f} | {r['honest_p99_ratio']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attacks", default="grpc-flood,rapid-reset,slowloris")
    parser.add_argument("--flood-connections", type=int, default=20)
    parser.add_argument("--slowloris", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each attack")
    args = parser.parse_args()
    attacks = args.attacks.split(",")
    results: dict[str, Any] = {"attacks": attacks}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        push_source(data, "echo", arithmetic_model("x"))
        keys = {"echo": create_key(data, "echo", "infer", models=["echo"])}
        server = InferdServer(data, workers=1, env={"INFERD_AUTH__ENABLED": "true"})
        try:
            server.wait_ready()
            guarded = Guarded(server, keys)
            if (os.cpu_count() or 1) > 1:  # the attackers on the last core, the rest apart
                others = list(range((os.cpu_count() or 2) - 1))
                tree = [p.pid for p in psutil.Process(server.process.pid).children(recursive=True)]
                pin_to(others, [0, server.process.pid, *tree])
                results["pinned"] = {"server_and_honest_clients": others, "attackers": "last"}
            if "grpc-flood" in attacks:
                results["grpc_flood"] = grpc_flood(guarded, args.flood_connections, args.rounds)
            if "rapid-reset" in attacks:
                rounds = [rapid_reset(guarded) for _ in range(args.rounds)]
                results["rapid_reset"] = {
                    "rounds": rounds,
                    "closed_after_s_median": statistics.median(r["closed_after_s"] for r in rounds),
                    "cpu_s_median": statistics.median(
                        r["gateway_cpu_s_first_second"] for r in rounds
                    ),
                }
            if "slowloris" in attacks:
                results["slowloris"] = slowloris(guarded, args.slowloris, server.port)
        finally:
            server.stop()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "abuse.json").write_text(json.dumps(results, indent=2) + "\n")
    (RESULTS / "abuse.md").write_text(report(results))
    print(f"wrote {RESULTS / 'abuse.json'}")


if __name__ == "__main__":
    main()
