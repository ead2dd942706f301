"""Gateway <-> replica transport: inferd's framed msgpack protocol vs ZeroMQ.

    .venv/bin/python bench/ipc.py [--reps 3] [--calls 20000] [--duration 5]
                                  [--concurrency 64] [--rows 1 64]

Two processes on this machine, parent = gateway side, child = replica side. The child
only echoes: for every ``Infer`` it replies an ``InferResult`` whose output tensor is the
input tensor, so what is measured is the transport (encode, syscalls, wake-ups, decode,
future matching), not a model. Variants:

* ``inferd``: the real thing. The child is a minimal asyncio Protocol server on a Unix
  socket decoding with ``protocol.FrameBuffer``; the parent is the real
  ``inferd.serving.client.ReplicaClient`` (``connect``, ``infer``).
* ``inferd-tcp``: the same client and protocol across hosts' transport: TCP (here on
  loopback) through :mod:`inferd.transport`, the cluster token's challenge-response
  before the first frame.
* ``zmq``: pyzmq with ``zmq.asyncio``; DEALER (parent) / ROUTER (child) over ``ipc://``,
  carrying the same msgspec-encoded bodies (no length prefix), with the same id-matched
  futures, per-call timeout timer and ``from_tensor`` decoding as ReplicaClient.
* ``zmq-raw`` (extra, best case for ZeroMQ): plain pyzmq sockets driven by the event
  loop's ``add_reader`` on ``zmq.FD`` and non-blocking drains, i.e. without the
  zmq.asyncio future per send/recv.

Per variant and payload (``--rows``; one row = 30 float32 features): latency of
sequential round trips (1 in flight; p50/p99 in microseconds over ``--calls`` calls) and
throughput with ``--concurrency`` calls in flight (calls/s over ``--duration`` s). The
variants are interleaved (inferd, zmq, zmq-raw, inferd, ...) for ``--reps`` repetitions,
with a fresh child per measurement; the table shows medians over repetitions. Both sides
run on uvloop (zmq.asyncio works on it: it only needs ``add_reader``). Writes
bench/results/ipc.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import uvloop

try:
    import zmq
    import zmq.asyncio
except ImportError:  # pyzmq is not a dependency: the zmq variants need it installed
    zmq = None  # type: ignore[assignment]

from inferd import transport
from inferd.serving.client import ReplicaClient
from inferd.shapes import replica as p

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
VARIANTS = ("inferd", "inferd-tcp", "zmq", "zmq-raw")
BENCH_TOKEN = transport.Credentials(b"bench-cluster-token-0123456789")
"""``inferd-tcp``: the cross-host transport (TCP on loopback, the cluster token's
challenge-response before the first frame), the cost of leaving the Unix socket."""
FEATURES = 30
TIMEOUT_S = 10.0
CHILD_MAX_S = 300.0
"""A child replica exits by itself after this long, whatever happens to the parent."""

_encoder = msgspec.msgpack.Encoder()


# --------------------------------------------------------------------------- child side


class EchoProtocol(asyncio.Protocol):
    """The replica side of inferd's protocol, minus the model: Infer in, InferResult out."""

    def __init__(self) -> None:
        self.frames = p.FrameBuffer()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        transport = self.transport
        for message in self.frames.feed(data):
            if isinstance(message, p.Infer) and transport is not None:
                transport.write(p.encode(p.InferResult(message.id, message.inputs)))


def echo_body(body: bytes) -> bytes | None:
    message = p.decode(body)
    if isinstance(message, p.Infer):
        return _encoder.encode(p.InferResult(message.id, message.inputs))
    return None


async def serve_inferd(path: str, stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_unix_server(EchoProtocol, path)
    await stop.wait()
    server.close()


async def serve_inferd_tcp(path: str, stop: asyncio.Event) -> None:
    """A guarded TCP listener on a free loopback port, written to ``path`` when ready."""
    transport.use(BENCH_TOKEN)
    server = await transport.listen("127.0.0.1:0", EchoProtocol)
    port = server.sockets[0].getsockname()[1]
    Path(path + ".tmp").write_text(f"127.0.0.1:{port}")
    os.replace(path + ".tmp", path)
    await stop.wait()
    server.close()


async def serve_zmq(path: str, stop: asyncio.Event) -> None:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(f"ipc://{path}")

    async def pump() -> None:
        while True:
            ident, body = await sock.recv_multipart()
            reply = echo_body(body)
            if reply is not None:
                await sock.send_multipart([ident, reply])

    task = asyncio.create_task(pump())
    await stop.wait()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    sock.close(linger=0)
    ctx.term()


async def serve_zmq_raw(path: str, stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(f"ipc://{path}")

    def on_readable() -> None:
        # zmq.FD is edge-triggered: drain until EVENTS says nothing is left.
        while sock.get(zmq.EVENTS) & zmq.POLLIN:
            ident, body = sock.recv_multipart(zmq.NOBLOCK)
            reply = echo_body(body)
            if reply is not None:
                sock.send_multipart([ident, reply], zmq.NOBLOCK)

    loop.add_reader(sock.FD, on_readable)
    on_readable()
    await stop.wait()
    loop.remove_reader(sock.FD)
    sock.close(linger=0)
    ctx.term()


async def child_main(variant: str, path: str, max_s: float) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.call_later(max_s, stop.set)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    serve = {
        "inferd": serve_inferd,
        "inferd-tcp": serve_inferd_tcp,
        "zmq": serve_zmq,
        "zmq-raw": serve_zmq_raw,
    }[variant]
    await serve(path, stop)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


# -------------------------------------------------------------------------- parent side


class Gone(Exception):
    pass


class _ZmqClientBase:
    """What ReplicaClient does per call (id, pending future, timeout timer, from_tensor),
    with ZeroMQ underneath instead of the framed Unix-socket Protocol."""

    def __init__(self) -> None:
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count(1)

    def _deliver(self, body: bytes) -> None:
        message = p.decode(body)
        future = self._pending.pop(message.id, None)  # type: ignore[union-attr]
        if future is not None and not future.done():
            future.set_result(message)

    async def _send(self, body: bytes) -> None:
        raise NotImplementedError

    async def infer(
        self, inputs: dict[str, p.Tensor], rows: int, timeout_s: float
    ) -> dict[str, np.ndarray]:
        message = p.Infer(next(self._ids), inputs, rows, timeout_s * 1000)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._pending[message.id] = future
        await self._send(_encoder.encode(message))
        timer = loop.call_later(timeout_s, _expire, future)
        try:
            reply = await future
        except (TimeoutError, asyncio.CancelledError):
            self._pending.pop(message.id, None)
            raise
        finally:
            timer.cancel()
        if isinstance(reply, p.InferResult):
            return {name: p.from_tensor(t) for name, t in reply.outputs.items()}
        raise Gone(f"unexpected reply {reply!r}")


def _expire(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_exception(TimeoutError("no reply"))


class ZmqAsyncClient(_ZmqClientBase):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(f"ipc://{path}")
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            self._deliver(await self.sock.recv())

    async def _send(self, body: bytes) -> None:
        await self.sock.send(body)

    def close(self) -> None:
        self._reader.cancel()
        self.sock.close(linger=0)
        self.ctx.term()


class ZmqRawClient(_ZmqClientBase):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.loop = asyncio.get_running_loop()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(f"ipc://{path}")
        self.loop.add_reader(self.sock.FD, self._drain)

    def _drain(self) -> None:
        sock = self.sock
        while sock.get(zmq.EVENTS) & zmq.POLLIN:
            self._deliver(sock.recv(zmq.NOBLOCK))

    async def _send(self, body: bytes) -> None:
        self.sock.send(body, zmq.NOBLOCK)
        # A send can consume the FD's edge for a reply that is already queued.
        self._drain()

    def close(self) -> None:
        self.loop.remove_reader(self.sock.FD)
        self.sock.close(linger=0)
        self.ctx.term()


Call = Callable[[], Awaitable[Any]]


async def latency(call: Call, calls: int, warmup: int, max_s: float) -> dict[str, float]:
    for _ in range(warmup):
        await call()
    samples = np.empty(calls, dtype=np.int64)
    clock = time.perf_counter_ns
    deadline = clock() + int(max_s * 1e9)
    n = 0
    while n < calls:
        t0 = clock()
        await call()
        t1 = clock()
        samples[n] = t1 - t0
        n += 1
        if t1 > deadline:
            break
    us = samples[:n] / 1000
    return {
        "lat_calls": n,
        "lat_p50_us": float(np.percentile(us, 50)),
        "lat_p99_us": float(np.percentile(us, 99)),
        "lat_mean_us": float(us.mean()),
    }


async def throughput(call: Call, concurrency: int, duration_s: float) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    end = loop.time() + duration_s
    done = [0] * concurrency

    async def worker(i: int) -> None:
        while loop.time() < end:
            await call()
            done[i] += 1

    started = time.perf_counter()
    await asyncio.wait_for(
        asyncio.gather(*(worker(i) for i in range(concurrency))), duration_s + 4 * TIMEOUT_S
    )
    elapsed = time.perf_counter() - started
    return {"tput_calls": sum(done), "tput_s": elapsed, "calls_per_s": sum(done) / elapsed}


def make_inputs(rows: int) -> dict[str, p.Tensor]:
    rng = np.random.default_rng(0)
    return {"features": p.to_tensor(rng.standard_normal((rows, FEATURES), dtype=np.float32))}


async def measure(variant: str, path: str, rows: int, args: argparse.Namespace) -> dict[str, Any]:
    inputs = make_inputs(rows)
    expected = p.from_tensor(inputs["features"])
    client: Any
    if variant == "inferd":
        client = ReplicaClient(f"unix:{path}")
        await client.connect()
    elif variant == "inferd-tcp":
        transport.use(BENCH_TOKEN)
        client = ReplicaClient(f"tcp:{Path(path).read_text()}")
        await client.connect()
    elif variant == "zmq":
        client = ZmqAsyncClient(path)
    else:
        client = ZmqRawClient(path)

    async def call() -> Any:
        request = p.InferRequest(started=time.perf_counter(), timeout_s=TIMEOUT_S)
        answer = await client.infer(inputs, rows, request)
        return getattr(answer, "outputs", answer)  # inferd's client: an Answer

    try:
        first = await call()
        if not np.array_equal(first["features"], expected):
            raise RuntimeError(f"{variant}: echo mismatch")
        lat = await latency(call, args.calls, args.warmup, args.max_phase_s)
        tput = await throughput(call, args.concurrency, args.duration)
    finally:
        client.close()
    return {**lat, **tput}


# ------------------------------------------------------------------------------ driver


def start_child(variant: str, path: str, loop: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", variant, "--address", path, "--loop", loop],
        cwd=ROOT,
    )
    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise RuntimeError(f"{variant} child exited with {proc.returncode}")
        if time.monotonic() > deadline:
            stop_child(proc)
            raise RuntimeError(f"{variant} child did not bind {path} within 30s")
        time.sleep(0.01)
    return proc


def stop_child(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_loop(coro: Any, loop: str) -> Any:
    return uvloop.run(coro) if loop == "uvloop" else asyncio.run(coro)


def summarize(runs: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    summary = []
    for rows in args.rows:
        base: dict[str, float] = {}
        for variant in args.variants:
            mine = [r for r in runs if r["variant"] == variant and r["rows"] == rows]
            if not mine:
                continue
            med = {
                k: statistics.median(r[k] for r in mine)
                for k in ("lat_p50_us", "lat_p99_us", "lat_mean_us", "calls_per_s")
            }
            base = base or med
            summary.append(
                {
                    "rows": rows,
                    "variant": variant,
                    "reps": len(mine),
                    **med,
                    "p50_ratio_vs_first": med["lat_p50_us"] / base["lat_p50_us"],
                    "tput_ratio_vs_first": med["calls_per_s"] / base["calls_per_s"],
                }
            )
    return summary


def table(summary: list[dict[str, Any]], args: argparse.Namespace) -> str:
    first = args.variants[0]
    lines = [
        f"| rows | transport | RTT p50 µs | RTT p99 µs | calls/s @{args.concurrency} in flight"
        f" | p50 vs {first} | calls/s vs {first} |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for s in summary:
        lines.append(
            f"| {s['rows']} | {s['variant']} | {s['lat_p50_us']:.1f} | {s['lat_p99_us']:.1f} | "
            f"{s['calls_per_s']:,.0f} | {s['p50_ratio_vs_first']:.2f}x | "
            f"{s['tput_ratio_vs_first']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--calls", type=int, default=20000, help="sequential calls per latency run")
    parser.add_argument("--warmup", type=int, default=1000)
    parser.add_argument("--max-phase-s", type=float, default=30.0, help="cap on a latency run")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per throughput run")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANTS,
        default=[v for v in VARIANTS if zmq is not None or not v.startswith("zmq")],
    )
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    parser.add_argument("--out", type=Path, default=RESULTS / "ipc.json")
    parser.add_argument("--serve", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.serve:
        run_loop(child_main(args.serve, args.address, CHILD_MAX_S), args.loop)
        return

    work = Path(tempfile.mkdtemp(prefix="inferd-ipc-"))
    runs: list[dict[str, Any]] = []
    started = time.monotonic()
    try:
        for rep in range(args.reps):
            for rows in args.rows:
                for variant in args.variants:
                    path = str(work / f"{variant}-{rep}-{rows}.sock")
                    child = start_child(variant, path, args.loop)
                    try:
                        r = run_loop(measure(variant, path, rows, args), args.loop)
                    finally:
                        stop_child(child)
                    runs.append({"rep": rep, "rows": rows, "variant": variant, **r})
                    print(
                        f"rep {rep} rows {rows:>3} {variant:>8}: p50 {r['lat_p50_us']:7.1f} us"
                        f"  p99 {r['lat_p99_us']:7.1f} us  {r['calls_per_s']:9,.0f} calls/s",
                        flush=True,
                    )
    finally:
        for leftover in work.iterdir():
            leftover.unlink()
        work.rmdir()

    summary = summarize(runs, args)
    md = table(summary, args)
    print()
    print(md)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "pyzmq": zmq.pyzmq_version() if zmq is not None else None,
        "libzmq": zmq.zmq_version() if zmq is not None else None,
        "uvloop": uvloop.__version__,
        "msgspec": msgspec.__version__,
        "wall_s": round(time.monotonic() - started, 1),
    }
    args_out = {
        k: (str(v) if isinstance(v, Path) else v)
        for k, v in vars(args).items()
        if k not in ("serve", "address")
    }
    args.out.write_text(
        json.dumps(
            {"args": args_out, "meta": meta, "summary": summary, "runs": runs, "table": md},
            indent=2,
        )
    )
    print(f"\nwrote {args.out} in {meta['wall_s']}s")


if __name__ == "__main__":
    main()
