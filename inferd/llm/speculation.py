"""Prompt-lookup (n-gram) speculative decoding for inferd's engine.

A sequence whose output copies from its context (a summary quoting its source, an edit
of code given in the prompt, a chat repeating a name) can often guess its next tokens:
find the last occurrence, earlier in the sequence, of its last ``n`` tokens and take the
``k`` tokens that followed it. The engine computes those guesses (the *draft*) in the
same forward pass as the sequence's real next token, as one short chunk over the KV
cache, and keeps the draft's longest prefix that greedy decoding would have chosen, plus
the token the model chose after it: one to ``k + 1`` tokens from one step, and exactly
the tokens plain greedy decoding gives (the rejected draft's keys and values are simply
overwritten later). It pays where a step costs about the same for ``k + 1`` tokens as
for one (a small batch: reading the weights dominates) and guesses hit.

The configuration has the shape of vLLM's ``speculative_config`` (``method: ngram``,
``num_speculative_tokens``, ``prompt_lookup_max``, ``prompt_lookup_min``), so one
setting or version metadata configures either engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

KEYS = {
    "method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
    "disable_by_batch_size",
}  # fmt: skip


@dataclass(frozen=True)
class Speculation:
    tokens: int = 4
    """Draft tokens proposed per step at most (``num_speculative_tokens``; how many a
    sequence guesses each time: :meth:`inferd.llm.engine.LLMEngine._propose`)."""
    lookup_max: int = 4
    """Longest suffix looked up (``prompt_lookup_max``); shorter ones are tried next."""
    lookup_min: int = 2
    """Shortest suffix looked up (``prompt_lookup_min``)."""
    max_batch: int | None = None
    """No speculation while more sequences than this run (``disable_by_batch_size``): a
    full batch is bound by compute, where checking guesses costs what it saves."""

    @classmethod
    def parse(cls, config: dict[str, Any] | None, where: str) -> Speculation | None:
        """From vLLM's ``speculative_config`` shape; None when ``config`` is empty.
        ValueError naming ``where`` and the field for anything inferd's engine cannot do."""
        if not config:
            return None
        if not isinstance(config, dict):
            raise ValueError(f"{where} must be an object like vLLM's speculative_config")
        unknown = sorted(set(config) - KEYS)
        if unknown:
            raise ValueError(
                f"{where}: unknown field(s) {unknown} for inferd's engine; it takes "
                f"{sorted(KEYS)} (other vLLM methods: use the vLLM engine)"
            )
        method = config.get("method", "ngram")
        if method != "ngram":
            raise ValueError(
                f"{where}.method {method!r}: inferd's engine speculates with 'ngram' "
                "(prompt lookup); other methods need the vLLM engine"
            )
        values: dict[str, int] = {}
        for key, name in (("num_speculative_tokens", "tokens"),
                          ("prompt_lookup_max", "lookup_max"),
                          ("prompt_lookup_min", "lookup_min")):  # fmt: skip
            value = config.get(key, getattr(cls, name))
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 64:
                raise ValueError(f"{where}.{key} must be an integer from 1 to 64, got {value!r}")
            values[name] = value
        cap = config.get("disable_by_batch_size")
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise ValueError(f"{where}.disable_by_batch_size must be a positive integer")
        if values["lookup_min"] > values["lookup_max"]:
            raise ValueError(f"{where}: prompt_lookup_min is larger than prompt_lookup_max")
        return cls(**values, max_batch=cap)

    @classmethod
    def for_version(
        cls, metadata: dict[str, Any], setting: dict[str, Any] | None
    ) -> Speculation | None:
        """A version's: its ``speculative`` metadata, else the ``llm.speculative``
        setting; errors name the one they came from."""
        if metadata.get("speculative") is not None:
            return cls.parse(metadata["speculative"], "metadata.speculative")
        return cls.parse(setting, "llm.speculative")

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """``limit`` tokens (at most) that followed the latest earlier occurrence of the
        longest suffix of ``tokens`` (``lookup_max`` down to ``lookup_min`` tokens)
        that occurred before, the repetition carried on where that runs into the end;
        [] when none occurred."""
        size = len(tokens)
        if limit <= 0 or size <= self.lookup_min:
            return []
        seq = np.asarray(tokens, dtype=np.int64)
        # earlier positions holding the last token, then those whose previous tokens
        # match the suffix's too, one more token at a time
        ends = np.flatnonzero(seq[:-1] == seq[-1])
        best, length = -1, 0
        for n in range(1, min(self.lookup_max, size - 1) + 1):
            if n > 1:
                ends = ends[ends >= n - 1]
                ends = ends[seq[ends - (n - 1)] == seq[size - n]]
            if not ends.size:
                break
            best, length = int(ends[-1]), n
        if length < self.lookup_min:
            return []
        # what followed it, read on past the end as the repetition it found continues
        # (a run of one token, a short loop)
        shift = size - 1 - best
        draft: list[int] = []
        for i in range(limit):
            at = size + i - shift
            draft.append(int(seq[at]) if at < size else draft[at - size])
        return draft
