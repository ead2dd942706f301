"""Next-token choice for a batch of sequences, each with its own sampling parameters.

First the penalties, on the rows that ask for them (vLLM's and OpenAI's definitions):
``repetition_penalty`` over the prompt's and the output's tokens, ``presence_penalty``
and ``frequency_penalty`` over the output's, and EOS and ``stop_token_ids`` masked until
``min_tokens``. Then greedy rows take the argmax (exactly what Hugging Face
``generate(do_sample=False)`` does); sampled rows apply temperature, then top-k, then
top-p (nucleus), then min-p, and draw with the sequence's own seeded generator when it
has one, so a seeded request gives the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import torch

from inferd.llm.sequence import Sequence


def sample(
    logits: torch.Tensor, seqs: list[Sequence], eos_token_id: int | None = None
) -> tuple[list[int], list[float | None]]:
    """Tokens, and the log-probability of each (under the unmodified distribution) for
    the sequences that asked for logprobs (None for the others: a full-vocabulary
    log-softmax per row is not free at a large batch)."""
    if not seqs:
        return [], []
    original = logits
    logits = _penalized(logits, seqs, eos_token_id)
    tokens = logits.argmax(dim=-1).tolist()
    wanted = []
    batched: list[int] = []
    for row, seq in enumerate(seqs):
        if not seq.params.greedy:
            if logits.device.type == "cpu":
                tokens[row] = _draw(logits[row].float(), seq)
            elif seq.generator is not None:  # a seeded row draws on the CPU, as it would there
                tokens[row] = _draw(logits[row].float().cpu(), seq)
            else:
                batched.append(row)
        if seq.params.logprobs:
            wanted.append(row)
    if batched:
        for row, token in zip(batched, _draw_rows(logits, batched, seqs), strict=True):
            tokens[row] = token
    chosen: list[float | None] = [None] * len(seqs)
    if wanted:
        device = logits.device
        rows = torch.tensor(wanted, device=device)
        picked = original[rows].float()
        chosen_ids = torch.tensor([tokens[r] for r in wanted], device=device)
        values = picked[torch.arange(len(wanted), device=device), chosen_ids]
        for row, value in zip(wanted, (values - picked.logsumexp(dim=-1)).tolist(), strict=True):
            chosen[row] = value
    return tokens, chosen


def _penalized(
    logits: torch.Tensor, seqs: list[Sequence], eos_token_id: int | None
) -> torch.Tensor:
    """The logits with each row's penalties applied (a copy, when any row has some)."""
    rows = [i for i, seq in enumerate(seqs) if seq.params.adjusts_logits]
    if not rows:
        return logits
    out = logits.clone()
    device = logits.device
    for i in rows:
        seq, row = seqs[i], out[i]
        params = seq.params
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.tokens)), dtype=torch.long, device=device)
            values = row[seen]
            penalty = params.repetition_penalty
            row[seen] = torch.where(values > 0, values / penalty, values * penalty)
        if seq.output_ids and (params.presence_penalty or params.frequency_penalty):
            output = torch.tensor(seq.output_ids, dtype=torch.long, device=device)
            ids, counts = torch.unique(output, return_counts=True)
            row[ids] -= params.frequency_penalty * counts.to(row.dtype) + params.presence_penalty
        if len(seq.output_ids) < params.min_tokens:
            ends = [*params.stop_token_ids]
            if eos_token_id is not None and not params.ignore_eos:
                ends.append(eos_token_id)
            if ends:
                row[torch.tensor(ends, dtype=torch.long, device=device)] = -torch.inf
    return out


def _draw_rows(logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> list[int]:
    """:func:`_draw` for many unseeded rows at once, on the logits' device (a GPU: one
    sort and one draw for the batch instead of a dozen small kernels per row)."""
    device = logits.device
    params = [seqs[r].params for r in rows]
    x = logits[torch.tensor(rows, device=device)].float()
    x /= torch.tensor([p.temperature for p in params], device=device)[:, None]
    ordered, order = x.sort(dim=-1, descending=True)
    vocab = x.shape[1]
    top_k = torch.tensor([p.top_k or vocab for p in params], device=device)
    ordered.masked_fill_(torch.arange(vocab, device=device)[None, :] >= top_k[:, None], -torch.inf)
    probs = torch.softmax(ordered, dim=-1)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    probs.masked_fill_(probs.cumsum(dim=-1) - probs > top_p[:, None], 0.0)
    if any(p.min_p for p in params):  # sorted: the first is the likeliest
        min_p = torch.tensor([p.min_p for p in params], device=device)
        probs.masked_fill_(probs < min_p[:, None] * probs[:, :1], 0.0)
    picked = torch.multinomial(probs, 1)
    return order.gather(1, picked).view(-1).tolist()


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
    if params.min_p:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if seq.generator is not None and params.seed is not None:
        seq.generator.manual_seed(position_seed(params.seed, len(seq.output_ids)))
    return int(torch.multinomial(probs, 1, generator=seq.generator).item())


def position_seed(seed: int, position: int) -> int:
    """The seed of a seeded request's draw for its ``position``-th output token: each
    draw depends on the request's seed and the position alone, so a generation resumed
    on another replica (or recomputed after preemption) draws what it would have."""
    return (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) % 2**64
