"""Many LoRA adapters over few slots (#37): 50 adapters on 2 replicas loaded on demand
(8 slots each, least recently used out, requests sent where their adapter is loaded)
against the same 50 preloaded on every replica (64 slots), same run, alternating order.

    .venv/bin/python bench/adapter_routing.py [--rounds 3] [--requests 400] [--clients 16]

The model: GPT-2's architecture, 6 layers, 512 wide, random weights, the word-level
tokenizer of ``bench/prefix_routing.py``; 50 rank-8 adapters on every attention
projection (``c_attn``), written here in PEFT's format with random weights. 2 replicas
of 1 intra-op thread, 2 gateway processes. A closed loop of ``--clients`` clients, each
sending the next request as soon as its answer is in, ``--requests`` in all, each for an
adapter drawn at random (a Zipf-like law over the 50: a few are asked often, most
seldom), a 20-word prompt, 32 tokens out (greedy, EOS ignored), streamed through
``/v1/completions``. Per run: requests/s, TTFT p50/p99, errors, adapter loads. Writes
bench/results/adapter_routing.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from prefix_routing import server
from servers import stop, wait_ready

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
ADAPTERS = 50
RANK = 8
WIDTH, LAYERS = 512, 6


def build(folder: Path) -> list[str]:
    """The model, its tokenizer and the adapters into ``folder``; prompt words."""
    from collections import Counter

    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel

    from inferd.demo.corpus import stdlib_corpus

    paragraphs = [p for p in stdlib_corpus().paragraphs if p.isascii()]
    words = Counter(w for p in paragraphs for w in p.split())
    vocab = ["<|endoftext|>", "[UNK]"] + [w for w, _ in words.most_common(4096)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>"])
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    config = GPT2Config(vocab_size=len(vocab), n_positions=512, n_embd=WIDTH, n_layer=LAYERS,
                        n_head=8, bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(folder, safe_serialization=True)
    peft = {"peft_type": "LORA", "r": RANK, "lora_alpha": 16, "target_modules": ["c_attn"],
            "fan_in_fan_out": True, "bias": "none"}  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    for i in range(ADAPTERS):
        out = folder / "adapters" / f"a{i}"
        out.mkdir(parents=True)
        weights = {}
        for layer in range(LAYERS):
            key = f"base_model.model.transformer.h.{layer}.attn.c_attn"
            weights[f"{key}.lora_A.weight"] = torch.randn(RANK, WIDTH, generator=gen) * 0.02
            weights[f"{key}.lora_B.weight"] = torch.randn(3 * WIDTH, RANK, generator=gen) * 0.02
        save_file(weights, str(out / "adapter_model.safetensors"))
        (out / "adapter_config.json").write_text(json.dumps(peft))
    return [w for w, _ in words.most_common(2000)]


def register(data: Path, model: Path) -> None:
    import subprocess

    names = {f"a{i}": f"adapters/a{i}" for i in range(ADAPTERS)}
    cmd = [sys.executable, "-m", "inferd", "models", "push", "base", str(model), "--version",
           "v1", "--data-dir", str(data), "--replicas", "2", "--meta",
           f"adapters={json.dumps(names)}"]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)


async def client(http: httpx.AsyncClient, jobs: list[tuple[str, str]], out: list[dict]) -> None:
    while jobs:
        adapter, prompt = jobs.pop()
        body = {"model": adapter, "prompt": prompt, "max_tokens": 32, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        sent, first, error = time.perf_counter(), None, None
        try:
            async with http.stream("POST", "/v1/completions", json=body) as reply:
                if reply.status_code != 200:
                    error = reply.status_code
                else:
                    async for line in reply.aiter_lines():
                        if line.startswith("data: {") and first is None:
                            first = time.perf_counter()
        except httpx.HTTPError as exc:
            error = repr(exc)
        out.append({"ttft_s": (first or time.perf_counter()) - sent, "error": error})


async def workload(url: str, words: list[str], requests: int, clients: int) -> dict[str, Any]:
    rng = random.Random(2)
    weights = [1 / (k + 1) for k in range(ADAPTERS)]  # Zipf: a0 the most asked
    jobs = [
        (f"a{rng.choices(range(ADAPTERS), weights)[0]}", " ".join(rng.sample(words, 20)))
        for _ in range(requests)
    ]
    out: list[dict] = []
    limits = httpx.Limits(max_connections=clients + 2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        began = time.perf_counter()
        await asyncio.gather(*(client(http, jobs, out) for _ in range(clients)))
        wall = time.perf_counter() - began
        version = (await http.get("/api/v1/models/base")).json()["versions"][0]
    ttfts = sorted(r["ttft_s"] for r in out if r["error"] is None)
    return {
        "requests": len(out),
        "errors": sum(r["error"] is not None for r in out),
        "requests_per_s": round(len(out) / wall, 2),
        "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
        "ttft_p99_ms": round(1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 1),
        "adapter_loads": sum(r["stats"].get("adapter_loads", 0) for r in version["replicas"]),
    }


VARIANTS = {"on-demand (8 slots)": "8", "preloaded (64 slots)": "64"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--clients", type=int, default=16)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="adapter-routing-"))
    words = build(work / "model")
    register(work / "data", work / "model")
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for round_ in range(args.rounds):
        order = list(VARIANTS) if round_ % 2 == 0 else list(reversed(VARIANTS))
        for name in order:
            env = {"INFERD_LLM__MAX_ADAPTERS": VARIANTS[name], "INFERD_LLM__MAX_LORA_RANK": "8",
                   "INFERD_LLM__KV_CACHE_MB": "256"}  # fmt: skip
            proc, url = server(work / "data", work, name.split()[0], env)
            try:
                wait_ready(f"{url}/health/ready", timeout_s=300)
                runs[name].append(asyncio.run(workload(url, words, args.requests, args.clients)))
            finally:
                stop(proc)
            print(name, round_ + 1, runs[name][-1], flush=True)
    report(runs, args)


def report(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    names = list(VARIANTS)
    ratios = [a["requests_per_s"] / b["requests_per_s"]
              for a, b in zip(runs[names[0]], runs[names[1]], strict=True)]  # fmt: skip
    summary = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "runs": runs,
        "requests_per_s_on_demand_over_preloaded": [round(r, 3) for r in ratios],
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "adapter_routing.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [
        f"# 50 LoRA adapters over 2 replicas, {summary['date']}",
        "",
        f"{args.requests} requests, {args.clients} clients, Zipf over 50 adapters, 32 tokens "
        f"each; medians of {len(ratios)} rounds (`bench/adapter_routing.py`).",
        "",
        "| adapters | requests/s | TTFT p50 | TTFT p99 | errors | adapter loads |",
        "|---|---|---|---|---|---|",
    ]
    for name in names:
        rs = runs[name]
        lines.append(
            f"| {name} | {statistics.median(r['requests_per_s'] for r in rs):.2f} | "
            f"{statistics.median(r['ttft_p50_ms'] for r in rs):.0f} ms | "
            f"{statistics.median(r['ttft_p99_ms'] for r in rs):.0f} ms | "
            f"{max(r['errors'] for r in rs)} | "
            f"{statistics.median(r['adapter_loads'] for r in rs):.0f} |"
        )
    lines += ["", f"requests/s, on demand / preloaded: {statistics.median(ratios):.2f}x "
                  f"(rounds {', '.join(f'{r:.2f}' for r in ratios)})."]  # fmt: skip
    (RESULTS / "adapter_routing.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
