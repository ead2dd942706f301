"""The demo LLM: a tiny GPT-2 and a LoRA adapter, both trained here from local text.

Nothing is downloaded. The base model learns English from the docstrings of the Python
standard library (read from its source files with :mod:`ast`, so no module is imported)
and the prose topics in :mod:`pydoc_data`; a LoRA adapter then makes it speak like the
product reviews in ``data/sentiment.csv``. One base, two visibly different styles.

The base also reads the reviews, as a tenth of its tokens. A LoRA on the attention
projections steers what the model already knows; it cannot teach the embeddings of
words the base never saw ("love", "refund"). Without them the adapter ended at a loss
of 5.6 writing fragments ("This product is a. A. The 'oed."); with them at 2.5 ("This
product is a refund. I could. I love it."), while the base's own greedy text stays in
the documentation voice ("This product is a file. The default is a list of ...").

Reproducibility rule: a training run is planned in *steps*, never in seconds. The step
count comes from the caller's time budget through a fixed reference rate, so a given
budget always means the same steps, seeds and data order, and so the same weights on
the same CPU. A deadline of 1.25x the budget guards a slow or busy machine: training
stops early rather than overrunning, and the metadata says so (``*_stopped_early``)
because those weights then depend on timing.

Tokenizers follow GPT-2's layout: byte-level BPE, regular tokens first and
``<|endoftext|>`` (end and start of text) as the last id.
"""

from __future__ import annotations

import functools
import json
import math
import random
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inferd.demo.corpus import (
    reviews,
    save_tokenizer,
    stdlib_corpus,
    token_stream,
    train_bpe,
)

if TYPE_CHECKING:
    import torch
    from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast

SEED = 0
ADAPTER_NAME = "reviews"
SAMPLE_PROMPTS = ("The function returns", "This product is")

TINY_VOCAB = 4096
# Narrow and fed small batches: with ~90 CPU-seconds, optimizer steps are what buy
# English. Of 128-256 wide, 2-4 deep, 2-16 window configurations, n_embd=128 with
# 4-window batches gave the lowest loss per CPU-second: ~5.0 in 90 s, where n_embd=256
# with 16 windows was still at 5.6.
TINY_SHAPE: dict[str, Any] = {"n_layer": 4, "n_head": 4, "n_embd": 128, "n_positions": 1024}
SEQ_LEN = 128
BATCH_SIZE = 4
# A context of 1,024 tokens (a chat template with tools and a conversation fits) at
# about the cost of 128-token windows: half of each batch's windows sit at a random
# place in the context (their position ids shifted), so every position's embedding
# learns; and every LONG_EVERY-th step is one LONG_SEQ-token window, so attention learns
# to reach far back. All-long windows cost 4.4x a step for 2x the tokens (357 against
# 82 ms here), which the same budget would pay for in English.
LONG_SEQ = 512
LONG_EVERY = 8
POSITION_BUCKETS = ((0, 128), (128, 512), (512, 1024))
"""Where the built base's loss is measured (``loss_by_position`` in its metadata)."""
# One intra-op thread. Two are 1.5x faster on an idle two-core machine (79 vs 122 ms a
# step), but when anything else holds a core they wait on each other at every small op
# and a step takes 2.3 s: the deadline would then cut training to a few dozen steps and
# the caller would cache a model that writes "the the the". One thread at worst shares.
TRAIN_THREADS = 1
# Optimizer steps per second with one thread on the two-core reference machine (AMD EPYC,
# base ~9, adapter ~11.5), rounded down so an ordinary machine finishes in the budget.
BASE_STEPS_PER_S = 8.0
ADAPTER_STEPS_PER_S = 9.0
DEADLINE_FACTOR = 1.25
REVIEW_REPEATS = 3
"""Copies of the reviews among the base's texts (see the module note)."""
BASE_LR = 3e-3
ADAPTER_LR = 1e-2


@dataclass(frozen=True)
class LLMDemo:
    base: Path
    """Base model folder: config.json, model.safetensors, generation_config.json, tokenizer."""
    adapter: Path
    """PEFT LoRA folder for ``base``: adapter_config.json, adapter_model.safetensors."""
    adapter_name: str
    metadata: dict[str, Any]


def build_tiny_gpt2(
    out_dir: Path,
    progress: Callable[[str], None] | None = None,
    *,
    train_seconds: float = 90.0,
    adapter_seconds: float = 35.0,
) -> LLMDemo:
    """Train the tiny base into ``out_dir/tiny-gpt2`` and its adapter into
    ``out_dir/tiny-gpt2-reviews`` (both replaced if present).

    ``train_seconds`` and ``adapter_seconds`` are the training budgets (see the module
    note); the whole build takes about their sum plus ~15 s.
    """
    say = progress or (lambda _message: None)
    out_dir = Path(out_dir)
    base_dir, adapter_dir = _fresh(out_dir / "tiny-gpt2"), _fresh(out_dir / "tiny-gpt2-reviews")
    started = time.monotonic()
    corpus, review_texts = stdlib_corpus(), reviews()
    texts = [*corpus.paragraphs, *(review_texts * REVIEW_REPEATS)]
    random.Random(SEED).shuffle(texts)
    tokenizer = save_tokenizer(train_bpe(texts, TINY_VOCAB), base_dir, TINY_SHAPE["n_positions"])
    say(f"llm: corpus {corpus.chars / 1e6:.2f} MB and tokenizer in {_since(started)}")
    stream, review_stream = token_stream(tokenizer, texts), token_stream(tokenizer, review_texts)
    with _training_threads(), _seeded(SEED), _quiet_hf():
        model, base = _train_base(tokenizer, stream, train_seconds)
        model.save_pretrained(base_dir, safe_serialization=True)
        say(f"llm: base {base['steps']} steps, loss {base['final_loss']} at {_since(started)}")
        tuned, adapter = _train_adapter(model, review_stream, adapter_seconds)
        tuned.save_pretrained(adapter_dir, safe_serialization=True)
        _tidy_adapter(adapter_dir, base_dir)
        say(f"llm: adapter {adapter['steps']} steps, loss {adapter['final_loss']}")
        samples = _samples(base_dir, adapter_dir)
    metadata = {
        "corpus": "Python standard-library docstrings and pydoc topics "
        f"(Python {sys.version.split()[0]})",
        "corpus_files": corpus.source_files,
        "corpus_paragraphs": len(corpus.paragraphs),
        "corpus_chars": corpus.chars,
        "corpus_sha256": corpus.sha256,
        "base_tokens": len(stream),
        "base_review_share": round(REVIEW_REPEATS * len(review_stream) / len(stream), 3),
        "adapter_dataset": f"inferd/demo/data/sentiment.csv ({len(review_texts)} reviews)",
        "adapter_tokens": len(review_stream),
        "vocab_size": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "parameters": model.num_parameters(),
        **{f"base_{key}": value for key, value in base.items()},
        **{f"adapter_{key}": value for key, value in adapter.items()},
        "samples": samples,
        "seed": SEED,
        "build_seconds": round(time.monotonic() - started, 1),
        "training_date": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    say(f"llm: built tiny-gpt2 and its '{ADAPTER_NAME}' adapter in {_since(started)}")
    return LLMDemo(base_dir, adapter_dir, ADAPTER_NAME, metadata)


def random_gpt2_small(out_dir: Path, seed: int = 0) -> Path:
    """A GPT-2-small-shaped model (124M parameters) with random weights, for speed tests.

    Written to ``out_dir/gpt2-small-random`` (replaced if present) with a 50257-token
    byte-level BPE tokenizer. The corpus only supports ~11k merges, so the vocabulary is
    the byte alphabet and the merges learned on it, padded with never-produced
    ``<|unused_N|>`` tokens to 50256 ids, then ``<|endoftext|>`` as 50256, as in GPT-2.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = _fresh(Path(out_dir) / "gpt2-small-random")
    tokenizer = save_tokenizer(train_bpe(stdlib_corpus().paragraphs, 50257), folder, 1024)
    eos = tokenizer.eos_token_id
    with _seeded(seed):
        model = GPT2LMHeadModel(GPT2Config(bos_token_id=eos, eos_token_id=eos))
    model.generation_config.pad_token_id = eos
    with _quiet_hf():
        model.save_pretrained(folder, safe_serialization=True)
    return folder


# -- training -------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    steps: int
    deadline_s: float


def _plan(seconds: float, steps_per_s: float) -> _Plan:
    return _Plan(max(1, int(seconds * steps_per_s)), seconds * DEADLINE_FACTOR)


def _train_base(
    tokenizer: PreTrainedTokenizerFast, stream: torch.Tensor, seconds: float
) -> tuple[GPT2LMHeadModel, dict[str, Any]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    eos = tokenizer.eos_token_id
    config = GPT2Config(
        vocab_size=len(tokenizer), bos_token_id=eos, eos_token_id=eos, **TINY_SHAPE,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # far too few steps to overfit
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    model.generation_config.pad_token_id = eos
    trained = _train(model, stream, _plan(seconds, BASE_STEPS_PER_S), peak_lr=BASE_LR)
    return model, {**trained, "loss_by_position": _loss_by_position(model, stream)}


def _loss_by_position(model: Any, stream: torch.Tensor, windows: int = 4) -> dict[str, float]:
    """The next-token loss over whole-context windows of ``stream``, by where in the
    context the token is (``POSITION_BUCKETS``): a context the model cannot use shows
    as a far higher loss late in the window."""
    import torch
    from torch.nn.functional import cross_entropy

    context = TINY_SHAPE["n_positions"]
    starts = torch.linspace(0, len(stream) - context - 1, windows).long()
    window = stream[starts[:, None] + torch.arange(context + 1)]
    with torch.inference_mode():
        logits = model(input_ids=window[:, :-1]).logits
        losses = cross_entropy(logits.transpose(1, 2), window[:, 1:], reduction="none")
    return {
        f"{lo}-{hi - 1}": round(float(losses[:, lo:hi].mean()), 4) for lo, hi in POSITION_BUCKETS
    }


def _train_adapter(
    model: GPT2LMHeadModel, stream: torch.Tensor, seconds: float
) -> tuple[Any, dict[str, Any]]:
    """LoRA on the attention projections; ``model`` gains the adapter layers in place."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["c_attn"],
        fan_in_fan_out=True, task_type="CAUSAL_LM",
    )  # fmt: skip
    with _peft_on_transformers_5():
        tuned = get_peft_model(model, lora)
    return tuned, _train(tuned, stream, _plan(seconds, ADAPTER_STEPS_PER_S), peak_lr=ADAPTER_LR)


def _train(model: Any, stream: torch.Tensor, plan: _Plan, peak_lr: float) -> dict[str, Any]:
    """AdamW on random windows of ``stream`` (``SEQ_LEN`` tokens, half of them at shifted
    positions; one of ``LONG_SEQ`` every ``LONG_EVERY`` steps): linear warm-up over 5% of
    the steps, then cosine decay to a tenth. ``final_loss`` averages the last 10 steps."""
    import torch
    from torch.nn.functional import cross_entropy

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(_lr, plan.steps))
    losses: list[float] = []
    model.train()
    started = time.monotonic()
    for step, (window, positions) in enumerate(_windows(stream, plan.steps)):
        if step and time.monotonic() - started > plan.deadline_s:
            break
        logits = model(input_ids=window[:, :-1], position_ids=positions).logits
        loss = cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    return {
        "steps": len(losses),
        "planned_steps": plan.steps,
        "stopped_early": len(losses) < plan.steps,
        "final_loss": round(sum(losses[-10:]) / len(losses[-10:]), 4),
        "train_seconds": round(time.monotonic() - started, 1),
    }


def _windows(stream: torch.Tensor, steps: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's token windows (one token longer than the input: the targets) and
    their position ids: ``BATCH_SIZE`` windows of ``SEQ_LEN``, half of them shifted to a
    random place in the context, or on every ``LONG_EVERY``-th step one of ``LONG_SEQ``
    at a random place. Drawn from the seed alone."""
    import torch

    order = torch.Generator().manual_seed(SEED)
    context = TINY_SHAPE["n_positions"]
    starts = torch.randint(0, len(stream) - LONG_SEQ, (steps, BATCH_SIZE), generator=order)
    shifts = torch.randint(0, context - SEQ_LEN + 1, (steps, BATCH_SIZE), generator=order)
    shifts[:, : BATCH_SIZE // 2] = 0
    long_shifts = torch.randint(0, context - LONG_SEQ + 1, (steps,), generator=order)
    for step in range(steps):
        if step % LONG_EVERY == LONG_EVERY - 1:
            begin, length = starts[step, :1], LONG_SEQ
            positions = long_shifts[step, None, None] + torch.arange(LONG_SEQ)
        else:
            begin, length = starts[step], SEQ_LEN
            positions = shifts[step, :, None] + torch.arange(SEQ_LEN)
        yield stream[begin[:, None] + torch.arange(length + 1)], positions


def _lr(total_steps: int, step: int) -> float:
    warmup = max(1, total_steps // 20)
    if step < warmup:
        return (step + 1) / warmup
    done = (step - warmup) / max(1, total_steps - warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * done))


def _samples(base_dir: Path, adapter_dir: Path) -> dict[str, dict[str, str]]:
    """Greedy 20-token continuations from the saved files, which also proves they load."""
    from peft import PeftModel
    from transformers import AutoTokenizer, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    base = GPT2LMHeadModel.from_pretrained(base_dir).eval()
    samples = {"base": {p: greedy(base, tokenizer, p) for p in SAMPLE_PROMPTS}}
    with _peft_on_transformers_5():
        tuned = PeftModel.from_pretrained(base, adapter_dir).eval()
    samples["adapter"] = {p: greedy(tuned, tokenizer, p) for p in SAMPLE_PROMPTS}
    return samples


def greedy(model: Any, tokenizer: Any, prompt: str, new_tokens: int = 20) -> str:
    """``prompt`` and its greedy continuation of ``new_tokens`` tokens, as text."""
    import torch

    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(
            **inputs,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )
    return str(tokenizer.decode(out[0], skip_special_tokens=True))


# -- helpers --------------------------------------------------------------------------


def _tidy_adapter(adapter_dir: Path, base_dir: Path) -> None:
    """Leave only the adapter files (PEFT adds a template model card) and point the
    config at the saved base, where PEFT records the in-memory model's empty name."""
    (adapter_dir / "README.md").unlink(missing_ok=True)
    path = adapter_dir / "adapter_config.json"
    config = json.loads(path.read_text())
    config["base_model_name_or_path"] = str(base_dir.resolve())
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _fresh(folder: Path) -> Path:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    return folder


def _since(started: float) -> str:
    return f"{time.monotonic() - started:.1f}s"


@contextmanager
def _training_threads() -> Iterator[None]:
    """``TRAIN_THREADS`` intra-op threads, restored afterwards: the setting is
    process-wide and the caller may be a server."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(TRAIN_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def _quiet_hf() -> Iterator[None]:
    """No progress bars from transformers while saving and loading (noise in the
    ``inferd serve`` console); the process-wide switch is restored afterwards."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()


@contextmanager
def _peft_on_transformers_5() -> Iterator[None]:
    """peft 0.21 wraps a model by reading a property transformers 5 deprecated; the
    FutureWarning is theirs and says nothing about this build."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning
        )
        yield


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Seed torch's global RNG (model init draws from it) without leaking the change."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
