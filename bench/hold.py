"""Requests while a model's only replica restarts after ``kill -9``: held (the default)
vs refused at once (``INFERD_HOLD_TIMEOUT_S=0``, the behaviour before requests were
held), alternating rounds.

Each round: a Python model with one replica, ``inferd bench --rate 50`` for 8 s, the
replica killed with SIGKILL after 2.5 s; the failed and total requests and the slowest.

    .venv/bin/python bench/hold.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.conftest import InferdServer, arithmetic_model, push_source  # noqa: E402
from tests.test_hold import _bench, _replica  # noqa: E402


def one_round(work: Path, hold_s: str) -> dict[str, object]:
    work.mkdir(parents=True)
    push_source(work, "calc", arithmetic_model("x * 3"))
    server = InferdServer(work, workers=1, env={"INFERD_HOLD_TIMEOUT_S": hold_s})
    try:
        server.wait_ready()
        before = _replica(server)
        out = work / "bench.json"
        load = _bench(server, out, rate=50, duration="8s")
        time.sleep(2.5)
        os.kill(before["pid"], signal.SIGKILL)
        load.communicate(timeout=60)
        (run,) = json.loads(out.read_text())["levels"]
        restarts = _replica(server)["restarts"]
    finally:
        server.stop()
    return {
        "hold_timeout_s": float(hold_s),
        "requests": run["requests"],
        "failed": run["errors"],
        "status_counts": run["status_counts"],
        "max_ms": run["latency"]["max"],
        "restarts": restarts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="inferd-bench-hold-") as tmp:
        for r in range(args.rounds):
            for hold_s in ("0", "30"):
                row = one_round(Path(tmp) / f"{r}-{hold_s}", hold_s)
                print(json.dumps(row), file=sys.stderr)
                rows.append(row)
    print("| hold_timeout_s | failed / requests | slowest ms | restarts |")
    print("|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['hold_timeout_s']:g} | {row['failed']} / {row['requests']} | "
            f"{row['max_ms']:.0f} | {row['restarts']} |"
        )
    (ROOT / "bench" / "results" / "hold.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
