"""Token-mask libraries for JSON-schema outputs: llguidance vs xgrammar vs outlines-core.

    /tmp/vv/bin/python bench/grammar_backends.py [--rounds 5] [--batch 8] [--threads 2]
        [--workdir /tmp/inferd-grammar-bench] [--out bench/results/grammar_backends.json]

Picks the constrained-decoding library for the engine's per-step token mask. Two local
byte-level BPE tokenizers (built by ``inferd.demo``, no network): ``gpt2`` (GPT-2-small shaped,
50257 ids, ~11k learned merges padded with ``<|unused_N|>`` tokens) and ``qwen2`` (2048 ids, with
``<|im_start|>``-style special tokens). Three schemas: ``object`` (name/age/tags),
``tool_call`` (``anyOf`` over three ``{"name": const, "arguments": {...}}`` functions) and
``json_object`` (``{"type": "object"}``: any JSON object). CPU, ``--threads`` threads. For each
library x tokenizer x schema:

* **init**: the library's tokenizer object (once per tokenizer). llguidance reads
  tokenizer.json itself; xgrammar takes the ``transformers`` tokenizer; outlines-core takes a
  ``{token bytes: [ids]}`` dict, built here from the byte-level vocabulary (its only loader,
  ``Vocabulary.from_pretrained``, downloads from the Hub);
* **compile**: schema to compiled grammar, no cache, up to ``--rounds`` times within
  ``--compile-budget`` seconds;
* **walk**: a valid instance (``json.dumps``, raw UTF-8) is tokenized; per round a fresh matcher
  walks it: fill the next-token bitmask row (an int32 tensor, one bit per token; llguidance and
  outlines-core write through a raw pointer, xgrammar takes the tensor), check the true token is
  allowed, consume it. Per token: median and p99 of mask and consume costs over all positions
  and rounds; the first mask after compiling (lazy work) separately. Libraries alternate within
  each round;
* **batch**: ``--batch`` matchers walk the document in lockstep; each step fills all rows one
  call at a time and through the library's batch API (llguidance ``fill_next_token_bitmask_par``,
  xgrammar ``BatchGrammarMatcher``; outlines-core has none), then consumes a token in each;
* **correctness**: every token of the valid document allowed; EOS allowed and the matcher
  accepting at its end; an invalid document rejected; mean allowed tokens per step; steps that
  allow a non-EOS special token (``<|im_start|>``...). Probes on ``json_object``: a ``\\u00e9``
  escape and 5-deep nesting, both valid JSON; how an invalid schema is reported.

Also: applying a bitmask to float32 logits (batch x vocab) with each method, on masks recorded
in the walks, and each library's install footprint (declared dependency closure, size on disk,
what ``import`` pulls in). Writes bench/results/grammar_backends.json.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import platform
import statistics
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import llguidance
import llguidance.torch
import numpy as np
import outlines_core
import torch
import xgrammar
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from inferd.demo.decoders import random_decoder
from inferd.demo.llm import random_gpt2_small

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def _function(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"const": name},
            "arguments": {
                "type": "object",
                "properties": arguments,
                "required": list(arguments),
                "additionalProperties": False,
            },
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


SCHEMAS: dict[str, dict[str, Any]] = {
    "object": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    },
    "tool_call": {
        "anyOf": [
            _function(
                "get_weather",
                {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
            ),
            _function(
                "search_web",
                {
                    "query": {"type": "string"},
                    "max_results": {"type": "integer"},
                    "safe": {"type": "string", "enum": ["off", "moderate", "strict"]},
                },
            ),
            _function(
                "send_email",
                {
                    "to": {"type": "string"},
                    "subject": {"type": "string"},
                    "priority": {"type": "string", "enum": ["low", "normal", "high"]},
                },
            ),
        ]
    },
    "json_object": {"type": "object"},
}
VALID: dict[str, Any] = {
    "object": {
        "name": "Ada Lovelace",
        "age": 36,
        "tags": ["mathematician", "writer", "analytical engine"],
    },
    "tool_call": {
        "name": "send_email",
        "arguments": {
            "to": "ada@example.org",
            "subject": "Notes on the engine, part 2",
            "priority": "high",
        },
    },
    "json_object": {
        "id": 7,
        "ok": True,
        "score": -1500.25,
        "items": [{"k": "v", "n": None}, [1, 2, 3]],
        "note": 'line\nbreak "quoted" café ☃',
    },
}
INVALID: dict[str, str] = {
    "object": '{"name": "Ada", "age": "36", "tags": []}',
    "tool_call": '{"name": "send_email", "arguments": {"city": "Paris"}}',
    "json_object": "[1, 2, 3]",
}
PROBES: dict[str, str] = {
    "unicode_escape": json.dumps({"note": "café"}),
    "nesting_depth_5": json.dumps({"a": {"b": {"c": {"d": {"e": 1}}}}}),
}
BAD_SCHEMA: dict[str, Any] = {"type": "object", "properties": {"x": {"type": "strin"}}}


# -- tokenizers -------------------------------------------------------------------------


@dataclass(frozen=True)
class Tok:
    name: str
    folder: Path
    hf: PreTrainedTokenizerBase
    vocab_size: int  # logits width: the model's config.json vocab_size
    eos: int
    specials: list[int]  # special token ids other than EOS

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)


def load_tokenizers(workdir: Path) -> list[Tok]:
    """Both tokenizers, built into ``workdir`` on first use (gpt2 with its 500 MB random model)."""
    sources: dict[str, tuple[Path, Callable[[], Path]]] = {
        "gpt2": (workdir / "gpt2-small-random", lambda: random_gpt2_small(workdir)),
        "qwen2": (workdir / "qwen2-random", lambda: random_decoder(workdir, "qwen2")),
    }
    toks = []
    for name, (folder, build) in sources.items():
        if not (folder / "tokenizer.json").exists():
            build()
        hf = AutoTokenizer.from_pretrained(folder)
        eos = hf.eos_token_id
        config = json.loads((folder / "config.json").read_text())
        specials = [i for i in hf.all_special_ids if i != eos]
        toks.append(Tok(name, folder, hf, config["vocab_size"], eos, specials))
    return toks


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable stand-in character -> byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in chars)
    chars.update((b, chr(256 + n)) for n, b in enumerate(shifted))
    return {c: b for b, c in chars.items()}


def byte_vocabulary(tok: Tok) -> dict[bytes, list[int]]:
    """outlines-core's input: token bytes -> ids, for a byte-level BPE; special tokens left out."""
    decoder = _byte_decoder()
    skip = {tok.eos, *tok.specials}
    vocab: dict[bytes, list[int]] = {}
    for token, i in tok.hf.get_vocab().items():
        if i not in skip:
            vocab.setdefault(bytes(decoder[c] for c in token), []).append(i)
    return vocab


# -- backends ---------------------------------------------------------------------------


class Backend(ABC):
    """One library behind a common interface; ``compiled`` and matchers are its own objects."""

    name: ClassVar[str]

    @abstractmethod
    def __init__(self, tok: Tok, threads: int) -> None: ...

    @abstractmethod
    def compile(self, schema: dict[str, Any]) -> Any: ...

    @abstractmethod
    def matcher(self, compiled: Any) -> Any: ...

    @abstractmethod
    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None: ...

    @abstractmethod
    def consume(self, matcher: Any, token: int) -> bool: ...

    @abstractmethod
    def accepting(self, matcher: Any) -> bool: ...

    def fill_rows(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        """Row ``i`` of ``bitmask`` for ``matchers[i]``, one call at a time."""
        for row, matcher in enumerate(matchers):
            self.fill(matcher, bitmask, row)

    def fill_batch(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        """The same through the library's batch API, where it has one."""
        self.fill_rows(matchers, bitmask)

    def consume_batch(self, matchers: list[Any], tokens: list[int]) -> list[bool]:
        return [self.consume(m, t) for m, t in zip(matchers, tokens, strict=True)]


class LLGuidance(Backend):
    """Compiled form: a fresh ``LLMatcher``, ``deep_copy``-ed per sequence. The library never
    raises on a bad schema: the matcher enters an error state (``is_error``/``get_error``)."""

    name = "llguidance"

    def __init__(self, tok: Tok, threads: int) -> None:
        path = str(tok.folder / "tokenizer.json")
        self.tokenizer = llguidance.LLTokenizer(path, n_vocab=tok.vocab_size, eos_token=tok.eos)
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, schema: dict[str, Any]) -> llguidance.LLMatcher:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled: llguidance.LLMatcher) -> llguidance.LLMatcher:
        return compiled.deep_copy()

    def fill(self, matcher: llguidance.LLMatcher, bitmask: torch.Tensor, row: int) -> None:
        # llguidance.torch.fill_next_token_bitmask without its checks and row slicing (~2.5 us)
        row_bytes = bitmask.shape[1] * bitmask.element_size()
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * row_bytes, row_bytes)

    def consume(self, matcher: llguidance.LLMatcher, token: int) -> bool:
        return matcher.consume_token(token)

    def accepting(self, matcher: llguidance.LLMatcher) -> bool:
        return matcher.is_accepting()

    def fill_batch(self, matchers: list[llguidance.LLMatcher], bitmask: torch.Tensor) -> None:
        rows = [(m, row) for row, m in enumerate(matchers)]
        llguidance.torch.fill_next_token_bitmask_par(self.executor, rows, bitmask)

    def consume_batch(self, matchers: list[llguidance.LLMatcher], tokens: list[int]) -> list[bool]:
        pairs = list(zip(matchers, tokens, strict=True))
        return llguidance.torch.consume_token_par(self.executor, pairs)


class XGrammar(Backend):
    name = "xgrammar"

    def __init__(self, tok: Tok, threads: int) -> None:
        info = xgrammar.TokenizerInfo.from_huggingface(
            tok.hf, vocab_size=tok.vocab_size, stop_token_ids=[tok.eos]
        )
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=threads)

    def compile(self, schema: dict[str, Any]) -> xgrammar.CompiledGrammar:
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, compiled: xgrammar.CompiledGrammar) -> xgrammar.GrammarMatcher:
        return xgrammar.GrammarMatcher(compiled)

    def fill(self, matcher: xgrammar.GrammarMatcher, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def consume(self, matcher: xgrammar.GrammarMatcher, token: int) -> bool:
        return matcher.accept_token(token)

    def accepting(self, matcher: xgrammar.GrammarMatcher) -> bool:
        return matcher.is_completed()

    def fill_batch(self, matchers: list[xgrammar.GrammarMatcher], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def consume_batch(
        self, matchers: list[xgrammar.GrammarMatcher], tokens: list[int]
    ) -> list[bool]:
        return xgrammar.BatchGrammarMatcher.batch_accept_token(matchers, tokens)


class OutlinesCore(Backend):
    """Regex-DFA index over the vocabulary; no batch API, so batches are a loop."""

    name = "outlines-core"

    def __init__(self, tok: Tok, threads: int) -> None:
        del threads  # single-threaded library
        self.vocabulary = outlines_core.Vocabulary(tok.eos, byte_vocabulary(tok))

    def compile(self, schema: dict[str, Any]) -> outlines_core.Index:
        regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(schema))
        return outlines_core.Index(regex, self.vocabulary)

    def matcher(self, compiled: outlines_core.Index) -> outlines_core.Guide:
        return outlines_core.Guide(compiled)

    def fill(self, matcher: outlines_core.Guide, bitmask: torch.Tensor, row: int) -> None:
        words, size = bitmask.shape[1], bitmask.element_size()
        matcher.write_mask_into(bitmask.data_ptr() + row * words * size, words, size)

    def consume(self, matcher: outlines_core.Guide, token: int) -> bool:
        try:
            matcher.advance(token, return_tokens=False)
        except ValueError:  # "No next state found for the current state"
            return False
        return True

    def accepting(self, matcher: outlines_core.Guide) -> bool:
        return matcher.is_finished()


BACKENDS: list[type[Backend]] = [LLGuidance, XGrammar, OutlinesCore]


# -- measuring --------------------------------------------------------------------------


def new_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    return torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def unpack(row: torch.Tensor, vocab_size: int) -> np.ndarray:
    return np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[:vocab_size].astype(bool)


def allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token >> 5]) >> (token & 31)) & 1)


def us(ns: list[int]) -> dict[str, float]:
    """Median and p99 of nanosecond samples, in microseconds."""
    p99 = statistics.quantiles(ns, n=100, method="inclusive")[98] if len(ns) > 1 else ns[0]
    return {"median": statistics.median(ns) / 1e3, "p99": p99 / 1e3}


@dataclass
class Case:
    """Timings and outcomes of one library x tokenizer x schema."""

    backend: Backend
    schema: str
    tokens: list[int]
    compiled: Any = None
    compile_s: list[float] = field(default_factory=list)
    error: str = ""
    new_matcher_ns: list[int] = field(default_factory=list)
    first_mask_ns: int = 0
    mask_ns: list[int] = field(default_factory=list)
    consume_ns: list[int] = field(default_factory=list)
    batch_rows_ns: list[int] = field(default_factory=list)
    batch_api_ns: list[int] = field(default_factory=list)
    batch_consume_ns: list[int] = field(default_factory=list)
    walk_failed_at: int | None = None


def compile_case(case: Case, rounds: int, budget_s: float) -> None:
    schema = SCHEMAS[case.schema]
    while len(case.compile_s) < rounds and sum(case.compile_s) < budget_s:
        start = time.perf_counter()
        try:
            case.compiled = case.backend.compile(schema)
        except Exception as e:  # a library that cannot compile the schema
            case.error = f"{type(e).__name__}: {e}"
            return
        case.compile_s.append(time.perf_counter() - start)


def timed_walk(case: Case, bitmask: torch.Tensor) -> None:
    backend, clock = case.backend, time.perf_counter_ns
    start = clock()
    matcher = backend.matcher(case.compiled)
    case.new_matcher_ns.append(clock() - start)
    first = not case.mask_ns
    for i, token in enumerate(case.tokens):
        t0 = clock()
        backend.fill(matcher, bitmask, 0)
        t1 = clock()
        ok = allowed(bitmask, 0, token)
        t2 = clock()
        ok = backend.consume(matcher, token) and ok
        t3 = clock()
        if first and i == 0:
            case.first_mask_ns = t1 - t0
        else:
            case.mask_ns.append(t1 - t0)
        case.consume_ns.append(t3 - t2)
        if not ok:
            case.walk_failed_at = i
            return


def batch_walk(case: Case, bitmask: torch.Tensor) -> None:
    """Each step fills the rows one call at a time and through the batch API, in turn first."""
    backend, clock = case.backend, time.perf_counter_ns
    matchers = [backend.matcher(case.compiled) for _ in range(bitmask.shape[0])]
    fills = [(backend.fill_rows, case.batch_rows_ns), (backend.fill_batch, case.batch_api_ns)]
    for step, token in enumerate(case.tokens):
        for fill, samples in fills[step % 2 :] + fills[: step % 2]:
            t0 = clock()
            fill(matchers, bitmask)
            samples.append(clock() - t0)
        t0 = clock()
        ok = backend.consume_batch(matchers, [token] * len(matchers))
        case.batch_consume_ns.append(clock() - t0)
        if not all(ok):
            return


def first_rejection(
    backend: Backend, compiled: Any, tokens: list[int], bitmask: torch.Tensor
) -> int | None:
    """Position of the first token the mask (or the matcher) refuses; None if all pass."""
    matcher = backend.matcher(compiled)
    for i, token in enumerate(tokens):
        backend.fill(matcher, bitmask, 0)
        if not allowed(bitmask, 0, token) or not backend.consume(matcher, token):
            return i
    return None


def check(case: Case, tok: Tok, bitmask: torch.Tensor, masks: list[torch.Tensor]) -> dict[str, Any]:
    """Walk the valid document untimed, recording mask contents (appended to ``masks``)."""
    backend = case.backend
    matcher = backend.matcher(case.compiled)
    counts, special_steps = [], 0
    for i, token in enumerate(case.tokens):
        backend.fill(matcher, bitmask, 0)
        masks.append(bitmask[0].clone())
        bits = unpack(bitmask[0], tok.vocab_size)
        counts.append(int(bits.sum()))
        special_steps += bool(bits[tok.specials].any())
        if not bits[token] or not backend.consume(matcher, token):
            return {
                "valid_accepted": False,
                "rejected_at": i,
                "rejected_token": tok.hf.decode([token]),
            }
    backend.fill(matcher, bitmask, 0)
    eos_allowed = allowed(bitmask, 0, tok.eos)
    return {
        "valid_accepted": True,
        "eos_allowed_at_end": eos_allowed,
        "accepting_at_end": backend.accepting(matcher),
        "invalid_rejected_at": first_rejection(
            backend, case.compiled, tok.encode(INVALID[case.schema]), bitmask
        ),
        "mean_allowed_tokens": statistics.mean(counts),
        "steps_allowing_special_tokens": special_steps,
    }


# -- applying masks to logits -----------------------------------------------------------

_SHIFTS = torch.arange(32, dtype=torch.int32)


def torch_unpack(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    bits = ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).bool().view(bitmask.shape[0], -1)
    logits.masked_fill_(~bits[:, : logits.shape[1]], float("-inf"))


def numpy_unpack(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")
    logits.masked_fill_(torch.from_numpy(bits[:, : logits.shape[1]]) == 0, float("-inf"))


APPLY: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {
    "xgrammar.apply_token_bitmask_inplace (C++)": xgrammar.apply_token_bitmask_inplace,
    "torch: unpack bits + masked_fill_": torch_unpack,
    "numpy.unpackbits + masked_fill_": numpy_unpack,
    "llguidance.torch.apply_token_bitmask_inplace (compiled)": (
        llguidance.torch.apply_token_bitmask_inplace
    ),
}


def bench_apply(tok: Tok, masks: list[torch.Tensor], batch: int, reps: int) -> list[dict[str, Any]]:
    """Each method over masks recorded in the walks (``batch`` different ones per call);
    methods alternate within each repetition."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(batch, tok.vocab_size, generator=gen)
    stacks = [
        torch.stack([masks[(k * batch + j) % len(masks)] for j in range(batch)]) for k in range(16)
    ]
    reference = base.clone()
    torch_unpack(reference, stacks[0])
    logits = base.clone()
    rows: dict[str, dict[str, Any]] = {}
    for method, apply in APPLY.items():  # first calls: torch.compile compiles here
        logits.copy_(base)
        start = time.perf_counter()
        apply(logits, stacks[0])
        first_ms = (time.perf_counter() - start) * 1e3
        rows[method] = {
            "first_call_ms": first_ms,
            "matches_reference": bool(torch.equal(logits, reference)),
        }
    samples: dict[str, list[int]] = {method: [] for method in APPLY}
    for k in range(reps):
        for method, apply in APPLY.items():
            logits.copy_(base)
            t0 = time.perf_counter_ns()
            apply(logits, stacks[k % len(stacks)])
            samples[method].append(time.perf_counter_ns() - t0)
    return [
        {
            "method": m,
            "tokenizer": tok.name,
            "vocab": tok.vocab_size,
            "batch": batch,
            "us": us(samples[m]),
            **row,
        }
        for m, row in rows.items()
    ]


# -- footprint --------------------------------------------------------------------------

_IMPORT_PROBE = """
import json, sys, time
start = time.perf_counter()
__import__(sys.argv[1])
heavy = ("torch", "transformers", "triton", "numpy", "pydantic", "tvm_ffi")
loads = [m for m in heavy if m in sys.modules]
print(json.dumps({"import_s": time.perf_counter() - start, "loads": loads}))
"""


def dist_size_mb(dist: md.Distribution) -> float:
    return sum(f.size or 0 for f in dist.files or []) / 2**20


def footprint(dist_name: str, module: str) -> dict[str, Any]:
    """Declared runtime dependency closure (extras excluded) with sizes, and a cold import."""
    closure: dict[str, md.Distribution] = {}
    todo = [dist_name]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in closure:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        closure[name] = dist
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    own = closure.pop(canonicalize_name(dist_name))
    probe = subprocess.run(
        [sys.executable, "-c", _IMPORT_PROBE, module], capture_output=True, text=True, check=True
    )
    return {
        "version": own.version,
        "requires": [r for r in own.requires or [] if "extra ==" not in r],
        "own_mb": dist_size_mb(own),
        "dependencies": sorted(closure),
        "with_dependencies_mb": dist_size_mb(own) + sum(dist_size_mb(d) for d in closure.values()),
        **json.loads(probe.stdout),
    }


# -- driver -----------------------------------------------------------------------------


def summarize(
    case: Case, tok: Tok, bitmask: torch.Tensor, masks: list[torch.Tensor]
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "library": case.backend.name,
        "tokenizer": tok.name,
        "schema": case.schema,
        "doc_tokens": len(case.tokens),
    }
    if case.compiled is None:
        return {**row, "compile_error": case.error}
    return {
        **row,
        "compile_ms": statistics.median(case.compile_s) * 1e3,
        "compile_reps": len(case.compile_s),
        "new_matcher_us": us(case.new_matcher_ns)["median"],
        "first_mask_us": case.first_mask_ns / 1e3,
        "mask_us": us(case.mask_ns),
        "consume_us": us(case.consume_ns),
        "batch_fill_rows_us": us(case.batch_rows_ns),
        "batch_fill_api_us": us(case.batch_api_ns),
        "batch_consume_us": us(case.batch_consume_ns),
        "walk_failed_at": case.walk_failed_at,
        "correctness": check(case, tok, bitmask, masks),
    }


def probe(case: Case, tok: Tok, bitmask: torch.Tensor) -> dict[str, Any]:
    """Which of the PROBES documents the ``json_object`` grammar accepts."""
    accepted = {
        name: first_rejection(case.backend, case.compiled, tok.encode(text), bitmask) is None
        for name, text in PROBES.items()
    }
    return {"library": case.backend.name, "tokenizer": tok.name, **accepted}


def bad_schema_error(backend: Backend) -> str:
    try:
        backend.compile(BAD_SCHEMA)
    except Exception as e:
        return f"{type(e).__module__}.{type(e).__name__}: {str(e).strip().splitlines()[0]}"
    return "compiled without error"


def run_tokenizer(tok: Tok, args: argparse.Namespace) -> dict[str, Any]:
    init, backends = {}, []
    for cls in BACKENDS:
        start = time.perf_counter()
        backends.append(cls(tok, args.threads))
        init[cls.name] = time.perf_counter() - start
    cases = [
        Case(b, s, tok.encode(json.dumps(VALID[s], ensure_ascii=False)))
        for s in SCHEMAS
        for b in backends
    ]
    for case in cases:
        compile_case(case, args.rounds, args.compile_budget)
    live = [c for c in cases if c.compiled is not None]
    bitmask, batch_mask = new_bitmask(1, tok.vocab_size), new_bitmask(args.batch, tok.vocab_size)
    for _ in range(args.rounds):  # libraries alternate, so machine noise hits them alike
        for case in live:
            timed_walk(case, bitmask)
            batch_walk(case, batch_mask)
    masks: list[torch.Tensor] = []
    results = [summarize(case, tok, bitmask, masks) for case in cases]
    return {
        "tokenizer": {"vocab_size": tok.vocab_size, "eos": tok.eos, "specials": tok.specials},
        "init_s": init,
        "results": results,
        "probes": [probe(c, tok, bitmask) for c in live if c.schema == "json_object"],
        "bad_schema": {b.name: bad_schema_error(b) for b in backends},
        "apply": [
            row
            for batch in sorted({1, args.batch})
            for row in bench_apply(tok, masks, batch, args.apply_reps)
        ],
    }


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def table(header: list[str], rows: list[list[Any]]) -> None:
    """Print ``rows`` under ``header``: text left-aligned, numbers right-aligned."""
    cells = [header, *([_cell(v) for v in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    left = [isinstance(v, str) for v in rows[0]]
    print()
    for row in cells:
        aligned = (
            c.ljust(w) if lf else c.rjust(w) for c, w, lf in zip(row, widths, left, strict=True)
        )
        print("  ".join(aligned).rstrip())


def print_tables(report: dict[str, Any]) -> None:
    rows = []
    for tok_name, part in report["tokenizers"].items():
        for r in part["results"]:
            head = [r["library"], tok_name, r["schema"], part["init_s"][r["library"]] * 1e3]
            if "compile_error" in r:
                rows.append([*head, r["compile_error"][:40], *[""] * 8])
                continue
            c = r["correctness"]
            ok = c["valid_accepted"] and c["eos_allowed_at_end"] and c["accepting_at_end"]
            ok = ok and c["invalid_rejected_at"] is not None
            rows.append(
                [
                    *head,
                    r["compile_ms"],
                    r["first_mask_us"],
                    r["mask_us"]["median"],
                    r["mask_us"]["p99"],
                    r["consume_us"]["median"],
                    r["consume_us"]["p99"],
                    r["batch_fill_rows_us"]["median"],
                    r["batch_fill_api_us"]["median"],
                    "yes" if ok else "NO",
                ]
            )
    b = report["meta"]["batch"]
    header = ["library", "tok", "schema", "init ms", "compile ms", "1st mask us"]
    header += ["mask us", "p99", "consume us", "p99", f"B={b} loop us", "batch API", "ok"]
    table(header, rows)
    apply = [
        [a["method"], a["vocab"], a["batch"], a["us"]["median"], a["us"]["p99"], a["first_call_ms"]]
        for part in report["tokenizers"].values()
        for a in part["apply"]
    ]
    table(["apply mask to float32 logits", "vocab", "B", "us", "p99", "1st call ms"], apply)
    feet = []
    for lib, f in report["footprint"].items():
        loads = ", ".join(f["loads"]) or "-"
        mb = [f["own_mb"], f["with_dependencies_mb"]]
        feet.append([lib, f["version"], *mb, f["import_s"] * 1e3, loads, len(f["dependencies"])])
    table(["library", "version", "MB", "MB with deps", "import ms", "import loads", "deps"], feet)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5, help="walks per case (and max compiles)")
    parser.add_argument("--batch", type=int, default=8, help="matchers per batch step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--compile-budget", type=float, default=8.0, help="seconds of compiling per case"
    )
    parser.add_argument("--apply-reps", type=int, default=200)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/inferd-grammar-bench"))
    parser.add_argument("--out", type=Path, default=RESULTS / "grammar_backends.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    tokenizers = {tok.name: run_tokenizer(tok, args) for tok in load_tokenizers(args.workdir)}
    libraries = {
        "llguidance": "llguidance",
        "xgrammar": "xgrammar",
        "outlines-core": "outlines_core",
    }
    report = {
        "meta": {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "threads": args.threads,
            "rounds": args.rounds,
            "batch": args.batch,
            "versions": {
                p: md.version(p) for p in ("torch", "transformers", "tokenizers", "numpy")
            },
            "seconds": time.perf_counter() - started,
        },
        "footprint": {lib: footprint(lib, module) for lib, module in libraries.items()},
        "tokenizers": tokenizers,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print_tables(report)
    print(f"\nwrote {args.out} in {report['meta']['seconds']:.0f} s")


if __name__ == "__main__":
    main()
