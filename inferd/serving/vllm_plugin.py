"""inferd's vLLM plugin (entry point ``vllm.general_plugins``: vLLM calls
:func:`register` in each of its processes, the model runner's included).

It makes a resumed generation go on as the lost one would have: its seeded draws (below)
and its text (:func:`prime`).

A resumed seeded generation draws what the lost one would have. When a replica
dies mid-stream, the gateway sends another one the prompt and the tokens already
streamed (:meth:`~inferd.routing.router.Router.generate`); vLLM takes them as the end of
the prompt. A seeded request gets a fresh ``torch.Generator`` seeded with its seed, and
each sampled token draws from it (a row of exponential noise the width of the
vocabulary for the Gumbel-max trick; on a CPU, one integer seeding that token's noise:
see :func:`advance`). So a request resumed after ``k`` sampled tokens would draw its
first token with the noise of the lost request's first, and go another way.
:mod:`inferd.serving.vllm_core` marks such a request with ``extra_args[RESUMED_DRAWS] =
k``; this plugin, once the model runner has made the request's generator, draws from
it what ``k`` sampled tokens drew and throws it away: the generator is then where the
lost one's was, and the rest of the generation is the uninterrupted one's token for
token (replaying the same draws advances a GPU's Philox counter as it advances a CPU's
Mersenne twister).

What it cannot give back: presence and frequency penalties, which count output tokens
only (the resumed tokens are prompt tokens to vLLM), and speculative decoding, which
draws differently. Without this plugin (vLLM imported from an environment without
inferd's entry points), a resumed sampled generation draws afresh, as before. Its cost:
importing vLLM's model runner in each vLLM process (~1 s on this machine in the
replica's own process, which would not import it otherwise), once, at start.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

RESUMED_DRAWS = "inferd_resumed_draws"
"""``SamplingParams.extra_args`` key: rows of noise the resumed request's generator
draws before its first token (the lost request's sampled tokens)."""


def register() -> None:
    """Wrap vLLM's model runner's ``_update_states`` (where new requests' generators are
    made) and its fast detokenizer's start (:func:`prime`) once per process; nothing
    where this vLLM has no such class."""
    _wrap_detokenizer()
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:  # another vLLM layout: resumed sampled generations draw afresh
        logger.warning("inferd's vLLM plugin found no GPUModelRunner; not installed")
        return
    if getattr(GPUModelRunner, "_inferd_resumes", False):
        return
    update_states = GPUModelRunner._update_states

    def _update_states(self: Any, scheduler_output: Any) -> Any:
        out = update_states(self, scheduler_output)
        for new in scheduler_output.scheduled_new_reqs:
            extra = getattr(new.sampling_params, "extra_args", None) or {}
            draws = extra.get(RESUMED_DRAWS)
            state = self.requests.get(new.req_id)
            if draws and state is not None and state.generator is not None:
                advance(state.generator, int(draws), self.input_batch.vocab_size, self.sampler)
        return out

    GPUModelRunner._update_states = _update_states
    GPUModelRunner._inferd_resumes = True


def advance(generator: Any, draws: int, vocab_size: int, sampler: Any) -> None:
    """Draw from ``generator`` what vLLM's sampler draws for ``draws`` sampled tokens of
    one request, and drop it: on a CPU (``forward_cpu``), one ``randint`` a token (the
    seed of its SplitMix64 noise); elsewhere (``forward_native``, which every
    accelerator falls back to for requests with generators), a row of exponential
    noise the width of the vocabulary (float32, or float64 with ``use_fp64_gumbel``)."""
    import torch

    fp64 = getattr(sampler, "use_fp64_gumbel", False)
    topk_topp = getattr(sampler, "topk_topp_sampler", None)
    forward = getattr(getattr(topk_topp, "forward", None), "__name__", "")
    if forward == "forward_cpu" and not fp64:
        for _ in range(draws):
            torch.randint(0, 2**31, (1,), generator=generator, dtype=torch.long)
        return
    row = torch.empty(vocab_size, dtype=torch.float64 if fp64 else torch.float32,
                      device=generator.device)  # fmt: skip
    for _ in range(draws):
        row.exponential_(generator=generator)


UNFINISHED = "\ufffd"  # what a decode ends with when its last character is incomplete
TAIL = 8  # tokens: an incomplete last character is in the last 4 bytes' tokens


def _wrap_detokenizer() -> None:
    try:
        from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer
    except ImportError:
        logger.warning("inferd's vLLM plugin found no FastIncrementalDetokenizer")
        return
    if getattr(FastIncrementalDetokenizer, "_inferd_primed", False):
        return
    init = FastIncrementalDetokenizer.__init__

    def __init__(self: Any, tokenizer: Any, request: Any) -> None:
        init(self, tokenizer, request)
        ids = request.prompt_token_ids
        if ids:
            stream = prime(self.tokenizer, ids, self.skip_special_tokens)
            if stream is not None:
                self.stream = stream

    FastIncrementalDetokenizer.__init__ = __init__
    FastIncrementalDetokenizer._inferd_primed = True


def prime(tokenizer: Any, ids: list[int], skip_special_tokens: bool) -> Any:
    """A ``DecodeStream`` primed with prompt ``ids`` that end inside a character (a
    resumed generation whose tokens so far stop mid-character), else None.

    vLLM primes its stream with the whole prompt. Where the prompt's text ends with an
    incomplete character, the stream keeps no prefix, and its first step returns the
    text of the whole prompt and what follows: the client would get the prompt and the
    text so far again, and stop strings would be matched in the prompt's text. This
    stream is primed with the prompt up to its last complete character, then steps
    through the rest (what that returns is prompt text: dropped), so it returns the
    new text only. Costs one decode of the prompt's last tokens per request; a prompt
    that ends inside a character (rare but for resumes) a few more."""
    from tokenizers.decoders import DecodeStream

    def unfinished(end: int) -> bool:
        tail = ids[max(0, end - TAIL) : end]
        return tokenizer.decode(tail, skip_special_tokens=skip_special_tokens).endswith(UNFINISHED)

    if not unfinished(len(ids)):
        return None
    # the longest prefix that decodes to whole characters (a run of stray bytes,
    # which a random model writes, ends none: then vLLM's stream is kept)
    for end in range(len(ids) - 1, max(0, len(ids) - 4 * TAIL), -1):
        if not unfinished(end):
            break
    else:
        return None
    stream = DecodeStream(ids=ids[:end], skip_special_tokens=skip_special_tokens)
    for token in ids[end:]:
        try:
            stream.step(tokenizer, token)
        except Exception:  # tokenizers' "Invalid prefix": vLLM's stream then
            return None
    return stream
