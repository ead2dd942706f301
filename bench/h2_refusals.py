"""What a refused gRPC call costs the gateway's event loop: CPU microseconds a call for a
burst of 299 calls to a method that does not exist, arriving in one read on a socket
pair (so the answers are written to a real socket), handled by :mod:`inferd.grpc.http2`'s
Connection on uvloop.

    .venv/bin/python bench/h2_refusals.py [--compare COMMIT] [--rounds 5]

With ``--compare``, that commit's ``inferd/grpc/http2.py`` is loaded beside this tree's
and the two are measured in alternating rounds; the median of each is printed, and
their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inferd.grpc import frames as f  # noqa: E402
from inferd.grpc import http2  # noqa: E402
from inferd.grpc.frames import literal  # noqa: E402
from inferd.grpc.service import methods  # noqa: E402

CALLS = 299
BURSTS = 100


class _Service:
    async def unary(self, call: Any, request: Any) -> Any:
        raise AssertionError("no call is admitted here")


def _module_at(commit: str) -> ModuleType:
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{commit}:inferd/grpc/http2.py"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp()) / "http2_base.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("inferd.grpc._http2_base", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


async def _microseconds_a_call(module: ModuleType) -> float:
    loop = asyncio.get_running_loop()
    block = b"\x83\x86" + literal(4, "/no.Such/Method") + literal(31, "application/grpc")
    calls = b"".join(
        f.head(len(block), f.HEADERS, f.END_HEADERS, stream) + block
        for stream in range(1, 2 * CALLS, 2)
    )
    server = module.GrpcServer(_Service(), methods(), 8 << 20)
    spent = 0.0
    for _ in range(BURSTS):
        ours, theirs = socket.socketpair()
        theirs.setblocking(False)
        transport, connection = await loop.connect_accepted_socket(
            lambda: module.Connection(server), ours
        )
        began = time.process_time()
        connection.data_received(f.PREFACE + f.settings({}) + calls)
        while connection.resuming is not None:  # a turn cut short goes on in the next
            await asyncio.sleep(0)
        spent += time.process_time() - began
        transport.close()
        theirs.close()
    return spent / (BURSTS * CALLS) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", help="a commit whose http2.py to measure beside")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    targets = {"this tree": http2}
    if args.compare:
        targets[args.compare] = _module_at(args.compare)
    figures: dict[str, list[float]] = {name: [] for name in targets}
    for round_ in range(args.rounds):
        order = list(targets.items())
        for name, module in order if round_ % 2 == 0 else order[::-1]:
            figures[name].append(uvloop.run(_microseconds_a_call(module)))
    for name, values in figures.items():
        rounds = ", ".join(f"{v:.2f}" for v in values)
        print(f"{name}: {statistics.median(values):.2f} us of CPU a refused call ({rounds})")
    if args.compare:
        ratio = statistics.median(figures[args.compare]) / statistics.median(figures["this tree"])
        print(f"{args.compare} / this tree: {ratio:.2f}x")


if __name__ == "__main__":
    main()
