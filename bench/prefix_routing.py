"""Prefix-aware vs least-loaded replica choice for a multi-turn chat workload (#37).

    .venv/bin/python bench/prefix_routing.py [--rounds 3] [--users 10] [--turns 8]

The workload: ``--users`` chats at once, each ``--turns`` turns one after the other (the
next question 0.5-2 s after the answer is in, uniformly: reading and typing), every
chat starting with the same 1,000-token system prompt; each question ~40 tokens of
prose, each answer 64 tokens (greedy, EOS ignored), streamed through
``/v1/chat/completions`` with usage, over one pooled HTTP client (so a chat's turns
reach either gateway process). Three servers, each started fresh per round, in
alternating order:

- **prefix**: 2 replicas, prefix-aware choice (the default);
- **least-loaded**: 2 replicas, ``INFERD_LLM__PREFIX_ROUTING=false``;
- **one-replica**: 1 replica (every turn finds what the chat computed before: the
  hit rate to compare with).

All: inferd's engine with prefix caching, 2 gateway processes, 1 intra-op thread per
replica, 1.5 GiB of KV cache per replica (each holds every chat), a random-weight
GPT-2 of GPT-2 small's shape (12 layers, 768 wide; 4,096 positions: speed does not
depend on the values) with a word-level tokenizer of the 4,096 commonest words of the
standard library's docstrings (the prose of the prompts too). Whole words split on
whitespace, so an answer's text encodes back to the tokens that were generated, as a
trained model's answers mostly do with any tokenizer; a random model's byte-level BPE
output often does not, and then no routing could find an answer in a cache.

Per run: the prefix-cache hit rate (prompt tokens the replicas' caches held, from each
reply's ``usage.prompt_tokens_details.cached_tokens``, over all prompt tokens), TTFT
p50/p99 (request sent -> first content chunk) and the wall time. The ratios are the
medians of each round's ratios. Writes bench/results/prefix_routing.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from servers import free_port, start, stop, wait_ready

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SYSTEM_TOKENS = 1000
QUESTION_TOKENS = 40
ANSWER_TOKENS = 64
KV_CACHE_MB = 1536
"""Per replica: each holds every chat (``--kv-cache-mb 512``: each holds about half)."""
THINK_S = (0.5, 2.0)
"""A user reads the answer and types the next question: uniform in this range."""
VARIANTS = ("prefix", "least-loaded", "one-replica")


def build_model(folder: Path) -> tuple[str, list[str]]:
    """The model and tokenizer into ``folder``; the system prompt and a pool of
    questions, cut to their token counts."""
    from collections import Counter

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel

    from inferd.demo.corpus import stdlib_corpus

    paragraphs = [p for p in stdlib_corpus().paragraphs if p.isascii()]
    folder.mkdir(parents=True, exist_ok=True)
    words = Counter(w for p in paragraphs for w in p.split())
    vocab = ["<|endoftext|>", "[UNK]", "system:", "user:", "assistant:"]
    vocab += [w for w, _ in words.most_common(4096) if w not in vocab]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(folder / "tokenizer.json"))
    config = GPT2Config(vocab_size=len(vocab), n_positions=4096, n_embd=768,
                        n_layer=12, n_head=12, bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(folder, safe_serialization=True)
    rng = random.Random(0)
    rng.shuffle(paragraphs)

    def cut(text: str, tokens: int) -> str:
        return " ".join(text.split()[:tokens])

    system = cut(" ".join(paragraphs[:200]), SYSTEM_TOKENS)
    questions = [cut(p, QUESTION_TOKENS) for p in paragraphs[200:1200] if len(p.split()) > 60]
    return system, questions


def server(
    data: Path, work: Path, name: str, env: dict[str, str], kv_cache_mb: int
) -> tuple[Any, str]:
    port = free_port()
    env = {
        "INFERD_LOG_LEVEL": "WARNING",
        "INFERD_REPLICA_THREADS": "1",
        "INFERD_GATEWAY_WORKERS": "2",
        "INFERD_LLM__KV_CACHE_MB": str(kv_cache_mb),
        **env,
    }
    cmd = [sys.executable, "-m", "inferd", "serve", "--port", str(port), "--grpc-port", "-1",
           "--data-dir", str(data)]  # fmt: skip
    return start(cmd, env, work / f"{name}.log"), f"http://127.0.0.1:{port}"


async def chat(
    http: httpx.AsyncClient,
    system: str,
    questions: list[str],
    out: list[dict[str, float]],
    rng: random.Random,
    answer_tokens: int = ANSWER_TOKENS,
) -> None:
    messages = [{"role": "system", "content": system}]
    previous = 0  # the last turn's prompt tokens
    for turn, question in enumerate(questions):
        await asyncio.sleep(rng.uniform(*THINK_S))
        messages.append({"role": "user", "content": question})
        body = {"model": "chat", "messages": messages, "max_tokens": answer_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        sent = time.perf_counter()
        first, text, usage = None, [], None
        async with http.stream("POST", "/v1/chat/completions", json=body) as reply:
            if reply.status_code != 200:
                raise RuntimeError(f"{reply.status_code}: {(await reply.aread())[:300]!r}")
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices") or ():
                    piece = choice.get("delta", {}).get("content")
                    if piece:
                        first = first or time.perf_counter()
                        text.append(piece)
        assert usage is not None and first is not None
        out.append({
            "turn": turn,
            "ttft_s": first - sent,
            "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            # its replica held the whole previous turn (prompt and answer were computed there)
            "found_previous": usage["prompt_tokens_details"]["cached_tokens"] >= previous,
        })  # fmt: skip
        previous = usage["prompt_tokens"]
        messages.append({"role": "assistant", "content": "".join(text)})


async def workload(
    url: str, system: str, questions: list[str], users: int, turns: int,
    answer_tokens: int = ANSWER_TOKENS,
) -> dict[str, Any]:  # fmt: skip
    rng = random.Random(1)
    asked = [rng.sample(questions, turns) for _ in range(users)]
    out: list[dict[str, float]] = []
    limits = httpx.Limits(max_connections=users, max_keepalive_connections=users)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        began = time.perf_counter()
        await asyncio.gather(
            *(
                chat(http, system, q, out, random.Random(i), answer_tokens)
                for i, q in enumerate(asked)
            )
        )
        wall = time.perf_counter() - began
        routed = [line for line in (await http.get("/metrics")).text.splitlines()
                  if line.startswith(("inferd_generation_routed_total{",
                                      "inferd_generations_total{"))]  # fmt: skip
    ttfts = sorted(r["ttft_s"] for r in out)
    prompt = sum(r["prompt_tokens"] for r in out)
    return {
        "requests": len(out),
        "hit_rate": round(sum(r["cached_tokens"] for r in out) / prompt, 4),
        "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
        "ttft_p99_ms": round(1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 1),
        "wall_s": round(wall, 2),
        "previous_turn_found": round(
            statistics.mean(r["found_previous"] for r in out if r["turn"] > 0), 3
        ),
        # later turns' TTFT p50, split by whether their replica held the previous turn
        "ttft_p50_found_ms": _p50_ms([r for r in out if r["turn"] > 0 and r["found_previous"]]),
        "ttft_p50_missed_ms": _p50_ms(
            [r for r in out if r["turn"] > 0 and not r["found_previous"]]
        ),
        "ttft_p50_by_turn_ms": [
            round(1000 * statistics.median(r["ttft_s"] for r in out if r["turn"] == t), 1)
            for t in range(turns)
        ],
        "prompt_tokens": prompt,
        "routed": routed,
    }


def _p50_ms(rows: list[dict[str, Any]]) -> float | None:
    return round(1000 * statistics.median(r["ttft_s"] for r in rows), 1) if rows else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--users", type=int, default=10)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--answer-tokens", type=int, default=ANSWER_TOKENS)
    parser.add_argument("--kv-cache-mb", type=int, default=KV_CACHE_MB,
                        help="per replica of two (one-replica: twice it)")  # fmt: skip
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="a subset, in order (prefix@M, prefix~T: variant_env)")  # fmt: skip
    args = parser.parse_args()
    variants = tuple(args.variants.split(","))
    work = Path(tempfile.mkdtemp(prefix="prefix-routing-"))
    system, questions = build_model(work / "model")
    datas = {}
    for replicas in (1, 2):
        datas[replicas] = work / f"data{replicas}"
        register(datas[replicas], work / "model", replicas)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for round_ in range(args.rounds):
        order = variants if round_ % 2 == 0 else tuple(reversed(variants))
        for name in order:
            data = datas[1 if name == "one-replica" else 2]
            env = variant_env(name)
            kv = args.kv_cache_mb * (2 if name == "one-replica" else 1)
            proc, url = server(data, work, name, env, kv)
            try:
                wait_ready(f"{url}/health/ready", timeout_s=300)
                result = workload(
                    url, system, questions, args.users, args.turns, args.answer_tokens
                )
                runs[name].append(asyncio.run(result))
            finally:
                stop(proc)
            print(name, round_ + 1, runs[name][-1], flush=True)
    if set(VARIANTS) <= set(variants) and args.answer_tokens == ANSWER_TOKENS:
        report(runs, args)  # the committed figure (and extra variants); others are printed only


def variant_env(name: str) -> dict[str, str]:
    """A variant's settings; extra variants, to compare settings in one run:
    ``prefix@M``, prefix-aware with ``llm.prefix_routing_margin`` M; ``prefix~T``, with
    ``llm.prefix_routing_move_tokens`` T."""
    if name == "least-loaded":
        return {"INFERD_LLM__PREFIX_ROUTING": "false"}
    if name.startswith("prefix@"):
        return {"INFERD_LLM__PREFIX_ROUTING_MARGIN": name.partition("@")[2]}
    if name.startswith("prefix~"):
        return {"INFERD_LLM__PREFIX_ROUTING_MOVE_TOKENS": name.partition("~")[2]}
    return {}


def register(data: Path, model: Path, replicas: int) -> None:
    cmd = [sys.executable, "-m", "inferd", "models", "push", "chat", str(model), "--version",
           "v1", "--data-dir", str(data), "--replicas", str(replicas)]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)


def report(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    rounds = range(len(runs["prefix"]))
    ttft_ratio = [runs["least-loaded"][i]["ttft_p50_ms"] / runs["prefix"][i]["ttft_p50_ms"]
                  for i in rounds]  # fmt: skip
    hit_vs_one = [
        runs["prefix"][i]["hit_rate"] / runs["one-replica"][i]["hit_rate"] for i in rounds
    ]
    kv = args.kv_cache_mb
    stem = "prefix_routing" if kv == KV_CACHE_MB else f"prefix_routing_kv{kv}"
    summary = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "workload": {"users": args.users, "turns": args.turns, "system_tokens": SYSTEM_TOKENS,
                     "question_tokens": QUESTION_TOKENS, "answer_tokens": ANSWER_TOKENS,
                     "kv_cache_mb_per_replica": kv},
        "runs": runs,
        "ttft_p50_least_loaded_over_prefix": [round(r, 2) for r in ttft_ratio],
        "hit_rate_prefix_over_one_replica": [round(r, 3) for r in hit_vs_one],
    }  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(summary, indent=2) + "\n")
    extra = f" --variants {','.join(runs)}" if len(runs) > len(VARIANTS) else ""
    lines = [
        f"# Prefix-aware routing, {summary['date']}",
        "",
        f"{args.users} chats x {args.turns} turns, {SYSTEM_TOKENS}-token shared system prompt, "
        f"{ANSWER_TOKENS}-token answers, {kv} MiB of KV cache per replica of two (one "
        f"replica: {2 * kv} MiB); medians of {len(runs['prefix'])} rounds "
        f"(`bench/prefix_routing.py --kv-cache-mb {kv}{extra}`).",
        "",
        "| routing | replicas | hit rate | previous turn cached | TTFT p50 | TTFT p99 | wall |",
        "|---|---|---|---|---|---|---|",
    ]
    names = [*VARIANTS, *(v for v in runs if v not in VARIANTS)]
    for name in names:
        lines.append(
            f"| {name} | {1 if name == 'one-replica' else 2} | {med(name, 'hit_rate'):.3f} | "
            f"{med(name, 'previous_turn_found'):.2f} | "
            f"{med(name, 'ttft_p50_ms'):.0f} ms | {med(name, 'ttft_p99_ms'):.0f} ms | "
            f"{med(name, 'wall_s'):.1f} s |"
        )
    lines += [
        "",
        f"TTFT p50, least-loaded / prefix: {statistics.median(ttft_ratio):.2f}x "
        f"(rounds {', '.join(f'{r:.2f}' for r in ttft_ratio)}); hit rate, prefix / one "
        f"replica: {statistics.median(hit_vs_one):.3f} "
        f"(rounds {', '.join(f'{r:.3f}' for r in hit_vs_one)}).",
    ]
    for name in names[len(VARIANTS) :]:
        ratio = [runs["least-loaded"][i]["ttft_p50_ms"] / runs[name][i]["ttft_p50_ms"]
                 for i in rounds]  # fmt: skip
        lines.append(
            f"TTFT p50, least-loaded / {name}: {statistics.median(ratio):.2f}x "
            f"(rounds {', '.join(f'{r:.2f}' for r in ratio)})."
        )
    split = []
    for name in (n for n in names if n != "one-replica"):
        found = [r["ttft_p50_found_ms"] for r in runs[name] if r["ttft_p50_found_ms"]]
        missed = [r["ttft_p50_missed_ms"] for r in runs[name] if r["ttft_p50_missed_ms"]]
        split.append(
            f"{name} {statistics.median(found):.0f} ms / "
            + (f"{statistics.median(missed):.0f} ms" if missed else "none missed")
        )
    lines.append(
        "Later turns' TTFT p50 where the replica held the previous turn / where it did "
        f"not: {'; '.join(split)}."
    )
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
