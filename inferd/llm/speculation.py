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

import numpy as np

from inferd.replica_config import SpeculationConfig


@dataclass(frozen=True)
class Speculation(SpeculationConfig):
    """The configuration (:class:`~inferd.replica_config.SpeculationConfig`: parsed and
    checked where settings are, with no numpy) and the proposer the engine asks."""

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
