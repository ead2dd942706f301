"""Next-token choice for a batch of sequences, each with its own sampling parameters.

Greedy rows take the argmax (exactly what Hugging Face ``generate(do_sample=False)``
does); sampled rows apply temperature, then top-k, then top-p (nucleus), and draw with
the sequence's own seeded generator when it has one, so a seeded request gives the same
tokens whatever else shares its batch.
"""

from __future__ import annotations

import torch

from inferd.llm.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float | None]]:
    """Tokens, and the log-probability of each (under the unmodified distribution) for
    the sequences that asked for logprobs (None for the others: a full-vocabulary
    log-softmax per row is not free at a large batch)."""
    if not seqs:
        return [], []
    tokens = logits.argmax(dim=-1).tolist()
    wanted = []
    for row, seq in enumerate(seqs):
        if not seq.params.greedy:
            tokens[row] = _draw(logits[row].float(), seq)
        if seq.params.logprobs:
            wanted.append(row)
    chosen: list[float | None] = [None] * len(seqs)
    if wanted:
        rows = torch.tensor(wanted)
        picked = logits[rows].float()
        values = picked[torch.arange(len(wanted)), torch.tensor([tokens[r] for r in wanted])]
        for row, value in zip(wanted, (values - picked.logsumexp(dim=-1)).tolist(), strict=True):
            chosen[row] = value
    return tokens, chosen


def _draw(row: torch.Tensor, seq: Sequence) -> int:
    params = seq.params
    row = row / params.temperature
    if params.top_k and params.top_k < row.numel():
        kth = torch.topk(row, params.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = sorted_probs.cumsum(0)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        cut = cumulative - sorted_probs > params.top_p
        sorted_probs[cut] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=seq.generator).item())
