"""The LLM engine alone (no HTTP, no processes): output tokens/s for a burst of requests.

    .venv/bin/python bench/llm_engine.py [--requests 500] [--max-num-seqs 64 128]

GPT-2-small-shaped model (124M, random weights), float32, 2 threads; every request has a
32-token prompt and generates 64 tokens (greedy, EOS ignored), all added at once, as in
bench/generate.py. Prints tokens/s and the mean step time per ``max_num_seqs``; the
difference to bench/generate.py's inferd figure is what the serving path costs.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

# As in a replica (inferd/control/backend.py): OpenMP threads sleep between ops.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from inferd.llm.engine import EngineConfig, LLMEngine
from inferd.llm.model import GPT2
from inferd.llm.tokenizer import TextTokenizer
from inferd.shapes.llm import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--max-num-seqs", type=int, nargs="+", default=[128])
    parser.add_argument("--max-batched-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from inferd.demo.llm import random_gpt2_small

    torch.set_num_threads(args.threads)
    folder = random_gpt2_small(Path(tempfile.mkdtemp(prefix="inferd-engine-bench-")))
    model = GPT2.load(folder)
    tokenizer = TextTokenizer.load(folder)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for max_num_seqs in args.max_num_seqs:
        config = EngineConfig(
            num_blocks=4096,
            max_num_seqs=max_num_seqs,
            max_batched_tokens=args.max_batched_tokens,
            max_waiting=args.requests,
        )
        engine = LLMEngine(model, tokenizer, config)
        gen = torch.Generator().manual_seed(0)
        for i in range(args.requests):
            prompt = torch.randint(0, 50000, (32,), generator=gen).tolist()
            engine.add_request(f"r{i}", prompt, params)
        started = time.perf_counter()
        steps = tokens = 0
        while engine.has_work():
            tokens += len(engine.step())
            steps += 1
        elapsed = time.perf_counter() - started
        print(
            f"max_num_seqs={max_num_seqs}: {tokens / elapsed:.0f} output tokens/s, "
            f"{steps} steps, {elapsed / steps * 1000:.0f} ms/step, {elapsed:.1f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
