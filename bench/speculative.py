"""Prompt-lookup speculative decoding (#37): one stream's output tokens/s with and
without it, same engine, same run, alternating order.

    .venv/bin/python bench/speculative.py [--rounds 5] [--new-tokens 128] [--train-seconds 120]

Each round measures both, back to back, each as the same stream repeated for a second
or more; the ratio is the median of the rounds' ratios (this machine is shared: pairs
within a round see the same load). inferd's engine alone (no HTTP: what a single
stream gains is the engine's), greedy,
EOS ignored, float32, ``--threads`` intra-op threads (1, as ``replica_threads``; with 2
and OpenMP's passive waits a small model's multi-token steps cost more than they
save), the C decode kernel on, speculation
``num_speculative_tokens`` 4, ``prompt_lookup_max`` 4, ``prompt_lookup_min`` 2 (the
defaults). Every run checks that the tokens with speculation equal those without.

Models, built here (nothing is downloaded):

- ``reciter``: a small GPT-2 (2 layers, 128 wide, byte-level) trained on the spot for
  ``--train-seconds`` until it knows 8 passages of the demo corpus (Python
  standard-library docstrings) by heart: given a blank line and a passage's first 24
  characters, it writes the rest. Two workloads, the same output (the passage), the
  same positions: ``copy``, the passage is in the prompt before the blank line (an
  answer that repeats its prompt: a summary quoting it, an edit of code it holds), and
  ``fresh``, another passage is (nothing to copy but what the two share).
- ``gpt2-small``: GPT-2 small's shape (124M) with random weights, a 128-token prompt of
  the same prose, continued (speed does not depend on the values; what a random model
  writes does: it falls into loops, which the lookup predicts, so its acceptance says
  nothing of a trained model's).

Writes bench/results/speculative.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as in a replica

import torch

from inferd.llm import native
from inferd.llm.engine import EngineConfig, LLMEngine
from inferd.llm.model import GPT2
from inferd.llm.speculation import Speculation
from inferd.llm.tokenizer import TextTokenizer
from inferd.shapes.llm import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
BREAK = "\n\n"
PASSAGES = 8
START = 24
"""Characters of a passage given in the prompt, from which the reciter goes on."""
SPEC = Speculation()  # the defaults: 4 tokens, lookup 4 down to 2


def passages() -> list[str]:
    """The demo corpus's paragraphs of 130-150 characters, ASCII: the ones recited."""
    from inferd.demo.corpus import stdlib_corpus

    found = [p for p in stdlib_corpus().paragraphs if 130 <= len(p) <= 150 and p.isascii()]
    random.Random(0).shuffle(found)
    return found[:PASSAGES]


def train_reciter(folder: Path, seconds: float) -> dict[str, Any]:
    """The reciter and its byte-level tokenizer into ``folder`` (HF layout): trained on
    every pair of passages ``Q`` "\n\n" ``P``, so it recites ``P`` after a blank line
    from its first words, wherever it stands in the context."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2Config, GPT2LMHeadModel

    texts = passages()
    folder.mkdir(parents=True, exist_ok=True)
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(texts, vocab_size=257, special_tokens=["<|endoftext|>"],
                            show_progress=False)  # fmt: skip
    tok.save(str(folder / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    config = GPT2Config(vocab_size=tok.get_vocab_size(), n_positions=512, n_embd=128,
                        n_layer=2, n_head=4, bos_token_id=eos, eos_token_id=eos)  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    pairs = [[*tok.encode(q + BREAK + p).ids, eos] for q in texts for p in texts]
    rng = random.Random(1)
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)  # training: every core; decoding: --threads
    started, steps, loss = time.monotonic(), 0, float("nan")
    while time.monotonic() - started < seconds:
        batch = rng.sample(pairs, 16)
        width = max(len(x) for x in batch)
        ids = torch.tensor([x + [eos] * (width - len(x)) for x in batch])
        labels = torch.tensor([x + [-100] * (width - len(x)) for x in batch])
        out = model(input_ids=ids, labels=labels)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        steps, loss = steps + 1, out.loss.item()
    torch.set_num_threads(threads)
    model.eval().save_pretrained(folder, safe_serialization=True)
    return {"steps": steps, "final_loss": round(loss, 3), "seconds": round(seconds)}


def decode(model: GPT2, tokenizer: TextTokenizer, prompt: list[int], new_tokens: int,
           spec: Speculation | None) -> tuple[float, list[int], dict[str, int]]:  # fmt: skip
    """One stream, alone in a fresh engine: (seconds, tokens, the engine's counters)."""
    config = EngineConfig(num_blocks=256, max_num_seqs=8, speculation=spec)
    engine = LLMEngine(model, tokenizer, config)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    engine.add_request("r", prompt, params)
    out: list[int] = []
    started = time.perf_counter()
    while engine.has_work():
        out += [o.token_id for o in engine.step() if o.token_id is not None]
    elapsed = time.perf_counter() - started
    stats = engine.stats()
    counters = {k: int(stats[k]) for k in ("steps", "spec_draft_tokens", "spec_accepted_tokens")}
    return elapsed, out, counters


Case = tuple[str, str, GPT2, TextTokenizer, list[int]]


def workloads(args: argparse.Namespace, work: Path) -> tuple[list[Case], dict[str, Any]]:
    """Each (model name, workload, model, tokenizer, prompt); how the reciter trained."""
    from inferd.demo.llm import random_gpt2_small

    found: list[Case] = []
    reciter_dir = work / "reciter"
    trained = train_reciter(reciter_dir, args.train_seconds)
    print(f"reciter: {trained}", flush=True)
    reciter, tok = GPT2.load(reciter_dir), TextTokenizer.load(reciter_dir)
    texts = passages()
    p, q = texts[3], texts[5]
    found.append(("reciter", "copy", reciter, tok, tok.encode(p + BREAK + p[:START])))
    found.append(("reciter", "fresh", reciter, tok, tok.encode(q + BREAK + p[:START])))
    if "gpt2-small" not in args.models.split(","):
        return found, trained
    small_dir = random_gpt2_small(work / "gpt2-small")
    small, small_tok = GPT2.load(small_dir), TextTokenizer.load(small_dir)
    prose = " ".join(texts)
    found.append(("gpt2-small", "fresh", small, small_tok, small_tok.encode(prose)[:128]))
    return found, trained


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--train-seconds", type=float, default=180.0)
    parser.add_argument("--threads", type=int, default=1, help="as replica_threads (1)")
    parser.add_argument("--models", default="reciter,gpt2-small")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    native.enable(True)
    work = Path(tempfile.mkdtemp(prefix="inferd-bench-speculative-"))
    cases, trained = workloads(args, work)
    name, _, model, tok, prompt = cases[0]
    _, recited, _ = decode(model, tok, prompt, args.new_tokens, None)
    want = passages()[3][START : START + args.new_tokens]
    got = tok.decode(recited)[: len(want)]
    trained["recited_chars"] = sum(a == b for a, b in zip(got, want, strict=False))
    trained["passage_chars"] = len(want)
    print(f"the reciter wrote {got!r}\n  for {want!r}", flush=True)
    results = []
    for name, workload, model, tok, prompt in cases:
        # warm-up (kernels, allocator); a measurement repeats the stream for 1 s or more
        warm, _, _ = decode(model, tok, prompt, args.new_tokens, None)
        repeats = max(1, round(1.0 / warm))
        rows: dict[str, list[float]] = {"plain": [], "speculative": []}
        ratios: list[float] = []
        counters: dict[str, int] = {}
        for r in range(args.rounds):
            order = [None, SPEC] if r % 2 == 0 else [SPEC, None]
            outputs = {}
            for spec in order:
                seconds, count = 0.0, 0
                for _ in range(repeats):
                    took, tokens, stats = decode(model, tok, prompt, args.new_tokens, spec)
                    seconds, count = seconds + took, count + len(tokens)
                key = "plain" if spec is None else "speculative"
                rows[key].append(count / seconds)
                outputs[key] = tokens
                if spec is not None:
                    counters = stats
            if outputs["plain"] != outputs["speculative"]:
                sys.exit(f"{name}/{workload}: speculative tokens differ from plain decoding's")
            ratios.append(rows["speculative"][-1] / rows["plain"][-1])
        plain, fast = statistics.median(rows["plain"]), statistics.median(rows["speculative"])
        drafted = counters["spec_draft_tokens"]
        row = {
            "model": name, "workload": workload, "prompt_tokens": len(prompt),
            "new_tokens": args.new_tokens, "plain_tok_s": round(plain, 1),
            "speculative_tok_s": round(fast, 1), "ratio": round(statistics.median(ratios), 3),
            "repeats": repeats,
            "acceptance": round(counters["spec_accepted_tokens"] / drafted, 3) if drafted else None,
            "steps_speculative": counters["steps"], "rounds": rows,
        }  # fmt: skip
        results.append(row)
        print(f"{name:10} {workload:6} plain {plain:7.1f} tok/s  speculative {fast:7.1f} tok/s"
              f"  {row['ratio']:.2f}x  acceptance {row['acceptance']}  "
              f"steps {counters['steps']} for {args.new_tokens} tokens", flush=True)  # fmt: skip
    write(results, trained, args)


def write(results: list[dict[str, Any]], trained: dict[str, Any], args: argparse.Namespace) -> None:
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    command = "python bench/speculative.py " + " ".join(sys.argv[1:])
    record = {"command": command, "finished": datetime.now(UTC).isoformat(timespec="seconds"),
              "cpus": os.cpu_count(), "reciter_training": trained, "results": results}  # fmt: skip
    (out / "speculative.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        f"One stream, inferd's engine alone, greedy, {args.threads} thread(s); medians of "
        f"{args.rounds} rounds, alternating order; `{command}`; the reciter trained "
        f"{trained['steps']} steps (loss {trained['final_loss']}) and wrote "
        f"{trained['recited_chars']} of the passage's {trained['passage_chars']} characters "
        "right.",
        "",
        "| model | workload | plain tok/s | speculative tok/s | ratio (median of rounds) "
        "| acceptance | steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['model']} | {r['workload']} | {r['plain_tok_s']:,} | "
            f"{r['speculative_tok_s']:,} | {r['ratio']:.2f}x | {r['acceptance']} | "
            f"{r['steps_speculative']} for {r['new_tokens']} tokens |"
        )
    (out / "speculative.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
