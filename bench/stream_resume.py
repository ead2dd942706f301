"""Streams that outlive their replica (#37): ``kill -9`` of one of two replicas under 32
concurrent streams, against the same streams with no kill, same server, alternating.

    .venv/bin/python bench/stream_resume.py [--rounds 3] [--streams 32] [--tokens 256]

The model of ``bench/prefix_routing.py`` (GPT-2 small's shape, random weights, a
word-level tokenizer), 2 replicas of 1 intra-op thread each, 2 gateway processes.
Each round: ``--streams`` greedy streams of ``--tokens`` tokens (EOS ignored) through
``/v1/completions``, once uninterrupted (the reference texts, and each stream's longest
gap between two chunks), once with the replica serving the most of them killed
(SIGKILL) when every stream has had a quarter of its tokens. Per run: streams that
failed, streams whose text differs from the reference, the longest gap between two
chunks of a stream (median over streams, and the worst), and the run's wall time.
Writes bench/results/stream_resume.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from prefix_routing import build_model, register, server
from servers import stop, wait_ready

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


async def stream(http: httpx.AsyncClient, i: int, tokens: int, seen: dict[int, int]) -> dict:
    body = {"model": "chat", "prompt": f"request {i} about the server and its replicas",
            "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    text, gap, last, failed = [], 0.0, time.perf_counter(), None
    seen[i] = 0
    try:
        async with http.stream("POST", "/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                return {"failed": f"{reply.status_code}", "text": "", "gap_s": 0.0}
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    failed = str(event["error"])[:200]
                    break
                for choice in event.get("choices") or ():
                    text.append(choice.get("text") or "")
                seen[i] += 1
                now = time.perf_counter()
                gap, last = max(gap, now - last), now
    except httpx.HTTPError as exc:
        failed = repr(exc)
    return {"failed": failed, "text": "".join(text), "gap_s": gap}


async def run(url: str, streams: int, tokens: int, kill: bool) -> dict[str, Any]:
    seen: dict[int, int] = {}
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        began = time.perf_counter()
        tasks = [asyncio.create_task(stream(http, i, tokens, seen)) for i in range(streams)]
        killed = None
        if kill:
            while len(seen) < streams or min(seen.values()) < tokens // 4:
                await asyncio.sleep(0.01)
            version = (await http.get("/api/v1/models/chat")).json()["versions"][0]
            pids = [r["pid"] for r in version["replicas"] if r["state"] == "ready"]
            killed = pids[0]
            os.kill(killed, signal.SIGKILL)
        out = await asyncio.gather(*tasks)
        wall = time.perf_counter() - began
    gaps = sorted(r["gap_s"] for r in out)
    return {
        "failed": sum(r["failed"] is not None for r in out),
        "errors": [r["failed"] for r in out if r["failed"]][:3],
        "texts": [r["text"] for r in out],
        "gap_p50_s": round(statistics.median(gaps), 3),
        "gap_max_s": round(gaps[-1], 3),
        "wall_s": round(wall, 2),
        "killed_pid": killed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stream-resume-"))
    build_model(work / "model")
    register(work / "data", work / "model", 2)
    rounds = []
    for round_ in range(args.rounds):
        proc, url = server(work / "data", work, "resume", {})
        try:
            wait_ready(f"{url}/health/ready", timeout_s=300)
            _wait_replicas(url, 2)
            order = (False, True) if round_ % 2 == 0 else (True, False)
            runs = {}
            for kill in order:
                runs["kill" if kill else "plain"] = asyncio.run(
                    run(url, args.streams, args.tokens, kill)
                )
                _wait_replicas(url, 2)  # the killed one restarted
            plain, killed = runs["plain"], runs["kill"]
            differ = sum(a != b for a, b in zip(plain["texts"], killed["texts"], strict=True))
            for r in runs.values():
                del r["texts"]
            rounds.append({"plain": plain, "kill": killed, "texts_differing": differ})
            print(round_ + 1, rounds[-1], flush=True)
        finally:
            stop(proc)
    report(rounds, args)


def _wait_replicas(url: str, count: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        version = httpx.get(f"{url}/api/v1/models/chat").json()["versions"][0]
        if sum(r["state"] == "ready" for r in version["replicas"]) >= count:
            return
        time.sleep(0.2)
    raise RuntimeError("the replicas did not come back")


def report(rounds: list[dict[str, Any]], args: argparse.Namespace) -> None:
    def med(kind: str, key: str) -> float:
        return statistics.median(r[kind][key] for r in rounds)

    summary = {"date": datetime.now(UTC).strftime("%Y-%m-%d"), "streams": args.streams,
               "tokens": args.tokens, "rounds": rounds}  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "stream_resume.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [
        f"# Streams through a replica's death, {summary['date']}",
        "",
        f"{args.streams} greedy streams of {args.tokens} tokens over 2 replicas; medians of "
        f"{len(rounds)} rounds (`bench/stream_resume.py`).",
        "",
        "| run | failed streams | texts differing | longest gap p50 | longest gap max | wall |",
        "|---|---|---|---|---|---|",
    ]
    for kind in ("plain", "kill"):
        differ = max(r["texts_differing"] for r in rounds) if kind == "kill" else 0
        lines.append(
            f"| {'kill -9 of one replica' if kind == 'kill' else 'no kill'} | "
            f"{max(r[kind]['failed'] for r in rounds)} | {differ} | "
            f"{med(kind, 'gap_p50_s'):.2f} s | {med(kind, 'gap_max_s'):.2f} s | "
            f"{med(kind, 'wall_s'):.1f} s |"
        )
    (RESULTS / "stream_resume.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
