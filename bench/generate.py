"""Generation benchmark: inferd's engine vs naive and static-batch Hugging Face serving.

    .venv/bin/python bench/generate.py [--requests 500] [--naive-seconds 60] [--dtype float32]

GPT-2-small-shaped model (124M, random weights: speed does not depend on values), CPU,
2 threads, prompts of 32 tokens, 64 new tokens each, greedy, EOS ignored. In one run:
1. inferd: ``inferd serve`` with the model; ``inferd bench`` sends all requests at once
   (closed loop, concurrency = requests), streaming; then an open loop at 2 requests/s
   for the TTFT target;
2. naive: a single-file server calling ``model.generate`` per request, one at a time
   (bench/naive_generate_app.py), kept saturated for a fixed time by a closed loop of 4
   connections (it serves one request at a time, so 500 connections would only add
   queueing: its tokens/s is the same and 500 requests would take ~20 minutes);
3. static batches: ``model.generate`` on batches of 32 prompts in this process, the best
   a simple batched server can do.
Writes bench/results/generate.json and generate.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from servers import free_port, start, stop, wait_ready

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
NEW_TOKENS = 64
PROMPT_TOKENS = 32


def write_payloads(path: Path, count: int, seed: int = 1) -> Path:
    """``count`` request bodies whose prompts are exactly PROMPT_TOKENS random token ids
    (as HF's static batches get), so every server does the same prefill work; a text
    prompt would tokenize to a different length per tokenizer."""
    import random

    rng = random.Random(seed)
    with path.open("w") as out:
        for _ in range(count):
            body = {
                "prompt": [rng.randrange(50000) for _ in range(PROMPT_TOKENS)],
                "max_tokens": NEW_TOKENS,
                "stream": True,
                "temperature": 0,
                "ignore_eos": True,
            }
            out.write(json.dumps(body) + "\n")
    return path


def bench(url: str, path: str, payloads: Path, *args: str) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp()) / "r.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "inferd",
            "bench",
            url,
            "--path",
            path,
            "--payloads",
            str(payloads),
            "--warmup",
            "0s",
            "--timeout",
            "1800s",
            "--seed",
            "1",
            "--json",
            str(out),
            *args,
        ],
        check=True,
        cwd=ROOT,
    )
    return dict(json.loads(out.read_text())["levels"][0])


def static_batches(model_dir: Path, batch: int, dtype: str, rounds: int = 2) -> float:
    """Output tokens/s of HF generate on static batches of ``batch`` prompts."""
    import torch
    from transformers import GPT2LMHeadModel

    torch.set_num_threads(2)
    model = GPT2LMHeadModel.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    ids = torch.randint(
        0, 50000, (batch, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0)
    )
    best = 0.0
    for _ in range(rounds):
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
        best = max(best, batch * NEW_TOKENS / (time.perf_counter() - started))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--naive-seconds", type=int, default=60)
    parser.add_argument("--rate-seconds", type=int, default=60)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    from inferd.demo.llm import random_gpt2_small
    from inferd.registry import Registry
    from inferd.shapes.tensors import Signature, TensorSpec

    work = Path(tempfile.mkdtemp(prefix="inferd-gen-bench-"))
    payloads = write_payloads(work / "payloads.jsonl", max(args.requests, 1000))
    model_dir = random_gpt2_small(work)
    registry = Registry(f"sqlite:///{work / 'data' / 'inferd.db'}", work / "data" / "artifacts")
    signature = Signature((TensorSpec("prompt", "BYTES"),), (TensorSpec("text", "BYTES"),))
    registry.push("gpt2s", model_dir, "v1", framework="gpt2", signature=signature)
    registry.close()
    results: dict[str, Any] = {"args": vars(args)}

    port = free_port()
    env = {
        "INFERD_LOG_LEVEL": "WARNING",
        "INFERD_REPLICA_THREADS": "2",
        "INFERD_LLM__DTYPE": args.dtype,
        "INFERD_LLM__KV_CACHE_MB": "2048",
        "INFERD_GATEWAY_WORKERS": "1",
    }
    proc = start(
        [
            sys.executable,
            "-m",
            "inferd",
            "serve",
            "--port",
            str(port),
            "--grpc-port",
            "-1",
            "--data-dir",
            str(work / "data"),
        ],
        env,
        work / "inferd.log",
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(f"{url}/health/ready", timeout_s=300, poll_s=0.5)
        path = "/api/v1/models/gpt2s/generate"
        n = str(args.requests)
        results["inferd_closed"] = bench(url, path, payloads, "-c", n, "-n", n)
        results["inferd_rate2"] = bench(
            url, path, payloads, "--rate", "2", "-d", f"{args.rate_seconds}s", "--slo", "ttft=500ms"
        )
    finally:
        stop(proc)

    port = free_port()
    proc = start(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "bench.naive_generate_app:app",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        {"INFERD_BENCH_MODEL": str(model_dir), "INFERD_BENCH_DTYPE": args.dtype},
        work / "naive.log",
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(f"{url}/health", timeout_s=300, poll_s=0.5)
        results["naive"] = bench(
            url, "/generate", payloads, "-c", "4", "-d", f"{args.naive_seconds}s"
        )
    finally:
        stop(proc)
    results["static_batch_32_tokens_per_s"] = static_batches(model_dir, 32, args.dtype)
    write(results)


def write(results: dict[str, Any]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "generate.json").write_text(json.dumps(results, indent=2))
    closed, naive = results["inferd_closed"], results["naive"]
    naive_tps = naive["output_tokens_per_s"]
    static = results["static_batch_32_tokens_per_s"]
    ours = closed["output_tokens_per_s"]
    lines = [
        "| server | output tokens/s | requests/min | TTFT p50 ms | TTFT p99 ms | errors |",
        "|---|---|---|---|---|---|",
        f"| inferd, {closed['requests']} concurrent | {ours:.0f} | "
        f"{closed['success_rps'] * 60:.0f} | {closed['ttft']['p50']:.0f} | "
        f"{closed['ttft']['p99']:.0f} | {closed['errors']} |",
        f"| naive HF generate per request (saturated) | {naive_tps:.0f} | "
        f"{naive['success_rps'] * 60:.1f} | {naive['ttft']['p50']:.0f} | "
        f"{naive['ttft']['p99']:.0f} | {naive['errors']} |",
        f"| HF generate, static batches of 32 | {static:.0f} | - | - | - | - |",
        "",
        f"inferd vs naive: {ours / naive_tps:.1f}x; vs static batch 32: {ours / static:.2f}x; "
        f"TTFT p99 at 2 requests/s: {results['inferd_rate2']['ttft']['p99']:.0f} ms.",
    ]
    (RESULTS / "generate.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
