"""Constrained decoding for inferd's engine: a JSON schema (or any JSON object) as a
token mask, through llguidance.

llguidance was chosen over xgrammar and outlines-core by ``bench/grammar_backends.py``
(results in ``bench/results/grammar_backends.json``): on GPT-2's 50,257-token vocabulary
all three compute a step's mask in microseconds, but llguidance has no dependencies
(xgrammar needs torch, transformers and a 1 GB triton; outlines-core compiles a schema
in tens of milliseconds against llguidance's fraction of one), takes any JSON object as
well as a schema, and is what vLLM's ``guidance`` backend runs, so both engines
constrain the same way.

Every guided sequence has its own matcher; each step, the rows of the batch that are
guided get their mask, applied to their logits before sampling (free rows are not
touched), and the sampled token advances the matcher. JSON is compact (no free
whitespace: a grammar that allows it lets a weak model pad until ``max_tokens``).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch


class GuideCompiler:
    """Matchers for one model's tokenizer (built on first use: ~0.1 s)."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_id: int | None) -> None:
        self.tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._tokenizer: Any = None
        self._words = (vocab_size + 31) // 32

    def matcher(self, guide: dict[str, Any]) -> Any:
        """A fresh matcher for ``guide`` (``{"json": schema}`` or ``{"json_object":
        True}``). Raises ValueError naming what cannot be compiled."""
        schema = {"type": "object"} if guide.get("json_object") else guide.get("json")
        if not isinstance(schema, dict):
            raise ValueError("a guide is {'json': <schema>} or {'json_object': true}")
        return self._compiled(json.dumps(schema)).deep_copy()  # key order is property order

    @functools.lru_cache(maxsize=256)  # noqa: B019 -- one compiler per engine, for its life
    def _compiled(self, schema: str) -> Any:
        """The compiled schema (a matcher at its start): clients repeat their schemas,
        and a copy costs ~15 us against ~0.4 ms to compile."""
        import llguidance

        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(
                str(self.tokenizer_json), n_vocab=self.vocab_size, eos_token=self.eos_token_id
            )
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": False}
            )
        except ValueError as exc:
            raise ValueError(f"the JSON schema cannot be compiled: {exc}") from None
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the JSON schema cannot be compiled: {matcher.get_error()}")
        return matcher

    def mask(self, logits: torch.Tensor, rows: list[int], matchers: list[Any]) -> None:
        """Set to -inf, in ``logits`` rows ``rows``, every token ``matchers`` forbid."""
        bits = np.zeros((len(rows), self._words), dtype=np.int32)
        size = self._words * 4
        base = bits.ctypes.data
        for i, matcher in enumerate(matchers):
            matcher.unsafe_compute_mask_ptr(base + i * size, size)
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")
        allowed = allowed[:, : logits.shape[1]].astype(bool)
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        picked = logits.index_select(0, index)
        picked.masked_fill_(torch.from_numpy(~allowed).to(logits.device), float("-inf"))
        logits.index_copy_(0, index, picked)
